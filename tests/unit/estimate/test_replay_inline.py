"""The fast CUDA replay answers as the plain one does.

The caching allocator keeps its blocks as ints in dicts and sorted key lists, and the replay's
CUDA walk inlines the allocator's loop (:meth:`StepWalk._run_cuda`), for speed. These tests hold
them to what they replace: the allocator to the block-object replay it was (kept here as the
reference), and the inlined walk to the generic walk over the allocator's own methods, on random
steps with every kind of event.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import pytest

from memfit.estimate import device as dev
from memfit.estimate.replay import CudaMemory, StepWalk, _Sharded
from memfit.estimate.step_trace import (
    ALLOC,
    CAT,
    CATEGORIES,
    FREE,
    FREE_PREV,
    FREE_RES,
    HOST_OP,
    MARK,
    PHASE,
    Segment,
    StepTrace,
)

MiB = 2**20


@dataclass
class _Block:
    address: int
    size: int
    segment: int
    free: bool = True
    previous: _Block | None = None


class _ReferenceAllocator:
    """The allocator as it was: block objects, (size, address) tuples in sorted pools."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.next_address = 0
        self.blocks: dict[int, _Block] = {}
        self.segment_end: dict[int, int] = {}
        self.pools: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])

    def malloc(self, size: int) -> int:
        size = dev.cuda_round_size(size)
        small = size <= dev.K_SMALL_SIZE
        pool = self.pools[0 if small else 1]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = self.blocks[pool.pop(i)[1]]
        else:
            segment = dev.cuda_segment_size(size)
            address = self.next_address
            self.next_address += segment + dev.K_SMALL_BUFFER
            block = self.blocks[address] = _Block(address, segment, address)
            self.segment_end[address] = address + segment
            self.reserved += segment
            self.max_reserved = max(self.max_reserved, self.reserved)
        remaining = block.size - size
        if (small and remaining >= 512) or (not small and remaining > dev.K_SMALL_SIZE):
            rest = _Block(block.address + size, remaining, block.segment, True, block)
            after = self.blocks.get(rest.address + remaining)
            if after is not None and after.segment == block.segment:
                after.previous = rest
            self.blocks[rest.address] = rest
            bisect.insort(pool, (remaining, rest.address))
            block.size = size
        block.free = False
        self.allocated += block.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        return block.address

    def free(self, address: int) -> None:
        block = self.blocks[address]
        block.free = True
        self.allocated -= block.size
        small = self.segment_end[block.segment] - block.segment == dev.K_SMALL_BUFFER
        pool = self.pools[0 if small else 1]
        following = self.blocks.get(block.address + block.size)
        if following is not None and following.free and following.segment == block.segment:
            pool.remove((following.size, following.address))
            del self.blocks[following.address]
            block.size += following.size
        preceding = block.previous
        if preceding is not None and preceding.free:
            pool.remove((preceding.size, preceding.address))
            del self.blocks[block.address]
            preceding.size += block.size
            block = preceding
        after = self.blocks.get(block.address + block.size)
        if after is not None and after.segment == block.segment:
            after.previous = block
        bisect.insort(pool, (block.size, block.address))


def _size(rng: random.Random) -> int:
    pick = rng.random()
    if pick < 0.35:
        return rng.randint(1, 8192)
    if pick < 0.6:
        return rng.randint(1, 2 * MiB)
    if pick < 0.85:
        return rng.randint(1, 48 * MiB)
    if pick < 0.95:
        # whole MiB: blocks used whole, or split with exactly 1 MiB left (which the large pool
        # does not split off)
        return rng.randint(2, 24) * MiB
    return rng.randint(1, 64) * dev.K_MIN_BLOCK_SIZE


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("address_bits", [48, 24])  # 24: the pools are re-keyed as they grow
def test_the_allocator_answers_as_the_block_replay(seed: int, address_bits: int) -> None:
    rng = random.Random(seed)
    fast, reference = dev.CachingAllocator(), _ReferenceAllocator()
    fast._shift, fast._mask = address_bits, (1 << address_bits) - 1
    live: list[int] = []
    for _ in range(4000):
        if live and rng.random() < 0.45:
            handle = live.pop(rng.randrange(len(live)))
            fast.free(handle)
            reference.free(handle)
        else:
            size = _size(rng)
            handle = fast.malloc(size)
            assert handle == reference.malloc(size)
            live.append(handle)
        counts = (fast.allocated, fast.reserved, fast.max_allocated, fast.max_reserved)
        assert counts == (
            reference.allocated,
            reference.reserved,
            reference.max_allocated,
            reference.max_reserved,
        )
    pools = [
        [(key >> fast._shift, key & fast._mask) for key in p] for p in (fast._small, fast._large)
    ]
    assert pools == [list(p) for p in reference.pools]


class _Generic:
    """CUDA's memory behind the generic walk (not a :class:`CudaMemory`: nothing inlined)."""

    def __init__(self) -> None:
        self.inner = CudaMemory()

    @property
    def level(self) -> int:
        return self.inner.level

    def malloc(self, size: int) -> int:
        return self.inner.malloc(size)

    def free(self, handle: int) -> None:
        self.inner.free(handle)


def _segment(rng: random.Random, n: int, kept_grads: bool) -> tuple[Segment, list[int]]:
    """Random events over ``n`` allocations: forward, then backward; gradients kept alive for
    the optimizer step when ``kept_grads``. Also the ids of the gradients kept."""
    sizes = [0 if rng.random() < 0.03 else _size(rng) for _ in range(n)]
    cats = [rng.choice([CAT["activations"], CAT["transient"], CAT["gradients"]]) for _ in sizes]
    ops = [
        rng.choice([HOST_OP, "mm.default", "addmm.default"]) if rng.random() < 0.1 else "empty"
        for _ in sizes
    ]
    events: list[tuple[int, int]] = [(MARK, PHASE["forward"])]
    alive: list[int] = []
    kept: list[int] = []
    for j in range(n):
        if j == n // 2:
            events.append((MARK, PHASE["backward"]))
        events.append((ALLOC, j))
        if kept_grads and cats[j] == CAT["gradients"] and ops[j] != HOST_OP:
            kept.append(j)
        else:
            alive.append(j)
        while alive and rng.random() < 0.5:
            events.append((FREE, alive.pop(rng.randrange(len(alive)))))
    events += [(FREE, j) for j in alive]
    segment = Segment(
        events=events,
        sizes=sizes,
        categories=cats,
        ops=ops,
        shapes=[(1,)] * n,
        itemsizes=[1] * n,
        formulas=[None] * n,
        params=[-1] * n,
        origins=[-1] * n,
    )
    return segment, kept


def _walk(
    memory: object,
    trace: StepTrace,
    accumulate: bool,
    emptied: bool = False,
    workspaces: bool = True,
) -> tuple[object, ...]:
    fb = trace.steps[1][1]
    walk = StepWalk(trace, fb, list(fb.sizes), _Sharded(None), memory, measure_buffer_frees=False)  # type: ignore[arg-type]
    walk.pinned = True  # host copies are pinned blocks for both (a CUDA target's)
    allocator = memory.inner.allocator if isinstance(memory, _Generic) else memory.allocator  # type: ignore[attr-defined]
    # the first step's cuBLAS workspaces (replay-only events), a cache emptied per micro-batch
    walk.workspaces = (32 * MiB, 1 * MiB, True) if workspaces else None
    walk.emptied = allocator if emptied else None
    walk.place(trace.initial)
    walk.tracking = False
    first, steady = trace.steps[0][2], trace.steps[1][2]
    assert first is not None and steady is not None
    walk.step(first, list(first.sizes), trace.first_optimizer_globals, accumulate)
    walk.tracking = True
    walk.step(steady, list(steady.sizes), None, accumulate)
    counts = (allocator.allocated, allocator.max_allocated, allocator.max_reserved)
    found = walk.best, walk.best_raw, walk.best_phase, walk.phases, walk.host_peak, counts
    return *found, walk.workspace_bytes


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_inlined_cuda_walk_answers_as_the_generic_walk(seed: int, accumulate: bool) -> None:
    rng = random.Random(seed)
    emptied = seed % 2 == 1
    fb, kept = _segment(rng, 400, kept_grads=True)
    residents = [_size(rng) for _ in range(30)]
    states = [_size(rng) for _ in range(8)]
    step = [(MARK, PHASE["optimizer_step"])] + [(FREE_PREV, j) for j in kept]
    # the first optimizer step creates the state (global ids after the residents); the steady
    # one frees it and makes it again, and frees a resident
    first_opt = Segment(events=step + [(ALLOC, i) for i in range(len(states))], sizes=states)
    first_opt.categories = [CAT["optimizer_state"]] * len(states)
    first_opt.ops = ["empty"] * len(states)
    globals_ = list(range(len(residents), len(residents) + len(states)))
    steady_events = step + [(FREE_RES, g) for g in globals_] + [(FREE_RES, 0)]
    steady_events += [(ALLOC, i) for i in range(len(states))]
    steady_opt = Segment(events=steady_events, sizes=states)
    steady_opt.categories, steady_opt.ops = first_opt.categories, first_opt.ops
    trace = StepTrace(
        resident_sizes=residents + states,
        resident_categories=[CAT["parameters"]] * len(residents)
        + [CAT["optimizer_state"]] * len(states),
        steps=[((1, 8), fb, first_opt), ((1, 8), fb, steady_opt)],
        num_parameters=1,
        parameter_bytes=1,
        initial=list(range(len(residents))),
        first_optimizer_globals=globals_,
    )
    fast = _walk(CudaMemory(), trace, accumulate, emptied)
    assert fast == _walk(_Generic(), trace, accumulate, emptied)
    best, best_raw, _, phases, _, counts, workspace = fast
    # the workspaces are allocated (kept to the end, in neither walk's categories)
    without = _walk(CudaMemory(), trace, accumulate, emptied, workspaces=False)
    assert workspace > 0 and without[-1] == 0
    assert counts[0] - without[5][0] == workspace  # type: ignore[index]
    assert (
        best > 0 and sum(best_raw) > 0 and set(phases) == {"forward", "backward", "optimizer_step"}
    )
    assert len(best_raw) == len(CATEGORIES)
