"""The CUDA caching-allocator replay and the CPU page model."""

from __future__ import annotations

import pytest

from memfit.devices.profiles import cuda_profile
from memfit.estimate.device import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    CachingAllocator,
    cpu_allocation_bytes,
    cuda_round_size,
    cuda_segment_size,
)

MiB = 2**20


def test_round_size_and_segment_sizes() -> None:
    assert cuda_round_size(1) == 512
    assert cuda_round_size(513) == 1024
    assert cuda_segment_size(1 * MiB) == K_SMALL_BUFFER
    assert cuda_segment_size(1 * MiB + 512) == K_LARGE_BUFFER
    assert cuda_segment_size(10 * MiB) == 10 * MiB
    assert cuda_segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_two_mib_segment() -> None:
    alloc = CachingAllocator()
    handles = [alloc.malloc(1000) for _ in range(100)]
    assert alloc.reserved == K_SMALL_BUFFER
    assert alloc.allocated == 100 * 1024
    for h in handles:
        alloc.free(h)
    assert alloc.allocated == 0
    # everything merged back: a 2 MiB request... is large, but a 1 MiB one reuses the segment
    alloc.malloc(1 * MiB)
    assert alloc.reserved == K_SMALL_BUFFER


def test_large_blocks_split_only_with_more_than_one_mib_left() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(3 * MiB)  # a 20 MiB segment, split: 17 MiB stay free
    assert alloc.reserved == K_LARGE_BUFFER and alloc.allocated == 3 * MiB
    b = alloc.malloc(16 * MiB + 512 * 1024)  # fits in the 17 MiB rest; 0.5 MiB left: not split
    assert alloc.reserved == K_LARGE_BUFFER
    assert alloc.allocated == 3 * MiB + 17 * MiB
    alloc.free(a)
    alloc.free(b)
    assert alloc.allocated == 0


def test_freed_memory_stays_reserved_and_fragments() -> None:
    alloc = CachingAllocator()
    x = alloc.malloc(12 * MiB)
    y = alloc.malloc(12 * MiB)
    alloc.free(x)
    alloc.free(y)
    # two separate 12 MiB segments cannot serve one 20 MiB tensor: a new segment is reserved
    alloc.malloc(20 * MiB)
    assert alloc.reserved == 44 * MiB
    assert alloc.max_reserved == 44 * MiB


def test_best_fit_reuses_the_smallest_free_block() -> None:
    alloc = CachingAllocator()
    big = alloc.malloc(40 * MiB)
    small = alloc.malloc(12 * MiB)
    alloc.free(big)
    alloc.free(small)
    alloc.malloc(11 * MiB)
    # served from the 12 MiB segment (best fit), leaving the 40 MiB one whole
    alloc.malloc(40 * MiB)
    assert alloc.reserved == 52 * MiB


def test_hopper_has_the_32_mib_cublas_workspace() -> None:
    assert cuda_profile((9, 0), "2.11.0").cublas_workspace_bytes == 32 * MiB
    assert cuda_profile((8, 0), "2.11.0").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cuda_profile((8, 0), "2.12.0").cublaslt_workspace_bytes == 0


def test_cpu_pages() -> None:
    assert cpu_allocation_bytes(100 * MiB) == 100 * MiB + 4096
    assert cpu_allocation_bytes(100) < 4096


def test_context_grows_with_the_kernels_a_step_loads() -> None:
    # lazy module loading: a training step loads backward and optimizer kernels on top of an eval
    # step's; half-precision SDPA loads the flash-attention kernels (eager attention does not)
    profile = cuda_profile((9, 0), "2.11.0")
    eval_fp32 = profile.context_for("eval", "fp32", "sdpa")
    train_fp32 = profile.context_for("train", "fp32", "sdpa")
    train_bf16 = profile.context_for("train", "bf16", "sdpa")
    assert eval_fp32 < train_fp32 < train_bf16
    assert profile.context_for("train", "bf16", "eager") == train_fp32
    assert eval_fp32 < profile.context_for("eval", "bf16", "sdpa") < train_bf16
    # GPUs without flash attention (before sm80) never load its kernels
    assert cuda_profile((7, 5), "2.11.0").context_for("train", "fp16", "sdpa") == train_fp32


@pytest.mark.slow
@pytest.mark.parametrize("torch_version", [None, "2.11"])
def test_a_training_step_holds_a_cublas_workspace_per_thread(
    torch_version: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.estimate import estimate, traces

    # the profile estimate uses (the GPU present, else the generic one); with torch 2.11's
    # rules, a cuBLASLt workspace of its own
    profile = cuda_profile(torch_version=torch_version)
    monkeypatch.setattr(traces, "cuda_profile", lambda *args, **kwargs: profile)
    # traced afresh: a trace keeps the profile it was traced with (the disk cache's too)
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    monkeypatch.setattr(traces, "_CACHE", {})
    kwargs = dict(task="classification", batch_size=2, seq_len=32, device="cuda")
    train = estimate("bert-base-uncased", **kwargs)  # type: ignore[arg-type]
    workspace = train.breakdown["runtime_overhead"] - train.details["context_bytes"]
    # the forward's thread: cuBLAS' workspace, and cuBLASLt's (BERT's linears have biases: the
    # gemm-and-bias); the backward's: cuBLAS' only (its matmuls are plain)
    one = profile.cublas_workspace_bytes + profile.cublaslt_workspace_bytes
    assert workspace == one + profile.cublas_workspace_bytes
    evaluated = estimate("bert-base-uncased", mode="eval", **kwargs)  # type: ignore[arg-type]
    assert evaluated.breakdown["runtime_overhead"] - evaluated.details["context_bytes"] == one
