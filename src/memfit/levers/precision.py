"""Mixed precision: fp32 master weights, the matmuls autocast to bf16 (or fp16 with a loss
scaler). Exact enough for training; the plan takes bf16 where the GPU has it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import knob
from memfit.levers.base import Lever, Room
from memfit.levers.cure import Fix, Patient

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(kw_only=True)
class PrecisionKnobs:
    precision: str | None = knob(
        "fp32 | fp16 | bf16 (mixed precision, autocast).", choices=PRECISIONS
    )
    """Mixed precision: fp32 master weights, matmuls in fp16 (with a loss scaler) or bf16."""


class Precision(Lever):
    name: ClassVar[str] = "precision"
    knobs: ClassVar[type] = PrecisionKnobs
    summary: ClassVar[str] = "mixed precision (bf16, or fp16 with loss scaling)"

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # pinned: kept; else the GPU's mixed precision first, fp32 beside it (which needs less
        # memory depends on the model: autocast keeps half-precision copies of the weights)
        pinned = room.job.precision
        return tuple(
            {"precision": p} for p in ((pinned,) if pinned else (room.mixed_precision, "fp32"))
        )

    def cure(self, patient: Patient) -> Fix | None:
        # the dtype the GPU has (bf16, else fp16), as memfit plan picks it; none on the CPU
        job = patient.job
        if job is not None and (job.precision or "fp32") != "fp32":
            return None
        if patient.on_cpu:
            patient.notes.append(
                "not proposed: mixed precision — memfit train runs fp32 on the CPU (no autocast "
                "there)"
            )
            return None
        mixed = patient.gpu_mixed_precision
        if patient.gpu_name is None or mixed is None:
            settings = {"precision": "bf16"}
            return Fix(
                change="mixed precision: bf16 autocast (fp16 with loss scaling on GPUs without "
                "bf16, before Ampere)",
                saves_bytes=patient.price(settings),
                cost="none on Ampere or newer (usually faster); fp16 needs a GradScaler",
                lever="precision",
                settings=settings,
            )
        if mixed == "bf16":
            change = (
                f"mixed precision: bf16 autocast (--precision bf16; the {patient.gpu_name} has "
                "bf16)"
            )
            cost = "none measurable on this GPU (usually faster)"
        else:
            change = (
                f"mixed precision: fp16 autocast with loss scaling (--precision fp16; the "
                f"{patient.gpu_name} has no bf16)"
            )
            cost = "a GradScaler (memfit train adds one); fp16's narrow range can overflow"
        settings = {"precision": mixed}
        return Fix(
            change=change,
            saves_bytes=patient.price(settings),
            cost=cost,
            lever="precision",
            settings=settings,
        )

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        precision = values.get("precision")
        if precision is None:
            return {}
        return {"bf16": precision == "bf16", "fp16": precision == "fp16"}

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return str(values.get("precision"))


LEVER = Precision()
