"""Activation offloading: the tensors the forward pass saves for the backward pass go to host
memory as they are saved and come back as the backward pass needs them.

On CUDA the copies run on a side stream into pinned host memory: TRL's
``get_act_offloading_ctx_manager`` (torchtune's ``OffloadActivations``), the only implementation
``memfit train`` runs there (it refuses without TRL installed: ``pip install 'memfit[trl]'``), so
an estimate for a CUDA device emulates TRL's rules. Exact (the same values come back), so it is
a lever without a quality cost (tier 0); it costs host memory and the host link's time where the
copies do not hide behind the step's compute. With checkpointing on, what is offloaded is what
the checkpointed step saves: each layer's input. Not in an evaluation (nothing is saved for a
backward pass): ``--mode eval`` with it is refused, as ``--optimizer-offload cpu`` is.

What stays on the GPU (the estimate traces it: :mod:`memfit.step.offload`): saves under 1 KiB,
parameters, the output head's input, the last few saves while their copies are in flight, and
in the backward each tensor brought back until the next node has run. On the CPU device host and
device memory are one: offloading saves nothing there, and a plan does not try it.

Its cost in time (:meth:`ActivationOffloading.micro_seconds`): the saved bytes cross the host
link twice, to the host during the forward and back during the backward. The copies run on a
side stream, so the model assumes each direction overlaps the compute of its own pass entirely
and charges only what exceeds it: ``max(0, saved / link − forward) + max(0, saved / link −
backward)``, the passes' times from their matmul FLOPs at the share of peak large matmuls reach
(no attention FLOPs: the model errs toward charging more). Saved bytes per micro-batch
(:func:`saved_bytes`): each layer's input (tokens × hidden × activation bytes) with
checkpointing; without it, about 34 × hidden bytes per token and layer in 16 bits (Korthikanti et
al. 2022, flash attention's ``5·a·s/h`` term gone), twice that in fp32. With the fused-linear
loss, also the gradients it computes in the forward and saves for the backward: the hidden
states' (tokens × hidden) and, where the head trains, the head weight's (vocab × hidden, in the
head's dtype). Liger's loss takes the head's weight inside the model's forward, not through the
head module, so TRL's output-head exception does not cover them: they go to the host and come
back every micro-batch. The host link's speed is the GPU's (``gpu.host_link_gbps``, the catalog
fills it); a GPU object without one is charged nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import knob
from memfit.levers.base import Chosen, Lever, Room
from memfit.levers.cure import Fix, Patient
from memfit.units import format_bytes

# the share of peak FLOP/s large matmuls reach (memfit.plan.cost.E_MAX: the levers do not import
# the plan)
_E_MAX = 0.6
# bytes a layer saves per token and hidden unit without checkpointing, in 16 bits (Korthikanti
# et al., "Reducing Activation Recomputation in Large Transformer Models": 34·s·b·h per layer
# once flash attention keeps no attention scores)
_SAVED_PER_HIDDEN = 34


@dataclass(kw_only=True)
class ActivationOffloadingKnobs:
    activation_offloading: bool | None = knob(
        "Move the tensors saved for backward to host memory (pinned, on a side stream) until "
        "the backward pass needs them."
    )
    """Activation offloading: the saved activations (each layer's input, with checkpointing)
    wait in host memory between the forward and the backward pass."""


def offloading(values: Mapping[str, Any]) -> bool:
    return bool(values.get("activation_offloading"))


def saved_bytes(values: Mapping[str, Any], shape: Any, tokens: int) -> int:
    """The bytes a micro-batch of ``tokens`` tokens offloads, by the cost model's rule (the
    module docstring): each layer's input with checkpointing, else ~34 × hidden per token; with
    the fused-linear loss also the gradients it saves (the hidden states', and the head
    weight's where the head trains)."""
    width = 4 if (values.get("precision") or "fp32") == "fp32" else 2
    per_token = shape.hidden * width
    if not values.get("gradient_checkpointing"):
        per_token *= _SAVED_PER_HIDDEN // 2  # 34 bytes in 16 bits is 17 elements
    saved = shape.layers * tokens * per_token
    if values.get("cross_entropy") == "fused-linear" and getattr(shape, "vocab", 0):
        # the hidden states' gradient, in the activations' dtype
        saved += tokens * shape.hidden * width
        if not values.get("lora_rank"):
            # the head weight's gradient, zeros_like(weight): the trained weights' dtype (fp32
            # master weights unless pure 16-bit training); a LoRA head is frozen: none
            held = 2 if values.get("weights_dtype") in ("bf16", "fp16") else 4
            saved += shape.vocab * shape.hidden * held
    return int(saved)


def mode_problem(values: Mapping[str, Any], mode: str) -> str | None:
    """Why the lever's values do not combine with ``mode`` (``memfit estimate --mode``): an
    evaluation saves nothing for a backward pass, so offloading is refused there (one line
    naming the flags), as ``--optimizer-offload cpu`` is (an evaluation has no optimizer)."""
    if offloading(values) and mode == "eval":
        return (
            "--activation-offloading: an evaluation (--mode eval) saves no tensors for a "
            "backward pass: nothing to offload; leave the flag out"
        )
    return None


class ActivationOffloading(Lever):
    name: ClassVar[str] = "activation-offloading"
    knobs: ClassVar[type] = ActivationOffloadingKnobs
    summary: ClassVar[str] = "activation offloading (saved activations in host memory)"
    negatable: ClassVar[tuple[str, ...]] = ("activation_offloading",)
    # a job that says on or off keeps it (off: no host memory to spare, or a trainer without it)
    pins: ClassVar[tuple[str, ...]] = ("activation_offloading",)
    # TRL's SFTConfig has the field (its trainer enters the context around each training step);
    # Hugging Face TrainingArguments do not
    in_training_arguments: ClassVar[bool] = False
    argument_fields: ClassVar[tuple[str, ...]] = ("activation_offloading",)
    outside_note: ClassVar[str] = (
        "activation offloading is TRL's SFTConfig(activation_offloading=True) (its SFTTrainer "
        "enters trl.models.get_act_offloading_ctx_manager around each training step), which "
        "plain TrainingArguments do not have"
    )

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        own = room.job.activation_offloading
        if own is not None:
            return ({"activation_offloading": own},)
        if room.job.device == "cpu":
            # host and device memory are one: nothing to gain
            return ({"activation_offloading": False},)
        # exact: the plan tries both
        return ({"activation_offloading": False}, {"activation_offloading": True})

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        # the saved activations leave the GPU: never more than keeping them
        return sorted(options, key=lambda o: not offloading(o))

    def last_resort(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
        # host memory and the host link's time, which the GPU's memory does not show: taken only
        # when nothing else of its tier fits (a job that asks for it keeps it)
        return offloading(values) and not offloading(base)

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if "activation_offloading" in values and not values["activation_offloading"]:
            return {"activation_offloading": None}  # off is the default: no flag
        return super().as_given(values)

    def micro_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any, tokens: int) -> float:
        """Seconds the copies add to a micro-batch of ``tokens`` tokens beyond the compute they
        hide behind (see the module docstring; 0 when off)."""
        if not offloading(values) or tokens <= 0:
            return 0.0
        # the GPU's host link (the catalog fills it for every card); none known: nothing charged
        link = float(getattr(gpu, "host_link_gbps", 0.0) or 0.0) * 1e9
        if link <= 0:
            return 0.0
        copy = saved_bytes(values, shape, tokens) / link
        rate = gpu.flops_per_second(str(values.get("precision") or "fp32")) * _E_MAX
        forward = 2.0 * shape.matmul_parameters * tokens / rate if rate > 0 else 0.0
        # the backward's two matmuls per forward one, and the recomputed forward with checkpointing
        backward = forward * (3.0 if values.get("gradient_checkpointing") else 2.0)
        # assumption: each direction's copies overlap the compute of their own pass entirely
        # (TRL's side stream), so only the excess stalls the step
        return max(0.0, copy - forward) + max(0.0, copy - backward)

    def time_words(self, values: Mapping[str, Any]) -> str | None:
        if not offloading(values):
            return None
        return (
            "the host link's copies of the saved activations, where they outlast the compute "
            "they overlap"
        )

    def plan_lines(self, chosen: Chosen) -> list[str]:
        values, base = chosen.values, chosen.base
        if not offloading(values):
            return []
        how = (
            "as given"
            if values.get("activation_offloading") == base.get("activation_offloading")
            else "chosen"
        )
        kept = {**values, "activation_offloading": False}
        return [
            f"Activation offloading ({how}): the tensors saved for backward wait in pinned host "
            f"memory: {format_bytes(chosen.peak_bytes)} on the GPU at micro-batch "
            f"{chosen.micro}, where keeping them would need {format_bytes(chosen.peak(kept))}. "
            "Same values back: no quality cost; time: the copies cross the host link on a side "
            "stream, and the throughput above counts what the compute does not hide.",
            "Run it with TRL: SFTConfig(activation_offloading=True); memfit train "
            "--activation-offloading runs TRL's context manager (pip install 'memfit[trl]').",
        ]

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return "activations offloaded" if offloading(values) else None

    def cure(self, patient: Patient) -> Fix | None:
        job = patient.job
        if job is not None and job.activation_offloading:
            return None
        if patient.on_cpu:
            patient.notes.append(
                "not proposed: activation offloading — the job runs on the CPU, where host and "
                "device memory are one"
            )
            return None
        settings = {"activation_offloading": True}
        return Fix(
            change="activation offloading: the tensors saved for backward wait in pinned host "
            "memory (--activation-offloading; TRL: SFTConfig(activation_offloading=True))",
            saves_bytes=patient.price(settings),
            cost="none in results (the same values come back); host memory for the saved "
            "activations, and the host link's copies where the compute does not hide them",
            lever=self.name,
            settings=settings,
        )

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        host = details.get("host")
        if not isinstance(host, Mapping) or not host.get("activation_offloading"):
            return []
        parts = host.get("parts") or {}
        which = {
            "trl": "TRL's context manager's rules (pinned copies on a side stream; what memfit "
            "train runs on CUDA)",
        }.get(str(host["activation_offloading"]), str(host["activation_offloading"]))
        return [
            f"activation offloading: {format_bytes(int(parts.get('activations', 0)))} of saved "
            f"activations in host memory at most, by {which}; the GPU keeps the small ones, the "
            "head's input and the copies in flight"
        ]

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # only TRL's SFTConfig takes it; apply_plan plans without it for arguments that lack it
        if not offloading(values):
            return {}
        return {"activation_offloading": True}


LEVER = ActivationOffloading()
