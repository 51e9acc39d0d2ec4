"""Compare memfit's CPU estimate with a real CPU step measured from outside the process.

For each case, ``memfit.estimate.estimate(..., device="cpu")`` predicts the peak; the same step
(``memfit.estimate.workload``) then runs for real in a child process and
``memfit.measure.measure_cpu_step`` reads its peak RSS above the between-steps baseline. The
compared quantity is what a step adds on top of what stays resident (weights, buffers, optimizer
state, runtime)::

    measured  = VmHWM - VmRSS before the step            (median of --repeats steps)
    estimated = total - parameters - buffers - optimizer_state - runtime_overhead
    error %   = (estimated - measured) / measured

The step is memfit's, and Hugging Face Trainer's: the loss is taken from the model's output and
the output itself (for a causal LM, the fp32 logits: batch x tokens x vocab x 4 bytes) is dropped
before backward. A hand-written loop that keeps it referenced through backward (``outputs =
model(**batch); outputs.loss.backward()``, as in the accelerate and transformers ``no_trainer``
examples) holds the logits at the backward peak as well: measured this way a causal LM's step
is one logits buffer larger than its estimate (-21 % for a GPT-2-, -23 % for a Llama-shaped
model), a classifier's is not (its logits are tiny). ``bench/trace_vs_real.py --hold-outputs``
shows it kernel by kernel.

Shapes are chosen so that the step's tensors are mostly >= 64 KiB: smaller ones share glibc's heap
(see ``memfit.measure``), where a step leaves freed chunks scattered between live ones; that
fragmentation is resident memory the estimator does not model (a bf16 MiniLM at batch 2 x 16
tokens measured ~8 MiB, 5 %, over the estimate for that reason; at 2 x 48 tokens, 0.3 %).

Usage::

    PYTHONPATH=src python bench/estimate_cpu_truth.py            # 48 cases (~20 min on 2 idle cores)
    PYTHONPATH=src python bench/estimate_cpu_truth.py --quick    # 4 cases (~2 min)
    PYTHONPATH=src python bench/estimate_cpu_truth.py --out      # + bench/results/estimate_cpu_truth.json
    PYTHONPATH=src python bench/estimate_cpu_truth.py --only gpt2 --list
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from memfit.measure import measure_cpu_step  # noqa: E402

MiB = 2**20
DEFAULT_OUT = ROOT / "bench" / "results" / "estimate_cpu_truth.json"
RESIDENT_KEYS = ("parameters", "buffers", "optimizer_state", "runtime_overhead")

# custom architectures, saved with save_pretrained into a temporary folder ("@name" in a case)
CUSTOM_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # BERT-like: 4 layers, hidden 256 (bert-mini)
    "bert-mini": (
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
    # a BERT with a 120k vocabulary (multilingual-style large embedding)
    "bert-120k": (
        "bert",
        dict(
            vocab_size=120000,
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=512,
        ),
    ),
    # GPT-2-like with GPT-2's 50257-token head (tied embeddings)
    "gpt2-mini": (
        "gpt2",
        dict(vocab_size=50257, n_embd=256, n_layer=4, n_head=4, n_positions=1024),
    ),
    # a narrower GPT-2 with the same 50257-token head, for bf16 (slow on CPU) at small shapes
    "gpt2-tiny": (
        "gpt2",
        dict(vocab_size=50257, n_embd=128, n_layer=2, n_head=2, n_positions=1024),
    ),
    # a narrow GPT-2 with a small vocabulary: bf16 training at shapes whose activations are
    # mmapped (>= 64 KiB) yet cheap enough for the CPU's bf16 reference matmul
    "gpt2-narrow": (
        "gpt2",
        dict(vocab_size=8192, n_embd=64, n_layer=2, n_head=2, n_positions=1024),
    ),
    # MiniLM-like: all-MiniLM-L6-v2's width, 3 layers
    "minilm-l3": (
        "bert",
        dict(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=3,
            num_attention_heads=12,
            intermediate_size=1536,
            max_position_embeddings=512,
        ),
    ),
    # Llama-like: grouped-query attention (4 heads, 2 key-value heads), RoPE, SwiGLU, RMSNorm,
    # an untied 32000-token head (Llama 2's vocabulary)
    "llama-mini": (
        "llama",
        dict(
            vocab_size=32000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen2-like: Qwen2.5's 151936-token head, tied to the embeddings (as in Qwen2.5-0.5B), biased
    # query-key-value projections, grouped-query attention
    "qwen2-mini": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma2-like: sliding-window and global layers alternate (window 64 < the 128 tokens of the
    # cases), soft-capped attention scores and final logits, head_dim 64, tied head
    "gemma2-mini": (
        "gemma2",
        dict(
            vocab_size=32768,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=1024,
        ),
    ),
    # Phi3-like: fused query-key-value (qkv_proj) and gate-up (gate_up_proj) projections, Phi-3's
    # 32064-token untied head
    "phi3-mini": (
        "phi3",
        dict(
            vocab_size=32064,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            pad_token_id=32000,
            bos_token_id=1,
            eos_token_id=32000,
        ),
    ),
    # ModernBERT-like: a global layer every third, local attention (window 64) between, GeGLU,
    # unpadded attention, ModernBERT's 50368-token vocabulary
    "modernbert-mini": (
        "modernbert",
        dict(
            vocab_size=50368,
            hidden_size=256,
            intermediate_size=384,
            num_hidden_layers=3,
            num_attention_heads=4,
            global_attn_every_n_layers=3,
            local_attention=64,
            max_position_embeddings=1024,
            pad_token_id=50283,
            bos_token_id=50281,
            eos_token_id=50282,
            cls_token_id=50281,
            sep_token_id=50282,
        ),
    ),
}

# the decoder families as today's checkpoints ship them: config.dtype bfloat16, which
# --weights-dtype auto (the default) holds a frozen base in ("@llama-mini-bf16", ...)
DECODERS = ("llama-mini", "qwen2-mini", "gemma2-mini", "phi3-mini")
for _name in DECODERS:
    _type, _kwargs = CUSTOM_CONFIGS[_name]
    CUSTOM_CONFIGS[f"{_name}-bf16"] = (_type, {**_kwargs, "dtype": "bfloat16"})

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class Case:
    model: str  # registry name, or "@name" for a CUSTOM_CONFIGS entry
    task: str
    batch_size: int
    seq_len: int
    # every knob goes as it is to ``estimate(..., device="cpu")`` and to the measured step
    # (``measure_cpu_step``): precision, optimizer, lora_rank, quantization, double_quant, ...
    knobs: dict[str, Any] = field(default_factory=dict)
    # modules the case needs (e.g. "bitsandbytes"): without one, the case is skipped, not failed
    requires: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.model[1:] if self.model.startswith("@") else self.model.split("/")[-1]

    @property
    def knob_text(self) -> str:
        k = self.knobs
        parts = [
            k.get("mode", "train"),
            k.get("precision", "fp32"),
            k.get("attn_implementation", "sdpa"),
        ]
        if k.get("mode", "train") == "train":
            parts.append(k.get("optimizer", "adamw"))
        if k.get("gradient_checkpointing"):
            parts.append("gc")
        if k.get("lora_rank"):
            parts.append(f"lora{k['lora_rank']}")
        if k.get("quantization", "none") != "none":
            parts.append(k["quantization"] + ("+dq" if k.get("double_quant") else ""))
        if k.get("loss"):
            parts.append(k["loss"])
        if k.get("weights_dtype", "auto") != "auto":
            parts.append("weights-" + k["weights_dtype"])
        if k.get("cross_entropy", "standard") != "standard":
            parts.append(k["cross_entropy"])
        return ",".join(parts)

    def missing(self) -> list[str]:
        """The modules of ``requires`` that cannot be imported here."""
        import importlib.util

        return [name for name in self.requires if importlib.util.find_spec(name) is None]


def C(
    model: str, task: str, batch: int, seq: int, requires: tuple[str, ...] = (), **knobs: Any
) -> Case:
    return Case(model, task, batch, seq, knobs, requires)


CLS, LM, EMB = "classification", "causal-lm", "sentence-embedding"


def _new_knob_cases(
    family: str, lm_batch: int, seq: int, fused_lora: tuple[int, int] | None = None
) -> list[Case]:
    """The weights' dtype and the fused-linear cross-entropy on one decoder family: a LoRA over a
    bf16 checkpoint (its frozen base held in bf16 by ``auto``), pure bf16 full fine-tuning, the
    fused-linear loss over fp32 weights and over a bf16 base, and QLoRA over a bf16 checkpoint
    (its unquantized embeddings and head in bf16). bf16 matmuls run on the CPU's slow reference
    kernel: small shapes, whose activations still pass glibc's 64 KiB mmap threshold.
    ``fused_lora``: the (batch, tokens) of the fused-linear LoRA case where those differ (its
    step holds no logits: its hidden states must pass the threshold themselves)."""
    bf16 = f"@{family}-bf16"
    fused_batch, fused_seq = fused_lora or (lm_batch, seq)
    return [
        C(bf16, LM, lm_batch, seq, precision="bf16", lora_rank=8),
        C(f"@{family}", LM, lm_batch, seq, precision="bf16", weights_dtype="bf16"),
        C(f"@{family}", LM, lm_batch, seq, cross_entropy="fused-linear"),
        C(
            bf16,
            LM,
            fused_batch,
            fused_seq,
            precision="bf16",
            lora_rank=8,
            cross_entropy="fused-linear",
        ),
        C(
            bf16,
            LM,
            lm_batch,
            seq,
            precision="bf16",
            lora_rank=8,
            quantization="nf4",
            requires=("bitsandbytes",),
        ),
    ]


# --weights-dtype and --cross-entropy on every decoder family (--new-knobs runs only these)
NEW_KNOBS: list[Case] = [
    *_new_knob_cases("llama-mini", 4, 64),
    # the fused-linear LoRA step holds no logits: at 2 x 64 tokens it is 3 MiB of tensors under
    # 64 KiB (32 KiB hidden states) and glibc's heap kept 0.6 MiB more resident (-16 %); at
    # 4 x 128, 8.5 MiB, RSS was 0.24 MiB above it (-2.8 %): the CPU's bf16 matmuls (oneDNN's
    # reference kernel) take 120-140 KiB of scratch each outside torch's tensors. The trace's
    # allocations equal the real step's one for one at both shapes (bench/trace_vs_real.py's
    # method): the case is sized so that this fixed scratch is a small part of it
    *_new_knob_cases("qwen2-mini", 2, 64, fused_lora=(8, 128)),
    # Gemma 2: 128 tokens, past its 64-token sliding window
    *_new_knob_cases("gemma2-mini", 2, 128),
    *_new_knob_cases("phi3-mini", 4, 64),
]

# fmt: off
MATRIX: list[Case] = [
    # real registry architectures at moderate shapes (random weights, nothing downloaded). Eval
    # cases keep >= ~32 MiB above the baseline: the RSS peak reads up to a few hundred KiB low.
    C("bert-base-uncased", CLS, 2, 64),  # peak in the optimizer step
    C("bert-base-uncased", CLS, 8, 128, mode="eval"),
    C("bert-base-uncased", CLS, 2, 64, gradient_checkpointing=True, attn_implementation="eager", optimizer="sgd"),
    C("gpt2", LM, 2, 64),  # GPT-2's 50257-token head
    C("gpt2", LM, 1, 128, gradient_checkpointing=True),
    C(MINILM, EMB, 4, 128),  # activations dominate
    C(MINILM, EMB, 32, 64, mode="eval"),
    # custom BERT-like
    C("@bert-mini", CLS, 16, 128),
    C("@bert-mini", CLS, 16, 128, attn_implementation="eager"),
    C("@bert-mini", CLS, 16, 128, gradient_checkpointing=True),
    C("@bert-mini", CLS, 32, 128, mode="eval", attn_implementation="eager"),
    # bf16 matmuls run on a slow reference kernel on CPUs without AVX512-BF16: small shapes only,
    # but not so small that activations drop under glibc's 64 KiB mmap threshold (see the top)
    C("@bert-mini", CLS, 4, 32, precision="bf16"),
    C("@bert-120k", CLS, 8, 128),  # large-vocabulary embedding
    C("@bert-120k", EMB, 8, 64),
    # custom GPT-2-like
    C("@gpt2-mini", LM, 4, 128),
    C("@gpt2-mini", LM, 4, 128, attn_implementation="eager", optimizer="sgd"),
    C("@gpt2-mini", LM, 4, 128, gradient_checkpointing=True),
    C("@gpt2-mini", LM, 8, 128, mode="eval"),
    C("@gpt2-mini", CLS, 8, 128),
    C("@gpt2-mini", LM, 4, 128, optimizer="adafactor"),
    C("@gpt2-narrow", LM, 4, 128, precision="bf16"),
    C("@gpt2-tiny", LM, 4, 64, precision="bf16", mode="eval"),
    # custom MiniLM-like sentence embedding, every loss
    C("@minilm-l3", EMB, 16, 64),
    C("@minilm-l3", EMB, 16, 64, loss="cosent", attn_implementation="eager"),
    C("@minilm-l3", EMB, 8, 64, loss="cosine", gradient_checkpointing=True),
    C("@minilm-l3", EMB, 16, 64, loss="softmax", optimizer="sgd"),
    C("@minilm-l3", EMB, 2, 48, precision="bf16"),
    # decoder families (Llama, Qwen2, Gemma2, Phi3) as causal LMs, train and eval, with and
    # without checkpointing; the head's fp32 logits (batch x tokens x vocab) and their gradients
    # are the largest tensors of these steps
    C("@llama-mini", LM, 4, 128),
    C("@llama-mini", LM, 8, 128, mode="eval"),
    C("@llama-mini", LM, 4, 128, gradient_checkpointing=True),
    C("@llama-mini", LM, 4, 128, attn_implementation="eager", optimizer="sgd"),
    C("@llama-mini", LM, 4, 128, lora_rank=8),
    C("@llama-mini", CLS, 8, 128),  # a decoder as a classifier (last-token head)
    C("@llama-mini", EMB, 8, 128),  # and as a sentence embedder (mean pooling)
    C("@qwen2-mini", LM, 2, 128),  # a 151936-token tied head
    C("@qwen2-mini", LM, 4, 128, mode="eval"),
    C("@qwen2-mini", LM, 2, 128, gradient_checkpointing=True),
    C("@gemma2-mini", LM, 4, 128, attn_implementation="eager"),  # soft-capped scores and logits
    C("@gemma2-mini", LM, 4, 128),
    C("@gemma2-mini", LM, 8, 128, mode="eval", attn_implementation="eager"),
    C("@gemma2-mini", LM, 4, 128, gradient_checkpointing=True, attn_implementation="eager"),
    C("@phi3-mini", LM, 4, 128),
    C("@phi3-mini", LM, 8, 128, mode="eval"),
    C("@phi3-mini", LM, 4, 128, gradient_checkpointing=True),
    # ModernBERT-like encoder: alternating local and global attention
    C("@modernbert-mini", CLS, 32, 256),
    C("@modernbert-mini", CLS, 32, 128, mode="eval"),
    C("@modernbert-mini", CLS, 32, 256, gradient_checkpointing=True),
    C("@modernbert-mini", EMB, 16, 64),
    # quantized base weights (QLoRA) and 8-bit optimizers: the measured step runs bitsandbytes'
    # own layers and optimizers (they run on the CPU), the estimate models them
    C("@llama-mini", LM, 4, 128, lora_rank=8, quantization="nf4", requires=("bitsandbytes",)),
    C("@llama-mini", LM, 4, 128, lora_rank=8, quantization="nf4", double_quant=True,
      gradient_checkpointing=True, requires=("bitsandbytes",)),
    C("@llama-mini", LM, 4, 128, lora_rank=8, quantization="int8", requires=("bitsandbytes",)),
    C("@llama-mini", LM, 4, 128, optimizer="adamw-8bit", requires=("bitsandbytes",)),
    C("@llama-mini", LM, 4, 128, lora_rank=8, quantization="nf4", optimizer="paged-adamw-8bit",
      requires=("bitsandbytes",)),
    *NEW_KNOBS,
]
# fmt: on

QUICK: list[Case] = [
    C("@bert-mini", CLS, 16, 128),
    C("@gpt2-mini", LM, 4, 128, gradient_checkpointing=True),
    C("@minilm-l3", EMB, 32, 64, mode="eval"),
    C("@llama-mini", LM, 4, 128),
]


def write_custom_configs(folder: Path, names: set[str]) -> dict[str, str]:
    import transformers

    paths: dict[str, str] = {}
    for name in sorted(names):
        model_type, kwargs = CUSTOM_CONFIGS[name]
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        path = folder / name
        config.save_pretrained(path)
        paths[name] = str(path)
    return paths


def estimated_above_resident(estimate: Any) -> int:
    return int(estimate.total_bytes) - sum(int(estimate.breakdown.get(k, 0)) for k in RESIDENT_KEYS)


def case_row(case: Case) -> dict[str, Any]:
    """What a row says about its case, whatever happened to it."""
    return {
        "model": case.model,
        "label": case.label,
        "task": case.task,
        "knobs": case.knobs,
        "knob_text": case.knob_text,
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
    }


def run_case(case: Case, model_path: str, repeats: int, threads: int | None) -> dict[str, Any]:
    row = case_row(case)
    if missing := case.missing():
        row["skipped"] = f"needs {', '.join(missing)}"
        return row
    kwargs = dict(case.knobs, task=case.task, batch_size=case.batch_size, seq_len=case.seq_len)
    started = time.perf_counter()
    try:
        from memfit.estimate import estimate

        est = estimate(model_path, device="cpu", **kwargs)
        row["estimated_bytes"] = estimated_above_resident(est)
        row["estimate_total_bytes"] = int(est.total_bytes)
        row["estimate_breakdown"] = {k: int(v) for k, v in est.breakdown.items()}
        row["estimate_peak_phase"] = est.peak_phase
    except Exception as exc:
        row["estimate_error"] = f"{type(exc).__name__}: {exc}"
    row["estimate_seconds"] = round(time.perf_counter() - started, 2)
    started = time.perf_counter()
    try:
        m = measure_cpu_step(model_path, repeats=repeats, threads=threads, **kwargs)
        row["measured_bytes"] = m.above_baseline_bytes
        row["measured_samples"] = m.samples
        row["measured_spread"] = m.spread
        row["baseline_rss_bytes"] = m.baseline_rss_bytes
        row["max_residual_bytes"] = m.max_residual_bytes
        row["step_seconds"] = round(m.step_seconds, 3)
        row["threads"] = m.threads
    except Exception as exc:
        row["measure_error"] = f"{type(exc).__name__}: {exc}"
    row["measure_seconds"] = round(time.perf_counter() - started, 2)
    if "estimated_bytes" in row and row.get("measured_bytes"):
        row["error_pct"] = (
            100.0 * (row["estimated_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
        )
    return row


HEADER = (
    f"{'model':<18} {'task':<18} {'knobs':<34} {'batch':>5} {'seq':>4} "
    f"{'measured MiB':>12} {'estimated MiB':>13} {'error %':>8} {'spread %':>8} {'est s':>6} {'meas s':>6}"
)


def format_row(row: dict[str, Any]) -> str:
    def mib(key: str) -> str:
        return f"{row[key] / MiB:.1f}" if key in row else "-"

    error = f"{row['error_pct']:+.2f}" if "error_pct" in row else "-"
    spread = f"{100 * row['measured_spread']:.2f}" if "measured_spread" in row else "-"
    line = (
        f"{row['label']:<18} {row['task']:<18} {row['knob_text']:<34} {row['batch_size']:>5} "
        f"{row['seq_len']:>4} {mib('measured_bytes'):>12} {mib('estimated_bytes'):>13} {error:>8} "
        f"{spread:>8} {row.get('estimate_seconds', 0):>6.1f} {row.get('measure_seconds', 0):>6.1f}"
    )
    if "skipped" in row:
        line += f"\n    skipped: {row['skipped']}"
    for key in ("estimate_error", "measure_error"):
        if key in row:
            first = row[key].strip().splitlines()
            line += f"\n    {key}: {first[0] if first else ''}"
            if key == "measure_error" and len(first) > 1:
                line += f" ... {first[-1]}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4-case subset (~2 minutes)")
    parser.add_argument(
        "--new-knobs",
        action="store_true",
        help="only the --weights-dtype and --cross-entropy cases (bf16 weights, pure bf16, "
        "fused-linear, with LoRA and QLoRA, on every decoder family)",
    )
    parser.add_argument(
        "--only", default=None, help="run only cases whose model or task contains this text"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per case (median)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads of the measured step"
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument(
        "--out",
        nargs="?",
        const=str(DEFAULT_OUT),
        default=None,
        help=f"write the rows as JSON (default path: {DEFAULT_OUT.relative_to(ROOT)})",
    )
    args = parser.parse_args(argv)
    raw_args = sys.argv[1:] if argv is None else argv
    command = "PYTHONPATH=src python bench/estimate_cpu_truth.py" + "".join(
        " " + shlex.quote(a) for a in raw_args
    )

    cases = QUICK if args.quick else NEW_KNOBS if args.new_knobs else MATRIX
    if args.only:
        cases = [
            c
            for c in cases
            if args.only in c.model or args.only in c.task or args.only in c.knob_text
        ]
    print(f"reproduce: {command}")
    if args.list:
        for case in cases:
            print(
                f"  {case.label:<18} {case.task:<18} {case.knob_text:<34} b={case.batch_size} s={case.seq_len}"
            )
        return 0

    import torch
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {len(cases)} cases, repeats {args.repeats}"
    )
    print(
        "measured = peak RSS above the between-steps RSS; estimated = total - parameters - buffers - "
        "optimizer_state - runtime_overhead; error = (estimated - measured) / measured"
    )
    print(HEADER)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memfit-truth-") as tmp:
        customs = write_custom_configs(
            Path(tmp), {c.model[1:] for c in cases if c.model.startswith("@")}
        )
        for case in cases:
            path = customs[case.model[1:]] if case.model.startswith("@") else case.model
            try:
                row = run_case(case, path, args.repeats, args.threads)
            except Exception:  # a bug in this script: show it, keep going
                row = case_row(case) | {"measure_error": traceback.format_exc()}
            rows.append(row)
            print(format_row(row), flush=True)
    elapsed = time.perf_counter() - started

    errors = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
    spreads = [100 * r["measured_spread"] for r in rows if "measured_spread" in r]
    skipped = [r for r in rows if "skipped" in r]
    failed = [r for r in rows if "error_pct" not in r and "skipped" not in r]
    summary: dict[str, Any] = {
        "cases": len(rows),
        "compared": len(errors),
        "failed": len(failed),
        "skipped": len(skipped),
        "median_abs_error_pct": statistics.median(errors) if errors else None,
        "max_abs_error_pct": max(errors) if errors else None,
        "max_spread_pct": max(spreads) if spreads else None,
        "seconds": round(elapsed, 1),
    }
    print()
    if errors:
        print(
            f"|error| median {summary['median_abs_error_pct']:.2f} %, max {summary['max_abs_error_pct']:.2f} % "
            f"over {len(errors)} cases; repeat spread max {summary['max_spread_pct']:.3f} %; "
            f"{len(failed)} failed, {len(skipped)} skipped; {elapsed:.0f} s"
        )
    else:
        print(f"no case compared ({len(failed)} failed, {len(skipped)} skipped); {elapsed:.0f} s")
    print(f"reproduce: {command}")

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": command,
            "environment": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "kernel": platform.release(),
            },
            "summary": summary,
            "rows": rows,
        }
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
