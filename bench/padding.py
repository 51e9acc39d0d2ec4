"""Padding on a long-tailed length distribution: fixed max-length vs dynamic vs token-budget batches.

Every mode goes through memfit's real training path (``memfit.train.run.train``) on the same CSV,
the same tiny BERT classifier, the same effective batch and the same number of optimizer steps,
one after the other in this process:

- ``fixed``        every row padded to ``--max-seq-len``, micro-batch 8 (the baseline)
- ``dynamic``      each micro-batch as wide as its longest row, micro-batch 8
- ``token-budget`` dynamic padding, micro-batch up to the whole step, at most 8 × max-seq-len
  tokens per micro-batch *padding included* (the fixed mode's memory bound; what memfit plan emits)
- ``token-budget+group``  the same, with ``group_by_length`` (steps of similar-length samples)

Figures come from each run's ``metrics.jsonl``: ``tokens`` (real) and ``padded_tokens`` (fed to
the model) per step; ``peak_bytes``, the peak of live tensor bytes in the step, counted by the CPU
memory cap (set far above anything reachable, so it never bites; its bookkeeping runs in every
mode alike); ``seconds`` per step. The probe step is off (``probe=False``): each mode runs only its
own steps. Every mode runs ``--rounds`` times, the order reversed every other round; the rounds
run the same steps (same rows, same order), so each step's time is its fastest round's: on a
shared 2-core machine other processes slow a run down several times over for a while (torch's two
threads then wait on each other), which one run per mode turns into a false speed ranking. Tokens
and peaks are the same every round (checked). On a busy machine, add rounds (``--rounds 5``).

Target (issue 5): padded tokens cut by ≥ 50 % against fixed, measured peak no higher.

Usage::

    python bench/padding.py    # 256 rows, batch 32, 512 tokens: 8 steps a mode, 3 rounds (~2 min idle)
    python bench/padding.py --rows 512 --out bench/results/padding_cpu.json
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py

from memfit.train import TrainConfig, train  # noqa: E402

MiB = 2**20
FIXED_MICRO_BATCH = 8
VOCAB_WORDS = 1000


def build_classifier(folder: Path, *, max_seq_len: int) -> None:
    """A small BERT (4 layers × 128 hidden) with a word-level tokenizer, saved like a Hub model."""
    from transformers import BertConfig, BertModel

    from _tiny import save_bert_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB_WORDS)]
    save_bert_tokenizer(folder, vocab[5:])
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=max(512, max_seq_len),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)


def write_long_tailed_csv(path: Path, rows: int, *, max_seq_len: int, seed: int) -> None:
    """Rows whose word counts are log-normal (median ~38 words, sigma 0.95): most texts are short,
    a few reach past max_seq_len (then truncated). Label 1 when the first word is in the vocab's
    first half."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for _ in range(rows):
            n = min(max(8, round(rng.lognormvariate(math.log(38), 0.95))), max_seq_len + 64)
            words = [rng.randrange(VOCAB_WORDS) for _ in range(n)]
            writer.writerow([" ".join(f"w{w}" for w in words), int(words[0] < VOCAB_WORDS // 2)])


def token_lengths(model_dir: Path, data: Path, max_seq_len: int) -> list[int]:
    """Each row's length as the model sees it: truncated to max_seq_len, [CLS]/[SEP] included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(data, newline="", encoding="utf-8") as handle:
        texts = [row["text"] for row in csv.DictReader(handle)]
    encoded = tokenizer(texts, truncation=True, max_length=max_seq_len)
    return [len(ids) for ids in encoded["input_ids"]]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def git_revision() -> str | None:
    """The checkout's commit, with ``+dirty`` when src/ has changes not committed."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def cpu_pressure() -> float | None:
    """The share of the last 10 s in which some runnable task waited for a CPU (Linux PSI), %."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return float(line.split()[1].split("=")[1])


def run_mode(out: Path, knobs: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """One ``memfit train`` run; its figures from DIR/metrics.jsonl."""
    started = time.perf_counter()
    pressure_before = cpu_pressure()
    train(TrainConfig(**base, output_dir=str(out), **knobs))
    wall = time.perf_counter() - started
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m and "eval_loss" not in m]
    tokens = sum(int(m["tokens"]) for m in steps)
    padded = sum(int(m["padded_tokens"]) for m in steps)
    samples = steps[-1]["samples_seen"]
    seconds = sum(float(m["seconds"]) for m in steps)
    chunks = [int(m["gradient_accumulation_steps"]) for m in steps]
    peaks = [int(m["peak_bytes"]) for m in steps]
    seen = [0] + [int(m["samples_seen"]) for m in steps]
    return {
        "steps": len(steps),
        "samples": samples,
        "tokens": tokens,
        "padded_tokens": padded,
        "padded_share": 1 - tokens / padded if padded else 0.0,
        "step_seconds": seconds,
        "wall_seconds": wall,
        "samples_per_second": samples / seconds if seconds > 0 else None,
        "median_step_samples_per_second": statistics.median(
            float(m["samples_per_second"]) for m in steps
        ),
        "peak_bytes": max(peaks),
        "peak_step": steps[peaks.index(max(peaks))]["step"],
        "median_step_peak_bytes": int(statistics.median(peaks)),
        "micro_batches_per_step": statistics.mean(chunks),
        "micro_batches_min": min(chunks),
        "micro_batches_max": max(chunks),
        "final_loss": steps[-1]["loss"],
        "step_samples": [b - a for a, b in itertools.pairwise(seen)],
        "step_seconds_each": [float(m["seconds"]) for m in steps],
        "cpu_pressure_before": pressure_before,
        "cpu_pressure_after": cpu_pressure(),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode over its rounds: tokens and peaks must agree (same rows, same order, every round).
    Its speed takes each step's fastest round (the one other processes disturbed least): samples
    over the sum of those step times; the median step from the same times. Every round is kept."""
    first = runs[0]
    for key in ("tokens", "padded_tokens", "peak_bytes", "micro_batches_per_step", "step_samples"):
        values = {json.dumps(r[key]) for r in runs}
        if len(values) != 1:
            raise RuntimeError(f"rounds disagree on {key}: {sorted(values)}")
    fastest = [min(column) for column in zip(*(r["step_seconds_each"] for r in runs), strict=True)]
    summary = {
        k: v
        for k, v in first.items()
        if k not in ("cpu_pressure_before", "cpu_pressure_after", "wall_seconds")
    }
    summary["step_seconds_each"] = fastest
    summary["step_seconds"] = sum(fastest)
    summary["samples_per_second"] = first["samples"] / sum(fastest)
    summary["median_step_samples_per_second"] = statistics.median(
        n / t for n, t in zip(first["step_samples"], fastest, strict=True)
    )
    summary["rounds_samples_per_second"] = [r["samples_per_second"] for r in runs]
    summary["rounds"] = runs
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=256, help="rows in the generated CSV")
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per mode (default: one epoch)"
    )
    parser.add_argument("--batch", type=int, default=32, help="effective batch (samples per step)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the runs")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of every mode, in alternating order; each step's fastest round counts",
    )
    parser.add_argument(
        "--no-group", action="store_true", help="skip the token-budget + group_by_length mode"
    )
    parser.add_argument("--out", default=None, help="write the JSON results to this file")
    args = parser.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/padding.py", *sys.argv[1:]])
    print(f"reproduce: {command}")

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected here
    torch.set_num_threads(args.threads)
    steps = args.steps or math.ceil(args.rows / args.batch)
    budget = FIXED_MICRO_BATCH * args.max_seq_len
    modes: dict[str, dict[str, Any]] = {
        "fixed": dict(padding="max_length", micro_batch_size=FIXED_MICRO_BATCH),
        "dynamic": dict(padding="longest", micro_batch_size=FIXED_MICRO_BATCH),
        "token-budget": dict(
            padding="longest", micro_batch_size=args.batch, max_tokens_per_micro_batch=budget
        ),
    }
    if not args.no_group:
        modes["token-budget+group"] = dict(
            padding="longest",
            micro_batch_size=args.batch,
            max_tokens_per_micro_batch=budget,
            group_by_length=True,
        )

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="memfit-padding-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        build_classifier(model_dir, max_seq_len=args.max_seq_len)
        data = work / "train.csv"
        write_long_tailed_csv(data, args.rows, max_seq_len=args.max_seq_len, seed=args.seed)
        lengths = token_lengths(model_dir, data, args.max_seq_len)
        dist = {
            "p50": percentile(lengths, 50),
            "p90": percentile(lengths, 90),
            "p99": percentile(lengths, 99),
            "max": max(lengths),
            "mean": round(statistics.mean(lengths), 1),
            "rows_at_max_seq_len": sum(n >= args.max_seq_len for n in lengths),
        }
        print(
            f"data: {args.rows} rows, tokens per row (special tokens in, truncated at "
            f"{args.max_seq_len}): p50 {dist['p50']}, p90 {dist['p90']}, p99 {dist['p99']}, "
            f"max {dist['max']}, mean {dist['mean']}; {dist['rows_at_max_seq_len']} rows "
            f"at {args.max_seq_len}"
        )
        print(
            f"model: BERT 4 layers × 128 hidden, 4 heads; AdamW; fp32; CPU, "
            f"{torch.get_num_threads()} threads; {steps} steps × {args.batch} samples per mode; "
            f"token budget {budget} = {FIXED_MICRO_BATCH} × {args.max_seq_len}; probe off"
        )
        base = dict(
            task="classification",
            model=str(model_dir),
            train_file=str(data),
            effective_batch_size=args.batch,
            max_steps=steps,
            max_seq_len=args.max_seq_len,
            optimizer="adamw",
            lr=5e-5,
            seed=args.seed,
            device="cpu",
            memory_cap=1 << 40,  # never bites: the cap only counts live tensor bytes (the peak)
            probe=False,
            quiet=True,
            cache_dir=str(work / "cache"),
        )
        # warm-up (not reported): tokenizes into the cache, starts the thread pools
        train(
            TrainConfig(
                **{**base, "max_steps": 2},
                output_dir=str(work / "warmup"),
                micro_batch_size=FIXED_MICRO_BATCH,
            )
        )
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
        for round_index in range(args.rounds):
            # alternate the order: a machine that slows down (or speeds up) hits every mode alike
            order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
            for name in order:
                run = run_mode(work / f"run-{name}-{round_index}", modes[name], base)
                runs[name].append(run)
                print(
                    f"  round {round_index + 1}/{args.rounds} {name}: {run['steps']} steps, "
                    f"{run['samples_per_second']:.1f} samples/s, {run['wall_seconds']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
        results = {name: summarize(runs[name]) for name in modes}
        for name, knobs in modes.items():
            results[name]["knobs"] = knobs
    load_after = os.getloadavg()
    fixed = results["fixed"]
    for r in results.values():
        r["padded_tokens_vs_fixed"] = r["padded_tokens"] / fixed["padded_tokens"]
        r["padded_tokens_cut"] = 1 - r["padded_tokens_vs_fixed"]
        # padding tokens only (fed minus real): the waste itself
        pad_only = r["padded_tokens"] - r["tokens"]
        r["padding_tokens"] = pad_only
        r["padding_tokens_cut"] = 1 - pad_only / (fixed["padded_tokens"] - fixed["tokens"])
        r["peak_vs_fixed"] = r["peak_bytes"] / fixed["peak_bytes"]
        r["speedup_vs_fixed"] = r["samples_per_second"] / fixed["samples_per_second"]
        r["meets_target"] = r["padded_tokens_cut"] >= 0.5 and r["peak_bytes"] <= fixed["peak_bytes"]

    header = (
        f"{'mode':<20} {'padded share':>12} {'fed tokens':>11} {'cut vs fixed':>12} "
        f"{'samples/s':>10} {'median/step':>11} {'speedup':>8} {'peak MiB':>9} "
        f"{'peak/fixed':>10} {'at step':>7} {'micro/step':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        micro = f"{r['micro_batches_per_step']:.1f}"
        if r["micro_batches_min"] != r["micro_batches_max"]:
            micro += f" ({r['micro_batches_min']}-{r['micro_batches_max']})"
        print(
            f"{name:<20} {r['padded_share'] * 100:>11.1f}% {r['padded_tokens']:>11,} "
            f"{r['padded_tokens_cut'] * 100:>11.1f}% {r['samples_per_second']:>10.1f} "
            f"{r['median_step_samples_per_second']:>11.1f} {r['speedup_vs_fixed']:>7.2f}x "
            f"{r['peak_bytes'] / MiB:>9.1f} {r['peak_vs_fixed']:>10.3f} {r['peak_step']:>7} "
            f"{micro:>10}"
        )
    print(
        "padded share = padding / fed tokens; cut = fed (padded) tokens saved against fixed; "
        f"samples/s = samples / summed step seconds, each step its fastest of {args.rounds} "
        "round(s) (median/step: the median step); peak = max over steps of live tensor bytes"
    )
    print(
        "samples/s of each whole round (the noise): "
        + "; ".join(
            f"{name} " + ", ".join(f"{x:.1f}" for x in r["rounds_samples_per_second"])
            for name, r in results.items()
        )
    )
    for name, r in results.items():
        if name == "fixed":
            continue
        verdict = "PASS" if r["meets_target"] else "FAIL"
        print(
            f"target (fed tokens cut ≥ 50 % vs fixed, peak ≤ fixed): {name}: {verdict} "
            f"(cut {r['padded_tokens_cut'] * 100:.1f} %, peak {r['peak_vs_fixed']:.3f} × fixed)"
        )
    print(
        f"load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f} on "
        f"{os.cpu_count()} CPUs: samples/s are wall-clock, other processes slow every mode"
    )
    print(f"reproduce: {command}")

    if args.out:
        import transformers

        import memfit

        payload = {
            "benchmark": "padding",
            "command": command,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "args": vars(args),
            "setup": {
                "steps": steps,
                "token_budget": budget,
                "fixed_micro_batch_size": FIXED_MICRO_BATCH,
                "model": "BERT 4 layers x 128 hidden, 4 heads, intermediate 512",
                "optimizer": "adamw",
                "probe": False,
                "rounds": args.rounds,
                "memory_cap": "1 << 40 (counts live tensor bytes; never bites)",
            },
            "lengths": dist,
            "modes": results,
            "machine": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "memfit": memfit.__version__,
                "memfit_commit": git_revision(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
                "processor": platform.processor(),
                "kernel": platform.release(),
                "load_average_1min_before": load_before[0],
                "load_average_1min_after": load_after[0],
            },
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
