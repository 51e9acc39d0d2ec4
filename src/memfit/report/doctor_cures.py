"""The cures ``memfit doctor`` offers for an out-of-memory error: memfit plan's levers
(:data:`memfit.levers.LEVERS`), in its order, each written by its lever
(:meth:`~memfit.levers.base.Lever.cure`) for the failed job's loss, data and device, priced by
the caller's ``price`` (the estimate at the job's shapes), and proposed only where
``memfit train`` takes the job so changed (the levers' one table of what combines)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from memfit import levers, step
from memfit.devices.catalog import Gpu, catalog
from memfit.errors import UsageError
from memfit.job import (
    CACHED_LOSSES,
    DEFAULT_MINI_BATCH_SIZE,
    IN_BATCH_NEGATIVE_LOSSES,
    Job,
    resolve_loss,
    round_seq_len,
)
from memfit.levers.cure import Fix, Patient
from memfit.report.oom_message import OomReport
from memfit.step import weights

__all__ = [
    "Fix",
    "checkpoint_dtype",
    "cures",
    "gpu_of",
    "loss_of",
    "rows_at_once",
]


def loss_of(job: Job) -> str:
    """The job's loss by its canonical name (the task's default when not given)."""
    return resolve_loss(job.task, job.loss, [])


def rows_at_once(job: Job) -> int:
    """The rows one forward holds: the cached loss's mini-batch, else the micro-batch."""
    batch = job.micro_batch_size or 1
    if loss_of(job) == "cached-mnrl":
        return min(job.mini_batch_size or DEFAULT_MINI_BATCH_SIZE, batch)
    return batch


def checkpoint_dtype(model: str) -> str | None:
    """The dtype ``model``'s checkpoint holds its weights in, as ``from_pretrained`` loads them
    (:func:`memfit.step.weights.checkpoint_dtype`: fp32 when the config names none), by memfit's
    name; None when the model cannot be resolved."""
    config = _config(model)
    return None if config is None else weights.dtype_name(weights.checkpoint_dtype(config))


def _config(model: str) -> Any:
    """``model``'s transformers config, or None when it cannot be resolved."""
    # start-up time: resolving a model loads transformers' configs, which reading a message needs not
    from memfit.models import resolve_model

    try:
        return resolve_model(model).config
    except UsageError:
        return None


def patient(
    job: Job | None,
    price: Callable[[Mapping[str, Any]], int | None],
    report: OomReport,
    notes: list[str],
) -> Patient:
    """The failed job as the levers' cures see it: the loss vocabulary and the plan's rounding
    of lengths (from :mod:`memfit.job`), the device and the GPU the message names."""
    card = gpu_of(report)
    loss = loss_of(job) if job is not None else None
    # the model's config (None: no job, or a model that does not resolve, whose cures are then
    # priced and the estimate says what is wrong)
    config = _config(job.model) if job is not None and job.model else None
    fused_problem = None
    if config is not None and job is not None and job.task == "causal-lm":
        # a head the fused loss does not model (Granite's logits_scaling): no such cure
        fused_problem = step.fused_linear_config_problem(config)
    return Patient(
        job=job,
        price=price,
        notes=notes,
        on_cpu=job.device == "cpu" if job is not None else report.kind in ("cpu", "memfit-cap"),
        gpu_name=card.name if card is not None else None,
        gpu_mixed_precision=card.mixed_precision() if card is not None else None,
        checkpoint_dtype=(
            None if config is None else weights.dtype_name(weights.checkpoint_dtype(config))
        ),
        fused_loss_problem=fused_problem,
        loss=loss,
        in_batch_negatives=loss in IN_BATCH_NEGATIVE_LOSSES,
        cached_loss=CACHED_LOSSES.get(loss, loss) if loss is not None else None,
        rows_at_once=rows_at_once(job) if job is not None else 1,
        round_seq_len=round_seq_len,
    )


def cures(
    knobs: Job | None,
    price: Callable[[Mapping[str, Any]], int | None],
    report: OomReport,
    notes: list[str],
) -> list[Fix]:
    """memfit plan's cures, in its order, that this job does not use yet and that the planner
    would take for its loss, data and device; ``price(settings)`` prices each (the job with
    those fields changed; None: unknown). A cure ``memfit train`` would refuse for the job is
    never proposed. Why a cure is left out goes to ``notes``."""
    # what train refuses of the job as it is: a cure is judged only by what it adds
    before = set(knobs.problems(run=True)) if knobs is not None else set()

    def refusals(settings: Mapping[str, Any]) -> list[str]:
        if knobs is None or not settings:
            return []
        cured = dataclasses.replace(knobs, **settings)
        return [p for p in cured.problems(run=True) if p not in before]

    def checked_price(settings: Mapping[str, Any]) -> int | None:
        # a cure train refuses is dropped below: no estimate spent on it
        return None if refusals(settings) else price(settings)

    sick = patient(knobs, checked_price, report, notes)
    for lever in levers.LEVERS:
        fix = lever.cure(sick)
        if fix is None:
            continue
        refused = refusals(fix.settings)
        if refused:
            notes.append(
                f"not proposed: {fix.lever} — memfit train refuses the job with it "
                f"({'; '.join(refused)})"
            )
            continue
        sick.fixes.append(fix)
    return sick.fixes


def gpu_of(report: OomReport) -> Gpu | None:
    """The catalog GPU whose memory, as CUDA reports it, is the message's capacity (printed with
    two decimals); None when none is, or when several are."""
    capacity = report.capacity_bytes
    if capacity is None or report.kind not in ("cuda-new", "cuda-old"):
        return None
    # the message rounds to a hundredth of its unit: within half of it (GiB for these sizes)
    close = [g for g in catalog().values() if abs(g.memory_bytes - capacity) <= (1 << 30) // 200]
    # several cards of one size (a 3060 12GB, a 3080 12GB, a 4070): none named
    return close[0] if len(close) == 1 else None
