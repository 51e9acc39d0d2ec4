"""Packing (causal LM): the rows of a step are packed into sequences of up to ``--seq-len``
tokens instead of each being padded to its micro-batch's longest.

Two strategies, TRL's names (``SFTConfig.packing_strategy``):

- ``bfd`` (the default): padding-free best-fit-decreasing packing. Each row keeps its own
  position ids (restarting at 0), attends only to itself and keeps its loss mask, so a packed
  step's loss is the loss of the same rows unpacked (what TRL's ``padding_free`` and transformers'
  ``DataCollatorWithFlattening`` do). Plain text, prompt/completion and chat rows alike.
- ``wrapped``: the texts concatenated and cut into blocks of ``--seq-len`` tokens that attend
  across document boundaries (Hugging Face's ``run_clm``), for continued pre-training on plain
  text; instruction rows are refused (their loss masks would be cut).

For memory, a packed micro-batch is B sequences of at most T tokens, as a padded one; with
``bfd`` on SDPA or eager attention transformers builds a block-diagonal (B, 1, T, T) mask from
the position ids, which the estimate traces (:attr:`memfit.estimate.step_spec.StepSpec.packed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Lever, Room

PACKING_STRATEGIES = ("bfd", "wrapped")
DEFAULT_PACKING_STRATEGY = "bfd"


@dataclass(kw_only=True)
class PackingKnobs:
    packing: bool | None = knob(
        "causal-lm: pack rows into sequences of up to --seq-len tokens (see --packing-strategy)."
    )
    """Pack the rows of a step into sequences of up to the sequence length (causal LM)."""
    packing_strategy: str | None = knob(
        "bfd (padding-free: rows keep their positions and loss masks, no attention across "
        "rows) | wrapped (texts concatenated into blocks that attend across documents).",
        choices=PACKING_STRATEGIES,
        shown_default=DEFAULT_PACKING_STRATEGY,
    )
    """How rows are packed: ``bfd`` (padding-free best-fit decreasing) or ``wrapped``."""


def packing_strategy(job: Any) -> str | None:
    """The strategy a job (or a mapping of its knobs) packs with (``bfd`` when --packing gives
    none), None: no packing."""
    values = job if isinstance(job, Mapping) else vars(job) if hasattr(job, "__dict__") else {}
    if not values.get("packing"):
        return None
    return values.get("packing_strategy") or DEFAULT_PACKING_STRATEGY


class Packing(Lever):
    name: ClassVar[str] = "packing"
    knobs: ClassVar[type] = PackingKnobs
    summary: ClassVar[str] = "rows packed into sequences of up to --seq-len tokens"
    negatable: ClassVar[tuple[str, ...]] = ("packing",)
    # the data's shape, not a lever the plan varies: a plan keeps the job's packing
    pins: ClassVar[tuple[str, ...]] = ("packing", "packing_strategy")

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # the job's own packing, kept: it decides what a step holds, not how it is run
        strategy = packing_strategy(room.job)
        if strategy is None:
            return ({},)
        return ({"packing": True, "packing_strategy": strategy},)

    def problems(self, job: Job) -> list[str]:
        problems: list[str] = []
        if job.packing and job.task not in (None, "causal-lm"):
            problems.append(f"--packing: only for --task causal-lm (got --task {job.task})")
        if job.packing_strategy is not None and not job.packing:
            problems.append("--packing-strategy: only with --packing")
        return problems

    def describe(self, values: Mapping[str, Any]) -> str | None:
        strategy = packing_strategy(values)
        return None if strategy is None else f"packing {strategy}"


LEVER = Packing()
