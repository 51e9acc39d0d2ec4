"""The sequence length a run folder's run really fed, read from the best record it has: shared
by the report page (the estimate beside the measured peak) and the doctor (the price of a fix)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.job import round_seq_len

# the width assumed where a run folder names no length at all
_DEFAULT_SEQ_LEN = {"causal-lm": 512}


@dataclass(frozen=True)
class RunWidth:
    """The padded width of the widest micro-batch a run fed, the data's longest row in tokens
    (None: not recorded) and where the width was read, in words."""

    seq_len: int
    longest_tokens: int | None
    source: str


def positive_int(value: Any) -> int | None:
    """``value`` if it is a positive int (a JSON record's field), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def run_width(
    run: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    metrics: Sequence[Mapping[str, Any]] = (),
) -> RunWidth:
    """run.json's ``resolved.seq_len`` (the micro-batch holding the data's longest row); older
    run folders: the probe event's longest row, padded as the run padded it; then the length the
    config allowed (an upper bound); then the padded tokens per row of the logged steps (a lower
    bound); else the task's default, a guess."""
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    longest = positive_int(resolved.get("longest_tokens"))
    if seq := positive_int(resolved.get("seq_len")):
        return RunWidth(
            seq,
            longest,
            "run.json's resolved.seq_len, the padded width of the micro-batch holding the data's "
            "longest row",
        )
    limit_key = next((k for k in ("max_seq_len", "seq_len") if positive_int(config.get(k))), None)
    limit = int(config[limit_key]) if limit_key else None
    probes = [positive_int(e.get("longest_tokens")) for e in events if e.get("type") == "probe"]
    if probe := max((p for p in probes if p), default=None):
        if config.get("padding") == "max_length":
            width = max(probe, limit or probe)
        else:  # as the recipe pads: up to its multiple, never past the length allowed
            multiple = positive_int(resolved.get("pad_to_multiple_of")) or 1
            width = min(round_seq_len(probe, multiple), max(probe, limit or probe))
        return RunWidth(
            width,
            probe,
            "the probe event's longest row in events.jsonl (run.json predates resolved.seq_len)",
        )
    if limit_key and limit:
        flag = "--" + limit_key.replace("_", "-")
        return RunWidth(
            limit,
            None,
            f"the config's {flag} ({limit_key}), an upper bound: the run folder records neither "
            "the data's longest row nor a probe",
        )
    batch = positive_int(config.get("effective_batch_size"))
    per_row = [
        math.ceil(m["padded_tokens"] / batch)
        for m in metrics
        if batch and positive_int(m.get("padded_tokens"))
    ]
    if per_row:
        return RunWidth(
            max(per_row),
            None,
            "the padded tokens per row of the logged steps, a lower bound (run.json names no "
            "sequence length)",
        )
    default = _DEFAULT_SEQ_LEN.get(str(config.get("task")), 128)
    return RunWidth(
        default, None, "the task's default length, a guess: the run folder names no length"
    )
