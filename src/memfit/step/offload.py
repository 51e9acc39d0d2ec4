"""Activation offloading (``--activation-offloading``): the tensors the forward pass saves for the
backward pass wait in host memory, run alike by ``memfit train`` and traced by the estimator.

:func:`offload_context` is what a run enters around each micro-batch's forward and backward
(:class:`PerMicroBatch`: one entry per attempt): on CUDA, TRL's ``get_act_offloading_ctx_manager``
(torchtune's ``OffloadActivations``: pinned host copies on a side stream), and only it: a CUDA run
without TRL installed is refused (``pip install 'memfit[trl]'``), so that a CUDA estimate
emulates TRL's rules whatever is installed where it runs. On the CPU device PyTorch's
``torch.autograd.graph.save_on_cpu`` (a copy to the CPU of a CPU tensor is the tensor itself).

:class:`OffloadEmulation` is what the estimator enters instead, on fake tensors: a
``saved_tensors_hooks`` whose pack decides, by the rules of the implementation that would run on
the target device, which saved tensors go to the host, asks the estimator for their host copy
(``host_copy``: its trace records host bytes apart from the device's) and lets go of the device
tensor when the implementation would; its unpack allocates an empty device tensor of the same
size, strides and dtype (values do not matter on fake tensors; sizes and lifetimes do).

TRL's rules (``trl/models/activation_offloading.py``, trl 1.16, read for these facts):

- A saved tensor stays on the device when it is smaller than ``min_offload_size`` (1024 bytes), a
  ``Parameter`` or buffer or any tensor on a parameter's storage, when its storage (pointer plus
  offset, and dtype) is already tracked by a tensor still in flight or kept (saved twice: the
  later save keeps it; the emulation takes a freed storage's key to track nothing, as no trace
  knows which block the caching allocator hands out again), or when it is saved inside the
  output head's forward (a ``NoOpManager`` hooked on ``lm_head``: the head's input would come
  straight back) or inside a module whose name says Liger.
- An offloaded tensor that is a view with an offset, or not contiguous, is cloned first (a
  contiguous device copy); one with a broadcast (zero) stride copies its whole storage instead.
  Its host copy is ``empty_like`` in pinned memory (CUDA's caching host allocator rounds each
  block up to a power of two and keeps it cached).
- The forward stash: the device tensor of an offloaded save is kept alive until the copy is done,
  which TRL takes to be when ``max_fwd_stash_size`` (5) later saves have been packed; what is
  still stashed when the backward starts is dropped after the first backward node that unpacks.
- The backward brings a tensor back (a new device tensor) when its node unpacks it, unless it is
  still stashed; it stays until the next node that unpacks anything has run (the copies overlap
  the compute), or to the end of the backward.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

# TRL's get_act_offloading_ctx_manager defaults (min_offload_size, max_fwd_stash_size)
MIN_OFFLOAD_BYTES = 1024
FORWARD_STASH = 5
# torchao's float8 training tensors TRL keeps on the device (already compressed)
_FLOAT8_CLASSES = ("Float8TrainingTensor", "ScaledMMConfig", "LinearMMConfig")

HostCopy = Callable[[torch.Tensor, bool], torch.Tensor]
"""The estimator's host copy of a saved tensor: ``(tensor, whole_storage)`` → a tensor whose
lifetime is the host memory's (dropped: the host block is free again). Not ``whole_storage``:
the tensor's own shape and dtype (emulating ``save_on_cpu`` on the CPU device it is what
unpacking returns: the CPU's "host" is its memory); ``whole_storage``: any contiguous tensor
holding the bytes of the tensor's storage (a broadcast tensor's copy)."""

StorageBack = Callable[[torch.Tensor], torch.Tensor]
"""The estimator's device copy of a whole-storage host copy, brought back: ``host`` → a contiguous
tensor of the same bytes whose size the estimator records as it recorded the host copy's (a
padded storage's size is no product of its dims: it fits by the storage's own formula)."""


def trl_available() -> bool:
    """Whether TRL's context manager can run here (it is not imported for the question)."""
    return importlib.util.find_spec("trl") is not None


TRL_MISSING = (
    "--activation-offloading on a CUDA device runs TRL's activation offloading context "
    "(trl.models.get_act_offloading_ctx_manager), and TRL is not installed: "
    "pip install 'memfit[trl]'"
)


def implementation(device_type: str) -> str:
    """Which implementation :func:`offload_context` runs on ``device_type``, in words
    (``run.json``, the estimate's details): on CUDA always TRL's context manager (a run without
    TRL installed is refused: :func:`require`), so that an estimate for a CUDA device emulates
    TRL's rules whatever is installed where it runs; elsewhere ``save_on_cpu`` (on the CPU
    device a copy that is the same memory)."""
    return "trl" if device_type == "cuda" else "save_on_cpu"


def missing(device_type: str) -> str | None:
    """Why activation offloading cannot run on ``device_type`` here (the caller refuses it:
    exit 2), or None: on CUDA without TRL (torch's ``save_on_cpu`` would copy every saved
    tensor, weights included, which is not what the estimate prices)."""
    if implementation(device_type) == "trl" and not trl_available():
        return TRL_MISSING
    return None


def empties_cuda_cache(imports_bitsandbytes: bool) -> bool:
    """Whether TRL's context empties CUDA's caching allocator each time a micro-batch enters it.

    TRL's ``__enter__`` (from trl 1.5, PR #5730) calls ``empty_cache()`` when bitsandbytes has been
    imported, to let go of bitsandbytes' dequantization buffers; then each step's blocks are
    reserved afresh. An H200 run's allocator history showed the cached segments returned at every
    step, and its reserved peak 10 % under a replay that keeps them. ``imports_bitsandbytes``: the
    run imports it where it is installed (it uses QLoRA or bitsandbytes' optimizers, or LoRA: peft
    imports it). The estimate takes what is installed where it runs for what the run will have;
    a TRL older than 1.5 installed here does not empty, and without TRL here its current rules hold.
    """
    if not imports_bitsandbytes or importlib.util.find_spec("bitsandbytes") is None:
        return False
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return True
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return (major, minor) >= (1, 5)


class OffloadUnavailable(RuntimeError):
    """Activation offloading asked for where it cannot run (:func:`missing` says why)."""


def require(device_type: str) -> None:
    """Raises :class:`OffloadUnavailable` where :func:`missing` says offloading cannot run."""
    problem = missing(device_type)
    if problem is not None:
        raise OffloadUnavailable(problem)


def offload_context(model: nn.Module, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context a run enters around each micro-batch's forward and backward (TRL enters it
    around its ``training_step``; :class:`PerMicroBatch` does for ``memfit train``). Built once
    per run and entered again for each micro-batch: TRL's registers its hooks on the model's
    output head when built. Refuses CUDA without TRL (:func:`require`)."""
    require(device_type)
    if implementation(device_type) == "trl":
        # optional: TRL is an extra of memfit train (importing it loads accelerate too)
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        context: contextlib.AbstractContextManager[Any] = get_act_offloading_ctx_manager(
            model, warn_if_no_head=False
        )
        return context
    # the copy on the CPU device is the tensor itself (``.to("cpu")`` of a CPU tensor)
    return torch.autograd.graph.save_on_cpu(pin_memory=False)


class PerMicroBatch:
    """Enters a run's offloading ``context`` as each micro-batch's forward starts and exits it
    when that micro-batch's backward has ended or anything in between failed: each attempt the
    guard makes (a re-run after an OOM too) runs in its own entry, so that TRL's ``__enter__``
    drops what a failed attempt left in its tracker and stashes (else its ``pack_tensor`` raises
    "Backward pass should have cleared tracker of all tensors" and the stashed tensors leak).

    The guard calls :meth:`autocast` (wrapping the run's autocast factory) around each
    micro-batch's forward and :meth:`backward` (wrapping the run's backward) on its loss.
    """

    def __init__(self, context: contextlib.AbstractContextManager[Any]) -> None:
        self.context = context
        self.entered = False

    def close(self, *exc: Any) -> None:
        """Exits the context if it is entered (after a failure: what failed)."""
        if self.entered:
            self.entered = False
            self.context.__exit__(*(exc or (None, None, None)))

    def autocast(
        self, inner: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """The guard's autocast factory: enters the context, then ``inner``'s autocast."""

        @contextlib.contextmanager
        def forward() -> Any:
            # a forward whose backward never ran (it failed in between): a fresh entry
            self.close()
            self.context.__enter__()
            self.entered = True
            try:
                with inner():
                    yield
            except BaseException as exc:
                self.close(type(exc), exc, exc.__traceback__)
                raise

        return forward

    def backward(
        self, inner: Callable[[torch.Tensor], None] | None
    ) -> Callable[[torch.Tensor], None]:
        """The guard's backward: ``inner`` (None: ``loss.backward()``), then the context exits."""

        def run(loss: torch.Tensor) -> None:
            try:
                if inner is None:
                    loss.backward()
                else:
                    inner(loss)
            except BaseException as exc:
                self.close(type(exc), exc, exc.__traceback__)
                raise
            self.close()

        return run


def output_head(model: nn.Module) -> nn.Module | None:
    """The module TRL keeps out of offloading (its ``NoOpManager``), found as TRL finds it."""
    unwrapped: Any = getattr(model, "module", model)
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    if hasattr(unwrapped, "output"):
        output = unwrapped.output
        if isinstance(output, nn.Module):
            return output
        linear = getattr(output, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(unwrapped, "lm_head"):
        head: nn.Module = unwrapped.lm_head
        return head
    if hasattr(unwrapped, "decoder"):
        decoder = unwrapped.decoder
        for name in ("output", "lm_head"):
            if hasattr(decoder, name):
                found: nn.Module = getattr(decoder, name)
                return found
        return None
    if hasattr(unwrapped, "final_layer_norm") or hasattr(unwrapped, "ln_f"):
        norm: nn.Module = getattr(unwrapped, "final_layer_norm", None) or unwrapped.ln_f
        return norm
    if isinstance(getattr(unwrapped, "head", None), nn.Module):
        last: nn.Module = unwrapped.head
        return last
    return None


def _kept_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward TRL runs under its NoOpManager: the output head, and any module
    whose name says Liger."""
    head = output_head(model)
    unwrapped: Any = getattr(model, "module", model)
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    liger = [m for name, m in unwrapped.named_modules() if "liger" in name.lower()]
    return ([head] if head is not None else []) + liger


class OffloadEmulation(saved_tensors_hooks):
    """Activation offloading on fake tensors, for the estimator (see the module docstring).

    ``model``: the traced model (its parameters and output head). ``target``: the implementation
    emulated (:func:`implementation`'s words). ``host_copy``: makes the host copy of an offloaded
    tensor (the estimator records it as host memory); the emulation holds it until the backward
    takes the tensor back. ``storage_back``: the device copy of a whole storage's host copy (a
    broadcast save brought back; ``torch.empty_like`` where not given). Build it once per model
    (it hooks the output head) and enter it around each forward and backward, as the run enters
    the real one.
    """

    def __init__(
        self,
        model: nn.Module,
        target: str,
        host_copy: HostCopy,
        storage_back: StorageBack | None = None,
    ) -> None:
        self.trl = target == "trl"
        self.host_copy = host_copy
        self.storage_back: StorageBack = storage_back or torch.empty_like
        # the model is held so that its parameters' storages stay theirs (an address freed
        # would be another tensor's)
        self.model = model
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.kept_depth = 0  # > 0 inside the output head's forward (TRL's NoOpManager)
        # the dims that count the step's tokens (the estimator sets them per traced step): a
        # tensor with one is never "small". The estimator traces a few hundred tokens, where a
        # tensor of one value per token can fall under 1 KiB, and fits the sizes to the shapes
        # asked, where it does not (nor may the traced steps' events differ with the shape)
        self.token_dims: frozenset[int] = frozenset()
        self._reset()
        if self.trl:
            for module in _kept_modules(model):
                module.register_forward_pre_hook(self._enter_kept)
                module.register_forward_hook(self._exit_kept, always_call=True)
        super().__init__(self._pack, self._unpack)

    def _reset(self) -> None:
        self.next_id = 0
        # id -> (the device tensor kept, or None) and (the host copy, the restore recipe)
        self.tracker: dict[int, tuple[torch.Tensor | None, Any, Any]] = {}
        self.forward_stash: dict[int, torch.Tensor] = {}
        self.backward_stash: dict[int, torch.Tensor] = {}
        # key -> the id that tracks it, and the storage the key was taken from (weakly: a key
        # whose storage is gone tracks nothing, see ``_tracked``)
        self.storage_ids: dict[tuple[int, int, torch.dtype], tuple[int, weakref.ref[Any]]] = {}
        self.id_storages: dict[int, tuple[int, int, torch.dtype]] = {}
        self.node: Any = None
        self.backward_started = False

    def __enter__(self) -> None:
        # TRL drops whatever a previous step left (its __enter__)
        self._reset()
        super().__enter__()

    def __exit__(self, *args: Any) -> None:
        # TRL syncs its streams and clears its stashes on exit
        self.forward_stash.clear()
        self.backward_stash.clear()
        self.node = None
        super().__exit__(*args)

    # -- TRL's NoOpManager around the output head ------------------------------------------------
    def _enter_kept(self, *args: Any) -> None:
        self.kept_depth += 1

    def _exit_kept(self, *args: Any) -> None:
        self.kept_depth -= 1

    # -- pack ------------------------------------------------------------------------------------
    def _storage_key(self, tensor: torch.Tensor) -> tuple[int, int, torch.dtype]:
        # TRL keys on the storage's data pointer plus the offset; fake storages have no pointer,
        # so the storage object stands for it (alive while a tensor holds it, as the pointer is)
        return (int(tensor.untyped_storage()._cdata), int(tensor.storage_offset()), tensor.dtype)

    def _track_key(
        self, key: tuple[int, int, torch.dtype], tensor_id: int, storage: torch.UntypedStorage
    ) -> None:
        self.storage_ids[key] = (tensor_id, weakref.ref(storage))
        self.id_storages[tensor_id] = key

    def _release_key(self, tensor_id: int) -> None:
        key = self.id_storages.pop(tensor_id, None)
        if key is not None and self.storage_ids.get(key, (None,))[0] == tensor_id:
            del self.storage_ids[key]

    def _tracked(self, key: tuple[int, int, torch.dtype], storage: torch.UntypedStorage) -> bool:
        """Whether ``key`` is tracked for this very storage. A save whose original was cloned
        tracks the original's key while the clone is stashed; once the original is freed, its
        address may be another storage's (a fake storage's address is the host allocator's, not
        the device's): that storage is no save in flight. TRL's device pointers can be taken
        again too (the caching allocator hands a freed block out again), which no trace
        predicts: the emulation takes a freed storage's key to track nothing."""
        entry = self.storage_ids.get(key)
        return entry is not None and entry[1]() is storage

    def _kept(self, tensor: torch.Tensor) -> bool:
        """Whether TRL leaves a saved tensor on the device (the rules in the module docstring)."""
        if self.kept_depth > 0:
            return True
        small = tensor.element_size() * tensor.nelement() < MIN_OFFLOAD_BYTES
        if small and not self.token_dims.intersection(tensor.shape):
            return True
        if isinstance(tensor, nn.Parameter | nn.Buffer):
            return True
        if type(tensor).__name__ in _FLOAT8_CLASSES:
            return True
        return tensor.untyped_storage()._cdata in self.param_storages

    def _pack(self, tensor: torch.Tensor) -> int:
        self.next_id += 1
        tensor_id = self.next_id
        if self.trl:
            key = self._storage_key(tensor)
            storage = tensor.untyped_storage()
            in_flight = self._tracked(key, storage)
            if in_flight or self._kept(tensor):
                self.tracker[tensor_id] = (tensor, None, None)
                if in_flight:
                    # the later save takes over the key (TRL's track_storage_key)
                    self._track_key(key, tensor_id, storage)
                return tensor_id
            broadcast = 0 in tensor.stride()
            if not broadcast and (not tensor.is_contiguous() or tensor.storage_offset() != 0):
                # a contiguous device copy first, so that the host copy can be restored in bounds
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            # the copies of saves FORWARD_STASH or more ago are taken to be done: their device
            # tensors go (the storages they tracked with them)
            for old in list(self.forward_stash):
                if old > tensor_id - FORWARD_STASH:
                    break
                del self.forward_stash[old]
                self._release_key(old)
        else:
            # save_on_cpu copies every saved tensor, parameters too
            broadcast = False
        if broadcast:
            # only the storage goes, not the materialized broadcast
            host = self.host_copy(tensor, True)
            restore: tuple[Any, ...] = (
                "broadcast",
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
        else:
            host = self.host_copy(tensor, False)
            # TRL's host copy (empty_like) keeps the strides; save_on_cpu's is contiguous
            stride = tensor.stride() if self.trl else None
            restore = ("plain", tuple(tensor.shape), stride, tensor.dtype)
        self.tracker[tensor_id] = (None, host, restore)
        if self.trl:
            # the device tensor stays until its copy is taken to be done
            self.forward_stash[tensor_id] = tensor
            self._track_key(key, tensor_id, storage)
        return tensor_id

    # -- unpack ----------------------------------------------------------------------------------
    def _unpack(self, tensor_id: int) -> torch.Tensor:
        kept, host, restore = self.tracker.pop(tensor_id)
        self._release_key(tensor_id)
        if kept is not None:
            return kept
        if not self.trl:
            # save_on_cpu on the CPU device: ``.to("cpu")`` returns the copy itself
            returned: torch.Tensor = host
            return returned
        if not self.backward_started and torch._C._current_graph_task_id() != -1:
            self.backward_started = True
            # TRL frees what is left of its backward stash when the backward ends
            torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                self.backward_stash.clear
            )
        node = torch._C._current_autograd_node()
        previous: list[int] = []
        if node is not self.node:
            # a new node: the previous node's tensors go once this one has run
            self.node = node
            previous = list(self.backward_stash)
        if tensor_id in self.forward_stash:
            # still on the device: no copy back
            tensor = self.forward_stash[tensor_id]
            brought_back = False
        else:
            tensor = self._restore(restore, host)
            self.backward_stash[tensor_id] = tensor
            brought_back = True
        del host  # the host block is free once the copy back is issued
        uses = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        # the hook below outlives the step with its node (TRL keeps the last node): it holds
        # no tensor, only the id
        del tensor

        def after_node(outputs: Any, inputs: Any) -> Any:
            if brought_back and tensor_id in self.backward_stash:
                current = self.backward_stash[tensor_id]
                if torch._C._storage_Use_Count(current.untyped_storage()._cdata) > uses:
                    # a view of it outlives the node (TRL's record_stream): it lives by its views
                    del self.backward_stash[tensor_id]
            # the backward has started: nothing stays for the forward's copies
            self.forward_stash.clear()
            for old in previous:
                self.backward_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(after_node)
        return self.forward_stash[tensor_id] if not brought_back else self.backward_stash[tensor_id]

    def _restore(self, restore: Any, host: torch.Tensor) -> torch.Tensor:
        """The device tensor the copy back allocates (empty: the values do not matter)."""
        if restore[0] == "broadcast":
            # the storage comes back whole (a tensor like its host copy), the broadcast a view
            _, shape, stride, dtype = restore
            flat = self.storage_back(host).reshape(-1).view(torch.uint8).view(dtype)
            return torch.as_strided(flat, shape, stride, 0)
        _, shape, stride, dtype = restore
        # the estimator's fake device stands for the target's
        if stride is None:
            return torch.empty(shape, dtype=dtype, device="cpu")
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")


__all__ = [
    "FORWARD_STASH",
    "MIN_OFFLOAD_BYTES",
    "TRL_MISSING",
    "OffloadEmulation",
    "PerMicroBatch",
    "implementation",
    "offload_context",
    "output_head",
    "require",
    "trl_available",
]
