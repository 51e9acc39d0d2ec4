"""More GPUs: ranks that share the effective batch, and how they divide the model's memory
(none: every rank holds all of it; DeepSpeed ZeRO 1/2/3: optimizer state, then gradients, then
parameters partitioned; FSDP2: parameters, gradients and state sharded). The plan's advice when
nothing fits on the GPUs given (``scale_out``), never a silent change of the job's GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob, whole
from memfit.levers.base import Lever

# none: every rank holds the whole model (data parallelism); fsdp: PyTorch FSDP2; zero1|2|3:
# DeepSpeed ZeRO (see memfit.estimate.sharding for what each divides)
SHARDING_SCHEMES = ("none", "zero1", "zero2", "zero3", "fsdp")
DEEPSPEED_SCHEMES = ("zero1", "zero2", "zero3")
# the optimizers memfit train steps under DeepSpeed ZeRO
ZERO_OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True)
class ShardingKnobs:
    world_size: int | None = knob("Data-parallel ranks (GPUs).", minimum=1)
    """Ranks that share the effective batch (None: what the launcher started, or 1)."""
    sharding: str = knob(
        "How the ranks divide the model: none | zero1 | zero2 | zero3 (DeepSpeed) | fsdp.",
        choices=SHARDING_SCHEMES,
        default="none",
    )
    """How the ranks divide parameters, gradients and optimizer state."""


class Sharding(Lever):
    name: ClassVar[str] = "sharding"
    knobs: ClassVar[type] = ShardingKnobs
    tier: ClassVar[int] = 6
    summary: ClassVar[str] = "more GPUs, the model's memory sharded over them (ZeRO, FSDP)"

    def problems(self, job: Job) -> list[str]:
        ranks, batch = job.world_size, job.effective_batch_size
        if ranks is not None and whole(ranks) and whole(batch) and batch % ranks:
            return [
                f"--effective-batch-size: {batch} does not split evenly over --world-size {ranks}"
            ]
        return []

    def run_problems(self, job: Job) -> list[str]:
        problems: list[str] = []
        if job.sharding in DEEPSPEED_SCHEMES:
            if job.task == "sentence-embedding":
                problems.append(
                    "--sharding: DeepSpeed ZeRO is built for classification and causal-lm; "
                    "sentence-embedding runs with --sharding none"
                )
            if job.optimizer not in ZERO_OPTIMIZERS:
                # DeepSpeed steps the optimizer on flat 1-D partitions: Adafactor's factored
                # moments and bitsandbytes' quantized state would not be those of one process
                problems.append(
                    f"--optimizer {job.optimizer}: with DeepSpeed ZeRO memfit train runs adamw "
                    "or sgd (ZeRO steps flat partitions, which factored or quantized optimizer "
                    "state does not survive)"
                )
            if job.lora_rank or job.quantization not in (None, "none"):
                problems.append(
                    "--sharding: DeepSpeed ZeRO with --lora-rank/--quantization is not "
                    "supported; use --sharding none"
                )
        if job.sharding == "fsdp" and job.task == "sentence-embedding":
            problems.append(
                "--sharding: fsdp is built for classification and causal-lm; sentence-embedding "
                "runs with --sharding none"
            )
        if job.sharding == "fsdp" and job.lora_rank:
            problems.append(
                "--sharding: fsdp with --lora-rank is not supported; use --sharding none"
            )
        return problems


LEVER = Sharding()
