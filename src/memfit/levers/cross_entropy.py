"""The causal-LM loss: the standard one (the head's full logits, B × T × V, their fp32 upcast and
their gradient) or a fused linear cross-entropy that never builds them.

``fused-linear`` computes the token loss from the last hidden states and the head's weight chunk
by chunk, as Liger Kernel's ``fused_linear_cross_entropy`` does (on CUDA, with liger-kernel
installed; memfit's own torch implementation elsewhere, which allocates what Liger's does): one
chunk's logits at a time, the gradients of the hidden states and of the head's weight computed in
the forward. Loss and gradients equal the standard loss's, so it is a lever without a quality
cost (tier 0): a plan tries it before every lever that has one.

Its cost in time (:meth:`CrossEntropy.micro_seconds`): the same three head matmuls run (the
logits, the gradient of the hidden states, the gradient of the weight), chunked. Liger's chunk
(``liger_kernel/ops/fused_linear_cross_entropy.py``) is ``next_power_of_2(ceil(rows /
ceil(V / H)))`` rows (``memfit.step.linear_ce.chunk_rows``, which the plan's model shape
applies for the lever: ``ModelShape.loss_chunks``), so a chunk's matmul of ``c × H × V`` reads the whole ``V × H`` weight for
``c`` rows: with ``c`` in the tens or hundreds it is memory-bound where the whole step's matmul
is not. The model charges, per micro-batch, what reading the weight once per chunk and matmul
takes beyond what the FLOPs already take (``max(0, chunks × matmuls × V·H·bytes / bandwidth −
matmuls × 2·rows·H·V / (peak × E_MAX))``): zero for a wide head over a small vocabulary, tens
of milliseconds for a 128k or 152k vocabulary over a narrow model. What the standard loss spends
and fused-linear does not (its passes over the fp32 logits, about 20 bytes per logit) is not
credited to fused-linear, so the model errs against it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Chosen, Lever, Room
from memfit.levers.cure import Fix, Patient
from memfit.units import format_bytes

# trl-chunked: TRL SFTTrainer's own fused LM head (trl.kernels.chunked_logprob), which only
# SFTTrainer runs: memfit estimate and plan price it pinned (apply_plan pins it for an
# SFTConfig), a plan and the doctor never propose it (plan_options, cure), memfit train refuses
# it (TRAIN_REFUSAL). Not a run_problems: the planner refuses those even pinned
TRL_CHUNKED = "trl-chunked"
TRAIN_REFUSAL = (
    "--cross-entropy trl-chunked: TRL's SFTTrainer computes this loss, memfit train does not; "
    "train with --cross-entropy standard or fused-linear, or run SFTTrainer "
    "(memfit.integrations.GuardedSFTTrainer)"
)
CROSS_ENTROPIES = ("standard", "fused-linear", "trl-chunked")
# Liger's apply_liger_kernel_to_<model> keywords (each takes those of its signature and ignores
# the rest): only the fused linear cross-entropy, so that the step that runs is the one estimated
LIGER_CONFIG = {
    "fused_linear_cross_entropy": True,
    "cross_entropy": False,
    "rope": False,
    "rms_norm": False,
    "swiglu": False,
    "geglu": False,
    "layer_norm": False,
}
# the share of peak FLOP/s large matmuls reach (memfit.plan.cost.E_MAX: the levers do not import
# the plan)
_E_MAX = 0.6


def trl_head_problem() -> str | None:
    """Why ``--cross-entropy trl-chunked`` cannot be priced here (one line: TRL with its fused LM
    head, ``trl.trainer.utils.add_fused_lm_head``, does not import), or None. The estimate traces
    TRL's own code (memfit.step.trl_head, which the levers do not import, says the same)."""
    problem = (
        "--cross-entropy trl-chunked: TRL's fused LM head (trl >= 1.16) is not installed; "
        "pip install 'memfit[trl]'"
    )
    if importlib.util.find_spec("trl") is None:
        return problem
    try:
        from trl.trainer import utils as trl_utils  # optional: the trl extra
    except Exception:  # an old or broken TRL
        return problem
    return None if hasattr(trl_utils, "add_fused_lm_head") else problem


def head_bytes(values: Mapping[str, Any], checkpoint_bytes: int) -> int:
    """Bytes per weight of the head's matrix as the loss's matmuls read it. The head is held in
    the frozen dtype under LoRA and QLoRA (the checkpoint's, ``checkpoint_bytes``, under
    ``--weights-dtype auto``; the quantizer keeps the output head unquantized), else in the
    trained dtype (fp32 master weights under ``auto``/``fp32``, 16 bits under pure 16-bit
    training); under autocast (``--precision`` bf16/fp16) an fp32 head is read as its 16-bit
    copy, without it as it is held."""
    dtype = values.get("weights_dtype") or "auto"
    if values.get("lora_rank"):
        held = checkpoint_bytes if dtype == "auto" else 4 if dtype == "fp32" else 2
    else:
        held = 2 if dtype in ("bf16", "fp16") else 4
    if (values.get("precision") or "fp32") != "fp32":
        return min(held, 2)
    return held


@dataclass(kw_only=True)
class CrossEntropyKnobs:
    cross_entropy: str | None = knob(
        "standard | fused-linear | trl-chunked: causal-lm's token loss; fused-linear never "
        "builds the full logits (Liger Kernel's on CUDA); trl-chunked is TRL SFTTrainer's own "
        "chunked head (estimate and plan only).",
        choices=CROSS_ENTROPIES,
        shown_default="standard",
    )
    """The causal-LM loss: the standard one over the full logits, or a fused linear
    cross-entropy computed chunk by chunk from the hidden states and the head's weight."""


def fused(values: Mapping[str, Any]) -> bool:
    return values.get("cross_entropy") == "fused-linear"


class CrossEntropy(Lever):
    name: ClassVar[str] = "cross-entropy"
    knobs: ClassVar[type] = CrossEntropyKnobs
    summary: ClassVar[str] = "a fused linear cross-entropy (no full logits)"
    # a loss the job names is kept (a user whose trainer has no fused loss pins standard)
    pins: ClassVar[tuple[str, ...]] = ("cross_entropy",)

    def problems(self, job: Job) -> list[str]:
        kind = job.cross_entropy
        if kind in ("fused-linear", TRL_CHUNKED) and job.task not in (None, "causal-lm"):
            return [
                f"--cross-entropy {kind}: only with --task causal-lm (it fuses a language "
                "model's output head with its token loss)"
            ]
        if kind == TRL_CHUNKED and (problem := trl_head_problem()) is not None:
            return [problem]
        return []

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        own = room.job.cross_entropy
        if own is not None:
            return ({"cross_entropy": own},)
        if room.job.task == "causal-lm" and room.fused_loss_problem is None:
            return ({"cross_entropy": "standard"}, {"cross_entropy": "fused-linear"})
        if room.job.task == "causal-lm":
            # a head the fused loss does not model: the standard loss, as if the job pinned it
            return ({"cross_entropy": "standard"},)
        return ({},)

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        # one chunk's logits instead of all of them, their upcast and their gradient
        return sorted(options, key=lambda o: not fused(o))

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if values.get("cross_entropy") == "standard":
            return {"cross_entropy": None}
        return super().as_given(values)

    def micro_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any, tokens: int) -> float:
        """Seconds the fused loss adds to a micro-batch of ``tokens`` rows (0 for the standard
        loss): its chunks' re-reads of the head's weight beyond what their FLOPs take (see the
        module docstring)."""
        vocab, hidden = getattr(shape, "vocab", 0), shape.hidden
        if not fused(values) or not vocab or tokens <= 0:
            return 0.0
        # Liger's chunks (the shape asks memfit.step.linear_ce, which the levers do not import)
        chunks = shape.loss_chunks(tokens)
        width = head_bytes(values, shape.checkpoint_bytes)
        # the logits and the hidden states' gradient; the weight's gradient unless it is frozen
        matmuls = 2 if values.get("lora_rank") else 3
        memory = chunks * matmuls * vocab * hidden * width / (gpu.memory_bandwidth_gbps * 1e9)
        compute = (
            matmuls
            * 2.0
            * tokens
            * hidden
            * vocab
            / (gpu.flops_per_second(str(values.get("precision") or "fp32")) * _E_MAX)
        )
        return max(0.0, memory - compute)

    def time_words(self, values: Mapping[str, Any]) -> str | None:
        if not fused(values):
            return None
        return "the fused loss's chunked head matmuls (small: the same FLOPs, the head's weight read once per chunk)"

    def plan_lines(self, chosen: Chosen) -> list[str]:
        values, base = chosen.values, chosen.base
        if values.get("cross_entropy") == TRL_CHUNKED:
            return [
                "TRL's chunked LM head (as given): the loss TRL's SFTTrainer computes "
                "(add_fused_lm_head: tiles of the hidden states × the head's weight, never the "
                "full logits). Run it with SFTTrainer (apply_plan onto its SFTConfig, or "
                "memfit.integrations.GuardedSFTTrainer); memfit train runs --cross-entropy "
                "standard or fused-linear instead."
            ]
        if not fused(values):
            return []
        how = "as given" if values.get("cross_entropy") == base.get("cross_entropy") else "chosen"
        standard = {**values, "cross_entropy": "standard"}
        return [
            f"Fused linear cross-entropy ({how}): the loss is computed from the last hidden "
            "states and the head's weight chunk by chunk, so the full logits, their fp32 upcast "
            f"and their gradient never exist: {format_bytes(chosen.peak_bytes)} at micro-batch "
            f"{chosen.micro}, where the standard loss would need "
            f"{format_bytes(chosen.peak(standard))}. Same loss and gradients: no quality cost.",
            "Run it with Liger Kernel (pip install liger-kernel; CUDA only): "
            "TrainingArguments(use_liger_kernel=True, liger_kernel_config="
            "{'fused_linear_cross_entropy': True, 'cross_entropy': False, 'rope': False, "
            "'rms_norm': False, 'swiglu': False}) patches only the loss, as estimated; Liger "
            "knows the common decoders (Llama, Mistral, Qwen, Gemma, Phi-3, ...) and leaves "
            "others on the standard loss. memfit train uses it where it runs.",
        ]

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return "fused CE" if fused(values) else None

    def cure(self, patient: Patient) -> Fix | None:
        job = patient.job
        # TRL's head (trl-chunked) is SFTTrainer's, which refuses Liger's fused loss
        if (
            job is None
            or job.task != "causal-lm"
            or job.cross_entropy in ("fused-linear", TRL_CHUNKED)
        ):
            return None
        if patient.fused_loss_problem is not None:
            patient.notes.append(f"not proposed: cross-entropy — {patient.fused_loss_problem}")
            return None
        settings = {"cross_entropy": "fused-linear"}
        return Fix(
            change="a fused linear cross-entropy: the loss from the hidden states and the head's "
            "weight chunk by chunk, never the full logits (--cross-entropy fused-linear; Hugging "
            "Face Trainer: use_liger_kernel=True with liger-kernel installed)",
            saves_bytes=patient.price(settings),
            cost="none: the same loss and gradients; Liger Kernel needs CUDA",
            lever=self.name,
            settings=settings,
        )

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        info = details.get("cross_entropy")
        if isinstance(info, Mapping) and info.get("kind") == TRL_CHUNKED:
            return [
                f"loss: TRL's chunked LM head, {info.get('token_tiles')} tiles of "
                f"{info.get('token_tile')} tokens × {info.get('vocab_tile')} vocabulary columns, "
                f"never the full logits: {info.get('implementation')}"
            ]
        if not isinstance(info, Mapping) or info.get("kind") != "fused-linear":
            return []
        return [
            f"loss: fused linear cross-entropy, {info.get('chunks')} chunks of "
            f"{info.get('chunk_rows')} rows, never the full logits: {info.get('implementation')}"
        ]

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if not fused(values):
            return {}
        return {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_CONFIG)}


LEVER = CrossEntropy()
