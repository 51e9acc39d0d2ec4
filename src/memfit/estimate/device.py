"""What the device adds to a trace: allocator rounding and caching, workspaces, the runtime.

The trace says which tensors are alive when; this module turns that into the bytes a device holds.
On CUDA, a replay of PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) over the
step's allocations and frees gives ``max_memory_reserved``; the CUDA context and cuBLAS workspaces
are added as the runtime overhead. On the CPU, each allocation takes whole pages from glibc.
"""

from __future__ import annotations

import bisect
from typing import Any

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


# A free block's place in its pool's sorted list: its size in the high bits, its address in the
# low ones, so that one int orders as the tuple (size, address) did (best fit, then the lowest
# address) and compares faster than a tuple. Addresses start at this many bits; a replay that
# reserves more address space re-keys its pools with a wider field (``_widen``).
_ADDRESS_BITS = 48


class CachingAllocator:
    """A replay of the CUDA caching allocator on one stream, default settings.

    Best fit among cached free blocks of the request's pool; split when the remainder is at least
    512 B (small pool) or more than 1 MiB (large pool); merge with free neighbours on free; segments
    are never returned (no ``empty_cache``), so reserved memory only grows. ``max_split_size`` and
    ``expandable_segments`` are left at their defaults (unlimited, off).

    A replay makes tens of thousands of these calls per estimate, so blocks are plain ints in
    dicts rather than objects: ``_size`` maps each block's start address to its size, negated while
    the block is free; ``_free_end`` maps the end address of each free block to its start (the
    free block before a block being freed is the one ending where it starts). Each pool's free
    blocks are a sorted list of keys (``_ADDRESS_BITS``): bisect finds the best fit and a free
    block's own key in O(log n), and the lists stay short (the free blocks of one step), so their
    inserts and deletes are cheap memmoves. Segments are placed apart (a gap after each), so the
    block starting where another ends, or ending where another starts, is of the same segment.
    """

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.max_allocated = 0
        self.max_reserved = 0
        self._next_address = 0
        self._size: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._small: list[int] = []  # free blocks of 2 MiB segments (requests up to 1 MiB)
        self._large: list[int] = []
        self._shift = _ADDRESS_BITS
        self._mask = (1 << _ADDRESS_BITS) - 1
        self._segments: list[tuple[int, int]] = []  # (start, size) of each segment, in order

    def segments(self) -> list[dict[str, Any]]:
        """Each segment as it stands: ``total`` (its size), ``allocated`` (the bytes of its blocks
        in use) and ``free_blocks`` (the sizes of its free ones), in the order they were made:
        what ``torch.cuda.memory._snapshot()`` says of a real allocator's (bench/gpu_validate.py
        compares the two)."""
        starts = sorted(self._size)
        found = []
        for start, size in self._segments:
            first = bisect.bisect_left(starts, start)
            last = bisect.bisect_left(starts, start + size)
            blocks = [self._size[a] for a in starts[first:last]]
            found.append(
                {
                    "total": size,
                    "allocated": sum(b for b in blocks if b > 0),
                    "free_blocks": [-b for b in blocks if b < 0],
                }
            )
        return found

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; returns the block's address (its handle)."""
        if size < K_MIN_BLOCK_SIZE:
            size = K_MIN_BLOCK_SIZE
        else:
            # cuda_round_size (512 is a power of two: the mask rounds down to its multiples)
            size = (size + K_MIN_BLOCK_SIZE - 1) & -K_MIN_BLOCK_SIZE
        return self.malloc_rounded(size)

    def malloc_rounded(self, size: int) -> int:
        """:meth:`malloc` of a size already rounded (:func:`cuda_round_size`)."""
        small = size <= K_SMALL_SIZE
        pool = self._small if small else self._large
        shift = self._shift
        i = bisect.bisect_left(pool, size << shift)
        if i < len(pool):
            key = pool.pop(i)
            address = key & self._mask
            block = key >> shift
        else:
            address, block = self.new_segment(size)
            shift = self._shift
        # the block taken is free, out of its pool: the rest of it (split off) stays free, and
        # ends where it ended
        remaining = block - size
        if (remaining >= K_MIN_BLOCK_SIZE) if small else (remaining > K_SMALL_SIZE):
            rest = address + size
            self._size[rest] = -remaining
            self._free_end[rest + remaining] = rest
            bisect.insort(pool, remaining << shift | rest)
            block = size
        else:
            del self._free_end[address + block]
        self._size[address] = block
        self.allocated += block
        if self.allocated > self.max_allocated:
            self.max_allocated = self.allocated
        return address

    def new_segment(self, size: int) -> tuple[int, int]:
        """cudaMalloc a segment for a request of ``size`` bytes (rounded) no cached block fits:
        its address and size, one free block (of ``_size`` and ``_free_end``) not in a pool."""
        block = cuda_segment_size(size)
        address = self._next_address
        # segments are distinct device ranges: never adjacent, so never merged
        self._next_address = address + block + K_SMALL_BUFFER
        if self._next_address > self._mask:
            self._widen()
        self._size[address] = -block
        self._free_end[address + block] = address
        self._segments.append((address, block))
        self.reserved += block
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved
        return address, block

    def free(self, address: int) -> None:
        sizes, free_end, shift = self._size, self._free_end, self._shift
        block = sizes[address]
        self.allocated -= block
        # its size names its pool: in a small segment a block in use is its request exactly (all
        # sizes are multiples of 512 B, and a remainder of 512 B or more is split off), at most
        # 1 MiB; in a large segment it is at least its request, over 1 MiB
        pool = self._small if block <= K_SMALL_SIZE else self._large
        bisect_left = bisect.bisect_left
        # merge with the following block, then with the preceding one, inside the segment
        following = address + block
        size = sizes.get(following, 0)
        if size < 0:
            # its end stays the merged block's (``_free_end`` is set to it below)
            del pool[bisect_left(pool, -size << shift | following)]
            del sizes[following]
            block -= size
        preceding = free_end.pop(address, -1)
        if preceding >= 0:
            size = sizes[preceding]
            del pool[bisect_left(pool, -size << shift | preceding)]
            del sizes[address]
            block -= size
            address = preceding
        sizes[address] = -block
        free_end[address + block] = address
        bisect.insort(pool, block << shift | address)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every segment with no block in use is returned."""
        kept = []
        for start, size in self._segments:
            if self._size.get(start) != -size:
                kept.append((start, size))
                continue
            pool = self._small if size == K_SMALL_BUFFER else self._large
            del pool[bisect.bisect_left(pool, size << self._shift | start)]
            del self._size[start]
            del self._free_end[start + size]
            self.reserved -= size
        self._segments = kept

    def _widen(self) -> None:
        """Make room for addresses past the keys' address field: re-key both pools."""
        old, mask = self._shift, self._mask
        while self._next_address > self._mask:
            self._shift += 16
            self._mask = (1 << self._shift) - 1
        for pool in (self._small, self._large):
            pool[:] = sorted((key >> old) << self._shift | (key & mask) for key in pool)


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
