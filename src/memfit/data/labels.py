"""The labels of a label column: their canonical text, which values a file may hold
(:class:`LabelRule`) and the sorted label set.

A label column holds the label's canonical text (``"3"`` for ``3``, ``3.0``, ``"3.0"`` and
``" 3 "``; a name stripped). No label: a fraction, NaN, an infinity, a list. Without a fixed label
set (``--labels``, ``--num-labels``) integer labels are 0 … 2**31-1, and the labels of an input are
all integers or all names (see :mod:`memfit.data.rows`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_INTEGER = re.compile(r"^[+-]?\d+$")
# a number written in a label cell ("3.0", "1e30", "1.5"): a label when it is a whole number
_NUMBER = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")
_NOT_A_NUMBER = frozenset({"nan", "+nan", "-nan"})
_INFINITE = frozenset({"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})
# the largest integer label without a fixed label set (a class id; past it, a data accident)
MAX_INTEGER_LABEL = 2**31 - 1


@dataclass(frozen=True)
class LabelRule:
    """Which label values a file may hold: ``allowed`` canonical texts (None: any), and where
    that set came from, for the message (``"--labels"``, ``"the training data"``)."""

    allowed: frozenset[str] | None = None
    source: str = ""
    # without ``allowed``: the one kind of label the input holds ("integer" or "name"; None:
    # not decided yet) and how many rows have it (for the message)
    kind: str | None = None
    kind_rows: int = 0

    def check(self, value: str) -> str | None:
        if self.allowed is None:
            return self._check_free(value)
        if value in self.allowed:
            return None
        known = ", ".join(sorted(self.allowed, key=_label_sort_key))
        if self.source == "the training data":
            return f"does not occur in the training data (labels: {known})"
        return f"is not one of the labels given by {self.source} ({known})"

    def _check_free(self, value: str) -> str | None:
        integer = bool(_INTEGER.match(value))
        if integer and int(value) < 0:
            return (
                "is negative: integer labels count from 0 (name every label with --labels "
                "to use it)"
            )
        if integer and int(value) > MAX_INTEGER_LABEL:
            return (
                f"is too large for an integer label (at most {MAX_INTEGER_LABEL}; name every "
                "label with --labels to use it)"
            )
        kind = "integer" if integer else "name"
        if self.kind is None or kind == self.kind:
            return None
        return (
            f"is {'an integer' if integer else 'a name'}, but the other labels are "
            f"{self.kind}s ({self.kind_rows} rows): labels are all integers or all names "
            "(give --labels to name every label)"
        )


def canonical_label(value: Any) -> str | None:
    """A label's canonical text, or None when ``value`` is no label (a fraction, NaN, a list…)."""
    return label_text(value)[0]


def label_text(value: Any) -> tuple[str | None, str]:
    """(the canonical text, "") or (None, why it is no label: "a fraction", "not a number"…)."""
    if isinstance(value, bool) or value is None:
        return None, ""
    if isinstance(value, int):
        return str(value), ""
    if isinstance(value, float):
        return _float_label(value)
    if isinstance(value, str):
        text = value.strip()
        if not text or any(ch in text for ch in "\n\r\t"):
            return None, ""  # a line break in a label is a quoting accident, not a name
        if _INTEGER.match(text):
            try:
                return str(int(text)), ""
            except ValueError:  # more digits than Python converts (4300)
                return None, "a number too long"
        if _NUMBER.match(text):
            return _float_label(float(text))
        if text.lower() in _NOT_A_NUMBER:
            return None, "not a number"
        if text.lower() in _INFINITE:
            return None, "infinite"
        return text, ""
    return None, ""


def _float_label(value: float) -> tuple[str | None, str]:
    if value != value:
        return None, "not a number"
    if value in (float("inf"), float("-inf")):
        return None, "infinite"
    if not value.is_integer():
        return None, "a fraction"
    return str(int(value)), ""


def _label_sort_key(text: str) -> tuple[int, int, str]:
    return (0, int(text), "") if _INTEGER.match(text) else (1, 0, text)


def label_values(texts: Iterable[str]) -> list[int | str]:
    """The sorted label set from canonical texts: integers in numeric order when every label is
    an integer, else names in text order (a mix of ``1`` and ``neg``, which only a fixed label
    set allows: all are names)."""
    unique = set(texts)
    if unique and all(_INTEGER.match(t) for t in unique):
        return sorted(int(t) for t in unique)
    return sorted(unique)


def label_kind(text: str) -> str:
    """``"integer"`` or ``"name"``: the kind of a canonical label text."""
    return "integer" if _INTEGER.match(text) else "name"
