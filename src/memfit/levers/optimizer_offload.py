"""Optimizer state in host memory: the optimizer's state (and its copy of the weights it
updates) lives in host memory and its step runs on the CPU.

One process or DDP: torchao's ``CPUOffloadOptimizer`` (``offload_gradients=False``, its default:
the GPU keeps the gradients until ``zero_grad``, each copied to a pinned host buffer as backward
makes it; parameters under 4096 elements stay on the GPU with their state). Under ``--sharding
zero1|2|3``: DeepSpeed ZeRO-Offload (``zero_optimization.offload_optimizer = {"device": "cpu",
"pin_memory": true}``, stepped by DeepSpeedCPUAdam). The update is the same AdamW, so it is a
lever without a quality cost (tier 0). What it keeps where: :mod:`memfit.estimate.optimizer_offload`.

Its cost in time (:meth:`OptimizerOffload.step_seconds`, per optimizer step), a stated model:

* the CPU's update streams, per trainable parameter, what AdamW reads and writes (weight,
  gradient and two moments read; weight and moments written: 7 values of the host copy's dtype,
  28 bytes in fp32), at :data:`HOST_MEMORY_BYTES_PER_SECOND`;
* the gradients go to the host and the updated weights come back over the host link
  (``Gpu.host_link_gbps``): one copy each way of every trainable parameter this rank updates
  (its partition under ZeRO), in the dtype each crosses in. torchao copies a gradient out as
  soon as backward makes it, so most of that hides behind backward; the model charges it all
  (an upper bound), and the weights' way back, which the next forward waits for.

What the GPU no longer does (its own update, a fraction of a millisecond per million
parameters) is not credited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Chosen, Lever, Room
from memfit.levers.cure import Fix, Patient
from memfit.units import format_bytes

OPTIMIZER_OFFLOADS = ("none", "cpu")
# the optimizers an offloaded step runs: torchao wraps torch's own classes (AdamW, SGD);
# DeepSpeed's ZeRO-Offload steps DeepSpeedCPUAdam, an AdamW
OFFLOAD_OPTIMIZERS = ("adamw", "sgd")
ZERO_OFFLOAD_OPTIMIZERS = ("adamw",)
# a CPU AdamW's rate over host memory, bytes read and written per second: a workstation's
# dual-channel DDR5 (about 60 GB/s peak) as a multi-threaded update reaches it. A stated
# assumption for ranking plans, not a measurement: a server's sockets stream several times more
HOST_MEMORY_BYTES_PER_SECOND = 25e9
# values of the host copy AdamW reads (weight, gradient, two moments) and writes (weight, two
# moments) per parameter; SGD without momentum reads weight and gradient and writes the weight
_STEP_VALUES = {"adamw": 7, "sgd": 3}
_DEEPSPEED = ("zero1", "zero2", "zero3")


@dataclass(kw_only=True)
class OptimizerOffloadKnobs:
    optimizer_offload: str | None = knob(
        "none | cpu: keep the optimizer's state in host memory and step it on the CPU "
        "(torchao's CPUOffloadOptimizer; DeepSpeed ZeRO-Offload under --sharding zero*).",
        choices=OPTIMIZER_OFFLOADS,
        shown_default="none",
    )
    """Where the optimizer's state lives: on the GPU (none) or in host memory (cpu)."""


def offloaded(values: Mapping[str, Any]) -> bool:
    return values.get("optimizer_offload") == "cpu"


def implementation(sharding: str | None) -> str:
    """Which implementation runs the offloaded optimizer under ``sharding``, in words."""
    if sharding in _DEEPSPEED:
        return "DeepSpeed ZeRO-Offload (offload_optimizer, DeepSpeedCPUAdam)"
    return "torchao's CPUOffloadOptimizer"


def offload_problems(optimizer: str, sharding: str | None, mode: str | None) -> list[str]:
    """Why ``--optimizer-offload cpu`` does not combine with the job's optimizer, sharding or
    mode (one line each, naming the flags)."""
    problems: list[str] = []
    if optimizer.startswith("paged-"):
        problems.append(
            f"--optimizer-offload cpu: --optimizer {optimizer} pages its own state to host "
            "memory (CUDA unified memory); offload runs adamw or sgd"
        )
    elif optimizer == "adamw-8bit":
        problems.append(
            "--optimizer-offload cpu: --optimizer adamw-8bit is bitsandbytes' 8-bit state on "
            "the GPU, which the offloaded step does not run; offload runs adamw or sgd"
        )
    elif optimizer not in OFFLOAD_OPTIMIZERS:
        problems.append(
            f"--optimizer-offload cpu: --optimizer {optimizer} is not priced in host memory; "
            "offload runs adamw or sgd"
        )
    elif sharding in _DEEPSPEED and optimizer not in ZERO_OFFLOAD_OPTIMIZERS:
        problems.append(
            f"--optimizer-offload cpu: under --sharding {sharding} DeepSpeed ZeRO-Offload steps "
            f"DeepSpeedCPUAdam (AdamW), not --optimizer {optimizer}"
        )
    if sharding == "fsdp":
        problems.append(
            "--optimizer-offload cpu: not with --sharding fsdp (FSDP2's CPUOffloadPolicy moves "
            "the parameters too, which memfit does not price); use --sharding zero1|zero2|zero3 "
            "or none"
        )
    if mode == "eval":
        problems.append("--optimizer-offload cpu: an evaluation has no optimizer")
    return problems


class OptimizerOffload(Lever):
    name: ClassVar[str] = "optimizer-offload"
    knobs: ClassVar[type] = OptimizerOffloadKnobs
    summary: ClassVar[str] = "optimizer state in host memory (the step on the CPU)"
    # a value the job gives is kept (none: a machine without the host memory to spare)
    pins: ClassVar[tuple[str, ...]] = ("optimizer_offload",)
    # no TrainingArguments field sets it: the Trainer takes an optimizer object, DeepSpeed its
    # config file
    in_training_arguments: ClassVar[bool] = False
    outside_note: ClassVar[str] = (
        "optimizer offload is an optimizer object or a DeepSpeed config: pass "
        "optimizers=(torchao.optim.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, "
        "lr=...), None) to the Trainer, or set zero_optimization.offload_optimizer = "
        '{"device": "cpu", "pin_memory": true} in the --deepspeed config'
    )

    def problems(self, job: Job) -> list[str]:
        if job.optimizer_offload != "cpu":
            return []
        return offload_problems(job.optimizer, job.sharding, getattr(job, "mode", None))

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        job = room.job
        own = job.optimizer_offload
        if own is not None:
            return ({"optimizer_offload": own},)
        if not offload_problems(job.optimizer, job.sharding, getattr(job, "mode", None)):
            return ({"optimizer_offload": "none"}, {"optimizer_offload": "cpu"})
        return ({},)

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        # the state (and the host copy of the weights) off the GPU: never more GPU memory
        return sorted(options, key=lambda o: not offloaded(o))

    def last_resort(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
        # the CPU's update and the host link cost time the memory does not show: taken only when
        # nothing else of tier 0 fits
        return offloaded(values) and not offloaded(base)

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if values.get("optimizer_offload") == "none":
            return {"optimizer_offload": None}
        return super().as_given(values)

    def step_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any) -> float:
        """Seconds the offloaded optimizer adds to each optimizer step (0 without it): the CPU's
        update and the gradients' and weights' trips over the host link (the module docstring
        states the model). Per rank: its partition under ZeRO, every trainable parameter
        otherwise."""
        if not offloaded(values):
            return 0.0
        trainable = shape.trainable(values.get("lora_rank") or None)
        sharding = values.get("sharding") or "none"
        ranks = max(1, int(values.get("world_size") or 1))
        optimizer = str(values.get("optimizer") or "adamw")
        pure16 = values.get("weights_dtype") in ("bf16", "fp16")
        if sharding in _DEEPSPEED:
            # DeepSpeedCPUAdam on the fp32 master partition; the module's dtype crosses the link
            updated = -(-trainable // ranks)
            host_width = 4
            link_width = 4 if (values.get("precision") or "fp32") == "fp32" else 2
        else:
            # torchao's host copies are in the trained parameters' dtype, and so are the copies
            updated = trainable
            host_width = link_width = 2 if pure16 else 4
        cpu = updated * _STEP_VALUES.get(optimizer, 7) * host_width / HOST_MEMORY_BYTES_PER_SECOND
        if gpu is None:
            return cpu  # no card: no host link to charge
        # every catalog Gpu has its link (memfit.devices.catalog: Gpu.host_link_gbps)
        link = 2 * updated * link_width / (float(gpu.host_link_gbps) * 1e9)
        return cpu + link

    def time_words(self, values: Mapping[str, Any]) -> str | None:
        if not offloaded(values):
            return None
        return (
            "the optimizer step on the CPU and the gradients' and weights' copies over the host "
            "link, each optimizer step"
        )

    def plan_lines(self, chosen: Chosen) -> list[str]:
        values, base = chosen.values, chosen.base
        if not offloaded(values):
            return []
        how = "as given" if offloaded(base) else "chosen"
        on_gpu = {**values, "optimizer_offload": "none"}
        seconds = self.step_seconds(values, chosen.shape, chosen.gpu)
        return [
            f"Optimizer state in host memory ({how}; {implementation(values.get('sharding'))}): "
            "the optimizer's state and the copy of the weights it updates live in host memory "
            f"and the update runs on the CPU: {format_bytes(chosen.peak_bytes)} on the GPU at "
            f"micro-batch {chosen.micro}, where the state on the GPU would need "
            f"{format_bytes(chosen.peak(on_gpu))}. Same update: no quality cost; about "
            f"{seconds:.2f} s per optimizer step (the CPU's AdamW at "
            f"{HOST_MEMORY_BYTES_PER_SECOND / 1e9:.0f} GB/s of host memory, and the gradients "
            "and weights over the host link).",
            f"Run it: {self.outside_note}. memfit train --optimizer-offload cpu does this.",
        ]

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return "optimizer on CPU" if offloaded(values) else None

    def cure(self, patient: Patient) -> Fix | None:
        job = patient.job
        if job is not None:
            if job.optimizer_offload == "cpu" or getattr(job, "mode", None) == "eval":
                return None
            if patient.on_cpu:
                return None  # host and device are the same memory
            settings = {"optimizer_offload": "cpu"}
            problems = offload_problems(job.optimizer, job.sharding, getattr(job, "mode", None))
            if problems:
                patient.notes.append(f"not proposed: {self.name} — {problems[0]}")
                return None
            where = implementation(job.sharding)
        else:
            settings = {"optimizer_offload": "cpu"}
            where = "torchao's CPUOffloadOptimizer, or DeepSpeed ZeRO-Offload"
        return Fix(
            change="keep the optimizer's state in host memory and step it on the CPU "
            f"(--optimizer-offload cpu: {where})",
            saves_bytes=patient.price(settings),
            cost="none in quality (the same update); time: the CPU's optimizer step and the "
            "gradients' and weights' copies over the host link each step; host memory: the "
            "state, a copy of the weights and of the gradients (16 bytes per trainable "
            "parameter for fp32 AdamW)",
            lever=self.name,
            settings=settings,
        )

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        host = details.get("host")
        parts = host.get("parts") if isinstance(host, Mapping) else None
        if not isinstance(parts, Mapping):
            return []
        keys = ("master_weights", "gradients", "optimizer_state")
        mine = {k: int(v) for k, v in parts.items() if k in keys or k in _IMPLEMENTATION_PARTS}
        if not any(mine.values()):
            return []
        sharding = str(details.get("sharding") or "none")
        kept = (
            "the GPU keeps the module's 16-bit weights and a gradient buffer"
            if sharding in _DEEPSPEED
            else "the GPU keeps the gradients (offload_gradients=False) and the state of "
            "parameters under 4096 elements"
        )
        return [
            f"optimizer offload ({implementation(sharding)}): "
            f"{format_bytes(sum(mine.values()))} in host memory; {kept}"
        ]

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # no TrainingArguments field: see outside_note
        return {}


# the host parts of memfit.estimate.optimizer_offload.host_parts beyond the three categories
_IMPLEMENTATION_PARTS = (
    "bit16_partition_buffer",
    "gradient_staging_buffer",
    "gradient_accumulation_buffers",
    "reduced_gradient_partitions",
    "pinned_rounding",
)


LEVER = OptimizerOffload()
