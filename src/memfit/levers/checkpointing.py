"""Activation (gradient) checkpointing: each layer keeps only its input in the forward pass and
recomputes the rest in the backward pass (about a third more compute; exact)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import knob
from memfit.levers.base import Lever, Room
from memfit.levers.cure import Fix, Patient


@dataclass(kw_only=True)
class CheckpointingKnobs:
    gradient_checkpointing: bool | None = knob("Recompute activations in backward.")
    """Activation checkpointing: keep each layer's input only, recompute the rest in backward."""


class Checkpointing(Lever):
    name: ClassVar[str] = "checkpointing"
    knobs: ClassVar[type] = CheckpointingKnobs
    summary: ClassVar[str] = "gradient checkpointing (activations recomputed in backward)"
    negatable: ClassVar[tuple[str, ...]] = ("gradient_checkpointing",)

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # exact: the plan tries both, whatever the job says
        return ({"gradient_checkpointing": False}, {"gradient_checkpointing": True})

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        return sorted(options, key=lambda o: not o.get("gradient_checkpointing"))

    def cure(self, patient: Patient) -> Fix | None:
        if patient.job is not None and patient.job.gradient_checkpointing:
            return None
        settings = {"gradient_checkpointing": True}
        return Fix(
            change="gradient checkpointing (recompute activations in backward; "
            "--gradient-checkpointing)",
            saves_bytes=patient.price(settings),
            cost="about 33 % more compute per step",
            lever="gradient_checkpointing",
            settings=settings,
        )

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        value = values.get("gradient_checkpointing")
        return {} if value is None else {"gradient_checkpointing": bool(value)}

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return f"checkpointing {'on' if values.get('gradient_checkpointing') else 'off'}"


LEVER = Checkpointing()
