"""memfit.progress: a status line on stderr, only on a terminal, never on stdout."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterator

import pytest

from memfit import progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SPINNER = re.compile("^[\u2800-\u28ff] ")  # rich's "dots" frames are braille characters


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal (what rich and progress look at)."""

    def isatty(self) -> bool:
        return True


def frames(text: str) -> list[str]:
    """The texts drawn on a fake terminal, in order (escape codes and spinner frames dropped)."""
    lines = re.split(r"[\r\n]+", ANSI.sub("", text))
    return [SPINNER.sub("", line) for line in (x.strip() for x in lines) if line]


@pytest.fixture
def terminal_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the environment against a status line."""
    for name in (progress.OFF_VARIABLE, "CI", "RANK", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")


@contextlib.contextmanager
def on_a_terminal() -> Iterator[tuple[FakeTerminal, io.StringIO]]:
    """stderr a fake terminal, stdout a plain pipe (inside the test: pytest's capture puts its
    own streams back between a fixture's setup and the test)."""
    stderr, stdout = FakeTerminal(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        yield stderr, stdout


def test_report_without_a_status_is_a_no_op(capsys: pytest.CaptureFixture[str]) -> None:
    progress.report("tracing 3 of 12 layers")
    assert progress._shown is None
    assert capsys.readouterr() == ("", "")


def test_nothing_is_shown_when_stderr_is_not_a_terminal(
    terminal_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with progress.status("loading torch", subject="memfit estimate gpt2"):
        assert progress._shown is None
        progress.report("tracing 3 of 12 layers")
        with progress.status("inner"):
            progress.report("step")
    assert capsys.readouterr() == ("", "")


def test_the_status_is_on_stderr_and_never_on_stdout(terminal_env: None) -> None:
    with on_a_terminal() as (stderr, stdout):
        with progress.status("loading torch and transformers", subject="memfit estimate gpt2"):
            assert sys.stdout is not stdout  # watched while the line is shown
            progress.report("tracing 3 of 12 layers")
        # the streams are given back
        assert sys.stdout is stdout and sys.stderr is stderr
    shown = frames(stderr.getvalue())
    assert shown[0] == "memfit estimate gpt2: loading torch and transformers"
    assert shown[-1] == "memfit estimate gpt2: tracing 3 of 12 layers"
    assert stderr.getvalue().endswith("\x1b[2K")  # and erased at the end
    assert stdout.getvalue() == ""
    assert progress._shown is None and progress._depth == 0


def test_nested_status_restores_the_outer_text(terminal_env: None) -> None:
    with on_a_terminal() as (stderr, _), progress.status("planning", subject="memfit plan bert"):
        with progress.status("estimating micro-batch 8"):
            progress.report("tracing 3 of 12 layers")
            with progress.status("reading the catalog", subject="memfit gpus"):
                pass
        assert progress._shown is not None
        assert progress._shown.levels == [["memfit plan bert", "planning"]]
    shown = frames(stderr.getvalue())
    # an inner block keeps the outer subject unless it names its own; its end draws the outer
    # text at once, and the last frame before the line is erased is the outer one
    assert shown.index("memfit plan bert: estimating micro-batch 8") > 0
    assert "memfit gpus: reading the catalog" in shown
    assert shown[-1] == "memfit plan bert: planning"


def test_the_first_write_to_stdout_ends_the_status(terminal_env: None) -> None:
    with on_a_terminal() as (stderr, stdout), progress.status("working"):
        print("a warning", file=sys.stderr)  # printed above the line, which stays
        assert progress._shown is not None
        print('{"total_bytes": 1}')
        # the command's output began: the line is gone for good, report() does nothing
        assert progress._shown is None and sys.stdout is stdout
        progress.report("later")
        with progress.status("inner"):
            pass
    assert stdout.getvalue() == '{"total_bytes": 1}\n'
    assert "a warning" in frames(stderr.getvalue())
    assert "later" not in stderr.getvalue() and "inner" not in stderr.getvalue()


def test_end_on_output_ends_the_status_at_the_first_stderr_line(terminal_env: None) -> None:
    with (
        on_a_terminal() as (stderr, _),
        progress.status("loading the model", subject="memfit train", end_on_output=True),
    ):
        sys.stderr.write("step 1/10  loss 0.69\n")
        assert progress._shown is None and sys.stderr is stderr
    assert frames(stderr.getvalue())[0] == "memfit train: loading the model"
    assert stderr.getvalue().endswith("\x1b[2Kstep 1/10  loss 0.69\n")


@pytest.mark.parametrize(
    ("name", "value"),
    [(progress.OFF_VARIABLE, "1"), ("CI", "true"), ("TERM", "dumb"), ("RANK", "1")],
)
def test_switched_off_by_the_environment(
    terminal_env: None, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with on_a_terminal() as (stderr, stdout), progress.status("working"):
        assert progress._shown is None
    assert stderr.getvalue() == "" and stdout.getvalue() == ""


def test_text_is_not_markup(terminal_env: None) -> None:
    with (
        on_a_terminal() as (stderr, _),
        progress.status("[3, 4] of [bold]12[/bold]", subject="[x]"),
    ):
        pass
    assert frames(stderr.getvalue())[0] == "[x]: [3, 4] of [bold]12[/bold]"


def test_an_error_in_the_block_erases_the_line_and_propagates(terminal_env: None) -> None:
    with on_a_terminal() as (stderr, stdout):
        with pytest.raises(ValueError, match="bad input"), progress.status("working"):
            raise ValueError("bad input")
        assert sys.stdout is stdout and sys.stderr is stderr
    assert progress._shown is None and progress._depth == 0
    assert stderr.getvalue().endswith("\x1b[2K")
