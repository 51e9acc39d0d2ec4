"""Replay a traced step on a model of the device's memory: its peak, and what is alive then.

A trace (:mod:`memfit.estimate.trace`) is a stream of events: allocations and frees of the step's
tensors, phase marks (forward, backward, optimizer step) and block marks (a layer's forward or
backward starting or ending). :class:`StepWalk` is the one walk over that stream, for both devices:
it keeps the bytes alive by category, runs the sharding scheme's buffers and conversions, and
records the peak of each phase. What an allocation costs is the device's own (:class:`Memory`):
whole pages on the CPU (:class:`CpuPages`), blocks of CUDA's caching allocator on a GPU
(:class:`CudaMemory`). The two replays differ only in where the walk starts: the CPU replay starts
from the steady state's resident tensors and walks one step; the CUDA replay moves the model to the
GPU and walks two steps (the first creates the optimizer state and warms the allocator's cache),
reporting the second, and adds what lives outside the allocator (CUDA context, cuBLAS, NCCL).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from memfit.devices.profiles import CudaProfile
from memfit.estimate import device as dev
from memfit.estimate.optimizer_offload import pinned_bytes as pinned_block_bytes
from memfit.estimate.sharding import Buffers, ShardLayout
from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    CAT,
    CATEGORIES,
    FREE,
    FREE_PREV,
    HOST_OP,
    MARK,
    PHASE,
    PHASES,
    Segment,
    StepTrace,
)
from memfit.estimate.workload import StepSpec
from memfit.levers.optimizer import OPTIMIZER_TABLE
from memfit.step import offload

__all__ = ["CpuPages", "CudaMemory", "Memory", "Peak", "StepWalk", "replay_step"]


@dataclass
class Peak:
    """The peak of a replayed step."""

    total_bytes: int
    breakdown: dict[str, int]
    phase: str
    allocated_peak_bytes: int
    reserved_peak_bytes: int | None
    context_bytes: int
    # the highest tensor bytes of each phase (allocated, not reserved, on CUDA)
    phase_peaks: dict[str, int] = field(default_factory=dict)
    # the most host memory the step holds at once (offloaded activations' host copies, each a
    # block of CUDA's caching host allocator); 0 when nothing is offloaded
    host_peak_bytes: int = 0


_PHASE_NAMES = {PHASES.index("setup"): "forward"} | {
    i: name for i, name in enumerate(PHASES) if name != "setup"
}


def replay_step(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    spec: StepSpec,
    profile: CudaProfile,
    world_size: int = 1,
    accumulate: bool = False,
    shard: ShardLayout | None = None,
) -> Peak:
    """Replay the steady step; ``shard`` resizes it for a sharding scheme (one rank's share).

    ``fb`` is the forward/backward segment with ``fb_sizes`` the sizes of its allocations at the
    shape asked. ``accumulate``: a second forward/backward (a later micro-batch) runs while the
    first one's gradients are alive; its own gradients are added in place, so each is a transient.

    Without sharding and with several ranks, memfit's data parallelism all-reduces each gradient
    in place after the step's micro-batches: no second copy of the gradients (torch DDP's reducer
    would keep one in buckets; ``estimate`` reports its size as ``ddp_bucket_bytes``).
    """
    optimizer_segments = (
        (trace.steps[0][2], trace.steps[1][2]) if spec.mode == "train" else (None, None)
    )
    sharded = _Sharded(shard)
    if spec.device == "cpu":
        return _replay_cpu(trace, fb, fb_sizes, optimizer_segments[1], spec, sharded, accumulate)
    return _replay_cuda(
        trace, fb, fb_sizes, optimizer_segments, spec, profile, sharded, world_size, accumulate
    )


def first_forward_backward(
    trace: StepTrace, fb: Segment, fb_sizes: list[int]
) -> tuple[Segment, list[int]]:
    """The forward+backward segment the CUDA replay's first step runs, at the sizes replayed.

    The first optimizer step frees allocations of the first traced step's forward+backward
    (``FREE_PREV``: its gradients, its batch), so it must follow that very segment. Where the
    first step made allocations the later ones do not (a model's lazily built state: LongRoPE's
    long frequencies on the first forward), its segment is not the steady ``fb``; such a trace
    has no fit (the fit's check is that step) and was traced at the very shape replayed, so its
    own sizes are the ones.
    """
    first = trace.steps[0][1]
    # the same events (the fit's check step) walk alike at the fitted sizes
    if first is fb or (first.events == fb.events and first.categories == fb.categories):
        return fb, fb_sizes
    return first, list(first.sizes)


# --- cuBLAS workspaces ----------------------------------------------------------------------------
# A replay-only event, ``(WORKSPACE, bytes)``: a cuBLAS workspace allocated at that point of the
# first step, kept for the process and counted as the runtime's (not in the step's categories)
WORKSPACE = 100
# the ops whose CUDA kernels are cuBLAS matmuls (their base names, as a segment's ``ops`` has them);
# those in ``_CUBLASLT_OPS`` run through cuBLASLt (a linear with a bias: gemm and bias)
_CUBLAS_OPS = frozenset(
    ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation", "addr")
)
_CUBLASLT_OPS = frozenset(("addmm", "_addmm_activation"))


def with_workspaces(
    seg: Segment, cublas: int, cublaslt: int, backward_thread: bool
) -> list[tuple[int, int]]:
    """``seg``'s events with each cuBLAS workspace allocated where the GPU allocates it (see
    :func:`workspace_events`)."""
    return workspace_events(seg, cublas, cublaslt, backward_thread)[0]


def workspace_events(
    seg: Segment, cublas: int, cublaslt: int, backward_thread: bool
) -> tuple[list[tuple[int, int]], int]:
    """``seg``'s events with each cuBLAS workspace allocated where the GPU allocates it.

    cuBLAS handles are per thread, and each handle's workspace (``cublas``) is allocated from the
    caching allocator by its thread's first matmul, right after the matmul's output; the
    cuBLASLt workspace (``cublaslt``) by its first gemm-and-bias. The forward runs on the caller's
    thread; a training step's backward (recomputed forwards included) on the autograd engine's
    device thread, whose first matmul comes once the loss's gradient is computed, when the
    logits' blocks are free. A workspace allocated there splits a freed logits-sized block, which
    a later step then cannot reuse: one H200 run's allocator history
    (bench/results/gpu_truth_20261128_H200/allocator_history) showed this, and the reserved peak
    one logits' block higher than a replay with the workspaces allocated up front.
    """
    # found once per segment and profile: a replay walks the same trace's segment many times
    memo: dict[tuple[int, int, bool], tuple[list[tuple[int, int]], int]] | None = getattr(
        seg, "_workspace_events", None
    )
    if memo is None:
        memo = {}
        seg._workspace_events = memo  # type: ignore[attr-defined]
    key = (cublas, cublaslt, backward_thread)
    found = memo.get(key)
    if found is not None:
        return found
    events: list[tuple[int, int]] = []
    made: set[tuple[bool, bool]] = set()  # (on the backward thread, cuBLASLt's)
    workspace = 0
    backward = PHASE["backward"]
    in_backward = False
    for kind, ref in seg.events:
        events.append((kind, ref))
        if kind == MARK:
            in_backward = backward_thread and ref == backward
        elif kind == ALLOC:
            base = seg.ops[ref].split(".", 1)[0]
            if base in _CUBLAS_OPS:
                for size, lt in ((cublas, False), (cublaslt, True)):
                    if size and (not lt or base in _CUBLASLT_OPS) and (in_backward, lt) not in made:
                        made.add((in_backward, lt))
                        events.append((WORKSPACE, size))
                        workspace += size
    memo[key] = events, workspace
    return events, workspace


def uses_bitsandbytes(spec: StepSpec) -> bool:
    """Whether the step runs bitsandbytes' layers or optimizers (so the run imports it)."""
    return spec.quantization != "none" or OPTIMIZER_TABLE[spec.optimizer].needs == "bitsandbytes"


def _host_allocs(seg: Segment) -> frozenset[int]:
    """The local ids of ``seg``'s host allocations (op :data:`HOST_OP`), found once per segment."""
    found: frozenset[int] | None = getattr(seg, "_host_allocs", None)
    if found is None:
        found = frozenset(j for j, op in enumerate(seg.ops) if op == HOST_OP)
        seg._host_allocs = found  # type: ignore[attr-defined]
    return found


def _transient_events(seg: Segment) -> list[tuple[int, int]]:
    """``seg``'s events as a later micro-batch of an accumulated step walks them (found once per
    segment): each gradient it computes is added in place into the first micro-batch's, so it is
    freed as soon as it is allocated, and its own free is dropped (host copies left as they are)."""
    found: list[tuple[int, int]] | None = getattr(seg, "_transient_events", None)
    if found is None:
        grads, cats, host = CAT["gradients"], seg.categories, _host_allocs(seg)
        found = []
        for kind, ref in seg.events:
            if kind in (ALLOC, FREE) and ref not in host and cats[ref] == grads:
                if kind == ALLOC:
                    found += [(ALLOC, ref), (FREE, ref)]
                continue
            found.append((kind, ref))
        seg._transient_events = found  # type: ignore[attr-defined]
    return found


def _cuda_rounded(sizes: list[int]) -> list[int]:
    """Each size as CUDA's allocator rounds it (:func:`memfit.estimate.device.cuda_round_size`),
    0 kept (an allocation a sharding scheme removed allocates nothing)."""
    lowest, multiple = dev.K_MIN_BLOCK_SIZE, -dev.K_MIN_BLOCK_SIZE
    step = lowest - 1
    return [
        ((size + step) & multiple if size >= lowest else lowest) if size else 0 for size in sizes
    ]


class _Sharded:
    """The replay's view of a :class:`ShardLayout` (or of no sharding at all)."""

    def __init__(self, shard: ShardLayout | None) -> None:
        self.shard = shard
        self.buffers = None if shard is None else Buffers(shard)

    def sizes(self, seg: Segment, sizes: list[int]) -> list[int]:
        return sizes if self.shard is None else self.shard.segment_sizes(seg, sizes)

    def pieces(self, alloc: int, size: int, category: int) -> tuple[tuple[int, int], ...]:
        if self.shard is None:
            return ((size, category),)
        return self.shard.pieces(alloc, size, category)

    def conversions(self, fb: Segment) -> tuple[list[tuple[int, int, int]], int]:
        """Gradients that shrink as backward ends, and the transient buffer that does it."""
        if self.shard is None:
            return [], 0
        return self.shard.conversions(fb), self.shard.root_reduce_scatter

    def actions(self, kind: int, ref: int) -> list[tuple[str, str, int, int]]:
        """The scheme's buffers to allocate and free at a phase or block mark, in order."""
        if self.buffers is None:
            return []
        return self.buffers.mark(ref) if kind == MARK else self.buffers.block(ref)


# --- the device's memory --------------------------------------------------------------------------
class Memory(Protocol):
    """What allocations cost on a device; ``level`` is the measure a peak is taken in."""

    @property
    def level(self) -> int: ...

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; the handle to free them with."""
        ...

    def free(self, handle: int) -> None: ...


class CpuPages:
    """The CPU's allocator: each allocation takes whole pages (a handle is its size)."""

    def __init__(self) -> None:
        self.level = 0  # the bytes the process holds for tensors

    def malloc(self, size: int) -> int:
        # an allocation a sharding scheme removed (a weight cast) takes nothing
        if size:
            self.level += dev.cpu_allocation_bytes(size)
        return size

    def free(self, handle: int) -> None:
        if handle:
            self.level -= dev.cpu_allocation_bytes(handle)


_NONE = -1  # the handle of an allocation a sharding scheme removed


class CudaMemory:
    """CUDA's caching allocator; ``level`` is its allocated bytes (the reserved ones are its own)."""

    def __init__(self) -> None:
        self.allocator = dev.CachingAllocator()

    @property
    def level(self) -> int:
        return self.allocator.allocated

    def malloc(self, size: int) -> int:
        return self.allocator.malloc(size) if size else _NONE

    def free(self, handle: int) -> None:
        if handle != _NONE:
            self.allocator.free(handle)

    def reset_peaks(self) -> None:
        """Forget the maxima so far (a warm-up step's)."""
        allocator = self.allocator
        allocator.max_allocated, allocator.max_reserved = allocator.allocated, allocator.reserved


# --- the walk -------------------------------------------------------------------------------------
class StepWalk:
    """The walk over a replay's events, on ``memory``: bytes by category, and the peak of each phase.

    ``trace`` and ``fb`` (its forward/backward segment, with ``fb_sizes``) are what is replayed;
    ``sharded`` resizes each segment as it is walked and adds the scheme's buffers. ``tracking``
    off (a warm-up step) walks without recording peaks. ``measure_buffer_frees``: a peak is also
    measured after a scheme's buffer is freed (the CPU replay's way: it changes the first
    measurement of a phase that starts with a free), not only after an allocation.
    """

    def __init__(
        self,
        trace: StepTrace,
        fb: Segment,
        fb_sizes: list[int],
        sharded: _Sharded,
        memory: Memory,
        *,
        measure_buffer_frees: bool,
    ) -> None:
        self.trace = trace
        self.fb = fb
        self.fb_sizes = fb_sizes  # unsharded: each walk resizes (the scheme's spikes follow it)
        self.sharded = sharded
        self.memory = memory
        self.measure_buffer_frees = measure_buffer_frees
        self.raw = [0] * len(CATEGORIES)  # the bytes alive, by category
        self.handles: dict[int, list[int]] = {}  # global id -> the handles of its pieces
        self.buffer_handles: dict[str, int] = {}  # a scheme's buffer -> its handle
        self.phase = "forward"
        self.tracking = True
        self.phases: dict[str, int] = {}
        self.best = -1
        self.best_raw = list(self.raw)
        self.best_phase = self.phase
        # the forward+backward segment walked last (the optimizer step frees its allocations),
        # its conversions, and its sizes once backward is over
        self.walked = fb
        self.conversions: list[tuple[int, int, int]] = []
        self.conversion_buffer = 0
        self.fb_after: list[int] = []
        # host memory (offloaded activations): bytes alive and the most at once; a CUDA
        # target's blocks are pinned ones (rounded as its caching host allocator rounds them)
        self.host = 0
        self.host_peak = 0
        self.pinned = isinstance(memory, CudaMemory)
        # the cuBLAS workspaces the next forward+backward allocates (the first step's: the
        # arguments of :func:`with_workspaces` after the segment), and their bytes once walked
        self.workspaces: tuple[int, int, bool] | None = None
        self.workspace_bytes = 0
        # the caching allocator emptied as each micro-batch starts, where the run empties it
        # (TRL's activation offloading: memfit.step.offload.empties_cuda_cache); None: never
        self.emptied: dev.CachingAllocator | None = None

    def place(self, ids: Iterable[int]) -> None:
        """Allocate the resident tensors ``ids`` (global ids), piece by piece."""
        sizes, cats = self.trace.resident_sizes, self.trace.resident_categories
        handles, raw, malloc, pieces = (
            self.handles,
            self.raw,
            self.memory.malloc,
            self.sharded.pieces,
        )
        for g in ids:
            placed = handles[g] = []
            for size, cat in pieces(g, sizes[g], cats[g]):
                placed.append(malloc(size))
                raw[cat] += size

    def start_peak(self, level: int) -> None:
        """The peak so far is ``level``, with what is alive now."""
        self.best, self.best_raw, self.best_phase = level, list(self.raw), self.phase

    def track(self) -> None:
        # called on every allocation: keep the common case cheap
        if not self.tracking:
            return
        level = self.memory.level
        phase = self.phase
        if level > self.phases.get(phase, 0):
            self.phases[phase] = level
            if level > self.best:
                self.best, self.best_raw, self.best_phase = level, list(self.raw), phase

    def step(
        self,
        opt: Segment | None,
        opt_sizes: list[int] | None,
        globals_: list[int] | None = None,
        accumulate: bool = False,
        first: tuple[Segment, list[int]] | None = None,
    ) -> None:
        """Forward and backward, then (training: ``opt``) the optimizer step.

        ``globals_``: the global id of each of ``opt``'s allocations, for the first optimizer step
        (its state stays for the next). ``accumulate``: a later micro-batch runs in between.
        ``first``: the first step's own forward+backward segment and its sizes (unsharded), where
        it is not the steady one (see :func:`first_forward_backward`).
        """
        fb, raw_sizes, fb_globals = self.fb, self.fb_sizes, None
        if first is not None and first[0] is not fb:
            fb, raw_sizes = first
            # its allocations follow the resident ones (global ids, as the trace numbers them):
            # what outlives the step (lazily built state) is a resident a later step may free
            start = len(self.trace.initial)
            fb_globals = list(range(start, start + len(raw_sizes)))
        fb_sizes = self.sharded.sizes(fb, raw_sizes)
        self.empty_cache()
        self.walked = fb
        self.conversions, self.conversion_buffer = self.sharded.conversions(fb)
        self.fb_after = list(fb_sizes)
        for j, _, after in self.conversions:
            self.fb_after[j] = after
        events = None
        if self.workspaces is not None:
            events, workspace = workspace_events(fb, *self.workspaces)
            self.workspace_bytes += workspace
            self.workspaces = None
        fb_handles = self.run(fb, fb_sizes, globals_=fb_globals, events=events)
        if opt is None:
            return
        assert opt_sizes is not None
        self.convert(fb_handles)
        if accumulate:
            # a later micro-batch runs the steady forward and backward
            steady = fb_sizes if fb is self.fb else self.sharded.sizes(self.fb, self.fb_sizes)
            self.empty_cache()
            self.run(self.fb, steady, transient_grads=True)
            # the later micro-batch's root gradients are reduce-scattered as well (added
            # into the shards in place): the transient run already freed them
        self.run(opt, opt_sizes, fb_handles, globals_)

    def empty_cache(self) -> None:
        """A micro-batch starts: the cache emptied where the run empties it (``emptied``)."""
        if self.emptied is not None:
            self.emptied.empty_cache()

    def run(
        self,
        seg: Segment,
        seg_sizes: list[int],
        prev: list[int] | None = None,
        globals_: list[int] | None = None,
        transient_grads: bool = False,
        events: list[tuple[int, int]] | None = None,
    ) -> list[int]:
        """Walk one segment; the handles of its allocations. ``prev``: those of ``fb``.

        ``transient_grads``: a later micro-batch of an accumulated step, whose gradients are
        computed and added in place into the first micro-batch's (alive all along). ``events``:
        the segment's events with others added (:func:`with_workspaces`).
        """
        memory = self.memory
        if events is None:
            events = _transient_events(seg) if transient_grads else seg.events
        if isinstance(memory, CudaMemory):
            return self._run_cuda(memory.allocator, seg, events, seg_sizes, prev, globals_)
        malloc, free, track, raw = memory.malloc, memory.free, self.track, self.raw
        local = [0] * len(seg_sizes)
        seg_cats = seg.categories
        host = _host_allocs(seg)
        for kind, ref in events:
            if host and ref in host and kind in (ALLOC, FREE):
                # a host copy: host memory, not the device's
                self._host(seg_sizes[ref], kind == ALLOC)
            elif kind == ALLOC:
                size = seg_sizes[ref]
                local[ref] = malloc(size)
                raw[seg_cats[ref]] += size
                if globals_ is not None:
                    self.handles[globals_[ref]] = [local[ref]]
                track()
            elif kind == FREE:
                free(local[ref])
                raw[seg_cats[ref]] -= seg_sizes[ref]
            else:
                self._other(kind, ref, prev)
        return local

    def _run_cuda(
        self,
        allocator: dev.CachingAllocator,
        seg: Segment,
        events: list[tuple[int, int]],
        seg_sizes: list[int],
        prev: list[int] | None,
        globals_: list[int] | None,
    ) -> list[int]:
        """:meth:`run` on CUDA's caching allocator, with the allocator's own loop inlined.

        The loop runs once per event of the step (tens of thousands for a large model), so the
        allocator's common paths (``malloc_rounded`` from a cached block, and ``free``, of
        :class:`~memfit.estimate.device.CachingAllocator`) are written out here on its dicts and
        pools, its allocated bytes held in locals, and :meth:`track` is inlined (``peak``: the
        current phase's highest level so far). What is rarer (a new segment, phase and block
        marks, frees of an earlier segment's or resident allocations) goes through the
        allocator's and the walk's methods, the counts written back first.
        tests/unit/estimate/test_replay_inline.py holds this to :meth:`run`'s generic walk over
        the allocator's methods.
        """
        sizes_of, free_end = allocator._size, allocator._free_end
        small_pool, large_pool = allocator._small, allocator._large
        shift, mask = allocator._shift, allocator._mask
        allocated, max_allocated = allocator.allocated, allocator.max_allocated
        small_size, min_block = dev.K_SMALL_SIZE, dev.K_MIN_BLOCK_SIZE
        bisect_left, insort = bisect.bisect_left, bisect.insort
        raw, handles, phases = self.raw, self.handles, self.phases
        tracking = self.tracking
        peak = phases.get(self.phase, 0)
        alloc_sizes = _cuda_rounded(seg_sizes)
        local = [0] * len(seg_sizes)
        seg_cats = seg.categories
        host = _host_allocs(seg)
        for kind, ref in events:
            if host and ref in host and kind in (ALLOC, FREE):
                # a host copy: host memory, not the device's
                self._host(seg_sizes[ref], kind == ALLOC)
            elif kind == ALLOC:
                size = alloc_sizes[ref]
                if size:
                    # CachingAllocator.malloc_rounded
                    small = size <= small_size
                    pool = small_pool if small else large_pool
                    i = bisect_left(pool, size << shift)
                    if i < len(pool):
                        key = pool.pop(i)
                        address, block = key & mask, key >> shift
                    else:
                        address, block = allocator.new_segment(size)
                        shift, mask = allocator._shift, allocator._mask
                    remaining = block - size
                    if (remaining >= min_block) if small else (remaining > small_size):
                        rest = address + size
                        sizes_of[rest] = -remaining
                        free_end[rest + remaining] = rest
                        insort(pool, remaining << shift | rest)
                        block = size
                    else:
                        del free_end[address + block]
                    sizes_of[address] = block
                    allocated += block
                    if allocated > max_allocated:
                        max_allocated = allocated
                    local[ref] = address
                else:
                    local[ref] = _NONE
                size = seg_sizes[ref]
                raw[seg_cats[ref]] += size
                if globals_ is not None:
                    handles[globals_[ref]] = [local[ref]]
                if tracking and allocated > peak:
                    phase = self.phase
                    phases[phase] = peak = allocated
                    if allocated > self.best:
                        self.best, self.best_raw, self.best_phase = allocated, list(raw), phase
            elif kind == FREE:
                address = local[ref]
                if address != _NONE:
                    # CachingAllocator.free
                    block = sizes_of[address]
                    allocated -= block
                    pool = small_pool if block <= small_size else large_pool
                    following = address + block
                    size = sizes_of.get(following, 0)
                    if size < 0:
                        del pool[bisect_left(pool, -size << shift | following)]
                        del sizes_of[following]
                        block -= size
                    preceding = free_end.pop(address, -1)
                    if preceding >= 0:
                        size = sizes_of[preceding]
                        del pool[bisect_left(pool, -size << shift | preceding)]
                        del sizes_of[address]
                        block -= size
                        address = preceding
                    sizes_of[address] = -block
                    free_end[address + block] = address
                    insort(pool, block << shift | address)
                raw[seg_cats[ref]] -= seg_sizes[ref]
            else:
                allocator.allocated, allocator.max_allocated = allocated, max_allocated
                self._other(kind, ref, prev)
                allocated, max_allocated = allocator.allocated, allocator.max_allocated
                peak = phases.get(self.phase, 0)
        allocator.allocated, allocator.max_allocated = allocated, max_allocated
        return local

    def _other(self, kind: int, ref: int, prev: list[int] | None) -> None:
        """An event of :meth:`run` other than an allocation or a free of the segment's own."""
        raw = self.raw
        if kind in (MARK, BLOCK):
            self._mark(kind, ref)
        elif kind == WORKSPACE:
            self.memory.malloc(ref)
        elif kind == FREE_PREV:
            assert prev is not None
            if ref in _host_allocs(self.walked):
                # a host copy kept to the optimizer step (a save no backward node took)
                self._host(self.fb_after[ref], False)
                return
            self.memory.free(prev[ref])
            raw[self.walked.categories[ref]] -= self.fb_after[ref]
        else:
            # a resident tensor (parameter, optimizer state) the step frees
            sizes, cats = self.trace.resident_sizes, self.trace.resident_categories
            for handle in self.handles[ref]:
                self.memory.free(handle)
            for size, cat in self.sharded.pieces(ref, sizes[ref], cats[ref]):
                raw[cat] -= size

    def _host(self, size: int, alloc: bool) -> None:
        size = pinned_block_bytes(size) if self.pinned else size
        if alloc:
            self.host += size
            self.host_peak = max(self.host_peak, self.host)
        else:
            self.host -= size

    def _mark(self, kind: int, ref: int) -> None:
        if kind == MARK:
            self.phase = _PHASE_NAMES[ref]
        for action, name, size, cat in self.sharded.actions(kind, ref):
            # a sharding scheme's buffer: gathered parameters, reduce buckets
            if action == "alloc":
                self.buffer_handles[name] = self.memory.malloc(size)
                self.raw[cat] += size
                self.track()
            else:
                self.memory.free(self.buffer_handles.pop(name))
                self.raw[cat] -= size
                if self.measure_buffer_frees:
                    self.track()

    def convert(self, fb_handles: list[int]) -> None:
        """Backward ends: FSDP's root reduce-scatters its whole gradients into fp32 shards
        through a reduce-scatter input, then frees them."""
        if not self.conversions:
            return
        memory, raw, grads = self.memory, self.raw, CAT["gradients"]
        buffer = memory.malloc(self.conversion_buffer)
        raw[grads] += self.conversion_buffer
        self.track()
        for j, before, after in self.conversions:
            memory.free(fb_handles[j])
            fb_handles[j] = memory.malloc(after)
            raw[grads] += after - before
        memory.free(buffer)
        raw[grads] -= self.conversion_buffer

    def breakdown(self) -> dict[str, int]:
        """The bytes of each category at the peak."""
        return {name: self.best_raw[i] for i, name in enumerate(CATEGORIES)}


# --- the two devices ------------------------------------------------------------------------------
def _replay_cpu(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    opt: Segment | None,
    spec: StepSpec,
    sharded: _Sharded,
    accumulate: bool = False,
) -> Peak:
    """The steady-state step on the CPU: resident tensors, then forward/backward and optimizer."""
    pages = CpuPages()
    walk = StepWalk(trace, fb, fb_sizes, sharded, pages, measure_buffer_frees=True)
    walk.place(trace.steady if spec.mode == "train" else trace.initial)
    walk.start_peak(pages.level)
    opt_sizes = None if opt is None else sharded.sizes(opt, opt.sizes)
    walk.step(opt, opt_sizes, accumulate=accumulate)
    breakdown = walk.breakdown()
    best = walk.best
    breakdown["allocator_overhead"] = best - sum(walk.best_raw)
    breakdown["runtime_overhead"] = 0
    return Peak(
        best, breakdown, walk.best_phase, best, None, 0, walk.phases, host_peak_bytes=walk.host_peak
    )


def _replay_cuda(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    optimizer_segments: tuple[Segment | None, Segment | None],
    spec: StepSpec,
    profile: CudaProfile,
    sharded: _Sharded,
    world_size: int,
    accumulate: bool = False,
) -> Peak:
    """Two steps on CUDA's caching allocator (the first warms it); the second's peak."""
    memory = CudaMemory()
    allocator = memory.allocator
    walk = StepWalk(trace, fb, fb_sizes, sharded, memory, measure_buffer_frees=False)
    # the model is moved to the GPU parameter by parameter
    walk.place(trace.initial)
    walk.start_peak(-1)
    walk.tracking = False
    # the first step runs the first traced step's forward and backward (lazily built state),
    # each thread's first matmuls allocating its cuBLAS workspaces (they stay for the process)
    first = first_forward_backward(trace, fb, fb_sizes)
    walk.workspaces = (
        profile.cublas_workspace_bytes,
        profile.cublaslt_workspace_bytes,
        spec.mode == "train",
    )
    if (
        spec.activation_offloading
        and spec.mode == "train"
        and offload.empties_cuda_cache(uses_bitsandbytes(spec) or spec.lora_rank > 0)
    ):
        walk.emptied = allocator
    if spec.mode == "train":
        first_opt, steady_opt = optimizer_segments
        assert first_opt is not None and steady_opt is not None
        # step 1 creates the optimizer state; step 2 is the steady state we report
        first_sizes = sharded.sizes(first_opt, first_opt.sizes)
        steady_sizes = sharded.sizes(steady_opt, steady_opt.sizes)
        walk.step(first_opt, first_sizes, trace.first_optimizer_globals, accumulate, first)
        memory.reset_peaks()
        walk.tracking = True
        walk.step(steady_opt, steady_sizes, None, accumulate)
    else:
        walk.step(None, None, first=first)  # a first batch warms the cache
        memory.reset_peaks()
        walk.tracking = True
        walk.step(None, None)
    breakdown = walk.breakdown()
    reserved = allocator.max_reserved
    workspace = walk.workspace_bytes
    breakdown["allocator_overhead"] = reserved - sum(walk.best_raw) - workspace
    # NCCL's communicator buffers live outside the caching allocator
    nccl = profile.nccl_bytes if world_size > 1 else 0
    context = profile.context_for(spec.mode, spec.precision, spec.attn_implementation)
    breakdown["runtime_overhead"] = context + workspace + nccl
    total = reserved + context + nccl
    return Peak(
        total,
        breakdown,
        walk.best_phase,
        allocator.max_allocated,
        reserved,
        context,
        walk.phases,
        host_peak_bytes=walk.host_peak,
    )
