"""A memory cap that makes out-of-memory real on a machine without a GPU.

The guard's whole point is surviving OOM, and a test that only *raises* an OOM by hand proves
little: the failed partial backward, the graph held by the traceback and the gradients written
half-way are what a real OOM leaves behind. :class:`CpuMemoryCap` is a ``TorchDispatchMode`` that
counts the bytes of every storage the run holds (the technique of
:class:`memfit.estimate.trace.StorageRecorder`: a storage seen for the first time is an
allocation, a weakref on the storage reports its free) and raises a real
``torch.OutOfMemoryError`` from the op that crosses the cap, so the op's outputs die with it just
as a failed CUDA allocation would.

Under FSDP2 a rank holds less than its tensors show: a sharded parameter is a ``DTensor`` whose
own storage has the *global* size, while the rank holds only its ``_local_tensor``; and FSDP frees
an unsharded parameter by ``untyped_storage().resize_(0)`` and allocates it again (its all-gather
output) by resizing the storage back, which no dispatched op shows. The cap counts the local
tensors of such wrapper subclasses, and while it is active it follows ``UntypedStorage.resize_``:
a resize down frees, a resize up allocates and, past the cap, raises the OOM before the storage
grows.

On CUDA the allocator enforces a cap by itself (``set_per_process_memory_fraction``);
:func:`memory_cap` picks the right one for the device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from memfit.errors import UsageError
from memfit.units import format_bytes

# the guard recognizes the cap's errors by this text (see memfit.guard.oom.is_oom)
CAP_MESSAGE_PREFIX = "memfit memory cap"


class CpuMemoryCap(TorchDispatchMode):
    """Counts the bytes of live tensor storages and raises ``torch.OutOfMemoryError`` past a cap.

    While the mode is active every op's outputs are seen (forward, the backward that autograd runs
    in the calling thread on the CPU, optimizer steps). A storage is counted once however many
    views share it, and in-place ops (``add_``, ``.grad`` accumulation, optimizer updates) return
    storages that are already counted. Tensors that existed before the mode started (parameters,
    their gradients, optimizer state) are counted with :meth:`track`. A wrapper subclass
    (``DTensor``) counts as its inner tensors (the rank's local shard), and while the mode is
    active ``UntypedStorage.resize_`` frees and allocates (FSDP2's unsharded parameters).
    """

    def __init__(self, cap_bytes: int) -> None:
        super().__init__()
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be more than 0, got {cap_bytes}")
        self.cap_bytes = int(cap_bytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._peak_before = 0  # the peak before the op under way (an op that fails adds none)
        # storage address -> (weakref whose callback subtracts the bytes, bytes); the weakref in
        # the value tells a freed storage from a new one that reuses its address
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._thread: int | None = None  # the thread that entered the mode (its resizes count)

    # -- counting ----------------------------------------------------------------------------
    def track(self, *objs: torch.Tensor | nn.Module | torch.optim.Optimizer) -> None:
        """Count tensors that exist already: tensors, a module's parameters, buffers and
        gradients, an optimizer's state. Counting the same storage twice is a no-op."""
        for obj in objs:
            if isinstance(obj, torch.Tensor):
                self._count(obj)
            elif isinstance(obj, nn.Module):
                for param in obj.parameters():
                    self._count(param)
                    if param.grad is not None:
                        self._count(param.grad)
                for buffer in obj.buffers():
                    self._count(buffer)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for leaf in tree_leaves(state):
                        if isinstance(leaf, torch.Tensor):
                            self._count(leaf)
            else:
                raise TypeError(
                    f"track() takes tensors, nn.Modules and optimizers, got {type(obj).__name__}"
                )

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (the loop calls this before each step)."""
        self.peak_bytes = self.live_bytes

    def _count(self, tensor: torch.Tensor) -> int:
        """Count the tensor's storage if it is new; returns the bytes added."""
        if type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
            # a wrapper (DTensor, …) holds no memory of its own; its storage reports the global
            # size: what the rank holds are the inner tensors (a DTensor's local shard)
            names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = (getattr(tensor, name) for name in names)
            return sum(self._count(t) for t in inner if isinstance(t, torch.Tensor))
        if tensor.device.type == "meta" or tensor.layout != torch.strided:
            return 0  # no memory behind it, or no single storage to count (sparse, nested)
        storage = tensor.untyped_storage()
        key = storage._cdata  # the C++ storage: views and in-place results share it
        if key in self._live:
            return 0  # a view, an in-place result, or a tensor tracked already
        nbytes = int(storage.nbytes())
        if nbytes == 0:
            return 0
        # a storage keeps its Python object alive as long as the C++ storage lives, so the
        # callback fires exactly when the memory goes back to the allocator; the weakref itself
        # keeps nothing alive
        ref = weakref.ref(storage, functools.partial(self._on_free, key))
        self._live[key] = (ref, nbytes)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return nbytes

    def _on_free(self, key: int, ref: weakref.ref[Any]) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.live_bytes -= entry[1]

    # -- storage resizes (FSDP's frees and all-gather allocations) ---------------------------
    def _counted(self, storage: Any) -> tuple[weakref.ref[Any], int] | None:
        entry = self._live.get(storage._cdata)
        # a dead weakref: a freed storage whose address a new one reuses (its callback is due)
        return entry if entry is not None and entry[0]() is storage else None

    def _check_resize(self, storage: Any, nbytes: int) -> None:
        """Before ``storage`` is resized to ``nbytes``: raise the OOM if growing it crosses the
        cap (nothing is allocated then, and the peak stays what it was)."""
        if storage.device.type == "meta":
            return
        entry = self._counted(storage)
        added = nbytes - (entry[1] if entry is not None else 0)
        if added > 0 and self.live_bytes + added > self.cap_bytes:
            self._raise_oom(self.live_bytes + added, "UntypedStorage.resize_")

    def _resized(self, storage: Any) -> None:
        """After ``storage`` was resized: count its new size (0 after FSDP frees it)."""
        if storage.device.type == "meta":
            return
        nbytes = int(storage.nbytes())
        entry = self._counted(storage)
        if entry is None:
            if nbytes == 0:
                return  # a storage never counted, freed: nothing to take back
            key = storage._cdata
            ref = weakref.ref(storage, functools.partial(self._on_free, key))
            self._live[key] = (ref, nbytes)
            self.live_bytes += nbytes
        else:
            # kept at 0 bytes when freed: the same weakref follows the storage's next growth
            self._live[storage._cdata] = (entry[0], nbytes)
            self.live_bytes += nbytes - entry[1]
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _raise_oom(self, held: int, what: object) -> NoReturn:
        # " out of memory." (with the full stop) is what accelerate's find_executable_batch_size
        # (the Trainer's auto_find_batch_size) looks for: the cap must reach it like a real OOM
        raise torch.OutOfMemoryError(
            f"{CAP_MESSAGE_PREFIX}: tried to hold {format_bytes(held)}, the cap is "
            f"{format_bytes(self.cap_bytes)} (simulated CPU out of memory. Raised by {what})"
        )

    # -- the mode ----------------------------------------------------------------------------
    def __enter__(self) -> CpuMemoryCap:
        # the mode is this thread's: so are the resizes it follows
        self._thread = threading.get_ident()
        _watch_resizes(self)
        try:
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            _unwatch_resizes(self)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _unwatch_resizes(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._peak_before = self.peak_bytes
        out = func(*args, **(kwargs or {}))
        added = 0
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                added += self._count(leaf)
        # like an allocator, only an op that allocates can fail
        if added == 0 or self.live_bytes <= self.cap_bytes:
            return out
        held = self.live_bytes
        # the failed allocation was never held: the peak stays at what was, as an allocator's
        self.peak_bytes = max(self._peak_before, held - added)
        # drop the outputs before raising: the traceback keeps this frame's locals, and memory
        # that failed to allocate must not stay held
        del out
        leaf = None
        self._raise_oom(held, func)


# The caps active now (a cap entered twice is here twice). ``UntypedStorage.resize_`` is not an op
# the dispatcher shows a mode, so while a cap is active the method itself is wrapped; the wrapper
# goes when the last cap exits.
_watching: list[CpuMemoryCap] = []
# the method ours calls; None while ours is in no chain of wrappers
_unwrapped_resize: Any = None


def _resize_watched(storage: Any, size: int) -> Any:
    here = threading.get_ident()
    caps = [cap for cap in dict.fromkeys(_watching) if cap._thread == here]
    for cap in caps:
        # FSDP's all-gather allocation: an OOM here leaves the storage as it was
        cap._check_resize(storage, int(size))
    out = _unwrapped_resize(storage, size)
    for cap in caps:
        cap._resized(storage)
    return out


def _watch_resizes(cap: CpuMemoryCap) -> None:
    global _unwrapped_resize
    if _unwrapped_resize is None:
        _unwrapped_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _resize_watched  # type: ignore[method-assign,assignment]
    # else ours is still called: in place, or under a wrapper someone put over it
    _watching.append(cap)


def _unwatch_resizes(cap: CpuMemoryCap) -> None:
    global _unwrapped_resize
    if cap in _watching:
        _watching.remove(cap)
    # put the method back, unless someone wrapped it over ours: they will put ours back, which
    # then passes every resize straight through (and ours stays the one that the next cap uses)
    if not _watching and torch.UntypedStorage.resize_ is _resize_watched:
        torch.UntypedStorage.resize_ = _unwrapped_resize  # type: ignore[method-assign]
        _unwrapped_resize = None


def _fraction(index: int) -> float:
    """The allocator's fraction on device ``index`` (1.0 where torch cannot say: before 2.6, or
    an allocator backend that does not keep one)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(index))
    except (RuntimeError, NotImplementedError):
        return 1.0


@contextlib.contextmanager
def memory_cap(size_bytes: int | None, device: torch.device) -> Iterator[CpuMemoryCap | None]:
    """Cap the memory of a run: nothing for ``None``, the allocator's fraction on CUDA, a
    :class:`CpuMemoryCap` on the CPU (yielded, so the caller can :meth:`~CpuMemoryCap.track` the
    model and optimizer it built before)."""
    if size_bytes is None:
        yield None
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        # the allocator checks the fraction only when it asks CUDA for a new segment: blocks it
        # cached before (a notebook's earlier run, the model's load) would be reused past the cap,
        # so the cache is released first and the cap then counts what is live from here on
        torch.cuda.empty_cache()
        before = _fraction(index)
        torch.cuda.set_per_process_memory_fraction(min(1.0, size_bytes / total), index)
        try:
            yield None
        finally:
            # the fraction that was set before (the whole GPU unless the caller set one): the cap
            # belongs to this run only
            torch.cuda.set_per_process_memory_fraction(before, index)
        return
    if device.type == "cpu":
        with CpuMemoryCap(size_bytes) as cap:
            yield cap
        return
    raise UsageError(
        f"--memory-cap: works on cpu and cuda devices, not {device.type}; drop --memory-cap"
    )
