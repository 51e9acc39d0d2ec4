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
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import typer

from memfit import progress
from memfit.errors import MemfitError, UsageError
from memfit.job import Job, flag_of, parse_target_modules
from memfit.models.folder import by_name_problem

F = TypeVar("F", bound=Callable[..., Any])


def field_parameter(
    f: dataclasses.Field[Any],
    annotation: Any,
    *,
    help: str | None = None,
    default: Any = dataclasses.MISSING,
    shown_default: str | None = None,
    flag: str | None = None,
) -> inspect.Parameter:
    """The typer option of dataclass field ``f``: its flag (``flag``, else the field's),
    ``annotation`` (the CLI's type), help (the field's metadata, unless ``help``) and default
    (the field's, unless ``default``; none: a required flag). A boolean is a ``--name/--no-name``
    pair if its metadata says ``negatable`` (or says nothing and it may be None), else
    ``--name`` alone.

    ``shown_default``: the default the help shows (``[default: …]``) where the flag's own is
    None (not given) and the field's default is decided later."""
    flag = flag or flag_of(f)
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


def cli_type(hint: Any, default: Any) -> Any:
    """The type a flag of a job field of type ``hint`` takes: a list is comma-separated text;
    None is allowed only where the default is None (not given)."""
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = kinds[0] if len(kinds) == 1 else hint
    if typing.get_origin(kind) is list:
        kind = str  # a, b (comma-separated)
    return kind | None if default is None else kind


def job_options(
    *,
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    required: Iterable[str] = (),
    helps: Mapping[str, str] | None = None,
    shown_defaults: Mapping[str, str] | None = None,
    after: str | None = None,
) -> Callable[[F], F]:
    """A verb's flags for the job's knobs, generated from :class:`Job`'s fields (their flag,
    type, default and help line, written once in :mod:`memfit.job` and :mod:`memfit.levers`).

    The command takes them as ``**knobs`` (field name → value); its own parameters stay as
    written, the job's flags listed after ``after`` (default: its arguments). ``fields``: the
    job's fields the verb has (default: all, less ``exclude``), in the job's order; ``flags``:
    the verb's own spelling of a field's flag (``memfit estimate --batch-size``); ``defaults``:
    the verb's default where it differs from the field's (a definite one: the flag then takes no
    None; False: a boolean is a switch alone); ``required``: flags the verb needs; ``helps``:
    a line the verb adds to a field's help; ``shown_defaults``: what the help shows as the default
    of a flag whose own default (None) is decided later.
    """
    flags, defaults = dict(flags or {}), dict(defaults or {})
    helps, shown_defaults = dict(helps or {}), dict(shown_defaults or {})
    required, exclude = set(required), set(exclude)

    def decorate(command: F) -> F:
        hints = typing.get_type_hints(Job)
        by_name = {f.name: f for f in dataclasses.fields(Job)}
        own = [
            p
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        names = list(by_name) if fields is None else list(fields)
        generated = []
        for name in names:
            if name in exclude or any(p.name == name for p in own):
                continue
            f = by_name[name]
            default = (
                dataclasses.MISSING
                if name in required
                else defaults.get(name, None if f.default is dataclasses.MISSING else f.default)
            )
            kind = cli_type(hints[name], default)
            help = f.metadata["help"] + (f" {helps[name]}" if name in helps else "")
            generated.append(
                field_parameter(
                    f,
                    kind,
                    help=help,
                    default=inspect.Parameter.empty if default is dataclasses.MISSING else default,
                    # a knob not given is decided later: its metadata says what it becomes
                    shown_default=shown_defaults.get(
                        name, f.metadata.get("shown_default") if default is None else None
                    ),
                    flag=flags.get(name),
                )
            )
        arguments = [p for p in own if p.default is inspect.Parameter.empty]
        at = (
            next(k for k, p in enumerate(own) if p.name == after) + 1
            if after is not None
            else len(arguments)
        )
        return with_parameters(command, [*own[:at], *generated, *own[at:]])

    return decorate


def given_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The job's knobs a verb's generated flags received (field → value), a comma-separated list
    (``--lora-target-modules a,b``) as a list."""
    hints = typing.get_type_hints(Job)
    out: dict[str, Any] = {}
    for name, value in knobs.items():
        if name in hints and isinstance(value, str) and _is_list(hints[name]):
            value = parse_target_modules(value)
        out[name] = value
    return out


def _is_list(hint: Any) -> bool:
    return any(typing.get_origin(t) is list for t in (hint, *typing.get_args(hint)))


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
    # a Hub id whose weights are in no cache while the Hub does not answer: one line now, before
    # torch and transformers take their seconds to load
    problem = by_name_problem(str(flags["model"]), "MODEL_DIR", f"memfit {verb}")
    if problem:
        raise UsageError(problem)
    with progress.status(f"loading {loading}", subject=f"memfit {verb} {flags['model']}"):
        # start-up: inference loads torch and transformers, under the status line
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
