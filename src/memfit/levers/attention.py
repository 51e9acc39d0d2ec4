"""The attention kernel transformers runs: SDPA (memory-efficient or flash kernels where the
device has them), the eager matmul-softmax, or the flash-attn package's FlashAttention 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Lever

# flash_attention_2: the flash-attn package's kernel as transformers calls it (modelled on a CUDA
# GPU of sm80 or newer; it never runs on the CPU)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


@dataclass(kw_only=True)
class AttentionKnobs:
    attn_implementation: str | None = knob(
        "sdpa | eager | flash_attention_2 (the model's attention kernel).",
        choices=ATTN_IMPLEMENTATIONS,
    )
    """The attention implementation transformers runs (SDPA, the eager matmul-softmax, or the
    flash-attn package's FlashAttention 2)."""


class Attention(Lever):
    name: ClassVar[str] = "attention"
    knobs: ClassVar[type] = AttentionKnobs
    summary: ClassVar[str] = "the attention kernel"

    def problems(self, job: Job) -> list[str]:
        problems: list[str] = []
        if job.attn_implementation == "flash_attention_2":
            # the flash-attn package: CUDA kernels (sm80+) that compute in fp16/bf16 only
            if job.device == "cpu":
                problems.append(
                    "--attn-implementation flash_attention_2: FlashAttention runs on CUDA GPUs "
                    "only, not --device cpu (use sdpa)"
                )
            if job.precision == "fp32":
                problems.append(
                    "--attn-implementation flash_attention_2: FlashAttention computes in fp16 or "
                    "bf16 only; give --precision bf16 (or fp16)"
                )
        return problems


LEVER = Attention()
