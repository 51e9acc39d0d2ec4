"""The memory levers, one module each, and the list every verb iterates over.

A lever (:class:`~memfit.levers.base.Lever`) declares its knobs (fields of
:class:`memfit.job.Job`, from which come its flags, config keys and API keywords), what it
combines with (:meth:`~memfit.levers.base.Lever.problems`, and what memfit's own runner cannot
run, :meth:`~memfit.levers.base.Lever.run_problems`), its place in the plan's order of harm
(``tier``; ``allow``: used only when ``memfit plan --allow`` names it), its flags in the
commands memfit prints and its names in the Hugging Face vocabulary. Adding a lever is adding a
module here, its ``LEVER`` to :data:`LEVERS` and its knobs dataclass to the bases of
:class:`memfit.job.Job` (written out there, not computed, so that type checkers see every field);
its effect on the step is then modelled in :mod:`memfit.estimate` and applied in
:mod:`memfit.train`.

Nothing here imports torch or transformers: the CLI's quick verbs read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.knobs import AnyJob as Job
from memfit.levers import (
    activation_offloading,
    attention,
    batch,
    checkpointing,
    cross_entropy,
    lora,
    mini_batch,
    optimizer,
    optimizer_offload,
    packing,
    precision,
    quantization,
    sharding,
    truncation,
    weights,
)
from memfit.levers.base import Lever

# every lever, in the plan's order: the exact ones first (tier 0), then those used only when
# allowed, least harmful first, then more GPUs
LEVERS: tuple[Lever, ...] = tuple(
    sorted(
        (
            batch.LEVER,
            mini_batch.LEVER,
            precision.LEVER,
            checkpointing.LEVER,
            attention.LEVER,
            cross_entropy.LEVER,
            activation_offloading.LEVER,
            optimizer_offload.LEVER,
            packing.LEVER,
            optimizer.LEVER,
            weights.LEVER,
            truncation.LEVER,
            lora.LEVER,
            quantization.LEVER,
            sharding.LEVER,
        ),
        key=lambda lever: lever.tier,
    )
)
# the levers ``memfit plan --allow`` names, least harmful first
ALLOWABLE: tuple[str, ...] = tuple(lever.name for lever in LEVERS if lever.allow)
BY_NAME: dict[str, Lever] = {lever.name: lever for lever in LEVERS}


def lever_of(field: str) -> Lever | None:
    """The lever that owns the job's field ``field`` (None: a field of the job itself)."""
    for lever in LEVERS:
        if field in lever.fields:
            return lever
    return None


def problems(job: Job, *, run: bool = False) -> list[str]:
    """Every lever's combination problems for ``job``; ``run``: also what memfit's own runner
    (``memfit train``) cannot run, which a plan or the doctor must not propose."""
    found: list[str] = []
    for lever in LEVERS:
        found.extend(lever.problems(job))
        if run:
            found.extend(lever.run_problems(job))
    return found


def flags(
    values: Mapping[str, Any],
    *,
    renames: Mapping[str, str] | None = None,
    only: tuple[str, ...] | None = None,
) -> list[str]:
    """The flags that set ``values`` (field → value), lever by lever in the plan's order;
    ``only``: these levers' (by name)."""
    out: list[str] = []
    for lever in LEVERS:
        if only is None or lever.name in only:
            out.extend(lever.flags(values, renames))
    return out


def trainer_args(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` in the Hugging Face / peft / bitsandbytes vocabulary (for ``apply_plan``)."""
    out: dict[str, Any] = {}
    for lever in LEVERS:
        out.update(lever.trainer_args(values))
    return out


__all__ = [
    "ALLOWABLE",
    "BY_NAME",
    "LEVERS",
    "Lever",
    "flags",
    "lever_of",
    "problems",
    "trainer_args",
]
