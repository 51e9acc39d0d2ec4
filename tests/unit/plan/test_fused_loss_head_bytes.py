"""The fused loss's time cost reads the head's weight in the dtype it is held in
(:func:`memfit.levers.cross_entropy.head_bytes`): under LoRA and QLoRA the frozen head is in the
checkpoint's dtype (the plan's ``ModelShape.checkpoint_bytes``) or ``--weights-dtype``'s;
a trained head is fp32 master weights read as autocast's 16-bit copy, or fp32 without autocast.
Its chunks are the step's rule (``memfit.step.linear_ce.chunk_rows``), one copy of it."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from memfit.devices.catalog import find_gpu
from memfit.estimate.workload import StepSpec
from memfit.levers import BY_NAME, cross_entropy
from memfit.levers.cross_entropy import head_bytes
from memfit.plan import cost
from memfit.step import linear_ce

CE = BY_NAME["cross-entropy"]


@pytest.mark.parametrize(
    ("values", "checkpoint", "expected"),
    [
        # LoRA: the frozen head as the checkpoint holds it, under fp32 precision too
        ({"lora_rank": 8, "precision": "fp32"}, 2, 2),
        ({"lora_rank": 8, "precision": "fp32"}, 4, 4),
        ({"lora_rank": 8, "precision": "fp32", "weights_dtype": "fp32"}, 2, 4),
        ({"lora_rank": 8, "precision": "fp32", "weights_dtype": "bf16"}, 4, 2),
        ({"lora_rank": 8, "precision": "bf16"}, 4, 2),  # autocast's 16-bit copy
        # full fine-tuning: fp32 master weights, whatever the checkpoint
        ({"precision": "fp32"}, 2, 4),
        ({"precision": "bf16"}, 2, 2),
        ({"precision": "fp32", "weights_dtype": "bf16"}, 4, 2),  # pure 16-bit
        ({"lora_rank": 0, "precision": "fp32", "weights_dtype": "auto"}, 2, 4),
    ],
)
def test_the_head_is_read_in_the_dtype_it_is_held_in(
    values: dict[str, Any], checkpoint: int, expected: int
) -> None:
    assert head_bytes(values, checkpoint) == expected


def test_a_bf16_checkpoint_under_lora_halves_the_re_reads() -> None:
    gpu = find_gpu("rtx4090")
    values = {"precision": "fp32", "lora_rank": 8, "cross_entropy": "fused-linear"}
    fp32 = cost.ModelShape(5 * 10**8, 10**6, 24, 896, 0, vocab=151936, checkpoint_bytes=4)
    bf16 = cost.ModelShape(5 * 10**8, 10**6, 24, 896, 0, vocab=151936, checkpoint_bytes=2)
    tokens = 8 * 1024
    chunks = fp32.loss_chunks(tokens)
    compute = 2 * 2.0 * tokens * 896 * 151936 / (gpu.flops_per_second("fp32") * 0.6)
    rate = gpu.memory_bandwidth_gbps * 1e9
    expected = [max(0.0, chunks * 2 * 151936 * 896 * w / rate - compute) for w in (4, 2)]
    assert CE.micro_seconds(values, fp32, gpu, tokens) == pytest.approx(expected[0])
    assert CE.micro_seconds(values, bf16, gpu, tokens) == pytest.approx(expected[1])
    assert expected[1] < expected[0]


def test_the_shape_carries_the_checkpoint_s_dtype() -> None:
    spec = StepSpec(task="causal-lm")
    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    bf16 = transformers.LlamaConfig(**tiny)
    bf16.dtype = "bfloat16"
    assert cost.model_shape(bf16, spec).checkpoint_bytes == 2
    assert cost.model_shape(transformers.LlamaConfig(**tiny), spec).checkpoint_bytes == 4


def test_the_chunks_are_the_step_s_rule() -> None:
    shape = cost.ModelShape(10**9, 10**9, 16, 896, 0, vocab=151936)
    for tokens in (1, 3, 1000, 8192):
        rows = linear_ce.chunk_rows(tokens, 151936, 896)
        assert shape.loss_chunks(tokens) == -(-tokens // rows)
    # one copy of the rule: the lever has none of its own
    assert not hasattr(cross_entropy, "chunk_rows")
