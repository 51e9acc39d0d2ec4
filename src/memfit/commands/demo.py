"""``memfit demo``: memfit estimate, plan, train (under a cap that makes it run out of memory) and
report on known models, each command printed before its output."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer

from memfit import progress
from memfit.commands._options import train_setup_status
from memfit.report.console import print_estimate, print_plan
from memfit.report.html import write_report
from memfit.units import format_bytes


def demo_command() -> None:
    """Estimate a known fine-tuning job (bert-base-uncased on a 16 GiB GPU), then plan it into 4 GiB."""
    typer.echo(
        "memfit demo: fine-tuning bert-base-uncased for classification, batch 32 × 128 tokens, AdamW, fp32"
    )
    typer.echo(
        "$ memfit estimate bert-base-uncased --task classification --batch-size 32 --seq-len 128 --gpu-memory 16GiB"
    )
    # each slow step under a status line; the demo's next printed line erases it
    with progress.status("loading torch and transformers", subject="memfit demo"):
        from memfit.estimate import estimate

        progress.report("estimating bert-base-uncased, batch 32 × 128 tokens, fp32")
        result = estimate(
            "bert-base-uncased",
            task="classification",
            batch_size=32,
            seq_len=128,
            gpu_memory="16GiB",
        )
    print_estimate(result)
    with progress.status(
        "estimating bert-base-uncased, batch 32 × 128 tokens, bf16", subject="memfit demo"
    ):
        bf16 = estimate(
            "bert-base-uncased",
            task="classification",
            batch_size=32,
            seq_len=128,
            precision="bf16",
            gpu_memory="16GiB",
        )
    typer.echo(
        f"With --precision bf16 the same step needs {format_bytes(bf16.total_bytes)} "
        f"({(1 - bf16.total_bytes / result.total_bytes) * 100:.0f} % less)."
    )
    from memfit.plan import plan

    typer.echo(
        "\nOn a 4 GiB budget, with 256 tokens and an effective batch of 64, the plan keeps the batch:"
    )
    typer.echo(
        "$ memfit plan bert-base-uncased --task classification --seq-len 256 "
        "--effective-batch-size 64 --gpu-memory 4GiB"
    )
    with progress.status("planning bert-base-uncased into 4 GiB", subject="memfit demo"):
        planned = plan(
            "bert-base-uncased",
            task="classification",
            seq_len=256,
            effective_batch_size=64,
            gpu_memory="4GiB",
        )
    print_plan(planned)
    _demo_train()


def _demo_train() -> None:
    """Fine-tune all-MiniLM-L6-v2 under a memory cap that makes the first step run out of memory."""
    from memfit.train import TrainConfig, train
    from memfit.train.demo import minilm_path, write_pairs

    model = minilm_path()
    folder = Path(tempfile.mkdtemp(prefix="memfit-demo-"))
    train_file, eval_file = write_pairs(folder)

    def peak(name: str, **knobs: Any) -> int:
        # two steps (the second holds the AdamW state) with a cap that never bites: live bytes
        probe = train(
            TrainConfig(
                task="sentence-embedding",
                model=model,
                train_file=str(train_file),
                output_dir=str(folder / name),
                effective_batch_size=32,
                max_steps=2,
                memory_cap=1 << 40,
                max_seq_len=32,
                device="cpu",
                quiet=True,
                **knobs,
            )
        )
        lines = (probe.output_dir / "metrics.jsonl").read_text().splitlines()
        return max(int(json.loads(x)["peak_bytes"]) for x in lines)

    typer.echo("\nMeasuring what a training step of all-MiniLM-L6-v2 holds (two probe steps)…")
    with progress.status("two probe steps of all-MiniLM-L6-v2, batch 32", subject="memfit demo"):
        whole = peak("probe-32")
        progress.report("two probe steps of all-MiniLM-L6-v2, mini-batches of 4")
        cap = (whole + peak("probe-4", mini_batch_size=4)) // 2
    typer.echo(
        "Now a real fine-tuning run: all-MiniLM-L6-v2 (sentence-transformers, MNRL) on 36 embedded "
        f"paraphrase pairs, batch 32, on the CPU capped at {format_bytes(cap)} — less than the whole "
        "batch needs, so the guard must recover from a real out-of-memory error:"
    )
    out = folder / "run"
    typer.echo(
        f"$ memfit train --task sentence-embedding --model {model} --train-file {train_file} "
        f"--eval-file {eval_file} --effective-batch-size 32 --max-steps 4 --memory-cap {cap} "
        f"--max-seq-len 32 --lr 2e-5 --device cpu --output-dir {out}"
    )
    with train_setup_status(
        "loading all-MiniLM-L6-v2, tokenizing the pairs", subject="memfit demo"
    ):
        result = train(
            TrainConfig(
                task="sentence-embedding",
                model=model,
                train_file=str(train_file),
                eval_file=str(eval_file),
                output_dir=str(out),
                effective_batch_size=32,
                max_steps=4,
                memory_cap=cap,
                max_seq_len=32,
                lr=2e-5,
                device="cpu",
            )
        )
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    ooms = sum(e["type"] == "oom" for e in events)
    metrics = "  ".join(f"{k} {v:.3f}" for k, v in result.eval_metrics.items())
    typer.echo(
        f"done: {result.steps} steps, {result.samples_seen} samples seen (none lost or repeated), "
        f"{ooms} out-of-memory error(s) survived; eval {metrics}"
    )
    typer.echo(f"run folder: {out} (model/, metrics.jsonl, events.jsonl, run.json)")
    typer.echo(f"\n$ memfit report {out}")
    with progress.status(
        f"estimating the run's step, drawing the plots of {out}", subject="memfit demo"
    ):
        page = write_report(out)
    typer.echo(
        f"wrote {page}: memory per step with the OOM and the back-off marked, the estimate "
        "beside the measured peak, loss and throughput (and the same plots as PNG beside it)"
    )
