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


@dataclass(frozen=True)
class CudaProfile:
    """What a CUDA device and its runtime hold outside the tensors of the step.

    ``context_bytes``: the CUDA context with lazy module loading plus the kernels an fp32 eval step
    loads, as ``mem_get_info`` shows it beyond ``memory_reserved``. Measured by
    ``bench/gpu_validate.py`` on an H100 (torch 2.11, CUDA 13.0, driver 580): 523 MiB right after
    ``torch.cuda.init()``, 683 MiB after an fp32 eval step of any of BERT, GPT-2, MiniLM.
    ``training_kernels_bytes``: the backward and optimizer kernels a training step loads on top
    (747 MiB after a training step, whatever the model, attention or shape).
    ``half_attention_kernels_bytes``: the fp16/bf16 flash-attention kernels SDPA loads (763 MiB
    after a bf16 SDPA training step, 691 after a bf16 SDPA eval step; eager attention loads none).
    ``cublas_workspace_bytes``: one per handle and stream, through the caching allocator; handles
    are per thread, so a training step holds two: the main thread's and the autograd engine's
    device thread's (backward matmuls), which the H100 measurements bear out (+33 MiB allocated);
    32 MiB on sm90 (H100/H200), else 4096 KiB·2 + 16 KiB·8 (aten/src/ATen/cuda/CublasHandlePool.cpp).
    ``cublaslt_workspace_bytes``: cuBLASLt's own 1 MiB workspace, persistent from torch 2.9 and
    shared with cuBLAS' from torch 2.12.
    ``nccl_bytes``: with several ranks, NCCL's communicator buffers, outside the caching
    allocator. An assumption from NCCL's defaults, not a measurement: a ring over 16 channels,
    each with send and receive buffers for its two peers of the Simple (NCCL_BUFFSIZE 4 MiB),
    LL128 (about 4.6 MiB) and LL (256 KiB) protocols: 16 × 2 × 8.9 MiB ≈ 288 MiB.
    """

    name: str = "generic sm80+"
    context_bytes: int = 683 * MiB
    training_kernels_bytes: int = 64 * MiB
    half_attention_kernels_bytes: int = 16 * MiB
    cublas_workspace_bytes: int = 4096 * 1024 * 2 + 16 * 1024 * 8
    cublaslt_workspace_bytes: int = 1 * MiB
    flash_attention: bool = True
    nccl_bytes: int = 288 * MiB

    def context_for(self, mode: str, precision: str, attn_implementation: str) -> int:
        """The CUDA context once a step of this kind has run (lazy loading: kernels on first use)."""
        context = self.context_bytes
        if mode == "train":
            context += self.training_kernels_bytes
        if precision != "fp32" and attn_implementation == "sdpa" and self.flash_attention:
            # the backward kernels are half of the flash-attention module
            context += self.half_attention_kernels_bytes // (1 if mode == "train" else 2)
        return context


def cuda_profile(
    capability: tuple[int, int] | None = None, torch_version: str | None = None
) -> CudaProfile:
    """The profile for a compute capability (detected when a GPU is present)."""
    import torch

    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    version = tuple(
        int(x) for x in (torch_version or torch.__version__).split("+")[0].split(".")[:2]
    )
    lt = 0 if version >= (2, 12) else 1 * MiB
    if capability == (9, 0):
        return CudaProfile(
            name="sm90", cublas_workspace_bytes=32 * MiB, cublaslt_workspace_bytes=lt
        )
    name = f"sm{capability[0]}{capability[1]}" if capability else "generic sm80+"
    flash = capability is None or capability >= (8, 0)
    return CudaProfile(name=name, cublaslt_workspace_bytes=lt, flash_attention=flash)


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
