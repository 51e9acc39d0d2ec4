"""A run folder's records as ``memfit report`` and ``memfit doctor`` read them, each field checked.

``metrics.jsonl``, ``events.jsonl`` and ``run.json`` are memfit train's, but they are files: a
run killed mid-write leaves half a line, and a hand (or a tool) may have edited them. Every field
the report, the plots and the doctor read is checked here against what memfit train writes (a
whole number of bytes or rows not below 0 and within reason, a finite number, a string, a flag,
null where the writer leaves it out): the readers then never meet ``Infinity`` in a byte count,
a list for a micro-batch or a 400-digit step. An event's fields are checked by its type: the
same name means another thing in another event (``from``/``to`` are micro-batch sizes in a
``backoff``, learning rates in an ``lr`` event).

* A line of ``metrics.jsonl`` or ``events.jsonl`` that does not parse, is not a JSON object, or
  holds a field that is not what memfit writes is skipped, and a note names the file, the line
  and the field.
* A field of ``run.json`` that is not what memfit writes is left out (as if not recorded), with
  a note naming the file and the field; a ``run.json`` that is not a JSON object is not used.

Fields the readers do not read are kept as they are (the page shows them escaped).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit import levers
from memfit.job import Job
from memfit.knobs import whole

# far above any real run (2^60 B is an exbibyte, 2^53 rows or steps beyond any data set) and
# below what a float holds exactly or a plot can draw
MAX_BYTES = 2**60
MAX_COUNT = 2**53
MAX_NUMBER = 1e300
# a size the user gave (--memory-cap, --gpu-memory take any number of bytes): far above any
# memory there is, and still a figure the page draws and writes out
MAX_GIVEN = 2**100
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
    """One number of bytes per rank (``rank_peak_bytes``), null for a rank that had no figure
    (memfit train's ``_gather``: a rank whose device reports no peak)."""
    if isinstance(value, list) and all(v is None or size(v) is None for v in value):
        return None
    return (
        f"{_shown(value)} is not a list of numbers of bytes (whole numbers from 0 to 2^60, or null)"
    )


def size_or_sizes(value: Any) -> str | None:
    """A ``*_bytes`` field memfit reads nothing of: a number of bytes, or one per rank."""
    return sizes(value) if isinstance(value, list) else size(value)


def _within(value: Any) -> bool:
    """A float (JSON's floats are all within a float's range), or an int a float holds: the
    readers draw and compare them as floats, and a 400-digit int does not convert."""
    return isinstance(value, float) or abs(value) <= MAX_NUMBER


def non_negative(value: Any) -> str | None:
    """A finite number ≥ 0 (seconds, a learning rate, a rate): any finite float (``--lr`` takes
    any finite number above 0)."""
    if _is_number(value) and _finite(value) and value >= 0 and _within(value):
        return None
    return f"{_shown(value)} is not a finite number ≥ 0"


def measured(value: Any) -> str | None:
    """A training figure (a loss, a gradient norm, an eval metric): any float, negative, NaN and
    ±inf included (an fp16 run logs the steps its loss scaler skips, whose loss is not finite;
    an eval perplexity is ``exp(loss)``, up to a float's largest, then inf), or an int a float
    holds."""
    if _is_number(value) and _within(value):
        return None
    return f"{_shown(value)} is not a number (an int within ±1e300, or a float)"


def fraction(value: Any) -> str | None:
    """A number in [0, 1) (a dropout probability)."""
    if _is_number(value) and _finite(value) and 0 <= value < 1:
        return None
    return f"{_shown(value)} is not a number in [0, 1)"


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

# events.jsonl, any event: the fields the readers read whatever the event's type (the plots place
# events by ``step``; the doctor and the page read the sizes) and the time and rank on each line.
# ``step`` is null where the guard had none (an eval's OOM)
EVENTS: dict[str, Check] = {
    "type": text,
    "time": non_negative,
    "step": COUNT,
    "rank": COUNT,
    "micro_batch_size": COUNT,
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

# each type's own fields, as its writers emit them (over EVENTS where a name differs): the guard
# (memfit.guard.guard, memfit.guard.policy), the training loop (memfit.train.loop, .setup,
# .memory), the Trainer integrations' memfit_events.jsonl (memfit.integrations, the same shape),
# predict/embed --events (memfit.infer.run). A field a type's writers do not write falls back
# to EVENTS; a field neither names is not read, and kept as it is
_GUARD_SIZES: dict[str, Check] = {"from": COUNT, "to": COUNT}
EVENT_TYPES: dict[str, dict[str, Check]] = {
    # the guard: micro-batch (or GradCache mini-batch) sizes, token budgets
    "oom": {"mini_batch_size": COUNT},
    "backoff": {**_GUARD_SIZES, "loss": text},
    "grow": _GUARD_SIZES,
    "stop": {},
    # the loop
    "probe": {},
    "resume": {"checkpoint": text},
    # a resume's --lr: the schedule's old peak learning rate and the new one (floats)
    "lr": {"from": non_negative, "to": non_negative},
    "checkpoint": {"path": text},
    "checkpoint_skipped": {"checkpoint": text, "moved_to": text},
    "skip": {},
    "not_finite": {"problems": strings},
    "eval": {},  # eval_* figures
    "lock": {},
    "memory_snapshot": {"path": text},
    # predict / embed --events
    "plan": {"batch_size": POSITIVE, "source": text},
    "done": {"batch_size": POSITIVE, "backoffs": COUNT},
}


def event_schema(kind: Any) -> Mapping[str, Check]:
    """The fields of an event of type ``kind`` and their checks (EVENTS for another type)."""
    own = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    return {**EVENTS, **own} if own else EVENTS


_JOB_KNOBS = {f.name: f for f in dataclasses.fields(Job)}
_JOB_HINTS = typing.get_type_hints(Job)


def _knob_check(knob: dataclasses.Field[Any], hint: Any) -> Check:
    """What memfit train writes for a knob of the job (its field's type ``hint``, resolved as
    :func:`typing.get_type_hints` gives it, and its bound): a flag, a list of names, a whole
    number from the knob's bound (``--lora-rank 0``: full fine-tuning), a fraction
    (``--lora-dropout``), else a string (a choice)."""
    kinds = (hint, *typing.get_args(hint))  # ``T | None``: T among the union's members
    if bool in kinds:
        return flag
    if any(typing.get_origin(kind) is list for kind in kinds):
        return strings
    if knob.metadata.get("fraction"):
        return fraction
    minimum = knob.metadata.get("minimum")
    return text if minimum is None else count(minimum)


# the levers' knobs as memfit train records them in run.json's config
LEVER_KNOBS: dict[str, Check] = {
    name: _knob_check(_JOB_KNOBS[name], _JOB_HINTS[name])
    for lever in levers.LEVERS
    for name in lever.fields
}

# run.json: the sections the readers use, and the fields of each they read
RUN_SECTIONS: dict[str, dict[str, Check]] = {
    "config": {
        "model": text,
        "task": text,
        "loss": text,
        "device": text,
        "padding": text,
        **LEVER_KNOBS,
        "seq_len": POSITIVE,
        "num_labels": POSITIVE,
        "labels": strings,
        # sizes as the user gave them, beyond the measured ones' bound
        "memory_cap": count(1, MAX_GIVEN),
        "gpu_memory": count(1, MAX_GIVEN),
    },
    "resolved": {
        "device": text,
        "precision": text,
        "sharding": text,
        "gradient_checkpointing": flag,
        "micro_batch_size": POSITIVE,
        "train_rows": COUNT,
        "world_size": POSITIVE,
        # the padded width of the longest row: 0 where that row has no token (the readers take
        # a positive one only)
        "seq_len": COUNT,
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
    metrics = kind == "metrics"
    not_null = _METRICS_NOT_NULL if metrics else _EVENTS_NOT_NULL
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
        schema = METRICS if metrics else event_schema(row.get("type"))
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


# the knobs the readers take from what the run fed or resolved (the shapes, the batches, the
# precision, the ranks: run.json's ``resolved``, the events), not from its ``config``
FROM_THE_RUN = (
    "effective_batch_size",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "max_tokens_per_micro_batch",
    "mini_batch_size",
    "precision",
    "gradient_checkpointing",
    "max_seq_len",
    "world_size",
    "sharding",
)


def _fits(knob: dataclasses.Field[Any], value: Any) -> bool:
    """``value`` is one of the knob's choices, a whole number within its bound, or a fraction
    in [0, 1)."""
    choices, minimum = knob.metadata.get("choices"), knob.metadata.get("minimum")
    if choices is not None:
        return value in choices
    if knob.metadata.get("fraction"):
        return fraction(value) is None
    return minimum is None or whole(value, minimum)


def lever_settings(config: Mapping[str, Any], skip: Collection[str] = ()) -> dict[str, Any]:
    """The run's own lever settings as run.json's ``config`` records them (memfit train's
    flags), each lever's only where the run used it (its values set a flag: a LoRA rank, a
    quantized base); a value outside its knob's choices or bound (an edited file) is left out.
    ``skip``: the fields the reader takes elsewhere (what the run resolved or fed)."""
    settings: dict[str, Any] = {}
    for lever in levers.LEVERS:
        values = {
            name: config[name]
            for name in lever.fields
            if name not in skip
            and config.get(name) is not None
            and _fits(_JOB_KNOBS[name], config[name])
        }
        if values and lever.flags(values):
            settings |= values
    return settings


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
