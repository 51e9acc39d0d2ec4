"""Trace real training steps on fake tensors: every storage allocation and free, by category.

The model is built on the meta device and moved to fake CPU tensors, so the real transformers code
runs with no memory and no GPU. A :class:`StorageRecorder` (a ``TorchDispatchMode``) sees every op's
outputs; a storage it has not seen before is an allocation, and a weakref finalizer on the storage
records its free. In-place ops (``param.add_``, optimizer updates, ``.grad`` accumulation) return a
storage that already exists, so they are not counted twice.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.estimate import workload
from memfit.estimate.blocks import block_layers, fsdp_blocks
from memfit.estimate.fake_model import BackwardModes, build_fake_model
from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    BLOCK_BACKWARD_END,
    BLOCK_BACKWARD_START,
    BLOCK_FORWARD_END,
    BLOCK_FORWARD_START,
    CAT,
    FREE,
    FREE_PREV,
    FREE_RES,
    HOST_OP,
    MARK,
    PHASE,
    ParamInfo,
    Segment,
    SizeFormula,
    StepTrace,
    host_allocation,
    sized_allocation,
    take_host_mark,
    take_size_hint,
)
from memfit.estimate.workload import StepSpec
from memfit.step import linear_ce, offload

# the recorder's constants, looked up once: it runs for every op of a traced step
_TRANSIENT = CAT["transient"]
_OPTIMIZER_STEP = PHASE["optimizer_step"]


class StorageRecorder(TorchDispatchMode):
    """Records storage allocations and frees, tagged by phase; categories are settled afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # storage address -> global allocation id
        self.sizes: list[int] = []
        self.categories: list[int] = []
        self.ops: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.itemsizes: list[int] = []
        self.formulas: list[SizeFormula | None] = []
        self.phases: list[int] = []
        self.events: list[tuple[int, int]] = []
        self.phase = PHASE["setup"]
        # storage -> parameter index, for the parameters registered with ``parameter_index``
        self._parameter_storages: dict[int, int] = {}
        # global allocation id -> the parameter it belongs to (weight casts, gradients, state)
        self.alloc_params: dict[int, int] = {}
        # global allocation id -> the parameter its inputs belong to (optimizer step only)
        self.origins: dict[int, int] = {}
        # inside declaring(): declares each allocation's dims and size formula (the fused loss's
        # chunks, memfit.step.linear_ce.declared_chunks)
        self._declarer: Callable[[torch.Tensor, str], Any] | None = None

    # -- bookkeeping -------------------------------------------------------------------------
    def set_phase(self, name: str) -> None:
        self.phase = PHASE[name]
        self.events.append((MARK, self.phase))

    def block_event(self, block: int, stage: int) -> None:
        """Mark where a transformer block's forward or backward starts or ends."""
        self.events.append((BLOCK, block * 4 + stage))

    def register(
        self, tensor: torch.Tensor, category: str, parameter_index: int | None = None
    ) -> None:
        """Count a storage that existed before recording (parameters, buffers)."""
        self._track(tensor, CAT[category], "resident")
        if parameter_index is not None:
            self._parameter_storages[tensor.untyped_storage()._cdata] = parameter_index
            alloc = self.alloc_id(tensor)
            if alloc is not None:
                self.alloc_params[alloc] = parameter_index

    @contextlib.contextmanager
    def declaring(self, declarer: Callable[[torch.Tensor, str], Any]) -> Iterator[None]:
        """Inside, ``declarer(tensor, op)`` gives each allocation's (dims, formula), or None; a
        declared allocation's size is its formula's (where the step's code allocates what a
        shape of another size would not, a formula of no bytes)."""
        previous, self._declarer = self._declarer, declarer
        try:
            yield
        finally:
            self._declarer = previous

    def alloc_id(self, tensor: torch.Tensor) -> int | None:
        return self._live.get(tensor.untyped_storage()._cdata)

    def _track(self, tensor: torch.Tensor, category: int, op: str) -> int:
        """The allocation id of ``tensor``'s storage, recorded as a new allocation if unseen."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return self._live[key]
        alloc = len(self.sizes)
        self._live[key] = alloc
        nbytes = int(storage.nbytes())
        itemsize = tensor.element_size()
        formula = None
        hint = take_size_hint()
        own_op = False
        if hint is None and self._declarer is not None:
            hint = self._declarer(tensor, op)
            if hint is not None:
                # the same op whatever the shape: kept (sharding drops a weight_cast copy)
                nbytes, own_op = hint[1](*hint[0]), True
        if hint is not None:
            dims, formula = hint
            self.shapes.append(dims)
            self.itemsizes.append(0)  # 0 marks a size given by a formula
        elif tensor.numel() * itemsize == nbytes:
            self.shapes.append(tuple(int(d) for d in tensor.shape))
            self.itemsizes.append(itemsize)
        else:  # a view onto part of a new storage: fit the storage as one flat dim
            self.shapes.append((nbytes,))
            self.itemsizes.append(1)
        self.formulas.append(formula)
        self.sizes.append(nbytes)
        self.categories.append(category)
        # a declared allocation may come from different ops (a placeholder or the real copy);
        # an offloaded activation's host copy is one whatever its size says (the replays count
        # host memory apart by this op, a formula-sized save's copy included)
        host = take_host_mark()
        if host:
            op = HOST_OP
        self.ops.append("declared" if formula is not None and not own_op and not host else op)
        self.phases.append(self.phase)
        self.events.append((ALLOC, alloc))
        # storages keep their Python object alive as long as the C++ storage lives, so this
        # fires exactly when the memory would be returned to the allocator
        weakref.finalize(storage, self._on_free, key, alloc)
        return alloc

    def _on_free(self, key: int, alloc: int) -> None:
        if self._live.get(key) == alloc:
            del self._live[key]
            self.events.append((FREE, alloc))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = func.__name__
        weight = self._cast_weight(op, args)
        if weight is not None:
            # autocast's low-precision copy of a parameter (CUDA's weight cache, or CPU autocast):
            # a sharded or 16-bit module (FSDP, DeepSpeed) computes with its own 16-bit
            # parameters instead, so the replay must be able to tell these apart
            op = "weight_cast"
        new: list[tuple[int, int]] = []  # (position among the outputs, allocation id)
        # most ops return one tensor: no pytree walk for those (the same leaves, in the same order)
        leaves = (out,) if type(out) is FakeTensor else tree_leaves(out)
        live = self._live
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                # activations by default; settled to gradient / optimizer state / transient later
                if leaf.untyped_storage()._cdata in live:
                    continue
                alloc = self._track(leaf, _TRANSIENT, op)
                new.append((position, alloc))
                if weight is not None:
                    self.alloc_params[alloc] = weight
        if new and self.phase == _OPTIMIZER_STEP:
            self._link_origins(out, args, kwargs or {}, new)
        return out

    def origin(self, tensor: Any) -> int:
        """The parameter a tensor belongs to or was computed from; -1 if none."""
        if not isinstance(tensor, torch.Tensor):
            return -1
        key = tensor.untyped_storage()._cdata
        if key in self._parameter_storages:
            return self._parameter_storages[key]
        alloc = self._live.get(key)
        if alloc is None:
            return -1
        return self.alloc_params.get(alloc, self.origins.get(alloc, -1))

    def _link_origins(
        self, out: Any, args: Any, kwargs: dict[str, Any], new: list[tuple[int, int]]
    ) -> None:
        # a foreach op's i-th output comes from the i-th item of its list arguments; any other
        # op's outputs from the first input that belongs to a parameter
        inputs = [*args, *kwargs.values()]
        if isinstance(out, (list, tuple)):
            lists = [a for a in inputs if isinstance(a, (list, tuple)) and len(a) == len(out)]
            for position, alloc in new:
                for items in lists:
                    if (found := self.origin(items[position])) >= 0:
                        self.origins[alloc] = found
                        break
            if all(alloc in self.origins for _, alloc in new):
                return
        found = next(
            (o for leaf in tree_leaves(inputs) if (o := self.origin(leaf)) >= 0),
            -1,
        )
        if found >= 0:
            for _, alloc in new:
                self.origins.setdefault(alloc, found)

    def _cast_weight(self, op: str, args: Any) -> int | None:
        """The parameter index when ``op`` casts a registered parameter (a weight copy)."""
        if not op.startswith("_to_copy") or not args or not isinstance(args[0], torch.Tensor):
            return None
        return self._parameter_storages.get(args[0].untyped_storage()._cdata)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    # frees must happen at the same point in every trace, so cyclic garbage is collected only at
    # step boundaries, never at the whim of the collector's thresholds
    enabled = gc.isenabled()
    gc.disable()
    # what lives when the trace starts (torch's and transformers' modules) is set aside for its
    # duration: the collection at its end walks only what the trace made, not the half a million
    # objects imports left in the young generations (0.7 s of a cold bert estimate). They come
    # back as the oldest generation, as if they had survived it.
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
            # the trace's garbage (the fake model, its graphs) goes now: left young, the next
            # trace would set it aside with the rest, into the oldest generation
            gc.collect(0)


AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def trace_steps(
    config: Any,
    spec: StepSpec,
    shapes: list[tuple[int, int]],
    *,
    optimizer_steps: int = 2,
    autocast: AutocastFactory | None = None,
    step_modes: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    backward_modes: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> StepTrace:
    """Trace one step per shape on fake tensors.

    The first ``optimizer_steps`` steps run the optimizer (the first creates its state, the second
    is the steady state); later steps run forward and backward only and drop the gradients: that
    is all of a step that depends on the shape. ``step_modes`` wraps each step in extra modes (the
    CUDA emulation); ``autocast`` wraps the forward.
    """
    # the fake model is built inside too, and dropped before the collector runs again: the
    # collection due then frees it (a web of cycles) with the rest of the trace's garbage
    with _no_gc():
        tracer = _Tracer.build(config, spec, autocast, step_modes, backward_modes)
        recorder = tracer.recorder
        steps: list[tuple[tuple[int, int], Segment, Segment | None]] = []
        resident = len(recorder.sizes)
        initial = list(range(resident))
        steady: list[int] = []
        first_optimizer_globals: list[int] = []
        for index, (batch_size, seq_len) in enumerate(shapes):
            start = len(recorder.events)
            grad_ids = tracer.run(batch_size, seq_len, step_optimizer=index < optimizer_steps)
            fb, opt, opt_globals = tracer.cut(
                start, resident, grad_ids, optimizer=tracer.train and index < optimizer_steps
            )
            if index == 0:
                first_optimizer_globals = opt_globals
                steady = sorted(recorder._live.values())
            steps.append(((batch_size, seq_len), fb, opt))
            # allocations of this step that survive it (optimizer state) are resident from now on
            resident = len(recorder.sizes)
        trace = tracer.step_trace(steps, initial, steady, first_optimizer_globals)
        del tracer, recorder
    return trace


@dataclass
class _Tracer:
    """A fake model with its recorder, optimizer and modes: what every traced step shares."""

    config: Any
    spec: StepSpec
    fake_mode: FakeTensorMode
    keeper: BackwardModes
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    blocks: list[torch.nn.Module]
    recorder: StorageRecorder
    resident_blocks: list[int]  # the FSDP block of each initial resident, -1 for the root's
    parameter_bytes: int
    optimizer: torch.optim.Optimizer | None
    scaler: Any
    autocast: AutocastFactory
    step_modes: Callable[[], contextlib.AbstractContextManager[Any]]
    backward_modes: Callable[[], contextlib.AbstractContextManager[Any]] | None
    # --activation-offloading: the emulation entered around each forward and backward
    offload: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    @property
    def train(self) -> bool:
        return self.spec.mode == "train"

    @classmethod
    def build(
        cls,
        config: Any,
        spec: StepSpec,
        autocast: AutocastFactory | None,
        step_modes: Callable[[], contextlib.AbstractContextManager[Any]] | None,
        backward_modes: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ) -> _Tracer:
        """Build the fake model, record its parameters and buffers, hook its blocks."""
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        keeper = BackwardModes()
        model = build_fake_model(config, spec, fake_mode, keeper)
        recorder = StorageRecorder()
        params = list(model.parameters())
        blocks = fsdp_blocks(model)
        resident_blocks = _register_residents(model, params, blocks, recorder, fake_mode)
        parameter_bytes = sum(
            s
            for s, c in zip(recorder.sizes, recorder.categories, strict=True)
            if c == CAT["parameters"]
        )
        _mark_blocks(blocks, recorder)
        train = spec.mode == "train"
        optimizer = (
            workload.make_optimizer(
                spec.optimizer, model, spec.device, offload=spec.optimizer_offload
            )
            if train
            else None
        )
        scaler = workload.make_scaler(spec, spec.device, fake=True)
        if autocast is None:
            autocast = workload.default_autocast(spec, "cpu")
        return cls(
            config=config,
            spec=spec,
            fake_mode=fake_mode,
            keeper=keeper,
            model=model,
            params=params,
            blocks=blocks,
            recorder=recorder,
            resident_blocks=resident_blocks,
            parameter_bytes=parameter_bytes,
            optimizer=optimizer,
            scaler=scaler,
            autocast=autocast,
            step_modes=step_modes or contextlib.nullcontext,
            backward_modes=backward_modes,
            offload=_offload_factory(model, spec, recorder),
        )

    def run(self, batch_size: int, seq_len: int, *, step_optimizer: bool) -> set[int]:
        """Run one step under the recorder; the allocation ids of the gradients it made."""
        recorder, spec, model = self.recorder, self.spec, self.model
        grad_ids: set[int] = set()
        _count_tokens(self.offload, batch_size, seq_len)
        with (
            self.fake_mode,
            recorder,
            self.step_modes(),
            linear_ce.declared_chunks(recorder.declaring),
        ):
            recorder.set_phase("setup")
            batch = workload.make_batch(self.config, spec, batch_size, seq_len)
            if not self.train:
                workload.eval_step(model, batch, spec, autocast=self.autocast, recorder=recorder)
            else:
                optimizer = self.optimizer
                assert optimizer is not None
                workload.forward_backward(
                    model,
                    batch,
                    spec,
                    scaler=self.scaler,
                    autocast=self.autocast,
                    backward_modes=self.keeper.wrap(self.backward_modes or contextlib.nullcontext),
                    recorder=recorder,
                    offload=self.offload,
                )
                for param_index, p in enumerate(self.params):
                    if p.grad is not None and (i := recorder.alloc_id(p.grad)) is not None:
                        grad_ids.add(i)
                        recorder.alloc_params[i] = param_index
                recorder.set_phase("optimizer_step")
                if step_optimizer:
                    if self.scaler is not None:
                        self.scaler.step(optimizer)
                    else:
                        optimizer.step()
                # flush the gradients as soon as we can, no need for this memory anymore
                optimizer.zero_grad(set_to_none=True)
            # the batch lives until the loop fetches the next one
            del batch
        return grad_ids

    def cut(
        self, start: int, resident: int, grad_ids: set[int], *, optimizer: bool
    ) -> tuple[Segment, Segment | None, list[int]]:
        """The step recorded from event ``start`` on as its forward+backward segment and, where
        ``optimizer``, its optimizer segment, with the global ids of the latter's allocations."""
        recorder, train = self.recorder, self.train
        state_ids = _optimizer_state_ids(self.optimizer, recorder, self.params)
        mid = _phase_start(recorder.events, start, PHASE["optimizer_step"])
        fb, local = _segment(recorder, start, mid, resident, grad_ids, state_ids, train=train)
        if not optimizer:
            return fb, None, []
        stop = len(recorder.events)
        opt, opt_local = _segment(
            recorder, mid, stop, resident, grad_ids, state_ids, train=train, previous=local
        )
        return fb, opt, sorted(opt_local, key=opt_local.__getitem__)

    def step_trace(
        self,
        steps: list[tuple[tuple[int, int], Segment, Segment | None]],
        initial: list[int],
        steady: list[int],
        first_optimizer_globals: list[int],
    ) -> StepTrace:
        """The traced steps with everything about the model a replay needs."""
        model, params, recorder = self.model, self.params, self.recorder
        param_infos = _param_infos(self.blocks, params, recorder)
        steady_set = set(steady)
        return StepTrace(
            block_layers=block_layers(model, self.blocks),
            resident_blocks=self.resident_blocks,
            params=param_infos,
            resident_params={g: i for g, i in recorder.alloc_params.items() if g in steady_set},
            largest_module_parameters=max(
                (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                default=0,
            ),
            resident_sizes=list(recorder.sizes),
            resident_categories=list(recorder.categories),
            steps=steps,
            num_parameters=sum(p.numel() for p in params),
            trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
            trainable_gradient_bytes=sum(
                p.numel() * p.element_size() for p in params if p.requires_grad
            ),
            parameter_bytes=self.parameter_bytes,
            initial=initial,
            steady=steady,
            first_optimizer_globals=first_optimizer_globals,
        )


def _offload_factory(
    model: torch.nn.Module, spec: StepSpec, recorder: StorageRecorder
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The activation offloading the step runs (``spec.activation_offloading``), emulated by the
    rules of the implementation the target device runs (:mod:`memfit.step.offload`); a CUDA
    target's host copies are recorded as host memory, the CPU's are its own memory."""
    if not spec.activation_offloading or spec.mode != "train":
        return contextlib.nullcontext
    target = offload.implementation(spec.device)
    host = spec.device != "cpu"

    def host_copy(tensor: torch.Tensor, whole_storage: bool) -> torch.Tensor:
        with host_allocation() if host else contextlib.nullcontext():
            if not whole_storage:
                return torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
            return _storage_copy(recorder, tensor)

    # a whole storage brought back is sized as its host copy was (by its formula where padded)
    emulation = offload.OffloadEmulation(
        model, target, host_copy, lambda host: _storage_copy(recorder, host)
    )
    return lambda: emulation


def _storage_copy(recorder: StorageRecorder, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s whole storage whose recorded dims are those its storage was
    recorded with (so that its size fits across shapes as the storage's does): bytes in the
    storage's dims times its element size, or under the storage's own size formula."""
    alloc = recorder.alloc_id(tensor)
    nbytes = int(tensor.untyped_storage().nbytes())
    if alloc is not None and recorder.formulas[alloc] is not None:
        formula = recorder.formulas[alloc]
        assert formula is not None
        with sized_allocation(recorder.shapes[alloc], formula):
            return torch.empty(nbytes, dtype=torch.uint8)
    if alloc is not None and recorder.itemsizes[alloc] > 0:
        return torch.empty((*recorder.shapes[alloc], recorder.itemsizes[alloc]), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def _count_tokens(offload_modes: Any, batch_size: int, seq_len: int) -> None:
    """Tell the offloading emulation the traced step's token dims (see
    :attr:`memfit.step.offload.OffloadEmulation.token_dims`): the sequence, the sequence less
    the shifted token, both times the batch, and the sequence rounded up to 32 (memory-efficient
    attention's logsumexp, (B, H, round_up(S, 32)): with few heads it crosses 1 KiB at some
    lengths of a batch of one, and its offloading may not change with the shape)."""
    emulation = offload_modes()
    if isinstance(emulation, offload.OffloadEmulation):
        dims = {seq_len, seq_len - 1}
        padded = -(-seq_len // 32) * 32
        emulation.token_dims = frozenset(dims | {batch_size * d for d in dims} | {padded})


def _register_residents(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    blocks: list[torch.nn.Module],
    recorder: StorageRecorder,
    fake_mode: FakeTensorMode,
) -> list[int]:
    """Record the parameters and buffers as the first allocations; the FSDP block of each."""
    block_of: dict[int, int] = {}  # storage -> the FSDP block that holds it
    for block_index, block in enumerate(blocks):
        for tensor in [*block.parameters(), *block.buffers()]:
            block_of.setdefault(tensor.untyped_storage()._cdata, block_index)
    resident_blocks: list[int] = []
    with fake_mode:
        for index, p in enumerate(params):
            before = len(recorder.sizes)
            recorder.register(p, "parameters", parameter_index=index)
            if len(recorder.sizes) > before:
                resident_blocks.append(block_of.get(p.untyped_storage()._cdata, -1))
        for b in model.buffers():
            before = len(recorder.sizes)
            recorder.register(b, "buffers")
            if len(recorder.sizes) > before:
                resident_blocks.append(block_of.get(b.untyped_storage()._cdata, -1))
    return resident_blocks


def _mark_blocks(blocks: list[torch.nn.Module], recorder: StorageRecorder) -> None:
    """Record where each transformer block's forward and backward start and end.

    Hooks only: no tensor is created, so the allocations are those of the unhooked step. The
    backward of a block starts when the gradient of any of its outputs arrives and ends when the
    gradient of its input does (tensor hooks, as FSDP's own pre- and post-backward hooks); a
    block whose input needs no gradient (the embeddings) has no end marker.
    """

    def grad_tensors(value: Any) -> list[torch.Tensor]:
        return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]

    for index, block in enumerate(blocks):

        def before(module: Any, args: Any, kwargs: Any, index: int = index) -> None:
            recorder.block_event(index, BLOCK_FORWARD_START)
            inputs = grad_tensors((args, kwargs))
            if inputs:
                register_multi_grad_hook(
                    inputs,
                    lambda grads, index=index: recorder.block_event(index, BLOCK_BACKWARD_END),
                    mode="any",
                )

        def after(module: Any, args: Any, kwargs: Any, output: Any, index: int = index) -> None:
            recorder.block_event(index, BLOCK_FORWARD_END)
            outputs = grad_tensors(output)
            if outputs:
                register_multi_grad_hook(
                    outputs,
                    lambda grads, index=index: recorder.block_event(index, BLOCK_BACKWARD_START),
                    mode="any",
                )

        block.register_forward_pre_hook(before, with_kwargs=True)
        block.register_forward_hook(after, with_kwargs=True)


def _optimizer_state_ids(
    optimizer: torch.optim.Optimizer | None,
    recorder: StorageRecorder,
    params: list[torch.nn.Parameter],
) -> set[int]:
    if optimizer is None:
        return set()
    index = {id(p): i for i, p in enumerate(params)}
    ids = set()
    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and (i := recorder.alloc_id(value)) is not None:
                ids.add(i)
                if id(param) in index:
                    recorder.alloc_params.setdefault(i, index[id(param)])
    return ids


def _param_infos(
    blocks: list[torch.nn.Module], params: list[torch.nn.Parameter], recorder: StorageRecorder
) -> list[ParamInfo]:
    owner: dict[int, int] = {}
    for block_index, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = block_index
    infos = []
    for p in params:
        alloc = recorder.alloc_id(p)
        infos.append(
            ParamInfo(
                alloc=-1 if alloc is None else alloc,
                shape=tuple(int(d) for d in p.shape),
                itemsize=p.element_size(),
                trainable=p.requires_grad,
                block=owner.get(id(p), -1),
            )
        )
    return infos


def _phase_start(events: list[tuple[int, int]], start: int, phase: int) -> int:
    for i in range(start, len(events)):
        if events[i] == (MARK, phase):
            return i
    return len(events)


def _segment(
    recorder: StorageRecorder,
    start: int,
    stop: int,
    resident: int,
    grad_ids: set[int],
    state_ids: set[int],
    *,
    train: bool,
    previous: dict[int, int] | None = None,
) -> tuple[Segment, dict[int, int]]:
    """Cut events [start, stop) into a segment with local allocation numbers and final categories."""
    seg = Segment()
    local: dict[int, int] = {}
    alive: set[int] = set()
    forward_alive: set[int] | None = None
    phase = PHASE["setup"]
    for kind, ref in recorder.events[start:stop]:
        if kind == BLOCK:
            seg.events.append((BLOCK, ref))
        elif kind == MARK:
            if phase == PHASE["forward"] and ref != PHASE["forward"] and forward_alive is None:
                forward_alive = set(alive)
            phase = ref
            seg.events.append((MARK, ref))
        elif kind == ALLOC:
            local[ref] = len(seg.sizes)
            alive.add(ref)
            seg.sizes.append(recorder.sizes[ref])
            seg.ops.append(recorder.ops[ref])
            seg.shapes.append(recorder.shapes[ref])
            seg.itemsizes.append(recorder.itemsizes[ref])
            seg.formulas.append(recorder.formulas[ref])
            seg.categories.append(-1)
            seg.params.append(-1)
            seg.origins.append(recorder.origins.get(ref, -1))
            seg.events.append((ALLOC, local[ref]))
        elif ref in local:
            alive.discard(ref)
            seg.events.append((FREE, local[ref]))
        elif previous is not None and ref in previous:
            seg.events.append((FREE_PREV, previous[ref]))
        elif ref < resident:
            seg.events.append((FREE_RES, ref))
        else:  # pragma: no cover - an allocation from another step: a bug in the trace cut
            raise RuntimeError(f"trace: free of allocation {ref} from outside its step")
    if forward_alive is None:
        forward_alive = set(alive)
    for g, j in local.items():
        if g in grad_ids:
            cat = CAT["gradients"]
        elif g in state_ids:
            cat = CAT["optimizer_state"]
        elif not train or g in forward_alive:
            # alive when the forward ended: saved for backward, the loss, logits, the input batch
            # (in eval, everything the forward holds is an activation)
            cat = CAT["activations"]
        else:
            cat = CAT["transient"]
        seg.categories[j] = cat
        recorder.categories[g] = cat
        seg.params[j] = recorder.alloc_params.get(g, -1)
    return seg, local
