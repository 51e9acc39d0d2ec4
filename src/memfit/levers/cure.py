"""What ``memfit doctor`` proposes for an out-of-memory error, lever by lever.

Each lever's :meth:`~memfit.levers.base.Lever.cure` writes its own :class:`Fix` (the change in
words, with its flag, and its price) for the failed job as the doctor knows it, a
:class:`Patient`; the doctor (:mod:`memfit.report.doctor_cures`) asks the levers in the plan's
order, prices each fix with the estimate and drops any that ``memfit train`` would refuse. The
two types live here, below the report, because the levers make them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.knobs import AnyJob as Job


@dataclass
class Fix:
    """One change that cures (or helps cure) the OOM: what to change, what it saves, its price."""

    change: str
    saves_bytes: int | None
    cost: str
    lever: str  # a stable name: expandable_segments, micro_batch, precision, …
    # the job's fields the fix changes (its values: those of the job memfit train would run),
    # for the doctor's check that train takes it; not part of the --json contract
    settings: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` fix: change, saves_bytes, cost, lever (the keys are a contract)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "settings"
        }


@dataclass
class Patient:
    """The job that ran out of memory as the doctor knows it, for the levers' cures.

    The loss vocabulary and the plan's rounding of lengths come from :mod:`memfit.job`, which
    stands on the levers; the doctor reads them there and hands them over here.
    """

    job: Job | None
    """The failed job (None: only the message is known, so each cure is said in general)."""
    price: Callable[[Mapping[str, Any]], int | None]
    """What the job with these fields changed saves on the estimated peak (None: unknown)."""
    notes: list[str]
    """Why a cure is left out ("not proposed: …"), in order: the doctor shows them."""
    on_cpu: bool = False
    """The job runs on the CPU (memfit train runs fp32 there)."""
    gpu_name: str | None = None
    """The catalog GPU the message's capacity names (None: none, or several, or not a GPU)."""
    gpu_mixed_precision: str | None = None
    """That GPU's mixed precision (bf16, else fp16)."""
    checkpoint_dtype: str | None = None
    """The dtype the model's checkpoint holds its weights in (fp32, bf16, fp16; None: unknown):
    what ``--weights-dtype auto`` holds frozen weights in."""
    fused_loss_problem: str | None = None
    """Why a fused linear cross-entropy cannot compute the model's loss (its head scales the
    logits: :func:`memfit.step.fused_linear_config_problem`); None: it can, or unknown."""
    loss: str | None = None
    """The job's loss by its canonical name."""
    in_batch_negatives: bool = False
    """The loss compares each row with the rest of its batch (accumulation would change it)."""
    cached_loss: str | None = None
    """The loss's cached (GradCache) variant, embedding a mini-batch at a time."""
    rows_at_once: int = 1
    """The rows one forward holds: the cached loss's mini-batch, else the micro-batch."""
    round_seq_len: Callable[[int], int] = int
    """A length rounded as memfit plan rounds the lengths it tries."""
    fixes: list[Fix] = field(default_factory=list)
    """The cures proposed so far, in the plan's order (a later lever may weigh itself against
    one)."""

    def proposed(self, lever: str) -> Fix | None:
        """The cure proposed so far for ``lever`` (by its fix's lever name), if any."""
        return next((fix for fix in self.fixes if fix.lever == lever), None)


__all__ = ["Fix", "Patient"]
