"""Errors that memfit reports to the user as one plain line (exit code 2 for bad input)."""

from __future__ import annotations


class MemfitError(Exception):
    """Base class: a problem memfit explains to the user instead of a traceback."""

    exit_code = 1


class UsageError(MemfitError):
    """Bad input or usage: an unknown model, a size that does not parse, a flag out of range.

    The message names the flag or file (and line, where there is one) and, where possible, the fix.
    """

    exit_code = 2


class NothingFitsError(MemfitError):
    """No configuration fits the memory budget (exit code 3)."""

    exit_code = 3


class TrainingStoppedError(MemfitError):
    """A run stopped itself to keep good weights: its loss or gradient was not finite (exit 4).

    The newest good state is kept as a checkpoint; nothing of the failed step was applied.
    """

    exit_code = 4
