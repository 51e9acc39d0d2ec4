"""Quantized base weights (bitsandbytes; QLoRA): the frozen base held in 4 bits (NF4 or FP4, the
block scales optionally quantized again) or 8 bits (LLM.int8()), dequantized into the compute
dtype for each matmul. Only under LoRA: only adapters train on a quantized base. The most harmful
lever a plan may use (with ``--allow quantization``).

Its cost in time (:meth:`Quantization.dequantization_seconds`, which the plan's cost model adds
to each pass): bitsandbytes' ``Linear4bit`` dequantizes each quantized weight into a
compute-dtype copy for the matmul in every forward, and again in the backward for the input's
gradient (a recomputed forward, a third time). A dequantization is memory-bound and does not
depend on the tokens, so it is charged per pass over the weights: ``quantized parameters ×
DEQUANT_BYTES_PER_PARAMETER / memory bandwidth``. The figure is fitted to LitGPT's resource
tables (``tutorials/resource-tables.md``, LoRA on one A100-SXM4-40GB, 1555 GB/s, bitsandbytes
0.41.1, micro-batch 1, 1k iterations): without quantization vs ``bnb.nf4`` / ``bnb.nf4-dq`` took
phi-1.5 1.62 / 1.77 / 1.87 min, StableLM-3B 1.24 / 1.82 / 1.87, Llama-2-7B 2.36 / 3.68 / 3.83,
Llama-2-13B 3.19 / 6.38 / 6.55. The extra time over two dequantizations per iteration of the 1.2,
3.2, 6.5 and 12.7 billion matmul weights is 3.7–7.5 ps per weight for nf4 (9 bytes at 1555 GB/s,
averaged) and 5.9–7.9 ps with double quantization (10.5 bytes): so 9 bytes, plus 1.5 for double
quantization. A raw dequantization moves about 2.5 bytes (0.5 read, 2 written); the kernels reach
a quarter of the bandwidth. The spread over the four models is about ±25 %. LLM.int8()
(``int8``) is charged the same figure, unmeasured: memfit never chooses int8 itself, only a
user's ``--quantization int8`` uses it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob, whole
from memfit.levers.base import Chosen, Lever, Room
from memfit.levers.cure import Fix, Patient
from memfit.levers.lora import LORA_RANK
from memfit.units import format_bytes

# the base weights as bitsandbytes holds them (QLoRA): 4-bit NormalFloat or float, LLM.int8()
QUANTIZATIONS = ("none", "nf4", "fp4", "int8")
FOUR_BIT = ("nf4", "fp4")
# QLoRA's recipe (Dettmers et al. 2023, arXiv:2305.14314): 4-bit NormalFloat base weights, their
# block scales quantized again
QLORA = {"quantization": "nf4", "double_quant": True}
# LLM.int8()'s outlier threshold (transformers' llm_int8_threshold default): activation columns
# above it are computed in 16 bits
INT8_THRESHOLD = 6.0
# memory traffic, at the GPU's full bandwidth, that one dequantization of a 4-bit weight costs per
# parameter; double quantization adds the second-level scales' (fitted: see the module docstring)
DEQUANT_BYTES_PER_PARAMETER = 9.0
DOUBLE_QUANT_BYTES_PER_PARAMETER = 1.5


@dataclass(kw_only=True)
class QuantizationKnobs:
    quantization: str | None = knob(
        "none | nf4 | fp4 | int8: the frozen base weights quantized by bitsandbytes (QLoRA; "
        "only with --lora-rank).",
        choices=QUANTIZATIONS,
    )
    """Quantized base weights (bitsandbytes): 4-bit NF4/FP4 or LLM.int8(); only under LoRA."""
    double_quant: bool | None = knob("4-bit: quantize the quantization constants too (QLoRA).")
    """4-bit only: the per-block scales quantized again (``bnb_4bit_use_double_quant``)."""


class Quantization(Lever):
    name: ClassVar[str] = "quantization"
    in_training_arguments: ClassVar[bool] = False
    outside_note: ClassVar[str] = (
        "quantized weights are from_pretrained's quantization_config=BitsAndBytesConfig(...), "
        "which no TrainingArguments field sets"
    )
    knobs: ClassVar[type] = QuantizationKnobs
    allow: ClassVar[bool] = True
    tier: ClassVar[int] = 5
    summary: ClassVar[str] = "quantized base weights under LoRA (QLoRA)"
    # the job's own base weights are the job: a plan keeps them as given
    pins: ClassVar[tuple[str, ...]] = ("quantization", "double_quant")

    def problems(self, job: Job) -> list[str]:
        problems: list[str] = []
        quantized = job.quantization not in (None, "none")
        if quantized and not whole(job.lora_rank) and job.quantization in QUANTIZATIONS:
            problems.append(
                f"--quantization {job.quantization}: only with --lora-rank R (QLoRA: quantized "
                "base weights are frozen; only LoRA adapters train on them)"
            )
        if job.double_quant and job.quantization not in FOUR_BIT:
            problems.append("--double-quant: only with --quantization nf4 or fp4 (4-bit weights)")
        return problems

    def flags(
        self, values: Mapping[str, Any], renames: Mapping[str, str] | None = None
    ) -> list[str]:
        # none: full-precision base weights, no flags; double quantization only for 4-bit
        if values.get("quantization") in (None, "none"):
            return []
        return super().flags(values, renames)

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # the job's own base weights (kept as given), then QLoRA's recipe when allowed; a
        # quantized base goes only with LoRA (the job's checks drop it without a rank)
        job = room.job
        own = {"quantization": job.quantization or "none", "double_quant": bool(job.double_quant)}
        if own["quantization"] == "none" and self.name in room.allowed:
            return (own, dict(QLORA))
        return (own,)

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # plain base weights are no quantization given, double or not
        if values.get("quantization") in (None, "none"):
            return dict.fromkeys(self.fields)
        return super().as_given(values)

    def dequantization_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any) -> float:
        """Seconds one pass over the weights spends dequantizing them (0 without quantization):
        the ``shape``'s quantizable weights at the fitted bytes per weight, at ``gpu``'s memory
        bandwidth (see the module docstring)."""
        if values.get("quantization") in (None, "none"):
            return 0.0
        per_parameter = DEQUANT_BYTES_PER_PARAMETER + (
            DOUBLE_QUANT_BYTES_PER_PARAMETER if values.get("double_quant") else 0.0
        )
        return shape.quantizable_parameters * per_parameter / (gpu.memory_bandwidth_gbps * 1e9)

    def pass_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any) -> float:
        return self.dequantization_seconds(values, shape, gpu)

    def time_words(self, values: Mapping[str, Any]) -> str | None:
        if values.get("quantization") in (None, "none"):
            return None
        return "dequantizing the base weights on every pass"

    def plan_lines(self, chosen: Chosen) -> list[str]:
        # what quantized base weights save and cost per step, what QLoRA found about quality,
        # and (allowed, not given) why the plan needed them
        values, base = chosen.values, chosen.base
        kind = values.get("quantization")
        if kind in (None, "none"):
            return []
        plain = {**values, "quantization": "none", "double_quant": False}
        how = "as given" if kind == base.get("quantization") else "allowed"
        name = kind + (" with double quantization" if values.get("double_quant") else "")
        slower = chosen.speed(plain) / chosen.speed(values) - 1
        step = chosen.samples_per_step / chosen.speed(values)
        per_pass = self.dequantization_seconds(values, chosen.shape, chosen.gpu)
        gpu = chosen.gpu.name
        lines = [
            f"Quantized base weights, {name} ({how}; QLoRA): bitsandbytes holds the "
            f"{chosen.shape.quantizable_parameters / 1e9:.2f} B frozen matmul weights in "
            + ("4" if kind != "int8" else "8")
            + f" bits, the LoRA adapters train on top: {format_bytes(chosen.peak_bytes)} at "
            f"micro-batch {chosen.micro}, where unquantized weights would need "
            f"{format_bytes(chosen.peak(plain))}.",
            f"Time: every forward and backward (and recomputed forward) dequantizes those "
            f"weights, {per_pass * 1e3:.0f} ms per pass on the {gpu}: about {slower:.0%} more "
            f"time per step ({step:.1f} s per optimizer step; cost model: "
            f"{DEQUANT_BYTES_PER_PARAMETER:g}"
            + (f" + {DOUBLE_QUANT_BYTES_PER_PARAMETER:g}" if values.get("double_quant") else "")
            + " bytes per weight per pass at the GPU's memory bandwidth, fitted to LitGPT's LoRA "
            "vs bnb.nf4-dq timings on an A100).",
            "Quality: the QLoRA paper (Dettmers et al. 2023, arXiv:2305.14314) found LoRA on NF4 "
            "weights with double quantization matches 16-bit LoRA and 16-bit full fine-tuning on "
            "GLUE, Super-NaturalInstructions and MMLU; a small risk remains for other models and "
            "tasks (compare on your eval set). Needs bitsandbytes (pip install "
            "'memfit[quantization]') and a CUDA GPU; embeddings and the output head stay "
            "unquantized.",
        ]
        if how == "allowed":
            unquantized = [
                peak
                for v, peak in chosen.least
                if v.get("quantization") == base.get("quantization")
            ]
            lines.append(
                "Quantization is the last lever tried: nothing allowed fits without it (the least "
                f"configuration on unquantized weights needs {format_bytes(min(unquantized))} of "
                f"{format_bytes(chosen.usable)}, the budget less the safety margin)."
            )
        return lines

    def allow_problems(self, allowed: Sequence[str], job: Job) -> list[str]:
        if self.name in allowed and "lora" not in allowed and not job.lora_rank:
            # allowing one lever never grants another: LoRA changes what is learned by itself
            return [
                "--allow quantization: quantized base weights are frozen, so it needs LoRA "
                "adapters (QLoRA); allow both (--allow lora,quantization) or give --lora-rank R"
            ]
        return []

    def allow_with(self, job: Job) -> tuple[str, ...]:
        # the hint allows LoRA with it (a LoRA rank of the job's own stays)
        return () if job.lora_rank else ("lora",)

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        rank = values.get("lora_rank") or job.lora_rank or LORA_RANK
        return (
            f"QLoRA: rank {rank} adapters on {values.get('quantization')} base weights"
            + (" with double quantization" if values.get("double_quant") else "")
            + "; each pass dequantizes them, slower steps"
        )

    def bnb_settings(
        self, values: Mapping[str, Any], compute_dtype: Any, skip: Sequence[str] | None
    ) -> dict[str, Any]:
        """``transformers.BitsAndBytesConfig``'s keywords for ``values`` (the same for the traced
        and the trained model); ``compute_dtype``: the dtype 4-bit matmuls compute in; ``skip``:
        modules left unquantized (None: transformers' own choice)."""
        kept = list(skip) if skip is not None else None
        if values.get("quantization") == "int8":
            # LLM.int8(): 8-bit weights, outlier features in 16 bits
            return {
                "load_in_8bit": True,
                "llm_int8_threshold": INT8_THRESHOLD,
                "llm_int8_skip_modules": kept,
            }
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": values.get("quantization"),
            "bnb_4bit_use_double_quant": bool(values.get("double_quant")),
            "bnb_4bit_compute_dtype": compute_dtype,
            "llm_int8_skip_modules": kept,
        }

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        # what bitsandbytes holds (details["quantization"]), when the base is quantized
        info = details.get("quantization")
        if not isinstance(info, dict):
            return []
        scheme = str(info.get("scheme"))
        double = " with double quantization" if info.get("double_quant") else ""
        kept = ", ".join(info.get("kept_modules") or ()) or "none"
        compute = f", computing in {info['compute_dtype']}" if scheme != "int8" else ""
        # the unquantized layers are frozen: held in the frozen weights' dtype (details["weights"])
        weights = details.get("weights")
        held = weights.get("frozen") if isinstance(weights, dict) else None
        return [
            f"base weights: {scheme}{double} (bitsandbytes){compute}: "
            f"{format_bytes(int(info.get('quantized_bytes') or 0))} for "
            f"{int(info.get('quantized_parameters') or 0):,} quantized parameters; "
            f"kept unquantized ({held or 'fp32'}): {kept}"
        ]

    def cure(self, patient: Patient) -> Fix | None:
        # QLoRA as the plan makes it (the job's LoRA rank, else rank 8), for a decoder on a GPU
        # with plain base weights; the estimate decides whether it gains (a small model's upcast
        # embeddings can outweigh the 4-bit weights)
        job = patient.job
        if (
            job is None
            or job.task != "causal-lm"
            or job.quantization not in (None, "none")
            or (job.device or "cuda") != "cuda"
        ):
            return None
        rank = job.lora_rank or LORA_RANK
        kind = QLORA["quantization"]
        settings = {"lora_rank": rank, **QLORA}
        saves = patient.price(settings)
        flags = " ".join(self.flags(QLORA))
        if job.lora_rank:
            change = (
                f"QLoRA: the frozen base weights in {kind} with double quantization under the "
                f"rank-{rank} adapters ({flags}; memfit plan --lora-rank {rank} --allow "
                "quantization plans it)"
            )
        else:
            change = (
                f"QLoRA: LoRA adapters (rank {rank}) on {kind} base weights with double "
                f"quantization (--lora-rank {rank} {flags}; memfit plan --allow lora,quantization "
                "plans it)"
            )
            lora = patient.proposed("lora")
            alone = lora.saves_bytes if lora is not None else None
            if saves is not None and alone is not None and saves <= alone:
                return None  # more harm than LoRA for no more memory
        return Fix(
            change=change,
            saves_bytes=saves,
            cost="slower steps: every forward and backward dequantizes the base weights (memfit "
            "plan prices it); QLoRA (Dettmers et al. 2023) matched 16-bit LoRA on its "
            "benchmarks, a small quality risk remains; needs bitsandbytes and a CUDA GPU",
            lever="quantization",
            settings=settings,
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        kind = values.get("quantization")
        if kind in (None, "none"):
            return None
        return f"{kind} base" + (" (double quant)" if values.get("double_quant") else "")


LEVER = Quantization()
