"""The estimate runs the attention kernels of the named GPU's generation, and its precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.devices import find_gpu
from memfit.devices.profiles import sdpa_sm
from memfit.errors import UsageError
from memfit.estimate.sdpa_emulation import CudaSdpa, SdpaBackend, select_sdpa_backend
from memfit.estimate.sdpa_kernels import (
    efficient_attention_backward_workspace_bytes,
    efficient_kernel_computes_delta,
)


def _qkv(dtype: torch.dtype, head_dim: int = 64) -> list[torch.Tensor]:
    return [torch.zeros(2, 4, 128, head_dim, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    ("gpu", "backend"),
    [("a100-40gb", SdpaBackend.FLASH), ("rtx3060", SdpaBackend.FLASH),
     ("t4", SdpaBackend.EFFICIENT), ("v100", SdpaBackend.EFFICIENT),
     ("p100", SdpaBackend.EFFICIENT), ("k80", SdpaBackend.MATH)],
)  # fmt: skip
def test_fp16_attention_picks_the_kernel_the_generation_has(gpu: str, backend: SdpaBackend) -> None:
    card = find_gpu(gpu)
    q, k, v = _qkv(torch.float16)
    capability = divmod(sdpa_sm(card.compute_capability), 10)
    assert select_sdpa_backend(q, k, v, compute_capability=capability) is backend
    # and the emulation runs it (it refused anything below sm80 before)
    sdpa = CudaSdpa(compute_capability=capability)
    with sdpa:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert sdpa.backend_counts[backend] == 1


def test_backward_workspace_and_delta_follow_the_generation() -> None:
    shape = (2, 4, 256, 256, 128, 128)
    # float32 before sm70: no split keys, no grad-Q accumulator: no workspace at all
    assert efficient_attention_backward_workspace_bytes(*shape, torch.float32, compute_capability=(6, 0)) == 0  # fmt: skip
    assert efficient_attention_backward_workspace_bytes(*shape, torch.float32, compute_capability=(8, 0)) > 0  # fmt: skip
    # fp16 at head dim 128: sm70/75 use 128 x 64 tiles, sm80 128 x 128 ones
    sm75 = efficient_attention_backward_workspace_bytes(*shape, torch.float16, compute_capability=(7, 5))  # fmt: skip
    sm80 = efficient_attention_backward_workspace_bytes(*shape, torch.float16, compute_capability=(8, 0))  # fmt: skip
    assert sm75 != sm80
    # the V100's (sm70) 16-bit kernels leave delta to the host when the output is not in registers
    assert not efficient_kernel_computes_delta(torch.float16, 256, False, (7, 0))
    assert efficient_kernel_computes_delta(torch.float16, 256, False, (7, 5))
    assert efficient_kernel_computes_delta(torch.float16, 64, False, (7, 0))
    assert not efficient_kernel_computes_delta(torch.float32, 64, False, (8, 0))


@pytest.mark.slow
def test_estimate_runs_the_named_gpus_kernels(tiny_gpt2: str) -> None:
    from memfit.estimate import estimate

    job = {"task": "causal-lm", "batch_size": 2, "seq_len": 64, "precision": "fp16"}
    on = {gpu: estimate(tiny_gpt2, gpu=gpu, **job) for gpu in ("a100-40gb", "t4", "k80")}
    assert [on[g].spec.sdpa_sm for g in on] == [80, 75, 37]
    assert on["t4"].details["gpu"]["attention_kernels"] == ["mem-efficient", "math"]
    # the K80 has only the math path, which keeps the attention probabilities for backward
    assert on["k80"].breakdown["activations"] > on["a100-40gb"].breakdown["activations"]
    # without --gpu (or on the CPU) the sm80+ kernels, as before
    assert estimate(tiny_gpt2, **job).spec.sdpa_sm == 80


@pytest.mark.parametrize("gpu", ["p100", "t4", "v100", "k80", "2080ti"])
def test_bf16_before_sm80_is_one_usage_error_naming_the_gpu(tmp_path: Path, gpu: str) -> None:
    from memfit.estimate import estimate

    with pytest.raises(UsageError, match=f"--precision bf16: the {find_gpu(gpu).short_name} "):
        estimate(str(tmp_path / "no-model"), task="classification", batch_size=1, seq_len=8,
                 precision="bf16", gpu=gpu)  # fmt: skip
