"""``memfit demo``: memfit estimate, plan, train (under a cap that makes it run out of memory) and
report on known models, each command printed before its output."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

from memfit import progress
from memfit.commands._options import train_setup_status
from memfit.errors import UsageError
from memfit.extras import DEMO, verb_problem
from memfit.report.console import print_estimate, print_plan
from memfit.report.html import write_report
from memfit.units import format_bytes, parse_size, size_arg


def demo_command() -> None:
    """Estimate and plan a known job (bert-base-uncased), then fine-tune all-MiniLM-L6-v2 under
    a memory cap that forces an out-of-memory error, and write its report page."""
    # its training step's packages, before the estimate and the plan take their seconds
    if problem := verb_problem("memfit demo", DEMO, "demo"):
        raise UsageError(problem)
    typer.echo(
        "memfit demo: fine-tuning bert-base-uncased for classification, batch 32 × 128 tokens, AdamW, fp32"
    )
    typer.echo(
        "$ memfit estimate bert-base-uncased --task classification --batch-size 32 --seq-len 128 --gpu-memory 16GiB"
    )
    # each slow step under a status line; the demo's next printed line erases it
    with progress.status("loading torch and transformers", subject="memfit demo"):
        # start-up: torch and transformers load under the status line
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
    # start-up: the planner loads torch (loaded already by the estimate above)
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
    demo_report(demo_training())


def demo_report(out: Path) -> None:
    """``memfit report`` on the demo's run folder ``out``; its temporary folder is deleted when
    the report fails or is interrupted (the demo's run has nothing else to show)."""
    typer.echo(f"\n$ memfit report {out}")
    try:
        with progress.status(
            f"estimating the run's step, drawing the plots of {out}", subject="memfit demo"
        ):
            page = write_report(out)
    except BaseException:
        # a demo stopped (Ctrl-C, an error) leaves nothing behind
        shutil.rmtree(out.parent, ignore_errors=True)
        raise
    typer.echo(
        f"wrote {page}: memory per step with the OOM and the back-off marked, the estimate "
        "beside the measured peak, loss and throughput (and the same plots as PNG beside it)"
    )


def demo_training() -> Path:
    """Fine-tune all-MiniLM-L6-v2 under a memory cap that makes a step run out of memory; the
    held-out retrieval metrics before and after. Returns the run folder, in a new temporary
    folder: the weights the demo wrote are deleted as it ends (the whole folder when it fails or
    is interrupted), its logs and the pairs it trained on stay."""
    folder = Path(tempfile.mkdtemp(prefix="memfit-demo-"))
    try:
        out = _train_under_cap(folder)
        removed = drop_weights(folder, out)
    except BaseException:
        # a demo stopped (Ctrl-C, an error) leaves nothing behind
        shutil.rmtree(folder, ignore_errors=True)
        raise
    typer.echo(
        f"run folder: {out} (metrics.jsonl, events.jsonl, run.json); deleted the probe runs and "
        f"the saved models ({', '.join(removed)}: {format_bytes(sum(removed.values()))}): the "
        "report needs the logs only"
    )
    return out


def _train_under_cap(folder: Path) -> Path:
    """:func:`demo_training`'s probes and run, in ``folder``; the run's folder."""
    # start-up: training loads torch, transformers and sentence-transformers
    from memfit.train import TrainConfig, train
    from memfit.train.demo import (
        BATCH,
        TRAIN_KNOBS,
        before_after,
        held_out_line,
        held_out_metrics,
        minilm_path,
        write_pairs,
    )

    model = minilm_path()
    train_file, eval_file = write_pairs(folder)
    knobs = {**TRAIN_KNOBS, "model": model, "train_file": str(train_file)}

    def probe(name: str, **extra: Any) -> list[dict[str, Any]]:
        # two steps (the second holds the AdamW state) with a cap that never bites: live bytes
        # by phase, one metrics line a step
        run = train(
            TrainConfig(
                **knobs,
                output_dir=str(folder / name),
                max_steps=2,
                memory_cap=1 << 40,
                quiet=True,
                **extra,
            )
        )
        lines = (run.output_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    typer.echo("\nMeasuring what a training step of all-MiniLM-L6-v2 holds (two probe steps)…")
    with progress.status(
        f"two probe steps of all-MiniLM-L6-v2, batch {BATCH}", subject="memfit demo"
    ):
        whole = probe(f"probe-{BATCH}")
        progress.report("two probe steps of all-MiniLM-L6-v2, mini-batches of 4")
        small = probe("probe-4", mini_batch_size=4)
    # above what mini-batches of 4 and every optimizer step hold (no micro-batch makes those
    # smaller), below the whole batch's forward and backward: halfway between
    needed = max(
        *(m["peak_bytes"] for m in small), *(m.get("optimizer_peak_bytes", 0) for m in whole)
    )
    whole_batch = max(
        max(m.get("forward_peak_bytes", 0), m.get("backward_peak_bytes", 0)) for m in whole
    )
    # written as the command prints it (rounded down): the printed command is the run
    cap_arg = size_arg((needed + max(whole_batch, needed)) // 2)
    cap = parse_size(cap_arg, name="--memory-cap")
    train_rows = len(train_file.read_text(encoding="utf-8").splitlines())
    eval_rows = len(eval_file.read_text(encoding="utf-8").splitlines())
    typer.echo(
        "Now a real fine-tuning run: all-MiniLM-L6-v2 (an English sentence-transformers model, MNRL "
        f"loss) learns to match Spanish questions to English guides from {train_rows} embedded "
        f"pairs, batch {BATCH}, on the CPU capped at {format_bytes(cap)} — less than the whole "
        "batch needs, so the guard must recover from a real out-of-memory error. The eval set "
        f"holds {eval_rows} questions about requests no training pair holds; before training:"
    )
    with progress.status("loading all-MiniLM-L6-v2, embedding the eval set", subject="memfit demo"):
        before = held_out_metrics(model, eval_file)
    typer.echo(f"untrained: held-out {held_out_line(before)}")
    out = folder / "run"
    typer.echo(
        f"$ memfit train --task sentence-embedding --model {model} --train-file {train_file} "
        f"--eval-file {eval_file} --effective-batch-size {BATCH} --epochs {knobs['epochs']} "
        f"--memory-cap {cap_arg} --max-seq-len {knobs['max_seq_len']} --lr {knobs['lr']:g} "
        f"--device cpu --output-dir {out}"
    )
    with train_setup_status(
        "loading all-MiniLM-L6-v2, tokenizing the pairs", subject="memfit demo"
    ):
        result = train(
            TrainConfig(**knobs, eval_file=str(eval_file), output_dir=str(out), memory_cap=cap)
        )
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    ooms = sum(e["type"] == "oom" for e in events)
    typer.echo(
        f"done: {result.steps} steps, {result.samples_seen} samples seen (none lost or repeated), "
        f"{ooms} out-of-memory error(s) survived"
    )
    typer.echo(f"held-out {before_after(before, result.eval_metrics)}")
    return out


def drop_weights(folder: Path, out: Path) -> dict[str, int]:
    """Delete what no one opens once the demo has run: the probe runs and the weights folders
    of the run ``out`` (its model and checkpoints, a copy of the installed model each); keep
    the run's logs, its report and the pairs the printed command names. Returns the deleted
    folders (relative to ``folder``) and their bytes."""
    doomed = [p for p in folder.iterdir() if p.is_dir() and p != out]
    doomed += [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
    removed: dict[str, int] = {}
    for path in sorted(doomed):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path)
        removed[f"{path.relative_to(folder).as_posix()}/"] = size
    return removed
