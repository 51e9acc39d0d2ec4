"""What a script sees when the guard stops it: one line and an exit code, not a traceback.

``trainer.train()`` raises :class:`~memfit.errors.NothingFitsError` (a
:class:`~memfit.errors.MemfitError`) when nothing the guard can do makes a step fit: code that
wants to go on catches it like any exception. A script that does not catch it ends as ``memfit
train`` does: ``memfit: error: <the one line>`` on stderr and the error's exit code (3), without
the traceback through the Trainer's loop. That is :func:`exit_if_uncaught` (applied by :class:`Surfaced`): it marks the error
and chains a ``sys.excepthook`` in front of the one there is, for marked errors only; every
other exception, and a marked one that something caught, is untouched. Notebooks do not use
``sys.excepthook``: there the error shows as itself, a short traceback ending in its one line.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from memfit.errors import MemfitError

# the attribute that marks an error (and the hook, so that it is chained once)
_MARK = "_memfit_exit_if_uncaught"


class Surfaced:
    """A ``with`` block that a :class:`~memfit.errors.MemfitError` leaves as itself, its
    traceback cut at the block (the frames inside, a Trainer's loop, say nothing a user can act
    on) and marked by :func:`exit_if_uncaught`. Any other exception passes untouched."""

    def __enter__(self) -> Surfaced:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(error, MemfitError):
            raise exit_if_uncaught(error).with_traceback(None) from None


def exit_if_uncaught(error: MemfitError) -> MemfitError:
    """Mark ``error`` so that, uncaught, it ends the script with its line and exit code."""
    setattr(error, _MARK, True)
    if not getattr(sys.excepthook, _MARK, False):
        sys.excepthook = _chained(sys.excepthook)
    return error


def _chained(previous: Any) -> Any:
    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not (isinstance(value, MemfitError) and getattr(value, _MARK, False)):
            previous(kind, value, tb)
            return
        # the same shape as the memfit CLI's errors: one line per line of the message
        for line in str(value).splitlines() or [""]:
            sys.stderr.write(f"memfit: error: {line}\n")
        sys.stderr.flush()
        # a SystemExit raised by the hook ends the interpreter with its code (CPython's
        # PyErr_Print handles it as it handles an uncaught one)
        sys.exit(value.exit_code)

    setattr(hook, _MARK, True)
    return hook
