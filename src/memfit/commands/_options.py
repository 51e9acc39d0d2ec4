"""What several verbs share: flags generated from the job's dataclass fields (their type, default,
flag and help line, once), the ``--trace-depth`` flag, ``memfit predict``/``embed``'s common
flags and ``memfit train``'s setup status line."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
import typing
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, TypeVar

import typer

from memfit import progress
from memfit.errors import MemfitError
from memfit.job import Job, flag_of

F = TypeVar("F", bound=Callable[..., Any])


class _Knob:
    """The default of a command parameter that is generated from the job's field of its name."""

    def __repr__(self) -> str:
        return "KNOB"


# ``task: str = KNOB``: the flag, its type, default and help come from :class:`Job`'s ``task``
KNOB: Any = _Knob()


def field_parameter(
    f: dataclasses.Field[Any],
    annotation: Any,
    *,
    help: str | None = None,
    default: Any = dataclasses.MISSING,
    shown_default: str | None = None,
) -> inspect.Parameter:
    """The typer option of dataclass field ``f``: its flag, ``annotation`` (the CLI's type), help
    (the field's metadata, unless ``help``) and default (the field's, unless ``default``; none:
    a required flag). A boolean is a ``--name/--no-name`` pair if its metadata says
    ``negatable`` (or says nothing and it may be None), else ``--name`` alone.

    ``shown_default``: the default the help shows (``[default: …]``) where the flag's own is
    None (not given) and the field's default is decided later."""
    flag = flag_of(f)
    if annotation is bool or annotation == bool | None:
        negatable = f.metadata.get("negatable", annotation is not bool)
        declaration = f"{flag}/--no-{flag.removeprefix('--')}" if negatable else flag
    else:
        declaration = flag
    option = typer.Option(
        declaration,
        help=help or f.metadata["help"],
        show_default=True if shown_default is None else shown_default,
    )
    if default is dataclasses.MISSING:
        default = f.default
    return inspect.Parameter(
        f.name,
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Annotated[annotation, option],
        default=inspect.Parameter.empty if default is dataclasses.MISSING else default,
    )


def with_parameters(command: F, parameters: Iterable[inspect.Parameter]) -> F:
    """``command`` with ``parameters`` as its signature, which typer reads for its flags (it
    calls the command with keywords; the command takes the generated ones as ``**knobs``)."""
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters]
    )
    return command


def job_knobs(command: F) -> F:
    """Give each parameter of ``command`` whose default is :data:`KNOB` the flag, type, default
    and help of :class:`Job`'s field of that name; the other parameters stay as written."""
    hints = typing.get_type_hints(Job)
    fields = {f.name: f for f in dataclasses.fields(Job)}
    signature = inspect.signature(command, eval_str=True)
    parameters = [
        field_parameter(fields[p.name], hints[p.name]) if p.default is KNOB else p
        for p in signature.parameters.values()
    ]
    return with_parameters(command, parameters)


# memfit estimate/plan --trace-depth: the choices, the help and the default in one place
TraceDepth = Annotated[
    Literal["auto", "full"],
    typer.Option(
        help="auto: trace a few layers and extrapolate the repeating block exactly (falls back to "
        "the whole model, and says so, where the model does not repeat); full: trace every layer."
    ),
]


def train_setup_status(message: str, subject: str) -> contextlib.AbstractContextManager[None]:
    """The status line of memfit train's setup, erased by the run's first line or step bar.

    The step bar is drawn by rich's default console, on stdout: where stdout is not a terminal it
    draws nothing before the run ends, and nothing would erase the line; no status line there.
    """
    try:
        interactive = sys.stdout.isatty()
    except (AttributeError, ValueError, OSError):
        interactive = False
    if not interactive:
        return contextlib.nullcontext()
    return progress.status(message, subject=subject, end_on_output=True)


# --- memfit predict and memfit embed ---------------------------------------------------------------
Opt = typer.Option

ModelDir = Annotated[
    str, typer.Argument(help="A model folder, or a memfit train run folder (its model/).")
]
File = Annotated[
    str,
    Opt(help="The rows: .csv/.tsv/.jsonl/.json/.parquet (.gz for text), a folder, save_to_disk."),
]
TextColumn = Annotated[str, Opt(help="The column with the text.")]
IdColumn = Annotated[
    str | None, Opt(help="Copied to the output beside each row.", show_default="id, when present")
]
BatchSize = Annotated[
    int | None, Opt(help="Start at this batch instead of the planned one (still guarded).")
]
GpuMemory = Annotated[
    str | None, Opt(help="Plan the batch for this budget.", show_default="the GPU's free memory")
]
MemoryCap = Annotated[
    str | None, Opt(help="Behave as if the device had only this much memory (e.g. 2GiB).")
]
Device = Annotated[str | None, Opt(help="cuda | cpu", show_default="cuda if present")]
MaxSeqLen = Annotated[
    int | None, Opt(help="Truncate rows to this many tokens.", show_default="the model's limit")
]
Precision = Annotated[str, Opt(help="fp32 | bf16 | fp16 (autocast).")]
Events = Annotated[
    str | None, Opt(help="Write plan/oom/backoff/done events to this file (JSON Lines).")
]
CacheDir = Annotated[
    str | None,
    Opt(help="Where the data reader caches Arrow files.", show_default="the datasets cache"),
]
# memfit predict/embed, memfit plan --write-config, memfit estimate --plot: the outputs the user
# names replace a file memfit wrote; any other existing file only with --overwrite
Overwrite = Annotated[
    bool,
    Opt(
        "--overwrite",
        help="Replace an existing output file that memfit did not write (never an input).",
    ),
]


def run_inference(verb: str, loading: str, doing: str, flags: dict[str, Any]) -> None:
    """``memfit predict``/``embed``: their flags are :class:`~memfit.infer.run.InferConfig`'s,
    one to one; the run prints nothing until its summary line (to stderr)."""
    # on screen before torch is imported
    with progress.status(f"loading {loading}", subject=f"memfit {verb} {flags['model']}"):
        from memfit.infer.output import Terminated
        from memfit.infer.run import InferConfig

        # memfit.infer.predict.predict or memfit.infer.embed.embed
        run = getattr(importlib.import_module(f"memfit.infer.{verb}"), verb)
        progress.report(doing)
        try:
            result = run(InferConfig(**flags))
        except Terminated as exc:
            # SIGTERM/SIGHUP: typer would make this KeyboardInterrupt a silent exit 130; the line
            # says what became of the output, the code is 128 + the signal
            stopped = MemfitError(str(exc))
            stopped.exit_code = exc.exit_code
            raise stopped from None
    typer.echo(result.summary(), err=True)
