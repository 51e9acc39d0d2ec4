"""The trace allocates what a real CPU step allocates, kernel by kernel.

The estimator's recorder (a dispatch mode with weakref finalizers on storages) runs here on real
tensors too (``bench/trace_vs_real.py``): a real steady-state CPU step of
``memfit.estimate.workload`` and memfit's fake-tensor trace of it must allocate and free the same
storages in the same order, so their peaks of live bytes above the resident state are equal.

A causal LM's largest tensors are its fp32 logits (batch × tokens × vocab) and their gradients.
The step memfit models (its own training loop, and Hugging Face Trainer's) takes the loss and
drops the model's output before backward; a loop that keeps ``outputs`` referenced through
backward holds the logits at the backward peak too: exactly one logits-sized allocation more.
"""

from __future__ import annotations

from typing import Any

import pytest

from memfit import job
from memfit.estimate.device import cpu_allocation_bytes
from memfit.estimate.workload import StepSpec
from trace_vs_real import StepRecord, differences, real_step, traced_step

_DECODER = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_config(family: str) -> Any:
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**_DECODER, tie_word_embeddings=False)
    if family == "qwen2":  # tied head, biased query-key-value
        return t.Qwen2Config(**_DECODER, tie_word_embeddings=True)
    if family == "gemma2":  # alternating sliding/global layers, soft-capped scores and logits
        return t.Gemma2Config(
            **_DECODER,
            head_dim=16,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return t.Phi3Config(**_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gpt2":
        return t.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    if family == "modernbert":
        return t.ModernBertConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=256,
            global_attn_every_n_layers=3,
            local_attention=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        )
    raise AssertionError(family)


def spec_of(task: str, **knobs: Any) -> StepSpec:
    return StepSpec(task=task, device="cpu", loss=job.DEFAULT_LOSS[task], **knobs)


def _summary(real: StepRecord, traced: StepRecord) -> str:
    diff = differences(real, traced)
    return f"real peak {real.peak_bytes} B, trace peak {traced.peak_bytes} B\n" + "\n".join(
        diff[:40]
    )


@pytest.mark.parametrize(
    ("family", "task", "knobs"),
    [
        pytest.param("llama", "causal-lm", {}, id="llama-train"),
        pytest.param("llama", "causal-lm", {"mode": "eval"}, id="llama-eval"),
        # peft's LoRA: nn.Dropout on each adapted layer's input (a dropped copy and its mask kept
        # for backward) at the default 0.1, nn.Identity (nothing kept) at --lora-dropout 0
        pytest.param("llama", "causal-lm", {"lora_rank": 4}, id="llama-lora"),
        pytest.param(
            "llama", "causal-lm", {"lora_rank": 4, "lora_dropout": 0.0}, id="llama-lora-no-dropout"
        ),
        pytest.param(
            "llama",
            "causal-lm",
            {"gradient_checkpointing": True},
            id="llama-gc",
            marks=pytest.mark.slow,
        ),
        pytest.param("qwen2", "causal-lm", {}, id="qwen2-train", marks=pytest.mark.slow),
        pytest.param(
            "gemma2",
            "causal-lm",
            {"attn_implementation": "eager"},
            id="gemma2-train",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "phi3", "causal-lm", {"optimizer": "sgd"}, id="phi3-train-sgd", marks=pytest.mark.slow
        ),
        pytest.param("gpt2", "causal-lm", {}, id="gpt2-train"),
        pytest.param("modernbert", "classification", {}, id="modernbert-classifier"),
    ],
)
def test_trace_allocates_what_the_real_step_allocates(
    family: str, task: str, knobs: dict[str, Any]
) -> None:
    config, spec = tiny_config(family), spec_of(task, **knobs)
    real = real_step(config, spec, 2, 32)
    traced = traced_step(config, spec, 2, 32)
    summary = _summary(real, traced)
    assert differences(real, traced) == [], summary
    assert real.peak_bytes == traced.peak_bytes, summary


def test_a_loop_holding_outputs_through_backward_holds_one_logits_buffer_more() -> None:
    batch_size, seq_len = 2, 32
    config, spec = tiny_config("llama"), spec_of("causal-lm")
    logits_bytes = batch_size * seq_len * config.vocab_size * 4  # fp32
    held = real_step(config, spec, batch_size, seq_len, hold_outputs=True)
    traced = traced_step(config, spec, batch_size, seq_len)
    summary = _summary(held, traced)
    assert held.peak_bytes - traced.peak_bytes == cpu_allocation_bytes(logits_bytes), summary
    # the only difference: the logits (the head's matmul output) are freed after the backward
    changed = [line for line in differences(held, traced, context=0) if line[:1] in "+-"]
    assert changed == [
        "--- trace",
        "+++ real",
        f"-free mm.default {logits_bytes}",
        f"+free mm.default {logits_bytes}",
    ], summary
