"""``memfit doctor``: an out-of-memory error explained and its fixes ranked
(:mod:`memfit.report.doctor`), from a message, a log or a run folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import given_knobs, job_options
from memfit.errors import UsageError
from memfit.job import STEP_DEFAULTS, STEP_FIELDS, Job, flag_of
from memfit.report import doctor

# the effective batch doctor derives (--batch-size × --gradient-accumulation-steps × the
# ranks): no flag
_DERIVED = "(derived effective batch)"
_FIELDS = {f.name: f for f in dataclasses.fields(Job)}
# the knob flags memfit doctor gained when its flags came from the job's fields (issue 31): they
# only price fixes, so without --model they are refused. The ones it took before stay accepted
# there (it ignored them without --model, and scripts may pass them so).
_MODEL_ONLY = (
    "max_seq_len",
    "world_size",
    "sharding",
    "attn_implementation",
    "lora_target_modules",
    "lora_dropout",
    "device",
)
_ACCEPTED_ALONE = tuple(name for name in STEP_FIELDS if name not in _MODEL_ONLY)


def _with_model(name: str) -> str:
    """The doctor's words after a knob's own help line: the knobs price the fixes, with --model
    only (a help line that is a bare list of choices gets them in parentheses)."""
    if name == "micro_batch_size":
        return "With --model: the micro-batch that ran out of memory."
    own = _FIELDS[name].metadata["help"].rstrip()
    return "With --model." if own.endswith(".") else "(with --model)."


@job_options(
    fields=("model", *STEP_FIELDS),
    flags={"micro_batch_size": "--batch-size"},
    defaults=STEP_DEFAULTS,
    helps={
        "model": "With it, the fixes are priced with memfit estimate (saves_bytes).",
        **{name: _with_model(name) for name in STEP_FIELDS},
    },
    after="file",
)
def doctor_command(
    run_dir: Annotated[
        str | None, typer.Argument(help="A memfit train output folder (events.jsonl, run.json).")
    ] = None,
    message: Annotated[str | None, typer.Option(help="The out-of-memory message, pasted.")] = None,
    file: Annotated[
        str | None, typer.Option(help="A log file (or -, standard input): its last OOM message.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    **knobs: Any,
) -> None:
    """Explain an out-of-memory error (a message, a log or a run folder) and rank the fixes."""
    sources = [
        name
        for name, v in (("--message", message), ("--file", file), ("RUN_DIR", run_dir))
        if v is not None
    ]
    if len(sources) != 1:
        raise UsageError(
            "give exactly one of --message TEXT, --file LOG or RUN_DIR"
            + (f" (got {', '.join(sources)})" if sources else "")
        )
    values = given_knobs(knobs)
    model, task = values["model"], values["task"]
    if model is None:
        # a knob flag given (not its default) that prices the fixes of nothing
        alone = [
            flag_of(_FIELDS[name])
            for name, value in values.items()
            if name not in ("model", *_ACCEPTED_ALONE)
            and value is not None
            and value != STEP_DEFAULTS.get(name, _FIELDS[name].default)
        ]
        if alone:
            raise UsageError(
                f"{', '.join(alone)}: only with --model (the failed job's knobs price the fixes; "
                "a run folder's come from its run.json)"
            )
    batch_size, seq_len = values.pop("micro_batch_size"), values["seq_len"]
    job = None
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
        job = doctor.failed_job(batch_size=batch_size, **values)
        # doctor's own flags: --batch-size is the micro-batch that failed, and the effective
        # batch follows from it (a problem with it is the --batch-size the user gave)
        problems = [
            p
            for p in job.problems(
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
        if job is not None
        else progress.status(
            "pricing the fixes with the run's model", subject=f"memfit doctor {run_dir}"
        )
        if run_dir is not None
        else contextlib.nullcontext()
    )
    with pricing:
        if message is not None:
            result = doctor.from_text(message, flag="--message", knobs=job)
        elif file is not None:
            result = doctor.from_file(file, knobs=job)
        else:
            assert run_dir is not None
            result = doctor.from_run_dir(run_dir)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        typer.echo(doctor.format_text(result))
