"""Whether two checkouts trace the same steps, field for field: for speed-ups of the tracer, which
must leave every trace as it was.

    PYTHONPATH=/tmp/memfit-before/src python bench/trace_identity.py dump /tmp/before.pkl [FILTER]
    python bench/trace_identity.py dump /tmp/after.pkl [FILTER]
    python bench/trace_identity.py compare /tmp/before.pkl /tmp/after.pkl   # exit 1 if any differs

`dump` traces a matrix of jobs as `memfit estimate` does (`traces.trace_model` on the grid of
shapes, the depth extrapolation included; the tiny Llama and gpt2 also on the batch-1,
odd-length grid), in this process's checkout, and pickles every StepTrace (size formulas by
name and arguments) with trace_model's details; FILTER keeps the jobs whose name contains it.
The matrix: bert, gpt2, a tiny Llama and Llama-3.1-8B; fp32, fp16, bf16; CUDA (sm80, sm75) and
the CPU; checkpointing, eager attention, eval, LoRA, QLoRA nf4, activation offloading, the
fused-linear loss. About a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import sys
import time
from typing import Any

os.environ.setdefault("MEMFIT_NO_CACHE", "1")

import transformers

from memfit.estimate import traces
from memfit.estimate.fit import grid_shapes
from memfit.estimate.workload import StepSpec
from memfit.models import resolve_model


def tiny_llama() -> Any:
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


CASES = [
    ("bert-fp32-t4", "bert-base-uncased", dict(task="classification", sdpa_sm=75)),
    (
        "bert-fp16-t4",
        "bert-base-uncased",
        dict(task="classification", precision="fp16", sdpa_sm=75),
    ),
    (
        "bert-bf16-ckpt",
        "bert-base-uncased",
        dict(task="classification", precision="bf16", gradient_checkpointing=True),
    ),
    ("bert-cpu", "bert-base-uncased", dict(task="classification", device="cpu")),
    (
        "bert-eager",
        "bert-base-uncased",
        dict(task="classification", precision="fp16", attn_implementation="eager"),
    ),
    (
        "gpt2-bf16-ckpt",
        "gpt2",
        dict(task="causal-lm", precision="bf16", gradient_checkpointing=True),
    ),
    ("gpt2-fp16-t4", "gpt2", dict(task="causal-lm", precision="fp16", sdpa_sm=75)),
    ("gpt2-eval", "gpt2", dict(task="causal-lm", precision="bf16", mode="eval")),
    ("tiny-llama-bf16", "TINY", dict(task="causal-lm", precision="bf16")),
    ("tiny-llama-cpu-fp32", "TINY", dict(task="causal-lm", device="cpu")),
    (
        "tiny-llama-fp16-ckpt-sm75",
        "TINY",
        dict(task="causal-lm", precision="fp16", gradient_checkpointing=True, sdpa_sm=75),
    ),
    (
        "tiny-llama-eager-lora",
        "TINY",
        dict(task="causal-lm", precision="bf16", attn_implementation="eager", lora_rank=8),
    ),
    (
        "tiny-llama-qlora",
        "TINY",
        dict(
            task="causal-lm", precision="bf16", lora_rank=8, quantization="nf4", double_quant=True
        ),
    ),
    (
        "tiny-llama-offload",
        "TINY",
        dict(
            task="causal-lm",
            precision="bf16",
            gradient_checkpointing=True,
            activation_offloading=True,
        ),
    ),
    (
        "tiny-llama-fused",
        "TINY",
        dict(task="causal-lm", precision="bf16", cross_entropy="fused-linear"),
    ),
    (
        "llama8b-lora16",
        "meta-llama/Llama-3.1-8B",
        dict(task="causal-lm", precision="bf16", gradient_checkpointing=True, lora_rank=16),
    ),
    (
        "llama8b-qlora-t4",
        "meta-llama/Llama-3.1-8B",
        dict(
            task="causal-lm",
            precision="fp16",
            gradient_checkpointing=True,
            lora_rank=16,
            quantization="nf4",
            sdpa_sm=75,
        ),
    ),
]


def plain(x: Any) -> Any:
    """Functions (size formulas) by name and arguments: partials compare by identity."""
    if isinstance(x, functools.partial):
        return ("partial", plain(x.func), plain(x.args), plain(x.keywords))
    if callable(x) and hasattr(x, "__qualname__"):
        return ("fn", x.__module__, x.__qualname__)
    if isinstance(x, dict):
        return {plain(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    return x


def dump(path: str, filt: str) -> None:
    """Trace every job of the matrix whose name contains ``filt``; pickle the traces to ``path``."""
    out = {}
    for name, model, kw in CASES:
        if filt and filt not in name:
            continue
        config = tiny_llama() if model == "TINY" else resolve_model(model).config
        spec = StepSpec(**kw)
        check, grid, second = grid_shapes(
            min(getattr(config, "max_position_embeddings", 512) or 512, 2048)
        )
        shapes = [check, *grid, second]
        start = time.perf_counter()
        try:
            trace, info = traces.trace_model(config, spec, shapes)
            res = (plain(dataclasses.asdict(trace)), info)
        except Exception as exc:  # a job that fails must fail the same way in both
            res = ("error", repr(exc))
        print(f"{name}: {time.perf_counter() - start:.2f}s", flush=True)
        out[name] = res
        # one odd-length, batch-1 trace of the whole thing too
        if model == "TINY" or model == "gpt2":
            check, grid, second = grid_shapes(512, batch_size=1, aligned=False)
            trace, info = traces.trace_model(config, spec, [check, *grid, second])
            out[name + "/b1odd"] = (plain(dataclasses.asdict(trace)), info)
    with open(path, "wb") as f:
        pickle.dump(out, f)


def compare(a: str, b: str) -> int:
    """Print which jobs' traces differ between two dumps (and which fields); how many differ."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        A, B = pickle.load(fa), pickle.load(fb)
    bad = 0
    for name in A:
        if name not in B:
            print("missing", name)
            bad += 1
            continue
        ta, tb = A[name], B[name]
        if ta == tb:
            print("same   ", name)
            continue
        bad += 1
        if isinstance(ta[0], dict) and isinstance(tb[0], dict):
            diff = [k for k in ta[0] if ta[0][k] != tb[0].get(k)]
            print("DIFF   ", name, diff, ta[1] != tb[1])
        else:
            print(
                "DIFF   ",
                name,
                ta[0] if not isinstance(ta[0], dict) else "",
                tb[0] if not isinstance(tb[0], dict) else "",
            )
    print("all same" if not bad else f"{bad} differ", f"({len(A)} traces)")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
