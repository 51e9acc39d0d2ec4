"""What a plan is made of: a configuration's levers (:class:`Levers`), a configuration that was
estimated (:class:`Candidate`) and the answer of :func:`memfit.plan.plan` (:class:`Plan`, whose
``to_dict`` is ``memfit plan --json``), with the commands it prints: ``memfit estimate`` to
re-check the peak, ``memfit plan`` on other GPUs, ``memfit train`` to run it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from memfit.plan import cost
from memfit.units import format_bytes, size_arg

LORA_RANK = 8
# QLoRA's recipe (Dettmers et al. 2023, arXiv:2305.14314): 4-bit NormalFloat base weights, their
# block scales quantized again
QLORA = ("nf4", True)
# a configuration's tier: the most harmful lever it uses, least harmful first
TIERS = ("none", "optimizer", "truncation", "lora", "quantization")


@dataclass(frozen=True)
class Levers:
    """A candidate's levers: everything but the micro-batch size."""

    precision: str
    gradient_checkpointing: bool
    optimizer: str
    max_seq_len: int
    lora_rank: int
    quantization: str = "none"  # the base weights (bitsandbytes): none | nf4 | fp4 | int8
    double_quant: bool = False

    def tier(
        self,
        base_optimizer: str,
        seq_len: int,
        base_rank: int = 0,
        base_quantization: str = "none",
    ) -> int:
        """0: no harmful lever; then the most harmful allowed lever used (:data:`TIERS`: 1
        optimizer, 2 truncation, 3 LoRA, 4 quantization), against the job's own values."""
        if self.quantization != base_quantization:
            return 4
        if self.lora_rank != base_rank:
            return 3
        if self.max_seq_len < seq_len:
            return 2
        return 1 if self.optimizer != base_optimizer else 0

    def paged_swap(self, base_optimizer: str) -> bool:
        """A paged optimizer instead of the job's own: searched after its tier's other knobs."""
        return self.optimizer != base_optimizer and cost.is_paged(self.optimizer)


@dataclass(frozen=True)
class Candidate:
    """A configuration that was estimated."""

    knobs: Levers
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    loss: str
    mini_batch_size: int | None
    predicted_peak_bytes: int
    predicted_samples_per_second: float
    sharding: str = "none"

    def settings(self) -> dict[str, Any]:
        """The plan keys (plus ``lora_rank``)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "precision": self.knobs.precision,
            "gradient_checkpointing": self.knobs.gradient_checkpointing,
            "optimizer": self.knobs.optimizer,
            "max_seq_len": self.knobs.max_seq_len,
            "loss": self.loss,
            "mini_batch_size": self.mini_batch_size,
            "max_tokens_per_micro_batch": (self.mini_batch_size or self.micro_batch_size)
            * self.knobs.max_seq_len,
            "lora_rank": self.knobs.lora_rank or None,
            "quantization": self.knobs.quantization,
            "double_quant": self.knobs.double_quant,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.settings(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_samples_per_second": round(self.predicted_samples_per_second, 3),
        }


@dataclass
class Plan:
    """What ``memfit plan`` answers; ``to_dict`` is the ``--json`` contract."""

    fits: bool
    budget_bytes: int
    predicted_peak_bytes: int | None
    min_required_bytes: int
    chosen: Candidate | None
    alternatives: list[Candidate]
    explanation: list[str]
    suggestions: list[str]
    # what the job is, for --write-config and for reading the plan back
    model: str = ""
    task: str = ""
    seq_len: int = 0
    effective_batch_size: int = 0
    num_labels: int = 2
    gpu: str | None = None
    safety_margin: float = 0.05
    data: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    sharding: str = "none"
    # the least configuration's memory per GPU on other world sizes and schemes (nothing fits)
    scale_out: list[dict[str, Any]] = field(default_factory=list)
    # the job's other flags, for the commands the plan prints
    loss: str | None = None
    allow: tuple[str, ...] = ()
    pinned_precision: str | None = None
    base_optimizer: str = "adamw"
    attn_implementation: str = "sdpa"
    # the job's own LoRA rank and quantization (None: not given; the levers may add them)
    lora_rank: int | None = None
    quantization: str | None = None
    double_quant: bool | None = None
    # the training data, when the plan read its lengths (for the memfit train command)
    train_file: str | None = None
    # the flags that say how to read it (--text-column, --prompt-column, ...), as given to plan
    data_flags: str = ""

    @property
    def plan(self) -> dict[str, Any] | None:
        return None if self.chosen is None else self.chosen.settings()

    @property
    def predicted_samples_per_second(self) -> float:
        return 0.0 if self.chosen is None else self.chosen.predicted_samples_per_second

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "min_required_bytes": self.min_required_bytes,
            "plan": self.plan,
            "predicted_samples_per_second": round(self.predicted_samples_per_second, 3),
            "alternatives": [c.to_dict() for c in self.alternatives],
            "explanation": list(self.explanation),
            "suggestions": list(self.suggestions),
            "world_size": self.world_size,
            "sharding": self.sharding,
            "scale_out": [dict(row) for row in self.scale_out],
            "train_command": self.train_command(),
        }

    def estimate_command(self) -> str | None:
        """The ``memfit estimate`` command that re-checks the plan's peak by hand."""
        if self.chosen is None:
            return None
        s = self.chosen.settings()
        parts = [
            f"memfit estimate {self.model} --task {self.task}",
            f"--batch-size {s['micro_batch_size']} --seq-len {self.seq_len}",
            f"--precision {s['precision']} --optimizer {s['optimizer']}",
        ]
        if self.task == "classification":
            parts.append(f"--num-labels {self.num_labels}")
        if self.task == "sentence-embedding":
            parts.append(f"--loss {s['loss']}")
        if s["mini_batch_size"]:
            parts.append(f"--mini-batch-size {s['mini_batch_size']}")
        if s["gradient_accumulation_steps"] > 1:
            parts.append(f"--gradient-accumulation-steps {s['gradient_accumulation_steps']}")
        if s["gradient_checkpointing"]:
            parts.append("--gradient-checkpointing")
        if s["max_seq_len"] < self.seq_len:
            parts.append(f"--max-seq-len {s['max_seq_len']}")
        if s["lora_rank"]:
            parts.append(f"--lora-rank {s['lora_rank']}")
        parts += _quantization_flags(s)
        if s["world_size"] > 1:
            parts.append(f"--world-size {s['world_size']}")
        if s["sharding"] != "none":
            parts.append(f"--sharding {s['sharding']}")
        if self.attn_implementation != "sdpa":
            parts.append(f"--attn-implementation {self.attn_implementation}")
        parts += self._budget_flags()
        return " ".join(parts)

    def budget_words(self) -> str:
        """The budget as a verdict says it, naming the card: ``a T4's 14.56 GiB`` (its memory),
        ``12.00 GiB on a T4`` (another budget on it), ``16.00 GiB`` (no card named)."""
        from memfit.devices.catalog import catalog as gpus

        card = gpus().get(self.gpu) if self.gpu else None
        size = format_bytes(self.budget_bytes)
        if card is None:
            return size
        return card.budget_words(size, is_its_memory=card.memory_bytes == self.budget_bytes)

    def _budget_flags(self) -> list[str]:
        """``--gpu NAME`` when the budget is that card's memory, else ``--gpu-memory SIZE`` (a
        size, rounded down: :func:`memfit.units.size_arg`) and the card, if one was named."""
        from memfit.devices.catalog import catalog as gpus

        card = gpus().get(self.gpu) if self.gpu else None
        flags = []
        if card is None or card.memory_bytes != self.budget_bytes:
            flags.append(f"--gpu-memory {size_arg(self.budget_bytes)}")
        if self.gpu:
            flags.append(f"--gpu {self.gpu}")
        return flags

    def plan_command(self, world_size: int, sharding: str) -> str:
        """The ``memfit plan`` command of this job on ``world_size`` GPUs with ``sharding``."""
        parts = [
            f"memfit plan {self.model} --task {self.task} --seq-len {self.seq_len}",
            f"--effective-batch-size {self.effective_batch_size}",
        ]
        if self.task == "classification" and self.num_labels != 2:
            parts.append(f"--num-labels {self.num_labels}")
        if self.loss:
            parts.append(f"--loss {self.loss}")
        parts += self._budget_flags()
        if self.pinned_precision:
            parts.append(f"--precision {self.pinned_precision}")
        if self.lora_rank:
            parts.append(f"--lora-rank {self.lora_rank}")
        parts += _quantization_flags(
            {"quantization": self.quantization, "double_quant": self.double_quant}
        )
        if self.allow:
            parts.append(f"--allow {','.join(self.allow)}")
        parts.append(f"--world-size {world_size}")
        if sharding != "none":
            parts.append(f"--sharding {sharding}")
        return " ".join(parts)

    def train_command(
        self, train_file: str | None = None, output_dir: str | None = None
    ) -> str | None:
        """The ``memfit train`` command that runs the chosen plan (None: nothing fits), every
        plan key as a flag; ``TRAIN_FILE`` and ``OUTPUT_DIR`` stand for what the plan does not
        know. The accumulation steps follow from the micro-batch and the effective batch."""
        if self.chosen is None:
            return None
        s = self.chosen.settings()
        train_file = shlex.quote(train_file or self.train_file or "TRAIN_FILE")
        parts = [
            f"memfit train --model {shlex.quote(self.model)} --task {self.task}",
            f"--train-file {train_file} --output-dir {shlex.quote(output_dir or 'OUTPUT_DIR')}",
            *([self.data_flags] if self.data_flags else []),
            f"--effective-batch-size {self.effective_batch_size}",
            f"--micro-batch-size {s['micro_batch_size']}",
            f"--precision {s['precision']} --optimizer {s['optimizer']}",
            "--gradient-checkpointing"
            if s["gradient_checkpointing"]
            else "--no-gradient-checkpointing",
            # the length the plan was sized for: longer rows would not fit
            f"--max-seq-len {s['max_seq_len']}",
        ]
        if self.task == "classification":
            parts.append(f"--num-labels {self.num_labels}")
        if self.task == "sentence-embedding":
            parts.append(f"--loss {s['loss']}")
        if s["mini_batch_size"]:
            parts.append(f"--mini-batch-size {s['mini_batch_size']}")
        if s["lora_rank"]:
            parts.append(f"--lora-rank {s['lora_rank']}")
        parts += _quantization_flags(s)
        if s["world_size"] > 1:
            parts.append(f"--world-size {s['world_size']}")
        if s["sharding"] != "none":
            parts.append(f"--sharding {s['sharding']}")
        return " ".join(parts)


def _quantization_flags(settings: dict[str, Any]) -> list[str]:
    """``--quantization Q [--double-quant]`` for quantized base weights (none: no flags)."""
    quantization = settings.get("quantization")
    if quantization in (None, "none"):
        return []
    return [f"--quantization {quantization}"] + (
        ["--double-quant"] if settings.get("double_quant") else []
    )
