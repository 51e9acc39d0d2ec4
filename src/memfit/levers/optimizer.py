"""The optimizer, and the memory-saving swaps a plan may make when ``--allow optimizer`` says so:
8-bit AdamW (bitsandbytes: the moments in 8 bits), Adafactor (factored second moments) or a paged
AdamW (state in CUDA unified memory, paged to the host under pressure: slow). Each changes the
training dynamics a little: the least harmful of the levers used only when allowed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Lever, Room
from memfit.levers.cure import Fix, Patient


@dataclass(frozen=True)
class Optimizer:
    """One optimizer: what memfit calls it and what it needs and costs."""

    name: str
    # weights + gradient + state, in bytes per trainable parameter (fp32 master weights), for
    # the planner's cost model; the estimate traces the real optimizer
    bytes_per_parameter: int
    # a memory-saving swap the plan may make with --allow optimizer
    saves_memory: bool = False
    # the package it needs at run time, with the install line (None: torch or transformers)
    needs: str | None = None
    # the Hugging Face TrainingArguments.optim values that are this optimizer (the first is
    # what memfit writes)
    hf_names: tuple[str, ...] = ()


OPTIMIZER_TABLE: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("adamw", 28, hf_names=("adamw_torch", "adamw_torch_fused", "adamw_hf")),
        Optimizer(
            "adamw-8bit",
            16,
            saves_memory=True,
            needs="bitsandbytes",
            hf_names=("adamw_bnb_8bit", "adamw_8bit"),
        ),
        # bitsandbytes' paged optimizers keep their state in CUDA unified memory, which the
        # driver pages out to host memory under pressure: it is not in PyTorch's allocator
        Optimizer(
            "paged-adamw-8bit",
            8,
            saves_memory=True,
            needs="bitsandbytes",
            hf_names=("paged_adamw_8bit",),
        ),
        Optimizer(
            "paged-adamw-32bit",
            8,
            saves_memory=True,
            needs="bitsandbytes",
            hf_names=("paged_adamw_32bit",),
        ),
        Optimizer("adafactor", 16, saves_memory=True, hf_names=("adafactor",)),
        Optimizer("sgd", 12, hf_names=("sgd",)),
    )
}
OPTIMIZERS = tuple(OPTIMIZER_TABLE)
SWAP_OPTIMIZERS = tuple(o.name for o in OPTIMIZER_TABLE.values() if o.saves_memory)


@dataclass(kw_only=True)
class OptimizerKnobs:
    optimizer: str = knob(" | ".join(OPTIMIZERS), choices=OPTIMIZERS, default="adamw")
    """The optimizer (see :data:`OPTIMIZER_TABLE`)."""


class OptimizerSwap(Lever):
    name: ClassVar[str] = "optimizer"
    knobs: ClassVar[type] = OptimizerKnobs
    allow: ClassVar[bool] = True
    tier: ClassVar[int] = 1
    summary: ClassVar[str] = "a memory-saving optimizer (8-bit AdamW, Adafactor, paged AdamW)"

    def flags(
        self, values: Mapping[str, Any], renames: Mapping[str, str] | None = None
    ) -> list[str]:
        return [f"--optimizer {values['optimizer']}"] if values.get("optimizer") else []

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        own = room.job.optimizer
        swaps = [o for o in SWAP_OPTIMIZERS if o != own] if self.name in room.allowed else []
        return tuple({"optimizer": o} for o in (own, *swaps))

    def last_resort(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
        # bitsandbytes' paged optimizers (their names say so) page their state over the host
        # link: slow, so a plain swap of the same tier that fits always wins
        name = str(values.get("optimizer"))
        return name != base.get("optimizer") and name.startswith("paged-")

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        return f"8-bit AdamW, Adafactor or a paged AdamW; least with {values.get('optimizer')}"

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        name = values.get("optimizer")
        if name not in OPTIMIZER_TABLE or not OPTIMIZER_TABLE[name].hf_names:
            return {}
        return {"optim": OPTIMIZER_TABLE[name].hf_names[0]}

    def cure(self, patient: Patient) -> Fix | None:
        # only where a swap holds less state than the job's own optimizer
        job = patient.job
        swap = SWAP_OPTIMIZERS[0]
        own = OPTIMIZER_TABLE.get(job.optimizer) if job is not None else None
        if job is not None and (
            own is None or own.bytes_per_parameter <= OPTIMIZER_TABLE[swap].bytes_per_parameter
        ):
            return None
        named = "AdamW" if job is None or job.optimizer == "adamw" else job.optimizer
        settings = {"optimizer": swap}
        return Fix(
            change=f"8-bit AdamW (bitsandbytes) or Adafactor instead of {named} "
            f"(--optimizer {swap} or --optimizer adafactor)",
            saves_bytes=patient.price(settings),
            cost="changes the optimizer: state is quantized (8-bit AdamW) or factored "
            "(Adafactor); usually close in quality",
            lever="optimizer",
            settings=settings,
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return str(values.get("optimizer"))


LEVER = OptimizerSwap()
