"""LoRA (peft): the base weights frozen, low-rank adapters trained beside the chosen layers.
Gradients and optimizer state shrink to the adapters'; what the model can learn changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob, whole
from memfit.levers.base import Lever, Room
from memfit.levers.cure import Fix, Patient

# the rank a plan gives adapters when it adds them
LORA_RANK = 8
# peft's dropout on each adapted layer's input when the job gives none (the usual recipe); at 0
# peft puts nn.Identity there, and the step keeps no dropped copy of the input for backward
LORA_DROPOUT = 0.1


@dataclass(kw_only=True)
class LoraKnobs:
    lora_rank: int | None = knob(
        "LoRA adapters of this rank (peft); 0: full fine-tuning.", minimum=0
    )
    """LoRA: the adapters' rank; the base weights are frozen."""
    lora_target_modules: list[str] | None = knob(  # noqa: RUF009 (a field, default None)
        "LoRA targets, comma-separated: attention | mlp | all-linear | module names.",
        shown_default="attention",
    )
    """Which layers get adapters (groups or module names); only with a rank."""
    lora_dropout: float | None = knob(
        "LoRA dropout on each adapted layer's input (peft), in [0, 1); 0: none. Only with "
        "--lora-rank.",
        fraction=True,
        shown_default=str(LORA_DROPOUT),
    )
    """The adapters' dropout probability (peft's ``lora_dropout``; None: :data:`LORA_DROPOUT`);
    above 0 each adapted layer keeps a dropped copy of its input for backward. Only with a rank."""


class Lora(Lever):
    name: ClassVar[str] = "lora"
    # peft wraps the model before the Trainer sees it: no TrainingArguments field
    in_training_arguments: ClassVar[bool] = False
    knobs: ClassVar[type] = LoraKnobs
    allow: ClassVar[bool] = True
    tier: ClassVar[int] = 4
    summary: ClassVar[str] = "LoRA adapters on a frozen base (peft)"
    # a rank the job gives is the job: a plan keeps it and its dropout as given (the targets are
    # LoRA's default)
    pins: ClassVar[tuple[str, ...]] = ("lora_rank", "lora_dropout")

    def problems(self, job: Job) -> list[str]:
        problems: list[str] = []
        if job.lora_target_modules and not whole(job.lora_rank):
            problems.append("--lora-target-modules: only with --lora-rank R (LoRA adapters)")
        if job.lora_dropout is not None and not whole(job.lora_rank):
            problems.append("--lora-dropout: only with --lora-rank R (LoRA adapters)")
        return problems

    def flags(
        self, values: Mapping[str, Any], renames: Mapping[str, str] | None = None
    ) -> list[str]:
        # rank 0 is full fine-tuning: no adapters, no flag
        if not values.get("lora_rank"):
            return []
        return super().flags(values, renames)

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # a rank the job gives is the job itself, not a lever; 0: full fine-tuning
        pinned, dropout = room.job.lora_rank, room.job.lora_dropout
        if pinned:
            # the job's dropout goes with its own adapters (the job's checks refuse it without)
            return ({"lora_rank": pinned} | ({} if dropout is None else {"lora_dropout": dropout}),)
        ranks = (0, LORA_RANK) if self.name in room.allowed else (0,)
        return tuple({"lora_rank": r} for r in ranks)

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        # adapters hold far less than the base's gradients and optimizer state
        return sorted(options, key=lambda o: -(o.get("lora_rank") or 0))

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        return f"rank {values.get('lora_rank')} adapters, base frozen"

    def cure(self, patient: Patient) -> Fix | None:
        if patient.job is not None and patient.job.lora_rank:
            return None
        settings = {"lora_rank": LORA_RANK}
        return Fix(
            change=f"LoRA adapters (peft, rank {LORA_RANK}) instead of full fine-tuning "
            f"(--lora-rank {LORA_RANK})",
            saves_bytes=patient.price(settings),
            cost="trains adapters, not all weights: quality can differ from full fine-tuning",
            lever="lora",
            settings=settings,
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        rank = values.get("lora_rank")
        return f"LoRA r={rank}" if rank else None


LEVER = Lora()
