"""A knob: one field of the job, with its help line, flag, allowed values and bound.

The floor under :mod:`memfit.job` and :mod:`memfit.levers`: each lever declares its knobs with
:func:`knob`, and every verb's flags, config keys and API keywords follow from those fields. The
checks here name the flag a value came through. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any

# the job (:class:`memfit.job.Job`) as the levers' checks see it: the job inherits the levers'
# knobs, so a lever does not import it (that would be an import circle, even for a type); the
# checks read its fields by name
AnyJob = Any


def positions_problem(flag: str, seq_len: Any, positions: int, model: str) -> str | None:
    """The problem with a sequence length past the ``positions`` ``model`` can embed, or None."""
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > positions:
        return (
            f"{flag}: {seq_len} is beyond the {positions} positions {model} can use; "
            f"use {flag} {positions} or less"
        )
    return None


def choice_problem(flag: str, value: Any, allowed: Iterable[str]) -> str | None:
    """The problem with ``value`` outside ``allowed``, or None."""
    allowed = tuple(allowed)
    if value in allowed:
        return None
    return f"{flag}: unknown value {value!r}; choose one of {', '.join(allowed)}"


def whole_problem(flag: str, value: Any, minimum: int = 1, *, typed: bool = False) -> str | None:
    """The problem with ``value`` if it is not a whole number ≥ ``minimum``, or None.

    ``typed``: the value came through the CLI or a config file, which already made it a number;
    the message for a count (``minimum`` ≥ 1) then names only the bound.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return None
    if typed and minimum >= 1 and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{flag}: must be ≥ {minimum}, got {value}"
    return f"{flag}: must be a whole number ≥ {minimum}, got {value!r}"


def finite_problem(flag: str, value: Any) -> str | None:
    """NaN passes every comparison that would refuse it, and inf trains a model of NaNs."""
    if isinstance(value, int | float) and not math.isfinite(value):
        return f"{flag}: must be a finite number, got {value}"
    return None


def fraction_problem(flag: str, value: Any) -> str | None:
    """The problem with ``value`` if it is not a number from 0 up to, not including, 1 (a
    probability such as a dropout's), or None. NaN fails the comparison, so it is refused too."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1:
        return None
    return f"{flag}: must be a number in [0, 1), got {value!r}"


def knob(
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: int | None = None,
    default: Any = None,
    required: bool = False,
    cli: bool = True,
    **extra: Any,
) -> Any:
    """A dataclass field that is a knob: its help line, flag (default ``--field-name``), allowed
    values or lower bound (checked by :meth:`Job.problems`), and whether the CLI shows it.
    ``fraction=True`` (in ``extra``): a number in [0, 1), checked by :func:`fraction_problem`."""
    metadata = {"help": help, "flag": flag, "choices": choices, "minimum": minimum, "cli": cli}
    metadata |= extra
    if required:
        return field(metadata=metadata)
    if isinstance(default, list | dict | set):
        raise TypeError("mutable defaults: use default_factory")
    return field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field[Any]) -> str:
    """The CLI flag of a dataclass field (its metadata's, else ``--name-with-dashes``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def whole(value: Any, minimum: int = 1) -> bool:
    """A whole number (not a bool) ≥ ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def field_problems(
    owner: Any,
    fields: Iterable[dataclasses.Field[Any]],
    *,
    typed: bool = False,
    flags: Mapping[str, str] | None = None,
    required: Iterable[str] = (),
) -> list[str]:
    """The problems of each of ``fields`` of ``owner`` on its own (a choice, a bound), in order:
    the named choices first, then the counts (the order every verb has always listed them)."""
    flags = dict(flags or {})
    required = set(required)
    problems: list[str] = []
    for f in sorted(fields, key=lambda f: f.metadata.get("choices") is None):
        value = getattr(owner, f.name)
        flag = flags.get(f.name) or flag_of(f)
        if value is None and f.name not in required:
            continue
        problem = None
        if f.metadata.get("choices") is not None:
            problem = choice_problem(flag, value, f.metadata["choices"])
        elif f.metadata.get("minimum") is not None:
            problem = whole_problem(flag, value, f.metadata["minimum"], typed=typed)
        elif f.metadata.get("fraction"):
            problem = fraction_problem(flag, value)
        if problem:
            problems.append(problem)
    return problems
