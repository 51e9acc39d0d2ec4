"""Measured per-rank peaks of ``memfit train --sharding zero1|zero2|zero3`` against the estimate.

Two CPU ranks (torchrun, gloo) run ``memfit train`` for a few steps on a small BERT built from a
config (4 layers x 256, random weights, the ``bert-mini`` of ``bench/sharding_check.py``) with
every scheme (none, fsdp, zero1, zero2, zero3), fp32, a fixed batch (effective batch 16,
micro-batch 8 per rank, ``--padding max_length`` to 128 tokens, so every step has the same
shapes) and ``--memory-cap 100GiB --no-probe``: the cap never binds, it only counts each rank's
live tensor bytes (``memfit.guard.cap``; DeepSpeed's partitions through
``ZeroModel.held_tensors()``). Each rank's peak of the last step (``rank_peak_bytes`` in
``metrics.jsonl``; steps >= 2 have the optimizer state already) is compared with
``memfit.estimate.estimate(..., device="cpu", world_size=2, sharding=S)`` for the same shapes:
its raw tensor bytes, the total less the page rounding (``allocator_overhead``), as
``sharding_check.py --fsdp-truth`` compares FSDP.

Usage::

    python bench/zero_truth.py --out                 # AdamW, the five schemes (~4 min, 2 cores)
    python bench/zero_truth.py --sgd --out           # + SGD for the same schemes
    python bench/zero_truth.py --only zero2 --keep /tmp/zt   # one scheme, keep the run folders
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "src", ROOT / "bench"):
    if str(_path) not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, str(_path))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sharding_check import FSDP_MODELS  # noqa: E402

MiB = 2**20
DEFAULT_OUT = ROOT / "bench" / "results" / "zero_truth_cpu.json"
SCHEMES = ("none", "fsdp", "zero1", "zero2", "zero3")
WORLD = 2
EFFECTIVE_BATCH = 16
MICRO = 8  # per rank: one micro-batch per rank and step
SEQ = 128
STEPS = 3
WORDS = [f"w{i}" for i in range(200)]


def build_model(folder: Path) -> None:
    """bert-mini (sharding_check's config) as a classifier of 2 labels, with a WordPiece
    tokenizer of ``WORDS``, saved in ``folder``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from _tiny import save_bert_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    save_bert_tokenizer(folder, WORDS)
    _, _, numbers = FSDP_MODELS["bert-mini"]
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**{**numbers, "num_labels": 2})).save_pretrained(
        folder
    )


def write_data(path: Path) -> None:
    """Rows longer than SEQ tokens (truncated, then every row is SEQ tokens: fixed shapes)."""
    import random

    rng = random.Random(0)
    lines = ["text,label"]
    for i in range(EFFECTIVE_BATCH * STEPS):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(SEQ + 20)) + f",{i % 2}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def train_command(model: Path, data: Path, out: Path, scheme: str, optimizer: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(WORLD),
        "-m",
        "memfit",
        "train",
        "--task",
        "classification",
        "--model",
        str(model),
        "--train-file",
        str(data),
        "--output-dir",
        str(out),
        "--device",
        "cpu",
        "--sharding",
        scheme,
        "--optimizer",
        optimizer,
        "--precision",
        "fp32",
        "--effective-batch-size",
        str(EFFECTIVE_BATCH),
        "--micro-batch-size",
        str(MICRO),
        "--max-seq-len",
        str(SEQ),
        "--padding",
        "max_length",
        "--max-steps",
        str(STEPS),
        "--memory-cap",
        "100GiB",
        "--no-probe",
        "--num-labels",
        "2",
    ]


def run_case(
    tmp: Path, model: Path, data: Path, scheme: str, optimizer: str, estimates: dict[str, Any]
) -> dict[str, Any]:
    out = tmp / f"run-{scheme}-{optimizer}"
    command = train_command(model, data, out, scheme, optimizer)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    seconds = round(time.perf_counter() - started, 1)
    row: dict[str, Any] = {
        "scheme": scheme,
        "optimizer": optimizer,
        "command": " ".join(shlex.quote(a) for a in command),
        "seconds": seconds,
    }
    if done.returncode != 0:
        row["error"] = (done.stderr or done.stdout)[-3000:]
        return row
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [x for x in lines if "rank_peak_bytes" in x]
    last = steps[-1]
    est = estimates[scheme]
    raw = est.total_bytes - est.breakdown.get("allocator_overhead", 0)
    measured = [int(x) for x in last["rank_peak_bytes"]]
    row.update(
        {
            "step": last["step"],
            "measured_rank_peak_bytes": measured,
            "measured_rank_peak_bytes_by_step": [x["rank_peak_bytes"] for x in steps],
            "measured_phase_peak_bytes": {
                k: last.get(f"{k}_peak_bytes") for k in ("forward", "backward", "optimizer")
            },
            "micro_batch_size": last["micro_batch_size"],
            "gradient_accumulation_steps": last["gradient_accumulation_steps"],
            "padded_tokens": last.get("padded_tokens"),
            "estimated_bytes": raw,
            "estimate_total_bytes": est.total_bytes,
            "estimate_peak_phase": est.peak_phase,
            "estimate_phase_peak_bytes": est.details.get("phase_peak_bytes"),
            "estimate_breakdown": est.breakdown,
            "estimate_model_state": est.details.get("model_state"),
            "ratio": max(measured) / raw,
        }
    )
    return row


def fsdp_reference(tmp: Path, estimates: dict[str, Any]) -> dict[str, Any]:
    """The same FSDP step counted by ``sharding_check.py``'s worker, whose counter unwraps DTensor
    shards and follows FSDP's ``storage.resize_`` (``memfit train``'s cap does neither: it counts
    a DTensor at its global size)."""
    result = tmp / "fsdp-reference"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(WORLD),
        str(ROOT / "bench" / "sharding_check.py"),
        "--fsdp-worker",
        "--model",
        "bert-mini",
        "--precision",
        "fp32",
        "--sharding",
        "fsdp",
        "--batch-size",
        str(MICRO),
        "--seq-len",
        str(SEQ),
        "--steps",
        str(STEPS),
        "--result",
        str(result),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    row: dict[str, Any] = {
        "scheme": "fsdp",
        "optimizer": "adamw",
        "source": "sharding_check.py --fsdp-worker (DTensor shards, storage resizes)",
        "command": " ".join(shlex.quote(a) for a in command),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if done.returncode != 0:
        row["error"] = (done.stderr or done.stdout)[-3000:]
        return row
    ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(WORLD)]
    measured = [int(r["steps"][-1]["peak"]) for r in ranks]
    est = estimates["fsdp"]
    raw = est.total_bytes - est.breakdown.get("allocator_overhead", 0)
    row.update(
        {
            "measured_rank_peak_bytes": measured,
            "measured_phase_peak_bytes": {
                k: max(r["steps"][-1][f"{k}_peak"] for r in ranks)
                for k in ("forward", "backward", "optimizer")
            },
            "estimated_bytes": raw,
            "estimate_peak_phase": est.peak_phase,
            "ratio": max(measured) / raw,
        }
    )
    return row


def estimate_all(model: Path, optimizer: str, schemes: list[str]) -> dict[str, Any]:
    from memfit.estimate import estimate

    return {
        scheme: estimate(
            str(model),
            task="classification",
            batch_size=MICRO,
            seq_len=SEQ,
            precision="fp32",
            optimizer=optimizer,
            device="cpu",
            world_size=WORLD,
            sharding=scheme,
            num_labels=2,
        )
        for scheme in schemes
    }


def print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['scheme']:6} {row['optimizer']:6} FAILED\n{row['error']}", flush=True)
        return
    ranks = " ".join(f"{b / MiB:8.2f}" for b in row["measured_rank_peak_bytes"])
    scheme = row["scheme"] + ("*" if row.get("source", "").startswith("sharding") else "")
    print(
        f"{scheme:6} {row['optimizer']:6} {ranks} {row['estimated_bytes'] / MiB:9.2f} "
        f"{row['ratio']:6.3f}  {row['seconds']:5.1f}s  {row['command']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", nargs="?", const=str(DEFAULT_OUT), help="write the JSON here")
    parser.add_argument("--sgd", action="store_true", help="also SGD (no optimizer state)")
    parser.add_argument("--only", action="append", choices=SCHEMES, help="these schemes only")
    parser.add_argument("--keep", help="build the model and run folders here (kept)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    schemes = args.only or list(SCHEMES)
    optimizers = ["adamw", "sgd"] if args.sgd else ["adamw"]
    import torch
    import transformers

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memfit-zero-truth-") as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        model, data = tmp / "bert-mini", tmp / "train.csv"
        build_model(model)
        write_data(data)
        print(
            f"{'scheme':6} {'optim':6} {'rank0 MiB':>8} {'rank1':>8} {'estimate':>9} "
            f"{'ratio':>6}  time    command"
        )
        for optimizer in optimizers:
            estimates = estimate_all(model, optimizer, schemes)
            for scheme in schemes:
                row = run_case(tmp, model, data, scheme, optimizer, estimates)
                row["source"] = "memfit train --memory-cap (rank_peak_bytes)"
                rows.append(row)
                print_row(row)
                if scheme == "fsdp" and optimizer == "adamw":
                    row = fsdp_reference(tmp, estimates)
                    rows.append(row)
                    print_row(row)
    result = {
        "command": command,
        "setup": {
            "model": "bert-mini (4 x 256, vocab 30522, 2 labels; random weights)",
            "world_size": WORLD,
            "effective_batch_size": EFFECTIVE_BATCH,
            "micro_batch_size_per_rank": MICRO,
            "seq_len": SEQ,
            "precision": "fp32",
            "steps": STEPS,
            "measured": "rank_peak_bytes of the last step (live tensor bytes under the CPU cap)",
            "estimated": "estimate(device='cpu', world_size=2).total_bytes - allocator_overhead",
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "deepspeed": _deepspeed_version(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if any(r.get("source", "").startswith("sharding") for r in rows):
        print(
            "fsdp*: the same step counted by sharding_check.py's worker (DTensor shards, "
            "storage resizes);\n  memfit train's cap counts a DTensor at its global size"
        )
    print(f"reproduce: {command}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


def _deepspeed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
