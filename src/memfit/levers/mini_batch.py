"""GradCache's mini-batch: an in-batch-negatives loss (MultipleNegativesRankingLoss) compares
each sample with the rest of its batch, so accumulation would change the objective; its cached
variant embeds the batch a mini-batch at a time without gradients, takes the loss on the whole
batch, then re-embeds each mini-batch with gradients. Exact, at about one more forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Lever
from memfit.levers.cure import Fix, Patient

# sentence-transformers' CachedMultipleNegativesRankingLoss default mini-batch
DEFAULT_MINI_BATCH_SIZE = 32


@dataclass(kw_only=True)
class MiniBatchKnobs:
    mini_batch_size: int | None = knob(
        "cached-mnrl: rows per GradCache mini-batch (the batch stays whole).",
        minimum=1,
        shown_default=str(DEFAULT_MINI_BATCH_SIZE),
    )
    """The cached in-batch-negatives loss: rows embedded at a time; the loss sees the whole batch."""


class MiniBatch(Lever):
    name: ClassVar[str] = "mini-batch"
    knobs: ClassVar[type] = MiniBatchKnobs
    summary: ClassVar[str] = "GradCache mini-batches (the cached in-batch-negatives loss)"

    def problems(self, job: Job) -> list[str]:
        # a sentence-embedding job with no loss given may still be planned onto the cached one
        undecided = job.loss is None and job.task == "sentence-embedding"
        if job.mini_batch_size is not None and job.resolved_loss != "cached-mnrl" and not undecided:
            return ["--mini-batch-size: only the cached loss (--loss cached-mnrl) has one"]
        return []

    def cure(self, patient: Patient) -> Fix | None:
        # an in-batch-negatives loss's cure, as memfit plan makes it: the whole batch stays one
        # step and the cached (GradCache) loss embeds it a mini-batch at a time
        job = patient.job
        if job is None or not patient.in_batch_negatives:
            return None
        batch, mini = job.micro_batch_size or 1, patient.rows_at_once
        if mini <= 1:
            patient.notes.append(
                "not proposed: a smaller GradCache mini-batch — it is already 1 row"
            )
            return None
        lower = mini // 2
        cached = patient.cached_loss or patient.loss
        settings = {
            "micro_batch_size": batch,
            "gradient_accumulation_steps": 1,
            "loss": cached,
            "mini_batch_size": lower,
        }
        return Fix(
            change=f"lower the GradCache mini-batch ({mini} → {lower} rows embedded at a time; "
            f"--loss {cached} --mini-batch-size {lower}): the batch of {batch} stays one step, "
            "so the in-batch negatives, the loss and its gradient stay the same",
            saves_bytes=patient.price(settings),
            cost="one more forward pass per step (GradCache embeds the batch without a graph, "
            "then again a mini-batch at a time with one): about a third more compute",
            lever="mini_batch",
            settings=settings,
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        size = values.get("mini_batch_size")
        return f"mini-batch {size}" if size else None


LEVER = MiniBatch()
