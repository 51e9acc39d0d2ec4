"""A memory cap that makes out-of-memory real on a machine without a GPU.

The guard's whole point is surviving OOM, and a test that only *raises* an OOM by hand proves
little: the failed partial backward, the graph held by the traceback and the gradients written
half-way are what a real OOM leaves behind. :class:`CpuMemoryCap` is a ``TorchDispatchMode`` that
counts the bytes of every storage the run holds (the technique of
:class:`memfit.estimate.trace.StorageRecorder`: a storage seen for the first time is an
allocation, a weakref on the storage reports its free) and raises a real
``torch.OutOfMemoryError`` from the op that crosses the cap, so the op's outputs die with it just
as a failed CUDA allocation would.

On CUDA the allocator enforces a cap by itself (``set_per_process_memory_fraction``);
:func:`memory_cap` picks the right one for the device.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
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
    their gradients, optimizer state) are counted with :meth:`track`.
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

    # -- the mode ----------------------------------------------------------------------------
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
        # " out of memory." (with the full stop) is what accelerate's find_executable_batch_size
        # (the Trainer's auto_find_batch_size) looks for: the cap must reach it like a real OOM
        raise torch.OutOfMemoryError(
            f"{CAP_MESSAGE_PREFIX}: tried to hold {format_bytes(held)}, the cap is "
            f"{format_bytes(self.cap_bytes)} (simulated CPU out of memory. Raised by {func})"
        )


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
        torch.cuda.set_per_process_memory_fraction(min(1.0, size_bytes / total), index)
        try:
            yield None
        finally:
            # the whole GPU again: the cap belongs to this run only
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        return
    if device.type == "cpu":
        with CpuMemoryCap(size_bytes) as cap:
            yield cap
        return
    raise UsageError(
        f"--memory-cap: works on cpu and cuda devices, not {device.type}; drop --memory-cap"
    )
