"""Every registry model's estimate under many lever combinations, and a sample of plans, recorded
once and held against another checkout: a refactor of the levers must not move a byte.

    python bench/lever_equality.py record OUT.json                 # this checkout's answers
    python bench/lever_equality.py compare BASE.json               # re-run here, hold against BASE
    python bench/lever_equality.py compare BASE.json NEW.json      # two recordings, no re-run
    python bench/lever_equality.py record OUT.json --models gpt2,bert-base-uncased --no-plans

Run it with the checkout to test on the path, e.g. for the baseline of commit 44b5bc3::

    PYTHONPATH=/tmp/wt_base/src python bench/lever_equality.py record \\
        bench/results/lever_equality_44b5bc3.json

Estimates (``memfit.estimate(model, **knobs)``, the public keyword API): every model of the
embedded registry at its own task (causal-lm for decoders, sentence-embedding for the
sentence-transformers, BGE and E5 checkpoints, classification for the other encoders), at least 20
combinations each: shapes, accumulation, truncation, every sharding scheme on several ranks, GPU
budgets, precision with checkpointing, the attention kernels, LoRA, and a rotating share of the
rest (optimizer swaps, quantization with and without double quantization, eval mode, the CPU,
other losses and label counts), plus combinations the API refuses, whose message is recorded.
Each case holds the total, every part of the breakdown, the peak's phase, the budget verdict, the
numeric details (timings left out) and the step spec the estimate reports.

Plans (``memfit.plan(model, **knobs)``): a sample of models × budgets × one GPU and several, a few
``allow`` sets and the example of issue 31 (Llama-3.1-8B on an RTX 3060 with lora,quantization);
each holds the ``--json`` object, the re-check command, the printed table and lines, and the exit
the CLI would give (0 fits, 3 nothing fits, 2 refused).

Each run traces into a new, empty MEMFIT_CACHE_DIR (made here, whatever the environment says), so
a changed cache key cannot hide a difference behind an old trace. The cases run in one fixed
order: the estimator fits its shapes from the first ones it traces, so the order is part of the
case list. ``compare`` prints every difference (case, field, before, after), a count by field, and
the command that reproduces it; it exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# what only says how long something took: never compared
TIMING_KEYS = ("trace_seconds", "estimate_seconds")
# the shape most cases start from (every registry model embeds at least 512 positions)
BASE = {"batch_size": 4, "seq_len": 256}
DECODER_TYPES = ("gpt2", "llama", "qwen2", "mistral", "gemma2", "phi3")
EMBEDDING_PREFIXES = ("sentence-transformers/", "BAAI/", "intfloat/")


def task_of(name: str, model_type: str) -> str:
    """The task a model is recorded at: the one its checkpoint is made for."""
    if name.startswith(EMBEDDING_PREFIXES):
        return "sentence-embedding"
    return "causal-lm" if model_type in DECODER_TYPES else "classification"


def _pool(task: str) -> list[dict[str, Any]]:
    """The rotating levers: each model takes three of them (a new trace each)."""
    pool: list[dict[str, Any]] = [
        {"precision": "bf16", "attn_implementation": "flash_attention_2"},
        {"precision": "bf16", "optimizer": "adamw-8bit"},
        {"precision": "bf16", "optimizer": "paged-adamw-8bit"},
        {"precision": "bf16", "optimizer": "paged-adamw-32bit"},
        {"optimizer": "adafactor"},
        {"precision": "bf16", "mode": "eval"},
        {"device": "cpu"},
        {"device": "cpu", "lora_rank": 8},
        {"precision": "bf16", "lora_rank": 8, "quantization": "int8"},
        {"precision": "bf16", "lora_rank": 8, "quantization": "nf4"},
        {"precision": "fp16", "lora_rank": 4, "quantization": "fp4", "double_quant": True},
        {"precision": "bf16", "lora_rank": 8, "lora_target_modules": ["all-linear"]},
        {"optimizer": "sgd", "gradient_checkpointing": True},
    ]
    if task == "classification":
        pool.append({"num_labels": 5})
    if task == "sentence-embedding":
        pool += [{"loss": "cosent"}, {"loss": "softmax", "num_labels": 3}, {"loss": "cosine"}]
    return pool


def estimate_cases(index: int, task: str) -> list[dict[str, Any]]:
    """The knob sets of model number ``index`` (without ``model``), in the order they run."""
    b = {"task": task, **BASE}
    fp32 = dict(b)
    ckpt = {**b, "precision": "bf16", "gradient_checkpointing": True}
    cases: list[dict[str, Any]] = [
        # full fine-tuning in fp32: the shapes, accumulation, truncation, the schemes
        fp32,
        {**fp32, "batch_size": 1, "seq_len": 128},
        {**fp32, "batch_size": 8, "seq_len": 512},
        {**fp32, "batch_size": 2, "gradient_accumulation_steps": 4},
        {**fp32, "seq_len": 512, "max_seq_len": 128},
        {**fp32, "world_size": 2},
        *({**fp32, "world_size": 4, "sharding": s} for s in ("zero1", "zero2", "zero3", "fsdp")),
        {**fp32, "sharding": "zero2"},  # one rank: the note, the buffers
        {**fp32, "gpu": "a100-80gb"},
        {**fp32, "gpu_memory": "1GiB"},
        # bf16 with checkpointing, alone and with the rest
        ckpt,
        {**ckpt, "batch_size": 8, "seq_len": 512, "world_size": 8, "sharding": "zero3"},
        {**ckpt, "gradient_accumulation_steps": 2, "gpu": "a100-40gb"},
        {**b, "precision": "fp16", "attn_implementation": "eager"},
        {**b, "precision": "bf16", "lora_rank": 8},
        {**b, "precision": "bf16", "lora_rank": 8, "world_size": 2, "gpu": "rtx3060"},
    ]
    if task == "causal-lm":
        qlora = {**b, "precision": "bf16", "lora_rank": 16, "quantization": "nf4"}
        cases += [{**qlora, "double_quant": True}, {**qlora, "double_quant": True, "seq_len": 512}]
    if task == "sentence-embedding":
        cached = {**b, "batch_size": 32, "seq_len": 128, "loss": "cached-mnrl"}
        cases += [
            {**cached, "mini_batch_size": 8},
            {**cached, "batch_size": 64, "mini_batch_size": 8},  # the same trace, more rows
            {**cached, "batch_size": 8, "mini_batch_size": 8},  # one mini-batch: the whole batch
        ]
    pool = _pool(task)
    for k in range(3):
        lever = pool[(3 * index + k) % len(pool)]
        cases.append({**b, **lever})
        if k == 0:
            cases.append({**b, **lever, "batch_size": 2, "seq_len": 512})
    # combinations the API may refuse (then its message is the answer)
    cases += [
        {**b, "device": "cpu", "attn_implementation": "flash_attention_2"},
        {**b, "precision": "bf16", "gpu": "t4"},
        {**b, "quantization": "nf4", "double_quant": True},  # a quantized base without LoRA
        {**b, "world_size": 3, "sharding": "zero5"},
    ]
    return cases


def plan_cases() -> list[dict[str, Any]]:
    """The plans: models × budgets × one GPU and several, then ``allow`` sets."""
    jobs = [
        {"model": "gpt2", "task": "causal-lm", "seq_len": 512, "effective_batch_size": 32},
        {
            "model": "HuggingFaceTB/SmolLM2-135M",
            "task": "causal-lm",
            "seq_len": 1024,
            "effective_batch_size": 16,
        },
        {
            "model": "meta-llama/Llama-3.2-1B",
            "task": "causal-lm",
            "seq_len": 512,
            "effective_batch_size": 16,
        },
        {
            "model": "bert-base-uncased",
            "task": "classification",
            "seq_len": 128,
            "effective_batch_size": 32,
        },
        {
            "model": "roberta-large",
            "task": "classification",
            "seq_len": 256,
            "effective_batch_size": 32,
            "num_labels": 3,
        },
        {
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "task": "sentence-embedding",
            "seq_len": 128,
            "effective_batch_size": 256,
        },
        {
            "model": "BAAI/bge-base-en-v1.5",
            "task": "sentence-embedding",
            "seq_len": 256,
            "effective_batch_size": 64,
            "loss": "cosent",
        },
    ]
    budgets: list[dict[str, Any]] = [
        {"gpu": "t4"},
        {"gpu": "rtx3060"},
        {"gpu_memory": "2GiB"},
        {"gpu_memory": "300MiB"},  # nothing fits most of them
    ]
    ranks: list[dict[str, Any]] = [{}, {"world_size": 4}, {"world_size": 4, "sharding": "zero3"}]
    cases = [{**job, **budget, **rank} for job in jobs for budget in budgets for rank in ranks]
    small = {"model": "HuggingFaceTB/SmolLM2-135M", "task": "causal-lm", "seq_len": 1024}
    small |= {"effective_batch_size": 16, "gpu_memory": "1GiB"}
    embed = {"model": "sentence-transformers/all-MiniLM-L6-v2", "task": "sentence-embedding"}
    embed |= {"seq_len": 256, "effective_batch_size": 512, "gpu_memory": "600MiB"}
    cases += [
        {**small, "allow": ["optimizer"]},
        {**small, "allow": ["truncation"]},
        {**small, "allow": ["truncation"], "data_profile": [100, 200, 300, 700, 1000] * 20},
        {**small, "allow": ["lora"]},
        {**small, "allow": ["quantization"]},  # needs lora: refused
        {**small, "allow": ["lora", "quantization"], "world_size": 2},
        {**small, "lora_rank": 16, "quantization": "nf4", "double_quant": True},
        {**small, "precision": "fp16", "optimizer": "adafactor"},
        {**embed},
        {**embed, "allow": ["truncation", "optimizer"]},
        {**embed, "loss": "cached-mnrl"},
        # issue 31: the plan offers zero3/fsdp commands that memfit train refuses with QLoRA
        {
            "model": "meta-llama/Llama-3.1-8B",
            "task": "causal-lm",
            "seq_len": 2048,
            "effective_batch_size": 16,
            "gpu": "rtx3060",
            "allow": ["lora", "quantization"],
        },
    ]
    return cases


def case_id(kind: str, knobs: dict[str, Any]) -> str:
    """A readable, unique name: the model, then every knob as key=value, in the order given."""
    rest = {k: v for k, v in knobs.items() if k != "model"}
    words = []
    for key, value in rest.items():
        if key == "data_profile":
            value = f"{len(value)}rows:{sum(value)}"
        elif isinstance(value, list):
            value = ",".join(str(x) for x in value)
        words.append(f"{key}={value}")
    return f"{kind} {knobs['model']} " + " ".join(words)


def _plain(value: Any) -> Any:
    """``value`` as JSON: dataclasses as dicts, tuples as lists, anything else as its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"}


def run_estimate(memfit: Any, knobs: dict[str, Any]) -> dict[str, Any]:
    args = dict(knobs)
    model = args.pop("model")
    try:
        est = memfit.estimate(model, **args)
    except Exception as exc:  # a refused combination: its message is the answer
        return _error(exc)
    details = {k: v for k, v in est.details.items() if k not in TIMING_KEYS}
    return {
        "total_bytes": est.total_bytes,
        "breakdown": dict(est.breakdown),
        "peak_phase": est.peak_phase,
        "budget_bytes": est.budget_bytes,
        "fits": est.fits,
        "batch_size": est.batch_size,
        "seq_len": est.seq_len,
        "biggest_part": est.biggest_part,
        "details": _plain(details),
        "spec": _plain(est.spec),
    }


def run_plan(memfit: Any, knobs: dict[str, Any]) -> dict[str, Any]:
    from rich.console import Console

    from memfit.report.console import print_plan

    args = dict(knobs)
    model = args.pop("model")
    try:
        result = memfit.plan(model, **args)
    except Exception as exc:
        return {**_error(exc), "exit": 2}
    out = io.StringIO()
    print_plan(result, Console(file=out, width=200, color_system=None, highlight=False))
    return {
        "exit": 0 if result.fits else 3,
        "json": _plain(result.to_dict()),
        "estimate_command": result.estimate_command(),
        "printed": out.getvalue().splitlines(),
    }


def _fresh_cache() -> str:
    """A new, empty trace cache for this run (before memfit is imported)."""
    path = tempfile.mkdtemp(prefix="memfit-lever-equality-")
    os.environ["MEMFIT_CACHE_DIR"] = path
    os.environ.pop("MEMFIT_NO_CACHE", None)
    return path


def record(
    models: list[str] | None, plans: bool, log: Any = sys.stderr, estimates_too: bool = True
) -> dict[str, Any]:
    cache = _fresh_cache()
    import memfit
    from memfit.models.registry import registry_names, resolve_model

    started = time.perf_counter()
    estimates: dict[str, Any] = {}
    names = registry_names()
    for index, name in enumerate(names):
        if (models and name not in models) or not estimates_too:
            continue
        task = task_of(name, resolve_model(name).config.model_type)
        t0 = time.perf_counter()
        for knobs in estimate_cases(index, task):
            knobs = {"model": name, **knobs}
            cid = case_id("estimate", knobs)
            assert cid not in estimates, cid
            estimates[cid] = {"knobs": knobs, **run_estimate(memfit, knobs)}
        log.write(f"  {name}: {time.perf_counter() - t0:.1f} s\n")
        log.flush()
    plan_results: dict[str, Any] = {}
    if plans:
        for knobs in plan_cases():
            if models and knobs["model"] not in models:
                continue
            t0 = time.perf_counter()
            cid = case_id("plan", knobs)
            assert cid not in plan_results, cid
            plan_results[cid] = {"knobs": knobs, **run_plan(memfit, knobs)}
            log.write(f"  {cid}: {time.perf_counter() - t0:.1f} s\n")
            log.flush()
    import torch
    import transformers

    return {
        "meta": {
            "memfit_source": str(Path(memfit.__file__).resolve().parent),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cache_dir": cache,
            "seconds": round(time.perf_counter() - started, 1),
            "estimate_cases": len(estimates),
            "plan_cases": len(plan_results),
        },
        "estimates": estimates,
        "plans": plan_results,
    }


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf fields by dotted path (lists by index), so each difference names its field."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        out = {}
        for i, v in enumerate(value):
            out |= _flat(v, f"{prefix}[{i}]")
        return out
    return {prefix: value}


MISSING = "<missing>"


def differences(
    base: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...] = ()
) -> list[tuple[str, str, Any, Any]]:
    """(case, field, before, after) for every field that differs, the meta block left out."""
    diffs = []
    for section in ("estimates", "plans"):
        before, after = base.get(section, {}), new.get(section, {})
        for cid in sorted(set(before) | set(after)):
            if cid not in after or cid not in before:
                diffs.append((cid, "(case)", cid in before, cid in after))
                continue
            a, b = _flat(before[cid]), _flat(after[cid])
            for key in sorted(set(a) | set(b)):
                if any(key == p or key.startswith(p + ".") for p in ignore):
                    continue
                if a.get(key, MISSING) != b.get(key, MISSING):
                    diffs.append((cid, key, a.get(key, MISSING), b.get(key, MISSING)))
    return diffs


def _field_group(key: str) -> str:
    """A difference's field without list indexes, for the count."""
    import re

    return re.sub(r"\[\d+\]", "[]", key)


def _write(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=0, sort_keys=True) + "\n", encoding="utf-8")


def _command(argv: list[str]) -> str:
    src = os.environ.get("PYTHONPATH")
    prefix = f"PYTHONPATH={shlex.quote(src)} " if src else ""
    return prefix + "python " + " ".join(shlex.quote(a) for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    rec = sub.add_parser("record", help="run every case and write OUT.json")
    rec.add_argument("out")
    cmp = sub.add_parser("compare", help="hold a recording (or a run here) against BASE.json")
    cmp.add_argument("base")
    cmp.add_argument("new", nargs="?", help="a second recording (default: run the cases here)")
    cmp.add_argument("--save", help="with no NEW: write this run's recording here too")
    cmp.add_argument(
        "--ignore",
        default="",
        help="comma-separated field paths to leave out (e.g. spec,details.method)",
    )
    for p in (rec, cmp):
        p.add_argument("--models", default="", help="only these registry names (comma-separated)")
        p.add_argument("--no-plans", action="store_true", help="estimates only")
        p.add_argument(
            "--no-estimates",
            action="store_true",
            help="plans only (compared with the base's plans only)",
        )
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m] or None
    print(f"reproduce: {_command(['bench/lever_equality.py', *argv])}", flush=True)
    if args.verb == "record":
        data = record(models, not args.no_plans, estimates_too=not args.no_estimates)
        _write(args.out, data)
        meta = data["meta"]
        print(
            f"wrote {args.out}: {meta['estimate_cases']} estimates, {meta['plan_cases']} plans "
            f"in {meta['seconds']} s (memfit from {meta['memfit_source']})"
        )
        return 0
    base = json.loads(Path(args.base).read_text(encoding="utf-8"))
    if args.new:
        new = json.loads(Path(args.new).read_text(encoding="utf-8"))
    else:
        new = record(models, not args.no_plans, estimates_too=not args.no_estimates)
        if args.save:
            _write(args.save, new)
    if models or args.no_plans or args.no_estimates:  # a partial run: the same part of the base
        keep = {cid for section in ("estimates", "plans") for cid in new.get(section, {})}
        base = {s: {c: v for c, v in base.get(s, {}).items() if c in keep} for s in base}
    ignore = tuple(x for x in args.ignore.split(",") if x)
    diffs = differences(base, new, ignore)
    for cid, key, before, after in diffs:
        print(f"{cid}\n    {key}: {json.dumps(before)} -> {json.dumps(after)}")
    cases = {cid for cid, *_ in diffs}
    total = sum(len(new.get(s, {})) for s in ("estimates", "plans"))
    by_field = Counter(_field_group(key) for _, key, *_ in diffs)
    print(
        f"\n{len(diffs)} differences in {len(cases)} of {total} cases "
        f"({base.get('meta', {}).get('memfit_source')} -> {new.get('meta', {}).get('memfit_source')})"
    )
    for key, n in by_field.most_common():
        print(f"  {n:6d}  {key}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
