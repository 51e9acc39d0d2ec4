"""The ``memfit`` command line: the verbs (one module each, in :mod:`memfit.commands`) registered
under one program, and its entry point, where errors become one plain line on stderr and an exit
code."""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
import typer.main
import typer.models

try:  # recent typer carries its own copy of click
    from typer._click.exceptions import ClickException as _ClickException
    from typer._click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp
except ImportError:  # pragma: no cover - typer built on click
    from click.exceptions import ClickException as _ClickException  # type: ignore[assignment]
    from click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp  # type: ignore[assignment,attr-defined]

from memfit import __version__, quiet
from memfit.errors import MemfitError, UsageError
from memfit.extras import missing_module_line
from memfit.paths import is_user_os_error, os_error_line
from memfit.runtime import launched_world_size, quiet_deepspeed

# the verbs, in the order ``memfit --help`` lists them: ``memfit VERB`` runs the function
# ``VERB_command`` of ``memfit.commands.VERB`` (a group: its module's ``app``)
VERBS = (
    "estimate", "plan", "limits", "report", "gpus", "models", "train", "doctor", "demo", "predict",
    "embed", "data", "ui",
)  # fmt: skip


def _summary(verb: str) -> str:
    """The docstring of ``verb``'s command function, read from its module's source, not imported:
    ``memfit --help`` lists every verb, and some (train) import torch."""
    spec = importlib.util.find_spec(f"memfit.commands.{verb}")
    assert spec is not None and spec.origin is not None
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name == f"{verb}_command":
            return ast.get_docstring(node) or ""
    return ""


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    # a full stop followed by a space ends it (not the dot of ``report.html`` or ``e.g.``)
    match = re.search(r"(?<!e\.g)(?<!i\.e)[.!?](?=\s)", paragraph)
    return paragraph if match is None else paragraph[: match.end()]


class _Verb(typer.core.TyperCommand):
    """A verb (or a group's command) whose usage line names its arguments as click does:
    ``MODEL``, ``[RUN_DIR]`` (typer writes a required one in braces)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces.extend(param.get_usage_pieces(ctx))
                continue
            name = param.metavar or (param.name or "").upper()
            pieces.append(
                (name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else "")
            )
        return pieces


def _house_style(command: Any) -> Any:
    """``command`` (and a group's commands) in one help style: arguments named in capitals
    (``MODEL``, ``RUN_DIR``) in the usage line and the argument list, every default shown as
    ``[default: …]`` (a default described in words, ``show_default="cuda if present"``, too:
    click would put it in parentheses), and a group's listing of its commands with each one's
    whole first sentence."""
    for param in command.params:
        if param.param_type_name == "argument" and param.metavar is None:
            param.metavar = (param.name or "").upper()
        shown = getattr(param, "show_default", None)
        if isinstance(shown, str):
            param.help = f"{param.help or ''}  [default: {shown}]".strip()
            param.show_default = False
    if type(command) is typer.core.TyperCommand:
        command.__class__ = _Verb  # the same object, with the usage line above
    for sub in getattr(command, "commands", {}).values():
        if sub.short_help is None and sub.help:
            sub.short_help = first_sentence(sub.help)
        _house_style(sub)
    return command


class _Verbs(typer.core.TyperGroup):
    """The program's verbs: a verb's module is imported when that verb runs or shows its help."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in VERBS:
            return None
        if cmd_name not in self.commands:
            module = importlib.import_module(f"memfit.commands.{cmd_name}")
            group = getattr(module, "app", None)
            command: Any
            if group is not None:
                command = typer.main.get_group(group)
            else:
                info = typer.models.CommandInfo(
                    cmd_name, callback=module.__dict__[f"{cmd_name}_command"]
                )
                command = typer.main.get_command_from_info(
                    info, pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=None
                )
            self.commands[cmd_name] = _house_style(command)
        return self.commands[cmd_name]

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        # each verb's first sentence, whole (wrapped, never cut), from the source
        rows = [(verb, first_sentence(_summary(verb))) for verb in VERBS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


app = typer.Typer(
    name="memfit",
    cls=_Verbs,
    help="Predict, plan and guard the memory of transformer fine-tuning.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memfit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Predict, plan and guard the memory of transformer fine-tuning."""


def _fail(message: str, code: int, *, quick: bool = False) -> None:
    # several ranks (torchrun) reach the same verdict on the same input: each host's first rank
    # says it once (on several hosts each has its own output, and maybe its own files)
    local_rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    if code in (2, 3) and local_rank not in ("", "0"):
        sys.exit(code)
    # one line per problem (bad data reports every bad row at once)
    for line in message.splitlines() or [""]:
        sys.stderr.write(f"memfit: error: {line}\n")
    if quick:
        # nothing is left to save (a lost rank): end without freeing every module one by one,
        # which takes seconds (tens of them on a busy host) while the job waits for this rank
        _quick_exit(code)
    sys.exit(code)


def _usage_message(exc: Any) -> str:
    message = " ".join(exc.format_message().split())
    # typer validates choices (Literal options) through pydantic, which prefixes its ValueError
    message = message.replace("Value error, ", "")
    param = getattr(exc, "param", None)
    if param is not None and getattr(param, "opts", None):
        flag = max(param.opts, key=len)
        # (an argument is named in capitals: MODEL)
        if flag.lower() not in message.lower():
            message = f"{flag}: {message}"
    return message


# verbs that only read and print: once they are done, nothing is left to tear down
_QUICK_EXIT_VERBS = frozenset({"estimate", "plan", "models", "gpus", "doctor"})


def main(argv: list[str] | None = None) -> Any:
    """Entry point: errors become one plain line on stderr with a meaningful exit code.

    Run as a program (``argv`` None), a read-only verb ends without the interpreter's teardown:
    freeing torch's and transformers' modules one by one takes a second or more, after the
    answer is printed. So does a rank of a training run of several ranks, once its part is
    written and its process group is gone: the teardown destroys the process group's C++
    threads in an order that can end in ``std::terminate`` ("terminate called without an active
    exception", SIGABRT: seen on a finished run's rank on a loaded 2-core machine), and the
    launcher then reports the finished run as failed. Exit handlers still run and both streams
    are flushed first.
    """
    # transformers imports DeepSpeed, where installed, as models load: its findings are not
    # memfit's output (its errors still show)
    quiet_deepspeed()
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    a_rank = verb == "train" and launched_world_size() > 1
    if argv is not None or (verb not in _QUICK_EXIT_VERBS and not a_rank):
        return _main(argv)
    if not a_rank:
        # importing torch and transformers makes millions of objects, and the collector's
        # default thresholds walk them again and again (about a second of a cold estimate)
        gc.set_threshold(50_000, 20, 100)
    try:
        _main(None)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    _quick_exit(code)
    return None


def _quick_exit(code: int) -> None:

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # a closed pipe: nothing more can be said on it
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # what a library wrote through C's stdio is in its buffers still (exit() would flush them)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


_NO_BACKGROUND = "MEMFIT_NO_BACKGROUND"  # memfit.estimate.background.OFF_VARIABLE
# whether _main set MEMFIT_NO_BACKGROUND for the verb now running (the user had not set it): a
# long-lived verb (memfit ui, which answers question after question) takes it off again then,
# and leaves the user's own setting alone (see :func:`background_set_by_cli`)
_background_set_here = False


def background_set_by_cli() -> bool:
    """Whether ``MEMFIT_NO_BACKGROUND`` is set only because the CLI set it for the verb now
    running, rather than by the user: ``memfit ui`` then lets the background tracer
    (:mod:`memfit.estimate.background`) work on the other core, as it would for a notebook."""
    return _background_set_here


def _main(argv: list[str] | None = None) -> Any:
    # the third-party lines that say nothing to the user (memfit.quiet; `import memfit` put
    # them in place, a caller of main() may have reset its warnings filters since)
    quiet.install()
    # transformers' advice for training scripts is noise for a planning tool
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # a command answers and exits: nothing is traced ahead in the background for later questions
    # (memfit.estimate.background; the variable, not its off(), keeps torch out of start-up), and
    # a caller of main() in a long-lived process gets its background back after; memfit ui,
    # long-lived itself, takes the variable off again where it was set here
    global _background_set_here
    background_set_here = _NO_BACKGROUND not in os.environ
    if background_set_here:
        os.environ[_NO_BACKGROUND] = "1"
    outer, _background_set_here = _background_set_here, background_set_here
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="memfit", standalone_mode=False)
        # outside standalone mode click returns typer.Exit's code instead of exiting
        if isinstance(result, int) and not isinstance(result, bool) and result != 0:
            sys.exit(result)
        return result
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail("aborted", 130)
    except _NoArgsIsHelp:
        sys.exit(0)  # the help was printed
    except _ClickException as exc:
        # bad usage: one line naming the flag, no boxed panel
        _fail(_usage_message(exc), 2)
    except UsageError as exc:
        _fail(str(exc), 2)
    except MemfitError as exc:
        _fail(str(exc), exc.exit_code, quick=getattr(exc, "quick_exit", False))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except ModuleNotFoundError as exc:
        # the last resort for an optional package that a verb's own checks did not name first
        # (memfit.extras): which extra installs it, exit 2. Any other missing module is a bug
        args = sys.argv[1:] if argv is None else argv
        verb = next((a for a in args if not a.startswith("-")), "")
        line = missing_module_line(exc, f"memfit {verb}".strip())
        if line is None:
            raise
        _fail(line, 2)
    except OSError as exc:
        # the last resort for a path or disk the user gave (full, read-only, not there, a file
        # where a folder should be): one line, exit 2; the commands check their destinations
        # first, with the flag's name. Any other OSError is a bug: its traceback, exit 1
        if not is_user_os_error(exc):
            raise
        _fail(os_error_line(exc), 2)
    finally:
        _background_set_here = outer
        if background_set_here:
            os.environ.pop(_NO_BACKGROUND, None)
    return None


if __name__ == "__main__":  # pragma: no cover
    main()
