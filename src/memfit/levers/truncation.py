"""Truncation: rows cut to a shorter length. It changes the data (the tokens past the cut are
never seen), so a plan uses it only when ``--allow truncation`` says so, and reports the share of
tokens cut from the data's length profile."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Lever, Room
from memfit.levers.cure import Fix, Patient


def shorter_lengths(seq_len: int, percentile: Any = None) -> list[int]:
    """Shorter lengths a plan tries, longest first: the data's 99th/95th/90th percentiles
    (``percentile``: a data profile's), or ¾ and ½ of the length; rounded up to a multiple of
    8, at least 8."""
    if percentile is not None:
        raw = [percentile(q) for q in (99, 95, 90)]
    else:
        raw = [seq_len * 3 // 4, seq_len // 2]
    out = sorted({max(8, -(-x // 8) * 8) for x in raw if x < seq_len}, reverse=True)
    return [x for x in out if x < seq_len]


@dataclass(kw_only=True)
class TruncationKnobs:
    max_seq_len: int | None = knob("Truncate sequences to this many tokens.", minimum=1)
    """Truncation: rows are cut to this many tokens (a plan lever; harms long rows)."""


class Truncation(Lever):
    name: ClassVar[str] = "truncation"
    # the tokenizer's max_length cuts rows: no TrainingArguments field
    in_training_arguments: ClassVar[bool] = False
    knobs: ClassVar[type] = TruncationKnobs
    allow: ClassVar[bool] = True
    tier: ClassVar[int] = 3
    summary: ClassVar[str] = "truncation (rows cut to fewer tokens)"

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # the plan's configurations always name their length: the job's own, or a cut
        seq_len = room.job.seq_len
        assert seq_len is not None
        cuts = shorter_lengths(seq_len, room.percentile) if self.name in room.allowed else []
        return tuple({"max_seq_len": n} for n in (seq_len, *cuts))

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        return sorted(options, key=lambda o: o["max_seq_len"])

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        return f"e.g. to {values.get('max_seq_len')} tokens"

    def cure(self, patient: Patient) -> Fix | None:
        # half the job's length, rounded as memfit plan rounds its tries (its shortest without a
        # data profile), only where the data has rows longer than that
        cost = (
            "tokens past the limit are cut: check the data's lengths first "
            "(memfit plan --train-file reports the share cut)"
        )
        job = patient.job
        if job is None or job.seq_len is None:
            return Fix(change="truncate sequences", saves_bytes=None, cost=cost, lever="truncation")
        # the rows' length is the job's cut where it has one (--max-seq-len below --seq-len)
        seq = min(job.seq_len, job.max_seq_len or job.seq_len)
        longest = getattr(job, "longest_tokens", None)
        shorter = patient.round_seq_len(max(1, seq // 2))
        if shorter >= seq:
            return None
        if longest is not None and longest <= shorter:
            patient.notes.append(
                f"not proposed: truncation to {shorter} tokens — the data's longest row has "
                f"{longest} tokens, nothing would be cut"
            )
            return None
        change = f"truncate sequences ({seq} → {shorter} tokens, --max-seq-len {shorter})"
        if longest is not None:
            change += (
                f": rows longer than {shorter} tokens lose their end (the longest has {longest})"
            )
            cost = (
                "the cut tokens are not learnt from; memfit plan --train-file reports the share cut"
            )
        settings = {"max_seq_len": shorter}
        return Fix(
            change=change,
            saves_bytes=patient.price(settings),
            cost=cost,
            lever="truncation",
            settings=settings,
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return f"{values.get('max_seq_len')} tokens"


LEVER = Truncation()
