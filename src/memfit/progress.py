"""A status line on stderr while a command works before it has anything to say.

``with progress.status("loading torch and transformers", subject="memfit estimate gpt2"):``
shows a rich spinner with "memfit estimate gpt2: loading torch and transformers" on stderr while
the block runs; code deep inside (the estimator's tracer), which does not know the command, refines
what is being done with ``progress.report("tracing 3 of 12 layers")``: the line then reads
"memfit estimate gpt2: tracing 3 of 12 layers". ``report`` costs one global look-up when no status
line is shown. A nested ``status`` block changes the text (keeping the subject unless it gives its
own) and gives the outer one its text back when it ends; the line is erased when the outermost
block ends. A block opened with ``steady=True`` keeps its text against ``report`` from the code
inside it (a plan's "tracing 5 of up to 24 knob sets" is not replaced by each trace's layer
count); its owner changes it with :func:`say`.

The line is shown only where a person watches it:

- stderr is a terminal (``isatty``): never under pipes, files, ``CliRunner`` or subprocess tests;
- ``MEMFIT_NO_PROGRESS`` is unset, empty or ``0``;
- ``CI`` is unset, empty, ``0``, ``false`` or ``no`` (CI logs keep no spinners);
- ``TERM`` is not ``dumb`` (a terminal that cannot move its cursor would get one line per frame);
- this is rank 0 (``RANK`` unset or 0): ranks launched by torchrun share one terminal.

A program that shows progress its own way (``memfit ui``'s page) opens :func:`listening` with a
callback: in that thread, every :func:`report`, :func:`say` and :func:`status` message also goes to
it, whether or not a status line is shown.

Nothing goes to stdout: while the line is shown, the first write to stdout erases it for good (the
command's output has begun, so the status has done its job) and then goes through untouched.
Writes to stderr (warnings, the guard's lines) are printed above the line, which stays, or, with
``status(..., end_on_output=True)``, erase it for good first: that is for phases followed by a
display of their own (``memfit train``'s step bar), which must not share the terminal with it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

OFF_VARIABLE = "MEMFIT_NO_PROGRESS"
# spinner frames per second: enough to look alive, little enough not to cost a 2-core machine
_REFRESH_PER_SECOND = 8

_FALSE = ("", "0", "false", "no", "off")


class _Shown:
    """The status line on screen: its rich Live, the stream watchers, one text per nesting level."""

    def __init__(self, subject: str, message: str, *, end_on_output: bool) -> None:
        # start-up: rich is loaded only when a status line is shown on a terminal
        from rich.console import Console
        from rich.live import Live
        from rich.spinner import Spinner
        from rich.text import Text

        self._text_type = Text
        self.stdout: TextIO = sys.stdout
        self.stderr: TextIO = sys.stderr
        # [subject, text] of each status() block open, the innermost last
        self.levels = [[subject, message]]
        # whether each level is steady (keeps its text against report())
        self.steady = [False]
        self._lock = threading.Lock()
        # stderr=True, pinned to the stream of now: sys.stderr is the watcher below from here on
        self.console = Console(file=self.stderr, stderr=True)
        self.spinner = Spinner("dots", text=self._line(), style="status.spinner")
        # the streams are watched here, not by rich's redirection: rich would send stdout's
        # writes to the status's console, that is to stderr
        self.live: Any = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=_REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.stdout_watch = _Watch(self.stdout, self, ends=True)
        self.stderr_watch = _Watch(self.stderr, self, ends=end_on_output)
        self.live.start(refresh=True)  # the first frame now, not after the first tick
        sys.stdout = self.stdout_watch
        sys.stderr = self.stderr_watch

    def _line(self) -> Any:
        subject, text = self.levels[-1]
        line = f"{subject}: {text}" if subject else text
        # markup-free (model names and paths hold brackets), and on one line
        return self._text_type(" ".join(line.split()))

    def _render(self) -> Any:
        line = self.spinner.render(self.console.get_time())
        if isinstance(line, self._text_type):
            # one line: a long path is cut with an ellipsis rather than wrapped
            line.no_wrap = True
            line.overflow = "ellipsis"
        return line

    def show(self, *, now: bool = False) -> None:
        """Draw the innermost level's text at the next frame, or ``now`` (a new phase)."""
        self.spinner.text = self._line()
        live = self.live
        if now and live is not None:
            live.refresh()

    def stop(self) -> None:
        """Erase the line and give the streams back; later calls do nothing."""
        global _shown
        with self._lock:
            live, self.live = self.live, None
        if live is None:
            return
        if _shown is self:
            _shown = None  # report() is a no-op from here on
        self.stderr_watch.flush_above()
        # the streams as they were, unless someone replaced them meanwhile
        if sys.stdout is self.stdout_watch:
            sys.stdout = self.stdout
        if sys.stderr is self.stderr_watch:
            sys.stderr = self.stderr
        live.stop()


class _Watch:
    """Stands in for sys.stdout or sys.stderr while the status line is shown.

    A write either erases the line for good first (``ends``) or is printed above it; everything
    else (``fileno``, ``isatty``, ``encoding``, ``buffer``) is the stream's own.
    """

    def __init__(self, stream: TextIO, shown: _Shown, *, ends: bool) -> None:
        # start-up: rich is loaded only when a status line is shown on a terminal
        from rich.file_proxy import FileProxy

        self._stream = stream
        self._shown = shown
        self._ends = ends
        self._above = None if ends else FileProxy(shown.console, stream)

    def write(self, text: Any) -> int:
        # an empty write (click probes streams with write(b"")) changes nothing on screen
        if text and self._shown.live is not None:
            if self._ends:
                self._shown.stop()
            elif isinstance(text, str) and self._above is not None:
                self._above.write(text)
                return len(text)
        return self._stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._shown.live is not None:
            self.flush_above()
        self._stream.flush()

    def flush_above(self) -> None:
        if self._above is not None:
            self._above.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_shown: _Shown | None = None  # the status line on screen; None when there is none
_depth = 0  # status() blocks open, shown or not
# listening() blocks open in any thread: report() looks no further while there are none
_listening = 0
_listening_lock = threading.Lock()
_listeners = threading.local()  # .callbacks: this thread's, the innermost last


@contextlib.contextmanager
def listening(callback: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, in this thread, every message of :func:`report`, :func:`say` and
    :func:`status` also goes to ``callback(message)`` (whether or not a status line is shown):
    for a program that shows progress its own way (``memfit ui``'s page). Blocks nest; each
    open one hears every message of its thread (a callback open twice, once). What ``callback`` raises reaches the code that
    reported (a page may stop the work so)."""
    global _listening
    callbacks = getattr(_listeners, "callbacks", None)
    if callbacks is None:
        callbacks = _listeners.callbacks = []
    callbacks.append(callback)
    with _listening_lock:
        _listening += 1
    try:
        yield
    finally:
        with _listening_lock:
            _listening -= 1
        callbacks.remove(callback)


def _tell(message: str) -> None:
    """``message`` to this thread's :func:`listening` callbacks, if any: each once, however many
    blocks opened it."""
    told: list[Callable[[str], None]] = []
    for callback in list(getattr(_listeners, "callbacks", None) or ()):
        if callback not in told:  # equal: a bound method is a new object at each access
            told.append(callback)
            callback(message)


def _wanted() -> bool:
    """Whether a status line is wanted here: see the module's docstring."""
    environ = os.environ
    if environ.get(OFF_VARIABLE, "").strip().lower() not in _FALSE:
        return False
    if environ.get("CI", "").strip().lower() not in _FALSE:
        return False
    if environ.get("TERM") == "dumb" or environ.get("RANK", "0") not in ("", "0"):
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):  # a closed or odd stream
        return False


def report(message: str) -> None:
    """Say what is being done now: the text after the status line's subject.

    A no-op when no status line is shown and no one listens (:func:`listening`): two global
    look-ups, cheap enough to call per step.
    """
    if _listening:
        _tell(message)
    shown = _shown
    if shown is None:
        return
    level = shown.levels[-1]
    if level[1] != message and not shown.steady[-1]:
        level[1] = message
        shown.show()


def is_open() -> bool:
    """Whether a :func:`status` block is open (a command's, shown or not): library code may
    nest its own in it, but never opens a line where no command did."""
    return _depth > 0


def say(message: str) -> None:
    """Set the innermost block's text, a ``steady`` one's too: for the code that opened it (from
    any thread). A no-op when no status line is shown and no one listens (:func:`listening`)."""
    if _listening:
        _tell(message)
    shown = _shown
    if shown is None:
        return
    level = shown.levels[-1]
    if level[1] != message:
        level[1] = message
        shown.show()


@contextlib.contextmanager
def status(
    message: str,
    *,
    subject: str | None = None,
    end_on_output: bool = False,
    steady: bool = False,
) -> Iterator[None]:
    """Show ``subject: message`` with a spinner on stderr while the block runs (see the module).

    ``subject`` (say, the command and its model) stays while :func:`report` changes ``message``;
    a nested block keeps the outer one's subject unless it gives its own, and restores the outer
    one's text when it ends. ``end_on_output``: the first write to stderr (as well as stdout)
    erases the line for good. ``steady``: :func:`report` from inside the block leaves its text
    alone; :func:`say` changes it.
    """
    global _depth, _shown
    if _listening:
        _tell(message)
    if _depth:
        _depth += 1
        shown = _shown
        if shown is not None:
            outer_subject = shown.levels[-1][0]
            shown.levels.append([outer_subject if subject is None else subject, message])
            shown.steady.append(steady)
            shown.show(now=True)
        try:
            yield
        finally:
            _depth -= 1
            if shown is not None:
                shown.levels.pop()
                shown.steady.pop()
                shown.show(now=True)
        return
    _depth = 1
    try:
        if not _wanted():
            yield
            return
        try:
            shown = _Shown(subject or "", message, end_on_output=end_on_output)
            shown.steady[0] = steady
        except Exception:  # a terminal rich cannot drive: the command runs on without a line
            yield
            return
        _shown = shown
        try:
            yield
        finally:
            shown.stop()
    finally:
        _depth = 0
        _shown = None
