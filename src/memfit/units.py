"""Sizes: parsed in one place, formatted only at the edges. Bytes are ``int`` everywhere inside."""

from __future__ import annotations

import re

from memfit.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Parse ``16GiB`` (16·2^30), ``16GB`` (16·10^9), ``512MiB`` or a bare integer of bytes.

    ``name`` is the flag or argument the value came from; it appears in the error message.
    """
    if isinstance(value, bool):
        raise UsageError(f"{name}: expected a size such as 16GiB, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise UsageError(f"{name}: a size in bytes must be whole, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise UsageError(
                f"{name}: cannot read {value!r} as a size; use e.g. 16GiB (2^30), 16GB (10^9) "
                "or a number of bytes"
            )
        number, unit = match.groups()
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise UsageError(
                f"{name}: unknown unit {unit!r} in {value!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            )
        size = round(float(number) * factor)
    else:
        raise UsageError(f"{name}: expected a size such as 16GiB, got {value!r}")
    if size <= 0:
        raise UsageError(f"{name}: must be more than 0 bytes, got {value!r}")
    return size


def format_bytes(num_bytes: int | float) -> str:
    """Human-readable binary size: ``13.10 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def size_arg(num_bytes: int) -> str:
    """A size as a command-line argument: ``14.73GiB``, ``512MiB``, ``1000`` (bytes).

    For the commands memfit prints (``--gpu-memory``, ``--memory-cap``): two decimals of the
    largest binary unit, rounded down, so that :func:`parse_size` reads back no more than
    ``num_bytes`` (a budget must not grow by being printed), and at most 1% of a unit less.
    """
    num_bytes = int(num_bytes)
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= factor:
            # from the hundredth above: a size read from a two-decimal figure (14.56 GiB, an OOM
            # message's) is a hair below it, and must print as itself, not 14.55
            hundredths = -(-num_bytes * 100 // factor)
            while hundredths > 0:
                text = f"{hundredths // 100}.{hundredths % 100:02d}".rstrip("0").rstrip(".")
                if parse_size(f"{text}{unit}") <= num_bytes:
                    return f"{text}{unit}"
                hundredths -= 1  # float rounding in parse_size went above: one step down
    return str(num_bytes)
