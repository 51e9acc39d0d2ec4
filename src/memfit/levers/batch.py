"""Micro-batch × gradient accumulation: the effective batch run as smaller forward/backward
passes whose gradients are summed before one optimizer step. Exact for per-sample and per-token
losses (the guard weights each micro-batch by its share of the step's samples or tokens); for
in-batch-negative losses see :mod:`memfit.levers.mini_batch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import knob
from memfit.levers.base import Lever
from memfit.levers.cure import Fix, Patient


@dataclass(kw_only=True)
class BatchKnobs:
    effective_batch_size: int = knob(
        "Samples per optimizer step, over all ranks (kept exactly).", minimum=1, default=32
    )
    """Samples per optimizer step over every rank: what the job learns from; plans keep it."""
    micro_batch_size: int | None = knob("Rows per forward/backward on one rank.", minimum=1)
    """Rows per forward and backward on one rank (``memfit estimate --batch-size``)."""
    gradient_accumulation_steps: int | None = knob("Micro-batches per optimizer step.", minimum=1)
    """Micro-batches summed into one optimizer step on each rank."""
    max_tokens_per_micro_batch: int | None = knob(
        "Token budget per micro-batch (rows × padded length).", minimum=1
    )
    """A token budget per micro-batch instead of a row count (rows × padded length)."""


class Batch(Lever):
    name: ClassVar[str] = "batch"
    knobs: ClassVar[type] = BatchKnobs
    summary: ClassVar[str] = "micro-batch × gradient accumulation (the effective batch kept)"

    def cure(self, patient: Patient) -> Fix | None:
        # half the rows at once, twice the accumulation: the effective batch and gradient kept
        job = patient.job
        if job is not None and patient.in_batch_negatives:
            # its cure is the GradCache mini-batch (memfit.levers.mini_batch), the batch kept
            patient.notes.append(
                f"not proposed: a smaller micro-batch with gradient accumulation — {patient.loss} "
                "takes each pair's negatives from the rest of its batch, so a smaller batch means "
                "fewer negatives and a different loss and gradient"
            )
            return None
        batch = job.micro_batch_size if job else None
        if batch is not None and batch <= 1:
            return None
        cost = "some throughput (smaller kernels, more steps per update); the recipe is unchanged"
        if job is None or batch is None:
            return Fix(
                change="halve the micro-batch and double gradient accumulation (effective batch "
                "kept); for an in-batch-negatives loss (MNRL) lower the GradCache mini-batch "
                "instead (--mini-batch-size)",
                saves_bytes=None,
                cost=cost,
                lever="micro_batch",
            )
        accumulation = job.gradient_accumulation_steps or 1
        settings = {"micro_batch_size": batch // 2, "gradient_accumulation_steps": 2 * accumulation}
        return Fix(
            change=f"halve the micro-batch ({batch} → {batch // 2}) and double gradient "
            f"accumulation ({accumulation} → {2 * accumulation}; --micro-batch-size {batch // 2}): "
            "the effective batch and the gradient stay the same",
            saves_bytes=patient.price(settings),
            cost=cost,
            lever="micro_batch",
            settings=settings,
        )

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if values.get("micro_batch_size") is not None:
            out["per_device_train_batch_size"] = values["micro_batch_size"]
        if values.get("gradient_accumulation_steps") is not None:
            out["gradient_accumulation_steps"] = values["gradient_accumulation_steps"]
        return out

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return (
            f"micro-batch {values.get('micro_batch_size')} × "
            f"{values.get('gradient_accumulation_steps')}"
        )


LEVER = Batch()
