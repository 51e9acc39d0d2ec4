"""A run folder's records as ``memfit report`` and ``memfit doctor`` read them, each field checked.

``metrics.jsonl``, ``events.jsonl`` and ``run.json`` are memfit train's, but they are files: a
run killed mid-write leaves half a line, and a hand (or a tool) may have edited them. Every field
the report, the plots and the doctor read is checked here against what memfit train writes (a
whole number of bytes or rows not below 0 and within reason, a finite number, a string, a flag,
null where the writer leaves it out): the readers then never meet ``Infinity`` in a byte count,
a list for a micro-batch or a 400-digit step.

* A line of ``metrics.jsonl`` or ``events.jsonl`` that does not parse, is not a JSON object, or
  holds a field that is not what memfit writes is skipped, and a note names the file, the line
  and the field.
* A field of ``run.json`` that is not what memfit writes is left out (as if not recorded), with
  a note naming the file and the field; a ``run.json`` that is not a JSON object is not used.

Fields the readers do not read are kept as they are (the page shows them escaped).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# far above any real run (2^60 B is an exbibyte, 2^53 rows or steps beyond any data set) and
# below what a float holds exactly or a plot can draw
MAX_BYTES = 2**60
MAX_COUNT = 2**53
MAX_NUMBER = 1e300
# a note lists this many bad lines of a file, then counts the rest
_LISTED = 5

Check = Callable[[Any], str | None]  # the problem with a value (None: it is fine)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """A number that is finite (an int always is: ``math.isfinite`` cannot take a 400-digit one)."""
    return isinstance(value, int) or math.isfinite(value)


def count(minimum: int = 0, maximum: int = MAX_COUNT) -> Check:
    """A whole number (rows, steps, tokens, bytes) in [minimum, maximum]."""

    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum:
            return None
        return f"{_shown(value)} is not a whole number from {minimum} to {_power(maximum)}"

    return check


def size(value: Any) -> str | None:
    """A number of bytes: whole (a measured or estimated figure), 0 to :data:`MAX_BYTES`."""
    if _is_number(value) and _finite(value) and 0 <= value <= MAX_BYTES:
        return None if float(value).is_integer() else f"{_shown(value)} is not whole bytes"
    return f"{_shown(value)} is not a number of bytes (a whole number from 0 to 2^60)"


def sizes(value: Any) -> str | None:
    """One number of bytes per rank (``rank_peak_bytes``)."""
    if isinstance(value, list) and all(size(v) is None for v in value):
        return None
    return f"{_shown(value)} is not a list of numbers of bytes (whole numbers from 0 to 2^60)"


def size_or_sizes(value: Any) -> str | None:
    """A ``*_bytes`` field memfit reads nothing of: a number of bytes, or one per rank."""
    return sizes(value) if isinstance(value, list) else size(value)


def non_negative(value: Any) -> str | None:
    """A finite number ≥ 0 (seconds, a learning rate, a rate)."""
    if _is_number(value) and _finite(value) and 0 <= value <= MAX_NUMBER:
        return None
    return f"{_shown(value)} is not a finite number ≥ 0"


def measured(value: Any) -> str | None:
    """A training figure (a loss, a gradient norm, an eval metric): a number, NaN and ±inf
    included (memfit train logs a step whose loss is not finite before it stops), not huge."""
    if _is_number(value) and (not _finite(value) or abs(value) <= MAX_NUMBER):
        return None
    return f"{_shown(value)} is not a number (within ±1e300)"


def text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"{_shown(value)} is not a string"


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{_shown(value)} is not true or false"


def strings(value: Any) -> str | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return None
    return f"{_shown(value)} is not a list of strings"


def mapping(value: Any) -> str | None:
    return None if isinstance(value, dict) else f"{_shown(value)} is not a JSON object"


def _power(n: int) -> str:
    """``2^53`` for a power of two (the bounds), else the number."""
    return f"2^{n.bit_length() - 1}" if n > 1024 and n & (n - 1) == 0 else str(n)


def _shown(value: Any) -> str:
    """``value`` as the note quotes it: JSON, cut short."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


COUNT, POSITIVE = count(), count(1)

# metrics.jsonl: one line per optimizer step (and eval lines); any ``*_bytes`` key is a size,
# any ``eval_*`` key a measured figure. ``step`` may not be null: the plots place lines by it
METRICS: dict[str, Check] = {
    "step": COUNT,
    "epoch": COUNT,
    "loss": measured,
    "grad_norm": measured,
    "samples_seen": COUNT,
    "micro_batch_size": COUNT,
    "gradient_accumulation_steps": POSITIVE,
    "max_tokens_per_micro_batch": COUNT,
    "tokens": COUNT,
    "padded_tokens": COUNT,
    "lr": non_negative,
    "seconds": non_negative,
    "samples_per_second": non_negative,
    "what": text,
    "rank_peak_bytes": sizes,  # several ranks: each one's peak
}
_METRICS_NOT_NULL = frozenset({"step"})

# events.jsonl: the guard's and the loop's events (``step`` is null where the guard had none)
EVENTS: dict[str, Check] = {
    "type": text,
    "time": non_negative,
    "step": COUNT,
    "rank": COUNT,
    "micro_batch_size": COUNT,
    "from": COUNT,
    "to": COUNT,
    "rows": COUNT,
    "longest_tokens": COUNT,
    "ooms": COUNT,
    "max_tokens": COUNT,
    "max_tokens_from": COUNT,
    "max_tokens_to": COUNT,
    "max_tokens_per_micro_batch": COUNT,
    "padded_tokens": COUNT,
    "seconds": non_negative,
    "changed": flag,
    "error": text,
    "phase": text,
    "what": text,
    "cure": text,
    "reason": text,
    "note": text,
    "cause": text,
}
_EVENTS_NOT_NULL = frozenset({"type"})

# run.json: the sections the readers use, and the fields of each they read
RUN_SECTIONS: dict[str, dict[str, Check]] = {
    "config": {
        "model": text,
        "task": text,
        "loss": text,
        "optimizer": text,
        "precision": text,
        "device": text,
        "padding": text,
        "attn_implementation": text,
        "quantization": text,
        "double_quant": flag,
        "gradient_checkpointing": flag,
        "effective_batch_size": POSITIVE,
        "micro_batch_size": POSITIVE,
        "seq_len": POSITIVE,
        "max_seq_len": POSITIVE,
        "num_labels": POSITIVE,
        "world_size": POSITIVE,
        "lora_rank": POSITIVE,
        "lora_target_modules": strings,
        "labels": strings,
        "memory_cap": count(1, MAX_BYTES),
        "gpu_memory": count(1, MAX_BYTES),
    },
    "resolved": {
        "device": text,
        "precision": text,
        "sharding": text,
        "gradient_checkpointing": flag,
        "micro_batch_size": POSITIVE,
        "train_rows": COUNT,
        "world_size": POSITIVE,
        "seq_len": POSITIVE,
        "longest_tokens": COUNT,
        "pad_to_multiple_of": POSITIVE,
    },
    "plan": {"budget_bytes": size, "plan": mapping},
    "estimate": {
        "total_bytes": size,
        "allocated_peak_bytes": size,
        "reserved_peak_bytes": size,
        "micro_batch_size": POSITIVE,
        "seq_len": POSITIVE,
        "breakdown": mapping,
    },
    "versions": {},
}


def _field_check(key: str, schema: Mapping[str, Check]) -> Check | None:
    if key in schema:
        return schema[key]
    if key.endswith("_bytes"):
        return size_or_sizes
    if key.startswith("eval_"):
        return measured
    return None


def line_problem(
    row: Mapping[str, Any], schema: Mapping[str, Check], not_null: frozenset[str]
) -> str | None:
    """The first field of ``row`` that is not what memfit writes, in words; None when fine."""
    for key, value in row.items():
        check = _field_check(str(key), schema)
        if check is None or (value is None and key not in not_null):
            continue
        problem = check(value)
        if problem:
            return f"{key}: {problem}"
    return None


@dataclass
class Lines:
    """The good lines of a JSON-lines file and the bad ones: ``(line number, why)``."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)


def read_jsonl(path: Path, kind: str) -> Lines:
    """The lines of ``metrics.jsonl`` (``kind="metrics"``) or ``events.jsonl`` (``"events"``)
    that are what memfit writes; the others are in ``bad``, with why."""
    schema, not_null = (
        (METRICS, _METRICS_NOT_NULL) if kind == "metrics" else (EVENTS, _EVENTS_NOT_NULL)
    )
    found = Lines()
    for number, line in enumerate(
        path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
    ):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        # ValueError: not JSON, or an integer of more digits than Python converts; RecursionError:
        # arrays nested thousands deep
        except (ValueError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            found.bad.append((number, f"not JSON ({reason})"))
            continue
        if not isinstance(row, dict):
            found.bad.append((number, "not a JSON object"))
            continue
        problem = line_problem(row, schema, not_null)
        if problem:
            found.bad.append((number, problem))
        else:
            found.rows.append(row)
    return found


def skipped_note(path: Path, bad: list[tuple[int, str]]) -> str:
    """One line naming the file and its skipped lines (the first few with why, then a count)."""
    listed = "; ".join(f"line {number}: {why}" for number, why in bad[:_LISTED])
    more = f"; and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
    lines = "line" if len(bad) == 1 else "lines"
    return f"{path}: skipped {len(bad)} {lines} ({listed}{more})"


def read_run_json(path: Path) -> tuple[dict[str, Any], list[str]]:
    """``run.json`` with every field the readers use checked: (the run, notes). A section or
    field that is not what memfit writes is left out, each named in a note; ``ValueError``
    when the file is not JSON (the caller says so)."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(loaded, dict):
        return {}, [f"{path}: not a JSON object: not used"]
    run = dict(loaded)
    dropped: list[str] = []
    for section, schema in RUN_SECTIONS.items():
        if section not in run or run[section] is None:
            continue
        if not isinstance(run[section], dict):
            dropped.append(f"{section}: {mapping(run[section])}")
            del run[section]
            continue
        kept = dict(run[section])
        for key, value in run[section].items():
            check = schema.get(key) or (size_or_sizes if str(key).endswith("_bytes") else None)
            if check is None or value is None:
                continue
            problem = check(value)
            if problem:
                dropped.append(f"{section}.{key}: {problem}")
                del kept[key]
        run[section] = kept
    for holder in ("plan", "estimate"):
        # the nested figures: the plan's own budget, the estimate's parts
        outer: dict[str, Any] = run.get(holder) or {}
        inner_name = "plan" if holder == "plan" else "breakdown"
        inner = outer.get(inner_name)
        if not isinstance(inner, dict):
            continue
        kept = dict(inner)
        for key, value in inner.items():
            check = size if holder == "estimate" or str(key).endswith("_bytes") else None
            if check is not None and (problem := check(value)):
                dropped.append(f"{holder}.{inner_name}.{key}: {problem}")
                del kept[key]
        outer[inner_name] = kept
    notes = [f"{path}: left out {d} (not what memfit train writes)" for d in dropped]
    return run, notes
