"""What the device adds to a trace: allocator rounding and caching, workspaces, the runtime.

The trace says which tensors are alive when; this module turns that into the bytes a device holds.
On CUDA, a replay of PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) over the
step's allocations and frees gives ``max_memory_reserved``; the CUDA context and cuBLAS workspaces
are added as the runtime overhead. On the CPU, each allocation takes whole pages from glibc.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MiB = 2**20

# --- CUDA caching allocator constants (c10/cuda/CUDACachingAllocator.cpp) -------------------------
K_MIN_BLOCK_SIZE = 512  # every request is rounded up to a multiple of this
K_SMALL_SIZE = 1 * MiB  # requests up to this size come from the small pool
K_SMALL_BUFFER = 2 * MiB  # small-pool segments
K_LARGE_BUFFER = 20 * MiB  # segments for large requests under K_MIN_LARGE_ALLOC
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB  # larger requests get their own segment, rounded to this


def cuda_round_size(size: int) -> int:
    """``round_size``: at least 512 bytes, in multiples of 512."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def cuda_segment_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd when no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(slots=True)
class _Block:
    address: int
    size: int
    segment: int
    free: bool = True
    # the block before this one in its segment (blocks tile a segment), None for the first
    previous: _Block | None = field(default=None, repr=False, compare=False)


@dataclass
class CachingAllocator:
    """A replay of the CUDA caching allocator on one stream, default settings.

    Best fit among cached free blocks of the request's pool; split when the remainder is at least
    512 B (small pool) or more than 1 MiB (large pool); merge with free neighbours on free; segments
    are never returned (no ``empty_cache``), so reserved memory only grows. ``max_split_size`` and
    ``expandable_segments`` are left at their defaults (unlimited, off).
    """

    allocated: int = 0
    reserved: int = 0
    max_allocated: int = 0
    max_reserved: int = 0
    _next_address: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)  # by start address
    _segment_end: dict[int, int] = field(default_factory=dict)  # segment start -> end address
    _free: tuple[list[tuple[int, int]], list[tuple[int, int]]] = field(
        default_factory=lambda: ([], [])
    )

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; returns the block's address (its handle)."""
        size = cuda_round_size(size)
        small = size <= K_SMALL_SIZE
        pool = self._free[0 if small else 1]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            _, address = pool.pop(i)
            block = self._blocks[address]
        else:
            segment = cuda_segment_size(size)
            address = self._next_address
            # segments are distinct device ranges: never adjacent, so never merged
            self._next_address += segment + K_SMALL_BUFFER
            block = _Block(address, segment, address)
            self._blocks[address] = block
            self._segment_end[address] = address + segment
            self.reserved += segment
            self.max_reserved = max(self.max_reserved, self.reserved)
        remaining = block.size - size
        if (small and remaining >= K_MIN_BLOCK_SIZE) or (not small and remaining > K_SMALL_SIZE):
            rest = _Block(block.address + size, remaining, block.segment, True, block)
            after = self._blocks.get(rest.address + remaining)
            if after is not None and after.segment == block.segment:
                after.previous = rest
            self._blocks[rest.address] = rest
            bisect.insort(pool, (remaining, rest.address))
            block.size = size
        block.free = False
        self.allocated += block.size
        if self.allocated > self.max_allocated:
            self.max_allocated = self.allocated
        return block.address

    def free(self, address: int) -> None:
        block = self._blocks[address]
        block.free = True
        self.allocated -= block.size
        small = (self._segment_end[block.segment] - block.segment) == K_SMALL_BUFFER
        pool = self._free[0 if small else 1]
        # merge with the following block, then with the preceding one, inside the segment
        following = self._blocks.get(block.address + block.size)
        if following is not None and following.free and following.segment == block.segment:
            pool.remove((following.size, following.address))
            del self._blocks[following.address]
            block.size += following.size
        preceding = block.previous
        if preceding is not None and preceding.free:
            pool.remove((preceding.size, preceding.address))
            del self._blocks[block.address]
            preceding.size += block.size
            block = preceding
        after = self._blocks.get(block.address + block.size)
        if after is not None and after.segment == block.segment:
            after.previous = block
        bisect.insort(pool, (block.size, block.address))


# --- CPU -------------------------------------------------------------------------------------------
PAGE = 4096
CPU_ALIGNMENT = 64  # c10's CPU allocator aligns every tensor to 64 bytes
CPU_MMAP_THRESHOLD = 64 * 1024


def cpu_allocation_bytes(size: int) -> int:
    """Resident bytes one tensor costs on the CPU (glibc malloc under c10's 64-byte alignment).

    Large allocations are mmapped: whole pages, including the chunk header in front of the data.
    Small ones come from the heap in 16-byte granules plus the alignment slack.
    """
    if size >= CPU_MMAP_THRESHOLD:
        return ((size + CPU_ALIGNMENT + PAGE - 1) // PAGE) * PAGE
    return ((size + CPU_ALIGNMENT + 15) // 16) * 16
