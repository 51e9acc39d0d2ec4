"""``memfit doctor``: an out-of-memory error explained and its fixes ranked
(:mod:`memfit.report.doctor`), from a message, a log or a run folder."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from memfit import progress
from memfit.commands._options import KNOB, job_knobs
from memfit.errors import UsageError
from memfit.report import doctor

# the effective batch doctor derives (--batch-size × --gradient-accumulation-steps): no flag
_DERIVED = "(derived effective batch)"


@job_knobs
def doctor_command(
    run_dir: Annotated[
        str | None, typer.Argument(help="A memfit train output folder (events.jsonl, run.json).")
    ] = None,
    message: Annotated[str | None, typer.Option(help="The out-of-memory message, pasted.")] = None,
    file: Annotated[
        str | None, typer.Option(help="A log file (or -, standard input): its last OOM message.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="The job's model (as memfit estimate takes it): fixes get saves_bytes."),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="With --model: classification | causal-lm | sentence-embedding"),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="With --model: the micro-batch that ran out of memory.")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="With --model: tokens per sample.")] = None,
    precision: Annotated[str, typer.Option(help="fp32 | fp16 | bf16")] = "fp32",
    optimizer: str = KNOB,
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="The job already recomputes.")
    ] = False,
    num_labels: Annotated[int, typer.Option(help="Classes of a classification head.")] = 2,
    loss: Annotated[str | None, typer.Option(help="sentence-embedding loss.")] = None,
    mini_batch_size: int | None = KNOB,
    lora_rank: Annotated[int | None, typer.Option(help="The job trains LoRA adapters.")] = None,
    quantization: str | None = KNOB,
    double_quant: bool | None = KNOB,
    gradient_accumulation_steps: Annotated[
        int, typer.Option(help="Micro-batches per optimizer step.")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Explain an out-of-memory error (a message, a log or a run folder) and rank the fixes."""
    given = [
        name
        for name, v in (("--message", message), ("--file", file), ("RUN_DIR", run_dir))
        if v is not None
    ]
    if len(given) != 1:
        raise UsageError(
            "give exactly one of --message TEXT, --file LOG or RUN_DIR"
            + (f" (got {', '.join(given)})" if given else "")
        )
    knobs = None
    if model is not None:
        missing = [
            f
            for f, v in (("--task", task), ("--batch-size", batch_size), ("--seq-len", seq_len))
            if v is None
        ]
        if missing:
            raise UsageError(f"--model: also give {', '.join(missing)} to price the fixes")
        if run_dir is not None:
            raise UsageError("--model: a run folder names its own model (run.json); drop --model")
        assert task is not None and batch_size is not None and seq_len is not None
        knobs = doctor.failed_job(
            model=model, task=task, batch_size=batch_size, seq_len=seq_len, precision=precision,
            gradient_checkpointing=gradient_checkpointing, optimizer=optimizer,
            num_labels=num_labels, loss=loss, mini_batch_size=mini_batch_size,
            lora_rank=lora_rank,
            quantization=quantization, double_quant=double_quant,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )  # fmt: skip
        # doctor's own flags: --batch-size is the micro-batch that failed, and the effective
        # batch follows from it (a problem with it is the --batch-size the user gave)
        problems = [
            p
            for p in knobs.problems(
                typed=True,
                flags={"micro_batch_size": "--batch-size", "effective_batch_size": _DERIVED},
            )
            if not p.startswith(_DERIVED)
        ]
        if problems:
            raise UsageError("; ".join(problems))
    # pricing the fixes runs memfit estimate (torch, traces: seconds), as a run folder's does;
    # reading a message alone is instant and shows no status line
    pricing = (
        progress.status(f"pricing the fixes with memfit estimate {model}", subject="memfit doctor")
        if knobs is not None
        else progress.status(
            "pricing the fixes with the run's model", subject=f"memfit doctor {run_dir}"
        )
        if run_dir is not None
        else contextlib.nullcontext()
    )
    with pricing:
        if message is not None:
            result = doctor.from_text(message, flag="--message", knobs=knobs)
        elif file is not None:
            result = doctor.from_file(file, knobs=knobs)
        else:
            assert run_dir is not None
            result = doctor.from_run_dir(run_dir)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        typer.echo(doctor.format_text(result))
