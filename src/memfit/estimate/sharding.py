"""What each way of spreading a model over W GPUs keeps on one of them.

The trace is of one unsharded step (the parameters in the dtypes of ``--weights-dtype``: fp32
trained ones, a frozen base in its checkpoint's dtype; autocast for mixed precision). A sharded
estimate replays the same events with their sizes changed by category, so the peak moves to the
phase where the scheme really peaks; :func:`layout` says how. Nothing here traces: the world size
and the scheme are replay-time knobs, and a trace serves every one of them.

The schemes (``--sharding``), per rank, with P parameters (Pt of them trainable), b bytes per
16-bit or 32-bit module parameter (2 under ``--precision bf16|fp16``, 4 under fp32) and W ranks.
``memfit train`` runs all of them (the DeepSpeed stages through DeepSpeed, :mod:`memfit.train.zero`):

``none``
    memfit's own data parallelism: every rank holds the whole model, its gradients and the
    optimizer state, exactly as one GPU does; after the step's micro-batches each ``.grad`` is
    all-reduced in place, so there is no second copy of the gradients. (torch DDP's reducer
    would add one, in 25 MiB buckets: reported as ``ddp_bucket_bytes``, not counted.) On CUDA
    NCCL's communicator buffers are added once W > 1.

``zero1`` / ``zero2`` / ``zero3``
    DeepSpeed ZeRO stage 1/2/3 (as accelerate's DeepSpeedPlugin runs it). Mixed precision in
    DeepSpeed means a 16-bit module (b = 2) with fp32 master weights inside the optimizer; in
    fp32 the module is fp32 (b = 4) and DeepSpeed still keeps its own fp32 copy of the partition
    it updates (``stage_1_and_2.py`` clones it), so the master copy is counted in both cases.
    Categories follow the ZeRO paper (Rajbhandari et al. 2020, §5: 2Ψ + 2Ψ + KΨ with K = 12 for
    mixed-precision Adam: fp32 master weights, momentum and variance):

    ======  ==============  =================  ================================
    stage   parameters      gradients          optimizer state (master + K)
    ======  ==============  =================  ================================
    zero1   b·P             b·Pt               (4 + k)·Pt / W
    zero2   b·P             b·Pt / W           (4 + k)·Pt / W
    zero3   b·P / W         b·Pt / W           (4 + k)·Pt / W
    ======  ==============  =================  ================================

    k is the traced optimizer's state per trainable parameter (8 for AdamW; the 8-bit AdamW,
    Adafactor and SGD states as traced, each state tensor divided by W). With b = 2 and AdamW
    these are the paper's 4P + 12P/W, 2P + 14P/W and 16P/W. Frozen parameters (LoRA's base
    model) have no gradient or state; ZeRO-3 partitions them too, ZeRO-1/2 do not.

    ``model_state`` keeps these categories and lists implementation buffers apart, so both
    checks stay readable: the fp32 gradient partition the optimizer step reads (4·Pt/W:
    DeepSpeed's own estimator counts it, "4_grads_32bit", which is why its ZeRO-2 figure is
    2P + 18P/W); ZeRO-3's persistent parameters (those under ``stage3_param_persistence_threshold``
    elements stay whole on every rank). What the replay holds, and when, is what DeepSpeed
    0.19.8 allocates (below, "Gather buffers"), measured on two CPU ranks by
    ``bench/zero_truth.py``. Checked against DeepSpeed 0.19.8's estimators: ZeRO-2 agrees (2P + 18P/W,
    up to AdamW's step counters); for ZeRO-3 DeepSpeed counts 4·largest_layer + 18P/W, and memfit
    2P/W more: the 16-bit parameter partition itself, which DeepSpeed's ZeRO-3 formula leaves out
    (its 18 is ZeRO-2's "2 grads 16-bit + 4 grads 32-bit + 4 params 32-bit + 8 optimizer states").

``zero1|zero2|zero3`` with ``--optimizer-offload cpu`` (ZeRO-Offload, ``offload_optimizer``)
    The fp32 master partition, the optimizer state and the gradient partitions move to host
    memory (:func:`memfit.estimate.optimizer_offload.host_parts` counts them there); the GPU keeps
    the 16-bit module (ZeRO-3: its partition), ZeRO-1's whole gradients until the step, the
    reduce buckets, a gradient buffer of the largest parameter and, at the step, each gradient
    restored from the host one at a time (its norm and its fp32 copy on the way out). Checked
    against DeepSpeed 0.19.8's ``estimate_zero2_model_states_mem_needs(cpu_offload=True)``: GPU
    2P, host 16P/W per rank (its 1.5 ``additional_buffer_factor`` left out).

``fsdp``
    PyTorch FSDP2 (``fully_shard``) on every transformer block (:func:`memfit.estimate.trace.
    fsdp_blocks`), then on the root, with FSDP's default resharding (blocks reshard after their
    forward; the root keeps its parameters until backward ends). Parameters, gradients and
    optimizer state are sharded per tensor on dim 0: each rank holds ceil(dim0 / W) rows of every
    tensor (padded), frozen ones included. Parameters stay fp32 when sharded (the fp32 shard is
    the master copy; mixed precision is ``MixedPrecisionPolicy(param_dtype=16-bit,
    reduce_dtype=fp32)``), gradients are fp32 shards. For mixed-precision AdamW that is the
    paper's ZeRO-3 figure, 16P/W.

Gather buffers. ZeRO's are windows of phases (allocated as a phase starts, freed as a phase they
are not alive in starts), moments at a mark (allocated and freed at once) and the optimizer
step's buffers in order; FSDP's follow the trace's block marks (:class:`Buffers`). ZeRO's, as
DeepSpeed 0.19.8 allocates them (``runtime/zero/stage_1_and_2.py``, ``stage3.py``), with b the
module's bytes per element (gradients are kept in the module's dtype: ``grad_accum_dtype``
defaults to it):

- Gradients during backward. ZeRO-1 reduces nothing until backward ends: autograd's whole
  gradients, as traced. ZeRO-2/3 reduce a bucket at a time from the gradient hooks: each gradient
  is whole (b·numel) for a moment as autograd makes it, copied into the bucket (or, larger than
  the bucket, reduced on its own), then only its partition is kept. The replay drops the traced
  gradients and holds each one whole at the first block mark after autograd makes it (the
  largest of those under one mark; the embeddings', made after backward's last mark, at that
  mark): a large embedding's gradient is whole only at the end of backward.
- ZeRO-1/2's partition buffer (``grads_in_partition``, ``copy_grads_in_partition``): the reduced
  gradients of a rank's partition are copied into one buffer sized as the *whole* of every
  parameter that overlaps its partition, summed over the optimizer's parameter groups (each
  group is flattened and partitioned on its own; memfit train's and the Trainer's groups:
  decayed matrices, then biases and norms, :func:`deepspeed_param_groups`). An embedding that
  straddles a boundary counts whole on both ranks; the replay takes the worst rank
  (:func:`zero12_partitions`). ZeRO-2 allocates it at the first reduction that touches the rank's
  partition (early in backward on the rank that holds the last layers), held from backward's
  start; its views are the gradients the step flattens group by group, so it lives to the end of
  the step. ZeRO-1 allocates it as backward ends, while every whole gradient is still alive (a
  moment at the step's mark; the replay then keeps the whole gradients to the step's end instead,
  an upper bound, as the buffer never holds more than all of them). The reduce bucket
  (``reduce_bucket_size`` elements, two with ``overlap_comm``) during backward.
- ZeRO-3: the reduced partitions go into ``grad_partitions_flat_buffer`` (b·Σceil(numel/W) over
  the trainable parameters), allocated with the optimizer and kept (a resident); one contiguous
  reduce bucket, also kept. During forward and backward the gathered 16-bit parameters: the
  largest module's own parameters (DeepSpeed's "largest layer"), the prefetch bucket, and those
  kept gathered because backward reuses them within ``stage3_max_reuse_distance`` (see
  :class:`ZeroSettings`; held as a constant: the forward's end, where they are most, is where
  activations peak too), never more than all the partitioned parameters: with the default
  distance every partitioned parameter is kept, the largest layer and the prefetch among them.
  DeepSpeed's own estimator counts 4 bytes per largest-layer parameter for its gathered
  parameters and gradients (2 + 2).
- The optimizer step (all three): the gradient norm is computed whether or not it clips
  (``compute_grad_norm``), each gradient piece copied to float64 (``get_norm_dtype()``, double
  wherever the accelerator has fp64: the CPU and CUDA), one at a time (taken on the rank where
  piece and partition buffer weigh most together); then each group's partition is flattened (a
  copy in the module's dtype) and cast to fp32 (no copy when it is fp32), and that fp32 gradient
  is kept through the group's update. The optimizer runs on one flat fp32 tensor per group, so a
  per-tensor temporary (the CPU's for-loop AdamW: its square root and quotient) is the size of
  the largest group's partition, not of the largest parameter's shard.
- FSDP: the root's parameters (embeddings, heads) in the compute dtype from the forward's start
  to the end of backward, and its unsharded gradients (compute dtype) from when autograd makes
  them to the end of backward, when an fp32 reduce-scatter input turns them into shards. Each
  block is gathered (all-gather output, then the unsharded parameters, then the output freed)
  as its forward starts, with the next block on CUDA, whose all-gather stream runs ahead; it is
  resharded as its forward ends. In backward a block is gathered as its backward starts, the
  previous block's all-gather output is prefetched, and as its backward ends its unsharded
  gradients (compute dtype) are copied into an fp32 reduce-scatter input, kept until the next
  block's reduce-scatter. Sizes are per block, padded to W rows per tensor. Measured on the CPU
  (``bench/sharding_check.py --fsdp-truth``), not yet on a GPU.

Under FSDP and DeepSpeed mixed precision the parameters the layers compute with are 16-bit
already, so autocast's cache of 16-bit weight copies (the trace's ``weight_cast`` allocations) is
not there: those allocations are dropped. Activations are otherwise as traced under autocast
(an upper bound for DeepSpeed's pure 16-bit module, whose layer norms and softmaxes keep 16-bit
outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memfit.estimate.optimizer_offload import host_parts
from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    BLOCK_BACKWARD_END,
    BLOCK_BACKWARD_START,
    BLOCK_FORWARD_END,
    BLOCK_FORWARD_START,
    CAT,
    MARK,
    PHASE,
    ParamInfo,
    Segment,
    StepTrace,
)
from memfit.estimate.workload import StepSpec

SCHEMES = ("none", "zero1", "zero2", "zero3", "fsdp")
DEEPSPEED_SCHEMES = ("zero1", "zero2", "zero3")
# least harmful first, for a memfit user: no sharding; FSDP, which PyTorch itself runs (the
# sharding of ZeRO-3; parameters gathered again in backward, 1.5x data parallelism's traffic);
# then DeepSpeed's stages, which need DeepSpeed installed (memfit[deepspeed]), fewest sharded
# states (and least traffic) first
SCHEME_ORDER = {name: i for i, name in enumerate(("none", "fsdp", "zero1", "zero2", "zero3"))}
# optimizer state of at most this many bytes, and smaller than its parameter's 4-byte copy, is a
# scalar (AdamW's step counter): one per tensor, whatever the shard
STATE_SCALAR_BYTES = 8


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed ``zero_optimization`` settings the estimate assumes (elements, not bytes).

    The bucket sizes are accelerate's ``"auto"`` values for a model of hidden size h
    (``Accelerator._prepare_deepspeed``): ``reduce_bucket_size`` h², ``stage3_prefetch_bucket_size``
    0.9·h², ``stage3_param_persistence_threshold`` 10·h. ``stage3_max_live_parameters`` and
    ``stage3_max_reuse_distance`` keep DeepSpeed's defaults (10⁹). Note what the reuse distance
    means for models under ~500M parameters: ZeRO-3 does not release a layer's gathered
    parameters when it will use them again within that many elements of fetches, and backward
    uses every layer again, so at the end of the forward min(P, distance / 2) parameters are
    gathered (16-bit) on every rank. A DeepSpeed config without these keys gets DeepSpeed's own
    defaults instead (a 5·10⁸-element reduce bucket: 1 GB of 16-bit buffer; accelerate fills
    its "auto" values only for keys a config file sets to "auto"), so a run that should match
    the estimate passes :meth:`config` (:func:`deepspeed_zero_config`) to DeepSpeed.
    """

    stage: int
    reduce_bucket_size: int
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int = 10**9
    max_reuse_distance: int = 10**9
    contiguous_gradients: bool = True

    @classmethod
    def for_model(cls, stage: int, hidden_size: int) -> ZeroSettings:
        h = int(hidden_size)
        return cls(
            stage=stage,
            reduce_bucket_size=h * h,
            prefetch_bucket_size=int(0.9 * h * h),
            param_persistence_threshold=10 * h,
        )

    @property
    def overlap_comm(self) -> bool:
        # DeepSpeed's default: on for stage 3 only (zero/config.py overlap_comm_valid)
        return self.stage == 3

    def config(self) -> dict[str, Any]:
        """The ``zero_optimization`` section of a DeepSpeed config with these settings."""
        section: dict[str, Any] = {
            "stage": self.stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "contiguous_gradients": self.contiguous_gradients,
            "overlap_comm": self.overlap_comm,
        }
        if self.stage == 3:
            section |= {
                "stage3_prefetch_bucket_size": self.prefetch_bucket_size,
                "stage3_param_persistence_threshold": self.param_persistence_threshold,
                "stage3_max_live_parameters": self.max_live_parameters,
                "stage3_max_reuse_distance": self.max_reuse_distance,
            }
        return section


def deepspeed_zero_config(sharding: str, hidden_size: int) -> dict[str, Any]:
    """The ``zero_optimization`` section memfit's estimate assumes for ``zero1|zero2|zero3``."""
    if sharding not in DEEPSPEED_SCHEMES:
        raise ValueError(f"{sharding!r} is not a DeepSpeed scheme ({', '.join(DEEPSPEED_SCHEMES)})")
    return ZeroSettings.for_model(int(sharding[-1]), hidden_size).config()


Action = tuple[str, str, int, int]  # ("alloc" | "free", name, bytes, category)


@dataclass(frozen=True)
class Window:
    """A buffer alive during some phases of every step (allocated as a phase starts)."""

    name: str
    size: int
    category: int
    phases: frozenset[int]


@dataclass
class ShardLayout:
    """How one scheme at one world size changes the trace's allocations (see :func:`layout`)."""

    scheme: str
    world_size: int
    # global allocation id -> the pieces it becomes, as (bytes, category); absent: unchanged
    resident: dict[int, tuple[tuple[int, int], ...]]
    windows: tuple[Window, ...]
    details: dict[str, Any]
    # FSDP: per transformer block, its unsharded parameters and trainable parameters (elements,
    # padded), the bytes per element the layers compute in, and whether the next block's
    # parameters are gathered ahead in forward (CUDA's all-gather stream)
    block_parameters: tuple[int, ...] = ()
    block_trainable: tuple[int, ...] = ()
    compute_bytes: int = 4
    forward_prefetch: bool = False
    # FSDP: the fp32 reduce-scatter input of the gradients reduced as backward ends (the root's,
    # the embeddings'), alive for a moment
    root_reduce_scatter: int = 0
    # per parameter: its gradient's bytes on this rank after backward, and during backward (FSDP's
    # root parameters keep their whole unsharded gradient until backward ends)
    _param_sizes: list[tuple[int, int]] = field(default_factory=list)
    _state_shard: list[float] = field(default_factory=list)
    _param_numels: list[int] = field(default_factory=list)
    _drop_casts: bool = False
    _optimizer_factor: float = 1.0
    # ZeRO: a per-tensor optimizer temporary's factor (the largest flat partition over the
    # largest parameter); 0: _optimizer_factor
    _optimizer_tensor_factor: float = 0.0
    # ZeRO: buffers allocated (and freed) in order as a phase starts, after the windows: the
    # optimizer step's gradient norm and flat gradient partition (see :class:`Buffers`)
    phase_actions: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    # ZeRO-2/3: per parameter, the bytes of its whole 16-bit (or fp32) gradient, alive for a
    # moment as autograd makes it (until its bucket is reduced); 0: none
    gradient_spike_bytes: tuple[int, ...] = ()
    # per segment (by id): local allocation -> its size, or the factor that scales its size
    _overrides: dict[int, dict[int, int | float]] = field(default_factory=dict)
    # per forward/backward segment (by id): mark ordinal (phase and block marks since the
    # forward's mark) -> spike bytes
    _spike_maps: dict[int, dict[int, int]] = field(default_factory=dict)
    # the spikes of the forward/backward segment last resized (the one being replayed)
    spikes: dict[int, int] = field(default_factory=dict)

    def pieces(self, alloc: int, size: int, category: int) -> tuple[tuple[int, int], ...]:
        return self.resident.get(alloc, ((size, category),))

    def segment_sizes(self, seg: Segment, sizes: list[int]) -> list[int]:
        """``sizes`` of a segment's allocations as this scheme has them."""
        overrides = self._overrides.get(id(seg))
        if overrides is None:
            overrides = self._segment_overrides(seg)
            self._overrides[id(seg)] = overrides
            if self.gradient_spike_bytes and seg.events[:1] != [(MARK, PHASE["optimizer_step"])]:
                self._spike_maps[id(seg)] = self._spike_map(seg)
        if id(seg) in self._spike_maps:
            self.spikes = self._spike_maps[id(seg)]
        if not overrides:
            return sizes
        out = list(sizes)
        for j, value in overrides.items():
            out[j] = _scaled(sizes[j], value) if isinstance(value, float) else value
        return out

    def _segment_overrides(self, seg: Segment) -> dict[int, int | float]:
        out: dict[int, int | float] = {}
        optimizer = seg.events[:1] == [(MARK, PHASE["optimizer_step"])]
        for j, (cat, param) in enumerate(zip(seg.categories, seg.params, strict=True)):
            if seg.ops[j] == "weight_cast" and self._drop_casts:
                # the module computes with its own 16-bit parameters: no cast copy
                out[j] = 0
            elif cat == CAT["gradients"] and param >= 0:
                out[j] = self._param_sizes[param][1]
            elif cat == CAT["optimizer_state"] and param >= 0:
                out[j] = self._state_size(param, seg.sizes[j])
            elif optimizer and cat == CAT["transient"]:
                # the optimizer's temporaries (AdamW's square roots) follow its shard: a foreach
                # op's outputs, one per tensor, scale with the parameters; a per-tensor op's
                # (the CPU's for-loop AdamW) are those of one tensor, the largest, which under
                # DeepSpeed is a whole flat partition (``_optimizer_tensor_factor``)
                factor = self._optimizer_factor
                if self._optimizer_tensor_factor and not seg.ops[j].startswith("_foreach"):
                    factor = self._optimizer_tensor_factor
                if factor != 1.0:
                    out[j] = factor
        return out

    def conversions(self, seg: Segment) -> list[tuple[int, int, int]]:
        """(allocation, bytes during backward, bytes after) of gradients that shrink when
        backward ends: FSDP's root reduce-scatters its unsharded gradients then."""
        return [
            (j, self._param_sizes[param][1], self._param_sizes[param][0])
            for j, (cat, param) in enumerate(zip(seg.categories, seg.params, strict=True))
            if cat == CAT["gradients"]
            and param >= 0
            and self._param_sizes[param][0] != self._param_sizes[param][1]
        ]

    def _state_size(self, param: int, size: int) -> int:
        return _state_bytes(size, self._state_shard[param], self._param_numels[param])

    def _spike_map(self, seg: Segment) -> dict[int, int]:
        """Where each gradient's whole-size moment goes: at the first phase or block mark after
        autograd allocates it (the ordinal of that mark since the forward's mark); those made
        after backward's last mark (the embeddings', the last ones) at that last mark. Several
        under one mark: the largest (each is reduced before the next one arrives)."""
        spikes: dict[int, int] = {}
        pending = 0
        ordinal = 0
        for kind, ref in seg.events:
            if kind == ALLOC:
                param = seg.params[ref]
                if seg.categories[ref] == CAT["gradients"] and param >= 0:
                    pending = max(pending, self.gradient_spike_bytes[param])
            elif kind in (MARK, BLOCK):
                ordinal = 0 if (kind, ref) == (MARK, PHASE["forward"]) else ordinal + 1
                if pending:
                    spikes[ordinal] = max(spikes.get(ordinal, 0), pending)
                    pending = 0
        if pending:
            # after backward's last mark (the embeddings' gradients): at that mark, whose
            # phase, backward, is the one they belong to
            spikes[ordinal] = max(spikes.get(ordinal, 0), pending)
        return spikes


class Buffers:
    """A scheme's buffers during one replay, allocated and freed as the step's events go by.

    Phase windows (:class:`Window`) open and close at phase marks. FSDP's blocks follow the
    trace's block marks: a block is gathered as its forward starts (on CUDA the next block is
    gathered with it) and resharded as it ends; in backward a block is gathered as its backward
    starts, the block before it in the forward order is prefetched (its all-gather output held
    until its own backward starts), and as its backward ends its unsharded gradients are copied
    into an fp32 reduce-scatter input (held until the next block's reduce-scatter), the gradients
    and the block's parameters freed. Everything left is freed when backward ends. ZeRO's gradient
    moments (:attr:`ShardLayout.spikes`) are allocated and freed at the mark they belong to, and
    its optimizer-step buffers (:attr:`ShardLayout.phase_actions`, named ``step.*``) are
    allocated in order as the step starts and freed as the next phase starts.
    """

    def __init__(self, shard: ShardLayout) -> None:
        self.shard = shard
        self.alive: dict[str, tuple[int, int]] = {}  # name -> (bytes, category)
        self.phase = PHASE["setup"]
        self._held_reduce: str | None = None
        self._backward_open: list[int] = []  # blocks whose backward started and did not end
        self._ordinal = 0  # phase and block marks since the forward's mark (gradient spikes)

    def _alloc(self, name: str, size: int, category: int, out: list[Action]) -> None:
        if name not in self.alive and size > 0:
            self.alive[name] = (size, category)
            out.append(("alloc", name, size, category))

    def _free(self, name: str, out: list[Action]) -> None:
        if name in self.alive:
            size, category = self.alive.pop(name)
            out.append(("free", name, size, category))

    def _spike(self, key: int, out: list[Action]) -> None:
        """A gradient alive for a moment, whole (ZeRO-2/3: until its bucket is reduced)."""
        size = self.shard.spikes.get(key, 0)
        self._alloc("unreduced_gradient", size, CAT["gradients"], out)
        self._free("unreduced_gradient", out)

    def _count(self, key: tuple[int, int], out: list[Action]) -> None:
        self._ordinal = 0 if key == (MARK, PHASE["forward"]) else self._ordinal + 1
        self._spike(self._ordinal, out)

    def mark(self, phase: int) -> list[Action]:
        out: list[Action] = []
        self._count((MARK, phase), out)
        self.phase = phase
        if phase not in (PHASE["forward"], PHASE["backward"]):
            # backward is over: the root's final callback reduce-scatters the gradients of the
            # root and of the blocks whose input needs no gradient (the embeddings: no end
            # marker; see ShardLayout.conversions), then frees what is left
            self._backward_open.clear()
            for name in [n for n in self.alive if n.startswith("block")]:
                self._free(name, out)
            self._held_reduce = None
        for window in self.shard.windows:
            if window.name in self.alive and phase not in window.phases:
                self._free(window.name, out)
        for window in self.shard.windows:
            if phase in window.phases:
                self._alloc(window.name, window.size, window.category, out)
        for name in [n for n in self.alive if n.startswith("step.")]:
            self._free(name, out)  # the optimizer step's own buffers, freed as it ends
        for action, name, size, category in self.shard.phase_actions.get(phase, ()):
            if action == "alloc":
                self._alloc(name, size, category, out)
            else:
                self._free(name, out)
        return out

    def block(self, ref: int) -> list[Action]:
        out: list[Action] = []
        shard = self.shard
        self._count((BLOCK, ref), out)
        if not shard.block_parameters:
            return out
        index, stage = divmod(ref, 4)
        c = shard.compute_bytes
        backward = self.phase == PHASE["backward"]
        if stage == BLOCK_FORWARD_START:
            self._gather(index, out)
            if shard.forward_prefetch and not backward:
                self._gather(index + 1, out)
        elif stage == BLOCK_FORWARD_END and not backward:
            # reshard_after_forward (a recomputation inside backward keeps the block gathered)
            self._free(f"block{index}", out)
        elif stage == BLOCK_BACKWARD_START:
            if index not in self._backward_open:
                self._backward_open.append(index)
            self._gather(index, out)
            if index > 0 and f"block{index - 1}" not in self.alive:
                # backward prefetch: the previous block's all-gather is issued now
                size = c * shard.block_parameters[index - 1]
                self._alloc(f"block{index - 1}.all_gather", size, CAT["parameters"], out)
        elif stage == BLOCK_BACKWARD_END:
            if index in self._backward_open:
                self._backward_open.remove(index)
            self._post_backward(index, out)
        return out

    def _post_backward(self, index: int, out: list[Action]) -> None:
        c = self.shard.compute_bytes
        trainable = self.shard.block_trainable[index]
        # the block's unsharded gradients (compute dtype), copied into the fp32 reduce-scatter
        # input, then freed with the block's unsharded parameters
        self._alloc(f"block{index}.gradients", c * trainable, CAT["gradients"], out)
        held = self._held_reduce
        self._alloc(f"block{index}.reduce_scatter", 4 * trainable, CAT["gradients"], out)
        self._free(f"block{index}.gradients", out)
        self._free(f"block{index}", out)
        if held is not None:
            # the previous reduce-scatter input is kept until this one is issued
            self._free(held, out)
        self._held_reduce = f"block{index}.reduce_scatter"

    def _gather(self, index: int, out: list[Action]) -> None:
        shard = self.shard
        if index >= len(shard.block_parameters) or f"block{index}" in self.alive:
            return
        size = shard.compute_bytes * shard.block_parameters[index]
        # the all-gather output, copied out into the unsharded parameters, then freed
        self._alloc(f"block{index}.all_gather", size, CAT["parameters"], out)
        self._alloc(f"block{index}", size, CAT["parameters"], out)
        self._free(f"block{index}.all_gather", out)


def _state_bytes(size: int, shard: float, numel: int) -> int:
    if shard == 0.0:
        return 0  # offloaded to host memory, step counters and all
    if size <= STATE_SCALAR_BYTES and size < 4 * numel:
        return size  # a step counter: one per tensor, whatever the shard
    return _scaled(size, shard)


def _scaled(size: int, factor: float) -> int:
    return math.ceil(size * factor) if factor != 1.0 else size


def shard_rows(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of one rank's FSDP shard of a tensor: ceil(dim0 / W) rows (padded)."""
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return -(-shape[0] // world_size) * rest


def module_bytes(precision: str) -> int:
    """Bytes per parameter of a DeepSpeed module (16-bit under mixed precision)."""
    return 4 if precision == "fp32" else 2


@dataclass
class _Parts:
    """What one scheme decides for :func:`layout`, before the optimizer state is cut to shards."""

    resident: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # per parameter: its gradient's bytes after and during backward, the share of its state
    param_sizes: list[tuple[int, int]] = field(default_factory=list)
    state_shard: list[float] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    drop_casts: bool = False
    optimizer_factor: float = 1.0
    optimizer_tensor_factor: float = 0.0
    # ZeRO only (see ShardLayout)
    phase_actions: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    gradient_spike_bytes: tuple[int, ...] = ()
    # FSDP only (see ShardLayout)
    block_parameters: tuple[int, ...] = ()
    block_trainable: tuple[int, ...] = ()
    compute_bytes: int = 4
    forward_prefetch: bool = False
    root_reduce_scatter: int = 0


def layout(
    trace: StepTrace,
    spec: StepSpec,
    scheme: str,
    world_size: int,
    *,
    hidden_size: int,
) -> ShardLayout:
    """The per-rank sizes of ``scheme`` on ``world_size`` ranks for this trace (see the module)."""
    if scheme in DEEPSPEED_SCHEMES:
        parts = _zero_parts(trace, spec, scheme, world_size, hidden_size)
    elif scheme == "fsdp":
        parts = _fsdp_parts(trace, spec, world_size)
    else:
        raise ValueError(f"unknown sharding scheme {scheme!r}")
    params = trace.params
    for g, size in _traced_states(trace):
        # the optimizer state that exists between steps, cut to this rank's shard
        index = trace.resident_params[g]
        state = _state_bytes(size, parts.state_shard[index], params[index].numel)
        parts.resident[g] = ((state, CAT["optimizer_state"]),)
    return ShardLayout(
        scheme=scheme,
        world_size=world_size,
        resident=parts.resident,
        windows=tuple(w for w in parts.windows if w.size > 0),
        details=parts.details,
        block_parameters=parts.block_parameters,
        block_trainable=parts.block_trainable,
        compute_bytes=parts.compute_bytes,
        forward_prefetch=parts.forward_prefetch,
        root_reduce_scatter=parts.root_reduce_scatter,
        _param_sizes=parts.param_sizes,
        _state_shard=parts.state_shard,
        _param_numels=[p.numel for p in params],
        _drop_casts=parts.drop_casts,
        _optimizer_factor=parts.optimizer_factor,
        _optimizer_tensor_factor=parts.optimizer_tensor_factor,
        phase_actions=parts.phase_actions,
        gradient_spike_bytes=parts.gradient_spike_bytes,
    )


def _zero_parts(trace: StepTrace, spec: StepSpec, scheme: str, W: int, hidden_size: int) -> _Parts:
    """DeepSpeed ZeRO stage 1, 2 or 3 (``scheme``): partitions, buffers and model states."""
    settings = ZeroSettings.for_model(int(scheme[-1]), hidden_size)
    stage = settings.stage
    params = trace.params
    train = spec.mode == "train"
    pcat, gcat, scat = CAT["parameters"], CAT["gradients"], CAT["optimizer_state"]
    P = sum(p.numel for p in params)
    Pt = sum(p.numel for p in params if p.trainable)
    b = module_bytes(spec.precision)
    parts = _Parts(drop_casts=spec.precision != "fp32", optimizer_factor=1 / W)
    # ZeRO-Offload: the master partition, the optimizer state and the gradient partitions live
    # in host memory (memfit.estimate.optimizer_offload.host_parts counts them there)
    offload = train and getattr(spec, "optimizer_offload", "none") == "cpu"
    persistent = 0
    spikes: list[int] = []
    for p in params:
        keep_whole = stage < 3 or (p.numel < settings.param_persistence_threshold)
        if stage == 3 and keep_whole:
            persistent += p.numel
        # a 16-bit weight (a frozen base held in bf16) stays 16-bit in an fp32 module
        module = min(b, p.itemsize) * (p.numel if keep_whole else -(-p.numel // W))
        pieces = [(module, pcat)]
        if p.trainable and train and not offload:
            # DeepSpeed's fp32 copy of the partition this rank updates (master weights)
            pieces.append((4 * -(-p.numel // W), scat))
            if stage == 3:
                # grad_partitions_flat_buffer: every reduced gradient partition, from the start
                pieces.append((b * -(-p.numel // W), gcat))
        parts.resident[p.alloc] = tuple(pieces)
        # ZeRO-1: autograd's whole gradients until the step's reduction; ZeRO-2/3: each one is
        # whole for a moment (a spike), then reduced into a partition buffer (a window or the
        # resident flat buffer above)
        grad = b * p.numel if stage == 1 else 0
        parts.param_sizes.append((grad, grad))
        spikes.append(b * p.numel if stage > 1 and p.trainable and train else 0)
        # offloaded: no optimizer state on the GPU (a step counter of a few bytes aside)
        parts.state_shard.append(0.0 if offload else 1 / W)
    parts.gradient_spike_bytes = tuple(spikes) if any(spikes) else ()
    largest = trace.largest_module_parameters
    partitioned = P - persistent
    groups = deepspeed_param_groups(params)
    largest_param = max((p.numel for p in params if p.trainable), default=0)
    if stage == 3:
        _zero3_buffers(parts, settings, b, largest, partitioned, train)
        # each parameter's partition: ceil(numel / W) on every rank; one flat fp32 partition
        # per parameter group (sub_group_size 10^9)
        group_partition = max((-(-sum(g) // W) for g in groups), default=0)
        worst, piece = -(-Pt // W), -(-largest_param // W)
        norm = 8 * piece
    else:
        overlap, rank_pieces, group_partition = zero12_partitions(groups, W)
        worst, piece = max(overlap, default=0), max(rank_pieces, default=0)
        # the norm's float64 copy of a piece, on the rank where it and the partition buffer
        # weigh most together (a rank whose partition is one slice of the embedding has the
        # largest piece, the rank it straddles into the largest buffer)
        norm = max((b * o + 8 * q for o, q in zip(overlap, rank_pieces, strict=True)), default=0)
        norm -= b * worst
        if train:
            _zero12_buffers(parts, settings, b, 0 if offload else worst)
    if offload and Pt:
        _offload_buffers(
            parts, stage, b, largest_param, -(-largest_param // W) if stage == 3 else piece
        )
    elif train and Pt:
        parts.phase_actions[PHASE["optimizer_step"]] = _step_actions(
            parts, stage, b, norm, group_partition
        )
        parts.optimizer_tensor_factor = group_partition / largest_param
    fp32_partition = 4 * -(-Pt // W) if train and Pt and not offload else 0
    # the module's parameters: b bytes each, but for 16-bit ones in an fp32 module
    narrow = sum(p.numel for p in params if p.itemsize < b)
    model_params = b * (P if stage < 3 else persistent + -(-partitioned // W))
    model_params -= (b - 2) * (narrow if stage < 3 else -(-narrow // W))
    model_grads = (b * (Pt if stage == 1 else -(-Pt // W))) if train else 0
    master = 4 * -(-Pt // W) if train else 0
    state = _sharded_state_bytes(trace, parts.state_shard) if train else 0
    host: dict[str, int] | None = None
    if offload:
        # in host memory, per rank: ZeRO's model-state categories (DeepSpeed's own estimator
        # counts these, 16 bytes per parameter over the ranks: fp32 master weights, fp32
        # gradients, AdamW's two fp32 moments); what DeepSpeed keeps there beyond them is in
        # details["host"]["parts"]
        moments = 8 if spec.optimizer == "adamw" else 0
        host = {
            "master_weights_bytes": master,
            "gradients_bytes": 4 * -(-Pt // W),
            "optimizer_state_bytes": moments * -(-Pt // W),
        }
        host["total_bytes"] = sum(host.values())
        # on the GPU: ZeRO-1's whole gradients until the step; ZeRO-2/3 keep no partition there
        model_grads = b * Pt if stage == 1 else 0
        master = 0
    paper_params = b * (P if stage < 3 else -(-P // W))
    paper_params -= (b - 2) * (narrow if stage < 3 else -(-narrow // W))
    implementation = {
        "fp32_gradient_partition": fp32_partition,
        "persistent_parameters": model_params - paper_params,
    }
    applies = _paper_applies(spec, P, Pt)
    parts.details["deepspeed"] = {"zero_optimization": settings.config()}
    parts.details.setdefault("gather", {}).update(
        {
            "gradient_partition_parameters": worst if train else 0,
            "largest_gradient_piece": piece if train else 0,
            "unreduced_gradient_bytes": max(spikes, default=0),
        }
    )
    parts.details["model_state"] = _model_state(
        paper_params,
        model_grads,
        master + state,
        implementation,
        paper=_paper_bytes(scheme, P, W) if applies and not offload else None,
        deepspeed=_deepspeed_bytes(scheme, P, largest, W) if applies and not offload else None,
    )
    if host is not None:
        parts.details["model_state"]["host"] = host
        if spec.device == "cpu":
            _host_is_the_device(parts, spec, scheme, W, groups)
        if applies and scheme == "zero2":
            # DeepSpeed 0.19.8's estimate_zero2_model_states_mem_needs(cpu_offload=True) on one
            # node, per rank, its additional_buffer_factor (1.5) left out: GPU 2P, host
            # P·max(4·W, 16) over the node's W ranks
            parts.details["model_state"]["deepspeed_offload_formula_bytes"] = {
                "gpu": 2 * P,
                "host": P * max(4 * W, 16) // W,
            }
    return parts


def _host_is_the_device(
    parts: _Parts, spec: StepSpec, scheme: str, W: int, groups: list[list[int]]
) -> None:
    """ZeRO-Offload on CPU ranks: host memory is the device's, so what DeepSpeed keeps there
    (:func:`memfit.estimate.optimizer_offload.host_parts`) is held through every phase of the
    step, beside the module: the master weights and the optimizer state as optimizer state, the
    gradient partitions and DeepSpeed's buffers as gradients."""
    held = host_parts(
        spec,
        trainable_parameters=sum(map(sum, groups)),
        trainable_dtype_bytes=4,
        world_size=W,
        sharding=scheme,
        parameter_groups=groups,
    )
    state = held.pop("master_weights", 0) + held.pop("optimizer_state", 0)
    every = frozenset(PHASE.values())
    parts.windows.append(Window("host.optimizer_state", state, CAT["optimizer_state"], every))
    parts.windows.append(Window("host.gradients", sum(held.values()), CAT["gradients"], every))


def _offload_buffers(parts: _Parts, stage: int, b: int, largest: int, piece: int) -> None:
    """ZeRO-Offload's GPU buffers (``stage_1_and_2.py``): a buffer of the largest parameter in
    the module's dtype that accumulated gradients come back through
    (``temp_grad_buffer_for_gpu_offload``, allocated with the optimizer and kept); at the step,
    each gradient restored whole from the host, its piece's float64 copy for its norm (``set_norm_for_param_grad_in_gpu``) and,
    from a 16-bit module, its fp32 copy on the way to the host
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), one piece at a time. The update itself
    runs on the CPU: no flat partition, no optimizer temporaries on the GPU. ZeRO-3 keeps its
    reduced gradient partitions in host memory too."""
    gcat = CAT["gradients"]
    if stage < 3:
        parts.windows.append(
            Window("offload_gradient_buffer", b * largest, gcat, frozenset(PHASE.values()))
        )
    # memfit train's caller-owned boundary: at the step each accumulated gradient comes back
    # whole from the host (``_restore_cpu_offload_grad_to_gpu``: a clone, freed once copied out)
    restored = b * largest if stage < 3 else 0
    actions: list[Action] = [
        ("alloc", "step.restored_gradient", restored, gcat),
        ("alloc", "step.gradient_norm", 8 * piece, gcat),
        ("free", "step.gradient_norm", 8 * piece, gcat),
    ]
    if b != 4:
        actions += [
            ("alloc", "step.fp32_gradient_piece", 4 * piece, gcat),
            ("free", "step.fp32_gradient_piece", 4 * piece, gcat),
        ]
    actions.append(("free", "step.restored_gradient", restored, gcat))
    parts.phase_actions[PHASE["optimizer_step"]] = tuple(actions)
    parts.optimizer_factor = 0.0
    parts.details.setdefault("gather", {})["offload_gradient_buffer_bytes"] = (
        b * largest if stage < 3 else 0
    )


def deepspeed_param_groups(params: list[ParamInfo]) -> list[list[int]]:
    """The element counts of the optimizer's parameter groups, in model order, as memfit train
    (and transformers' Trainer) builds them: weight-decayed matrices, then the vectors (biases,
    norms) without decay. DeepSpeed flattens and partitions each group on its own."""
    trainable = [p for p in params if p.trainable]
    decay = [p.numel for p in trainable if len(p.shape) >= 2]
    no_decay = [p.numel for p in trainable if len(p.shape) < 2]
    return [g for g in (decay, no_decay) if g]


def zero12_partitions(groups: list[list[int]], W: int) -> tuple[list[int], list[int], int]:
    """ZeRO-1/2's gradient partitions: per rank, the elements its partition buffer holds and
    its largest gradient piece (the part of one parameter inside its partition); and the
    largest group's partition size.

    DeepSpeed flattens each group (``stage_1_and_2.py``: padded to a multiple of 2·W elements,
    partition size = that / W) and a rank's ``params_in_partition`` are the parameters that
    overlap its partition (``get_partition_info``). The buffer its reduced gradients are copied
    into (``grads_in_partition``, ``copy_grads_in_partition``) is sized as the *whole* of every
    overlapping parameter, summed over the groups: a large embedding that straddles a partition
    boundary counts in full on both ranks.
    """
    per_rank = [0] * W
    pieces = [0] * W
    largest_partition = 0
    for numels in groups:
        total = sum(numels)
        alignment = 2 * W  # nccl_start_alignment_factor · W
        size = -(-total // alignment) * alignment // W
        largest_partition = max(largest_partition, size)
        index = 0
        for n in numels:
            if n > 0 and size > 0:
                first, last = index // size, min(W - 1, (index + n - 1) // size)
                for rank in range(first, last + 1):
                    per_rank[rank] += n
                    inside = min(index + n, (rank + 1) * size) - max(index, rank * size)
                    pieces[rank] = max(pieces[rank], inside)
            index += n
    return per_rank, pieces, largest_partition


def _step_actions(
    parts: _Parts, stage: int, b: int, norm: int, partition: int
) -> tuple[Action, ...]:
    """The optimizer step's gradient buffers, in DeepSpeed's order (``step()`` of
    ``stage_1_and_2.py`` and ``stage3.py``): the gradient norm (``compute_grad_norm`` is on by
    default, clipping or not) takes each gradient piece in float64 (``get_norm_dtype()``: double
    wherever the accelerator has fp64, CUDA and the CPU), one at a time; then each group's
    partition is flattened (a copy in the module's dtype) and cast to fp32 (no copy when it is
    fp32 already), the copy freed; the fp32 gradient stays for the group's update."""
    gcat = CAT["gradients"]
    actions: list[Action] = []
    if stage == 1:
        # the reduction at the end of backward (engine.allreduce_gradients -> reduce_gradients):
        # the partition buffer is allocated while every whole gradient is still alive; those
        # are then moved into it (the replay keeps the whole ones to the step's end instead,
        # an upper bound: the buffer never holds more than all of them)
        zero1 = parts.details["gather"]["gradient_partition_bytes"]
        actions += [("alloc", "zero1.gradient_partition", zero1, gcat)]
        actions += [("free", "zero1.gradient_partition", zero1, gcat)]
    actions += [
        ("alloc", "step.gradient_norm", norm, gcat),
        ("free", "step.gradient_norm", norm, gcat),
    ]
    if b == 4:
        actions.append(("alloc", "step.fp32_gradient_partition", 4 * partition, gcat))
    else:
        actions += [
            ("alloc", "step.flat_gradient_partition", b * partition, gcat),
            ("alloc", "step.fp32_gradient_partition", 4 * partition, gcat),
            ("free", "step.flat_gradient_partition", b * partition, gcat),
        ]
    return tuple(actions)


def _reduce_bucket_bytes(settings: ZeroSettings, b: int) -> int:
    """ZeRO-1/2's gradient reduce bucket (two of them with ``overlap_comm``)."""
    return b * settings.reduce_bucket_size * (2 if settings.overlap_comm else 1)


def _zero12_buffers(parts: _Parts, settings: ZeroSettings, b: int, worst: int) -> None:
    """ZeRO-1/2's gradient buffers (training only): the reduce bucket during backward, and under
    ZeRO-2 the partition buffer the reduced gradients are copied into, from the start of backward
    (the rank whose partition holds the last layers fills it with the first bucket) to the end of
    the step (its views are the ``averaged_gradients`` the step flattens, group by group)."""
    bucket = _reduce_bucket_bytes(settings, b)
    gcat, bwd, opt = CAT["gradients"], PHASE["backward"], PHASE["optimizer_step"]
    parts.windows.append(Window("reduce_buckets", bucket, gcat, frozenset({bwd})))
    # (0 under ZeRO-Offload: the reduced gradients go straight to the host partition)
    partition = b * worst
    if settings.stage == 2 and partition:
        parts.windows.append(Window("gradient_partition", partition, gcat, frozenset({bwd, opt})))
    parts.details["gather"] = {
        "reduce_bucket_bytes": bucket,
        "gradient_partition_bytes": partition,
    }


def _zero3_buffers(
    parts: _Parts, settings: ZeroSettings, b: int, largest: int, partitioned: int, train: bool
) -> None:
    """ZeRO-3's gathered parameters (forward and backward) and its reduce bucket."""
    fwd, bwd = PHASE["forward"], PHASE["backward"]
    kept = (
        min(partitioned, settings.max_reuse_distance // 2, settings.max_live_parameters)
        if train
        else 0
    )
    # never more than every partitioned parameter: with DeepSpeed's default reuse distance the
    # kept ones already are all of them, the largest layer and the prefetch among them
    gathered = b * min(partitioned, kept + largest + settings.prefetch_bucket_size)
    parts.windows.append(
        Window("gathered_parameters", gathered, CAT["parameters"], frozenset({fwd, bwd}))
    )
    # one contiguous bucket (stage3.py allocates it with the optimizer and keeps it)
    bucket = b * settings.reduce_bucket_size if train else 0
    parts.windows.append(
        Window("reduce_bucket", bucket, CAT["gradients"], frozenset(PHASE.values()))
    )
    parts.details["gather"] = {
        "kept_gathered_parameters": kept,
        "largest_layer_parameters": largest,
        "prefetch_bucket_parameters": settings.prefetch_bucket_size,
        "gathered_parameter_bytes": gathered,
        "reduce_bucket_bytes": bucket,
    }


def _fsdp_parts(trace: StepTrace, spec: StepSpec, W: int) -> _Parts:
    """FSDP2: per-tensor row shards, the root's gathered parameters and the blocks' sizes."""
    params = trace.params
    train = spec.mode == "train"
    mixed = spec.precision != "fp32"
    pcat = CAT["parameters"]
    P = sum(p.numel for p in params)
    Pt = sum(p.numel for p in params if p.trainable)
    parts = _Parts(drop_casts=mixed)
    blocks: dict[int, int] = {}
    trainable_blocks: dict[int, int] = {}
    root = reduced_at_the_end = 0
    sharded_params = sharded_trainable = 0
    c = 2 if mixed else 4  # the dtype the layers compute with (param_dtype)
    late = _blocks_reduced_at_the_end(trace)
    for p in params:
        rows = shard_rows(p.shape, W)
        # a shard keeps its parameter's dtype (fp32 master weights; a frozen base held in 16
        # bits stays 16-bit), and so does its gradient shard
        sharded_params += rows * p.itemsize
        parts.resident[p.alloc] = ((p.itemsize * rows, pcat),)
        # a block's gradients are reduce-scattered to shards as its backward ends; the root's
        # (and those of a block whose backward has no end marker: the embeddings) wait for the
        # end of backward, whole and in the compute dtype
        whole = p.block < 0 or p.block in late
        compute = min(c, p.itemsize)
        parts.param_sizes.append(
            (p.itemsize * rows, compute * rows * W if whole else p.itemsize * rows)
        )
        if whole and p.trainable:
            reduced_at_the_end += rows * W
        parts.state_shard.append(rows / max(1, p.numel))
        if p.trainable:
            sharded_trainable += rows
        # the all-gather output is padded too; counted in elements of the compute dtype (a
        # 16-bit weight in an fp32 step is gathered in 16 bits: half an fp32 element each)
        unsharded = -(-rows * W * compute // c)
        if p.block < 0:
            root += unsharded
        else:
            blocks[p.block] = blocks.get(p.block, 0) + unsharded
            if p.trainable:
                trainable_blocks[p.block] = trainable_blocks.get(p.block, 0) + unsharded
    # the root's parameters (embeddings, heads) are gathered as the forward starts and not
    # resharded until backward ends (their gradients: see param_sizes above)
    fwd_bwd = frozenset({PHASE["forward"], PHASE["backward"]})
    parts.windows.append(Window("root_parameters", c * root, pcat, fwd_bwd))
    count = 1 + max(blocks, default=-1)
    parts.block_parameters = tuple(blocks.get(i, 0) for i in range(count))
    parts.block_trainable = tuple(trainable_blocks.get(i, 0) for i in range(count))
    parts.details["gather"] = {
        "root_parameters": root,
        "largest_block_parameters": max(parts.block_parameters, default=0),
        "blocks": count,
        "compute_bytes_per_parameter": c,
        "forward_prefetch": spec.device == "cuda",
    }
    grads = sum(p.itemsize * shard_rows(p.shape, W) for p in params if p.trainable) if train else 0
    state = _sharded_state_bytes(trace, parts.state_shard) if train else 0
    parts.details["model_state"] = _model_state(
        sharded_params,
        grads,
        state,
        {},
        paper=_paper_bytes("zero3", P, W) if _paper_applies(spec, P, Pt) else None,
        deepspeed=None,
    )
    parts.optimizer_factor = sharded_trainable / Pt if Pt else 1.0
    parts.compute_bytes = c
    parts.forward_prefetch = spec.device == "cuda"
    parts.root_reduce_scatter = 4 * reduced_at_the_end if train else 0
    return parts


def _blocks_reduced_at_the_end(trace: StepTrace) -> set[int]:
    """Blocks whose backward starts but never ends in the trace: their input needs no gradient
    (the embeddings), so FSDP reduce-scatters them in the root's final callback."""
    if len(trace.steps) < 2:
        return set()
    started: set[int] = set()
    ended: set[int] = set()
    for kind, ref in trace.steps[1][1].events:
        if kind == BLOCK:
            index, stage = divmod(ref, 4)
            if stage == BLOCK_BACKWARD_START:
                started.add(index)
            elif stage == BLOCK_BACKWARD_END:
                ended.add(index)
    return started - ended


def _traced_states(trace: StepTrace) -> list[tuple[int, int]]:
    """(global id, bytes) of the traced optimizer state tensors."""
    return [
        (g, trace.resident_sizes[g])
        for g in trace.steady
        if trace.resident_categories[g] == CAT["optimizer_state"] and g in trace.resident_params
    ]


def _traced_state_bytes(trace: StepTrace) -> int:
    return sum(size for _, size in _traced_states(trace))


def _sharded_state_bytes(trace: StepTrace, state_shard: list[float]) -> int:
    """The traced optimizer state, each tensor cut to its shard (step counters stay whole)."""
    return sum(
        _state_bytes(
            size,
            state_shard[trace.resident_params[g]],
            trace.params[trace.resident_params[g]].numel,
        )
        for g, size in _traced_states(trace)
    )


def _model_state(
    parameters: int,
    gradients: int,
    optimizer_state: int,
    implementation: dict[str, int],
    *,
    paper: int | None,
    deepspeed: int | None,
) -> dict[str, Any]:
    by_category = parameters + gradients + optimizer_state
    extra = sum(implementation.values())
    return {
        "parameters_bytes": parameters,
        "gradients_bytes": gradients,
        "optimizer_state_bytes": optimizer_state,
        "by_paper_categories_bytes": by_category,
        "implementation_bytes": dict(implementation),
        "total_bytes": by_category + extra,
        "paper_formula_bytes": paper,
        "deepspeed_formula_bytes": deepspeed,
    }


def _paper_applies(spec: StepSpec, P: int, Pt: int) -> bool:
    """The paper's (and DeepSpeed's) figures are for mixed-precision Adam, every weight trained."""
    all_trained = P == Pt  # noqa: SIM300 - the paper's notation
    return (
        spec.mode == "train"
        and spec.precision != "fp32"
        and spec.optimizer == "adamw"
        and all_trained
        # fp32 master weights: pure 16-bit training keeps none
        and spec.weights_dtype in ("auto", "fp32")
    )


def _paper_bytes(scheme: str, P: int, W: int) -> int:
    """ZeRO paper, mixed-precision Adam (K = 12): the model states of one rank."""
    if scheme == "zero1":
        return 4 * P + 12 * P // W
    if scheme == "zero2":
        return 2 * P + 14 * P // W
    if scheme == "zero3":
        return 16 * P // W
    return 16 * P


def _deepspeed_bytes(scheme: str, P: int, largest_layer: int, W: int) -> int | None:
    """DeepSpeed 0.19's estimators without offload (``estimate_zero2/3_model_states_mem_needs``)."""
    if scheme == "zero2":
        return 2 * P + int(18 * P / W)
    if scheme == "zero3":
        return 4 * largest_layer + int(18 * P / W)
    return None


DDP_FIRST_BUCKET = 1 << 20
DDP_BUCKET = 25 << 20


def ddp_bucket_sizes(gradient_bytes: int) -> list[int]:
    """torch DDP's gradient buckets (``bucket_cap_mb=25``, the first one 1 MiB)."""
    sizes: list[int] = []
    left = gradient_bytes
    while left > 0:
        size = min(left, DDP_FIRST_BUCKET if not sizes else DDP_BUCKET)
        sizes.append(size)
        left -= size
    return sizes


def none_details(trace: StepTrace, spec: StepSpec, world_size: int) -> dict[str, Any]:
    """Model states of plain data parallelism (what every rank holds, as one GPU does)."""
    params = sum(p.numel * p.itemsize for p in trace.params)
    P = sum(p.numel for p in trace.params)
    Pt = sum(p.numel for p in trace.params if p.trainable)
    train = spec.mode == "train"
    grads = trace.trainable_gradient_bytes if train else 0
    state = _traced_state_bytes(trace) if train else 0
    return {
        "model_state": _model_state(
            params,
            grads,
            state,
            {},
            paper=_paper_bytes("none", P, world_size) if _paper_applies(spec, P, Pt) else None,
            deepspeed=None,
        )
    }


__all__ = [
    "DEEPSPEED_SCHEMES",
    "SCHEMES",
    "SCHEME_ORDER",
    "ParamInfo",
    "ShardLayout",
    "ZeroSettings",
    "ddp_bucket_sizes",
    "deepspeed_zero_config",
    "layout",
    "module_bytes",
    "none_details",
    "shard_rows",
]
