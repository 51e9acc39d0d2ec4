"""The CPU estimate against a real CPU step measured from outside the process (within 5 %).

Each case traces the step on fake tensors (``memfit.estimate.estimate(..., device="cpu")``) and
runs the same step for real in a child process (``memfit.measure.measure_cpu_step``). Compared:
what the step adds on top of the between-steps resident memory (gradients, activations, the
batch, temporaries), i.e. ``total - parameters - buffers - optimizer_state - runtime_overhead``
against ``VmHWM - VmRSS``. The full matrix is ``bench/estimate_cpu_truth.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from estimate_cpu_truth import CUSTOM_CONFIGS

MiB = 2**20
TOLERANCE = 0.05
RESIDENT_KEYS = ("parameters", "buffers", "optimizer_state", "runtime_overhead")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not os.path.exists("/proc/self/clear_refs"),
        reason="the measurement reads /proc/<pid>/clear_refs (Linux)",
    ),
]

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert-l4-h256": (
        "bert",
        dict(
            vocab_size=30522,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=512,
        ),
    ),
    "gpt2-l2-v50257": (
        "gpt2",
        dict(vocab_size=50257, n_embd=128, n_layer=2, n_head=2, n_positions=512),
    ),
    "minilm-l2": (
        "bert",
        dict(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=2,
            num_attention_heads=12,
            intermediate_size=1536,
            max_position_embeddings=512,
        ),
    ),
    # today's families, as the benchmark has them (bench/estimate_cpu_truth.py)
    **{
        name: CUSTOM_CONFIGS[name]
        for name in (
            "llama-mini",
            "llama-mini-bf16",  # dtype bfloat16: --weights-dtype auto holds a LoRA base in bf16
            "qwen2-mini",
            "gemma2-mini",
            "phi3-mini",
            "modernbert-mini",
        )
    },
}

# (config, task, batch, seq, knobs)
CASES = [
    # peak in the optimizer step: gradients + AdamW's per-parameter temporaries
    pytest.param("bert-l4-h256", "classification", 4, 128, {}, id="bert-train"),
    # peak in the backward: fp32 logits over a 50257-token vocabulary and their gradients
    pytest.param("gpt2-l2-v50257", "causal-lm", 4, 64, {}, id="gpt2-vocab50257-train"),
    pytest.param(
        "minilm-l2", "sentence-embedding", 8, 32, {"loss": "mnrl"}, id="minilm-mnrl-train"
    ),
    # SGD keeps the optimizer step small, so the peak is the recomputation in the backward
    pytest.param(
        "bert-l4-h256",
        "classification",
        16,
        128,
        {"gradient_checkpointing": True, "attn_implementation": "eager", "optimizer": "sgd"},
        id="bert-checkpointing-eager-sgd",
    ),
    pytest.param("bert-l4-h256", "classification", 32, 128, {"mode": "eval"}, id="bert-eval"),
    # gradient caching: four mini-batches of 8, traced as two, the other rows added exactly
    pytest.param(
        "minilm-l2",
        "sentence-embedding",
        32,
        128,
        {"loss": "cached-mnrl", "mini_batch_size": 8},
        id="minilm-cached-mnrl-train",
    ),
    # LoRA via peft on the architecture's attention projections (memfit's table, shared by
    # estimate, plan and train): frozen base, no base gradients or optimizer state
    pytest.param("bert-l4-h256", "classification", 8, 128, {"lora_rank": 8}, id="bert-lora"),
    # GPT-2's fused query-key-value and its attention output (memfit's table for gpt2)
    pytest.param("gpt2-l2-v50257", "causal-lm", 4, 64, {"lora_rank": 8}, id="gpt2-lora"),
    # decoder families: the fp32 logits over the vocabulary and their gradients peak the backward
    pytest.param("llama-mini", "causal-lm", 4, 128, {}, id="llama-train"),
    pytest.param("llama-mini", "causal-lm", 8, 128, {"mode": "eval"}, id="llama-eval"),
    pytest.param(
        "qwen2-mini",
        "causal-lm",
        2,
        128,
        {"gradient_checkpointing": True},
        id="qwen2-vocab151936-checkpointing",
    ),
    pytest.param(
        "gemma2-mini",
        "causal-lm",
        4,
        128,
        {"attn_implementation": "eager"},
        id="gemma2-softcapping-train",
    ),
    pytest.param(
        "phi3-mini", "causal-lm", 4, 128, {"gradient_checkpointing": True}, id="phi3-checkpointing"
    ),
    pytest.param("phi3-mini", "causal-lm", 8, 128, {"mode": "eval"}, id="phi3-eval"),
    # the weights' dtype and the loss without logits (bench/estimate_cpu_truth.py --new-knobs
    # has every family): pure bf16 (weights, gradients and AdamW state), the fused-linear loss
    # with fp32 weights, and a LoRA over a bf16 checkpoint (auto: the base held in bf16) with it
    pytest.param(
        "llama-mini",
        "causal-lm",
        4,
        64,
        {"precision": "bf16", "weights_dtype": "bf16"},
        id="llama-pure-bf16",
    ),
    pytest.param(
        "llama-mini", "causal-lm", 4, 64, {"cross_entropy": "fused-linear"}, id="llama-fused"
    ),
    # (8 x 128: at 4 x 64 the step holds 15 MiB and RSS moved by 2.7 % between repeats in a CI run)
    pytest.param(
        "llama-mini-bf16",
        "causal-lm",
        8,
        128,
        {"precision": "bf16", "lora_rank": 8, "cross_entropy": "fused-linear"},
        id="llama-bf16-base-lora-fused",
    ),
    # ModernBERT: local and global attention layers
    pytest.param("modernbert-mini", "classification", 32, 256, {}, id="modernbert-train"),
    pytest.param(
        "modernbert-mini",
        "classification",
        32,
        256,
        {"gradient_checkpointing": True},
        id="modernbert-checkpointing",
    ),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import transformers

    root = tmp_path_factory.mktemp("truth-configs")
    paths = {}
    for name, (model_type, kwargs) in CONFIGS.items():
        path = Path(root) / name
        transformers.AutoConfig.for_model(model_type, **kwargs).save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize(("config", "task", "batch_size", "seq_len", "knobs"), CASES)
def test_cpu_estimate_matches_measured_step(
    model_dirs: dict[str, str],
    config: str,
    task: str,
    batch_size: int,
    seq_len: int,
    knobs: dict[str, Any],
) -> None:
    from memfit.estimate import estimate
    from memfit.measure import measure_cpu_step

    model = model_dirs[config]
    kwargs = dict(knobs, task=task, batch_size=batch_size, seq_len=seq_len)
    est = estimate(model, device="cpu", **kwargs)
    estimated = est.total_bytes - sum(est.breakdown.get(k, 0) for k in RESIDENT_KEYS)
    # one thread: the suite runs one test process per core (memory, not speed, is measured)
    measured = measure_cpu_step(model, repeats=3, threads=1, **kwargs)
    error = (estimated - measured.above_baseline_bytes) / measured.above_baseline_bytes
    summary = (
        f"estimated {estimated / MiB:.2f} MiB, measured {measured.above_baseline_bytes / MiB:.2f} MiB "
        f"(samples {[round(s / MiB, 2) for s in measured.samples]}), error {100 * error:+.2f} %, "
        f"breakdown { {k: round(v / MiB, 2) for k, v in est.breakdown.items()} }, peak in {est.peak_phase}"
    )
    print(summary)
    # the repeats agree well inside the tolerance the estimate is held to (a CI run on a busy
    # machine saw 15.17/15.52/15.36 MiB for a 15 MiB step: RSS moves by pages not the step's)
    assert measured.spread <= TOLERANCE / 2, summary
    assert (
        abs(estimated - measured.above_baseline_bytes) <= TOLERANCE * measured.above_baseline_bytes
    ), summary
