"""What each CUDA generation and its runtime hold outside a step's tensors, and which kernels it runs.

The figures are measurements where a GPU was at hand (``bench/gpu_validate.py``) and the library
defaults otherwise; the estimate adds them as the runtime overhead (see
:mod:`memfit.estimate.device` for the allocator).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


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
    device thread's (backward matmuls). Each is allocated by its thread's first matmul (the H200
    allocator histories in ``bench/results/gpu_truth_20261128_H200/allocator_history``);
    32 MiB on sm90 (H100/H200), else 4096 KiB·2 + 16 KiB·8 (aten/src/ATen/cuda/CublasHandlePool.cpp).
    ``cublaslt_workspace_bytes``: cuBLASLt's own 1 MiB workspace, persistent from torch 2.9 and
    shared with cuBLAS' from torch 2.12; a thread makes it at its first gemm-and-bias (a linear
    with a bias), so a backward that recomputes no forward has none.
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


def attention_kernels(capability: tuple[int, int]) -> tuple[str, ...]:
    """The SDPA kernels PyTorch has for a compute capability, best first (sdp_utils.cpp
    check_flash_attention_hardware_support: sm80-121; check_mem_efficient_hardware_support:
    sm50-121; the math path everywhere)."""
    sm = capability[0] * 10 + capability[1]
    kernels = []
    if 80 <= sm <= 121:
        kernels.append("flash")
    if 50 <= sm <= 121:
        kernels.append("mem-efficient")
    return (*kernels, "math")


def sdpa_sm(capability: tuple[int, int]) -> int:
    """The SM version whose attention kernels an estimate emulates (``StepSpec.sdpa_sm``): every
    sm80+ GPU as an sm80 one (the same flash and memory-efficient kernels; the sm86/89 head-dim
    limits of flash backward above 192 are not told apart), older ones as themselves."""
    sm = capability[0] * 10 + capability[1]
    return min(sm, 80)


def cuda_profile(
    capability: tuple[int, int] | None = None, torch_version: str | None = None
) -> CudaProfile:
    """The profile for a compute capability (detected when a GPU is present)."""
    # start-up: memfit.devices is read by quick verbs that never load torch
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
