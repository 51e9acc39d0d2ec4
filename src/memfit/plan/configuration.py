"""What a plan is made of: a configuration's levers (:class:`Levers`), a configuration that was
estimated (:class:`Candidate`) and the answer of :func:`memfit.plan.plan` (:class:`Plan`, whose
``to_dict`` is ``memfit plan --json``), with the commands it prints: ``memfit estimate`` to
re-check the peak, ``memfit plan`` on other GPUs, ``memfit train`` to run it. Their flags are
the levers' own (:func:`memfit.levers.flags`).
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from memfit.devices.catalog import catalog as gpus
from memfit.job import Job
from memfit.knobs import flag_of
from memfit.levers import ALLOWABLE, BY_NAME, LEVERS, lever_of
from memfit.levers.lora import LORA_RANK
from memfit.levers.quantization import QLORA as _QLORA
from memfit.units import format_bytes, size_arg

__all__ = ["LORA_RANK", "QLORA", "TIERS", "Candidate", "Levers", "Plan", "tier_of"]

# QLoRA's recipe as the quantization lever's values, in its fields' order
# (:data:`memfit.levers.quantization.QLORA`)
QLORA = tuple(_QLORA.values())
# a configuration's tier: the most harmful lever it uses, least harmful first (the levers
# ``memfit plan --allow`` names, in their order)
TIERS = ("none", *ALLOWABLE)
# the job's own fields' flags (those of no lever: the sequence length, the labels, the loss)
_JOB_FLAGS = {f.name: flag_of(f) for f in dataclasses.fields(Job)}
# what memfit estimate takes when a flag is left out: the re-check command leaves those out
_ESTIMATE_DEFAULTS = {
    "gradient_accumulation_steps": 1,
    "gradient_checkpointing": False,
    "world_size": 1,
    "sharding": "none",
    "attn_implementation": "sdpa",
}


def tier_of(values: Mapping[str, Any], base: Mapping[str, Any]) -> int:
    """0: no harmful lever; else the most harmful lever used only when allowed whose values
    differ from the job's own ``base`` (its index in :data:`TIERS`)."""
    used = [
        TIERS.index(lever.name)
        for lever in LEVERS
        if lever.allow
        and any(f in values and f in base and values[f] != base[f] for f in lever.fields)
    ]
    return max(used, default=0)


# memfit plan's --safety-margin default: the share of the budget a plan keeps free (memfit
# estimate's verdict says when a step is within the budget but not within the rest)
SAFETY_MARGIN = 0.05


@dataclass(frozen=True)
class Levers:
    """A candidate's levers: everything but the micro-batch size, the loss and the ranks. The
    fields are the job's (:class:`memfit.job.Job`), in the plan's words: no adapters is rank 0,
    plain base weights ``none``, no truncation the job's own length. A lever's fields the plan
    itself reads nowhere (a detail of the base weights' form) travel in ``others``."""

    precision: str
    gradient_checkpointing: bool
    optimizer: str
    max_seq_len: int
    lora_rank: int
    quantization: str = "none"  # the base weights (bitsandbytes): none | nf4 | fp4 | int8
    # the levers' other fields and their values, (field, value) in the levers' order
    others: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Levers:
        """The levers of ``values`` (field → value: every lever's plan options merged)."""
        named = {f.name for f in dataclasses.fields(cls)} - {"others"}
        others = tuple((k, v) for k, v in values.items() if k not in named)
        return cls(**{k: v for k, v in values.items() if k in named}, others=others)

    @functools.cached_property
    def values(self) -> Mapping[str, Any]:
        """The fields and their values, ``others`` among them (read only: shared by every
        caller)."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        others = named.pop("others")
        return MappingProxyType({**named, **dict(others)})

    def job_values(self, seq_len: int) -> dict[str, Any]:
        """The levers as the job's fields say them: what the plan leaves off (no adapters, no
        cut of a ``seq_len`` job, plain weights) is None, not given."""
        values = dict(self.values)
        if not values["lora_rank"]:
            values["lora_rank"] = None
        if values["max_seq_len"] >= seq_len:
            values["max_seq_len"] = None
        for lever in LEVERS:
            values.update(lever.as_given(values))
        return values

    def tier(
        self,
        base_optimizer: str,
        seq_len: int,
        base_rank: int = 0,
        base_quantization: str = "none",
    ) -> int:
        """0: no harmful lever; then the most harmful allowed lever used (:data:`TIERS`), against
        the job's own values."""
        base = {
            "optimizer": base_optimizer,
            "max_seq_len": seq_len,
            "lora_rank": base_rank,
            "quantization": base_quantization,
        }
        return tier_of(self.values, base)

    def paged_swap(self, base_optimizer: str) -> bool:
        """A paged optimizer instead of the job's own: searched after its tier's other knobs."""
        values, base = self.values, {"optimizer": base_optimizer}
        # the optimizer lever's last resort only: offloading is one too, and no paged optimizer
        return BY_NAME["optimizer"].last_resort(values, base)


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
        """The plan keys (plus ``lora_rank`` and the other levers' values)."""
        settings: dict[str, Any] = {
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
        }
        # the levers' other values (the base weights' form), as the plan says them
        settings.update((k, v) for k, v in self.knobs.values.items() if k not in settings)
        return settings

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
    safety_margin: float = SAFETY_MARGIN
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
    # the job's own values of the fields a plan keeps as given (its LoRA rank, its base weights:
    # :attr:`memfit.levers.base.Lever.pins`); None: not given, the levers may add them
    pinned: dict[str, Any] = field(default_factory=dict)
    # the training data, when the plan read its lengths (for the memfit train command)
    train_file: str | None = None
    # the flags that say how to read it (--text-column, --prompt-column, ...), as given to plan
    data_flags: str = ""
    # the budget on host memory (what offloading keeps there), and what the chosen configuration
    # keeps there (None: nothing)
    host_budget_bytes: int | None = None
    predicted_host_bytes: int | None = None

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
            # the budget less the safety margin: what every configuration is checked against
            "safety_margin": self.safety_margin,
            "usable_bytes": int(self.budget_bytes * (1 - self.safety_margin)),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "min_required_bytes": self.min_required_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "predicted_host_bytes": self.predicted_host_bytes,
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
        values = {
            **self.chosen.knobs.job_values(self.seq_len),
            **{k: s[k] for k in ("micro_batch_size", "gradient_accumulation_steps")},
            **{k: s[k] for k in ("mini_batch_size", "world_size", "sharding")},
            **self._job_values(s, all_labels=True),
            "attn_implementation": self.attn_implementation,
        }
        # what memfit estimate takes anyway is left out
        values = {k: v for k, v in values.items() if _ESTIMATE_DEFAULTS.get(k) != v}
        order = (
            "micro_batch_size",
            "seq_len",
            "precision",
            "optimizer",
            "num_labels",
            "loss",
            "mini-batch",
            "gradient_accumulation_steps",
            "checkpointing",
            "truncation",
            "lora",
            "quantization",
            "sharding",
            "attention",
        )
        flags = _flags(values, order, renames={"micro_batch_size": "--batch-size"})
        return " ".join(
            [f"memfit estimate {self.model} --task {self.task}", *flags, *self._budget_flags()]
        )

    def _job_values(self, settings: Mapping[str, Any], *, all_labels: bool) -> dict[str, Any]:
        """The job's own fields the commands name: the length, the labels of a classifier
        (``all_labels``: also the default 2), the loss of a sentence embedder."""
        labels = self.task == "classification" and (all_labels or self.num_labels != 2)
        return {
            "seq_len": self.seq_len,
            "num_labels": self.num_labels if labels else None,
            "loss": settings.get("loss") if self.task == "sentence-embedding" else None,
        }

    def budget_words(self) -> str:
        """The budget as a verdict says it, naming the card: ``a T4's 14.56 GiB`` (its memory),
        ``12.00 GiB on a T4`` (another budget on it), ``16.00 GiB`` (no card named)."""
        card = gpus().get(self.gpu) if self.gpu else None
        size = format_bytes(self.budget_bytes)
        if card is None:
            return size
        return card.budget_words(size, is_its_memory=card.memory_bytes == self.budget_bytes)

    def _budget_flags(self) -> list[str]:
        """``--gpu NAME`` when the budget is that card's memory, else ``--gpu-memory SIZE`` (a
        size, rounded down: :func:`memfit.units.size_arg`) and the card, if one was named."""
        card = gpus().get(self.gpu) if self.gpu else None
        flags = []
        if card is None or card.memory_bytes != self.budget_bytes:
            flags.append(f"--gpu-memory {size_arg(self.budget_bytes)}")
        if self.gpu:
            flags.append(f"--gpu {self.gpu}")
        if self.safety_margin != SAFETY_MARGIN:
            # memfit estimate's verdict and memfit plan's search against the same usable budget
            flags.append(f"--safety-margin {self.safety_margin:g}")
        return flags

    def plan_command(self, world_size: int, sharding: str) -> str:
        """The ``memfit plan`` command of this job on ``world_size`` GPUs with ``sharding``."""
        values = {
            **self._job_values({"loss": self.loss}, all_labels=False),
            "effective_batch_size": self.effective_batch_size,
            # the job's own pins: the plan varies the rest
            "precision": self.pinned_precision,
            **self.pinned,
            "world_size": world_size,
            "sharding": None if sharding == "none" else sharding,
        }
        allow = [f"--allow {','.join(self.allow)}"] if self.allow else []
        order = (
            "effective_batch_size",
            "num_labels",
            "loss",
            self._budget_flags(),
            "precision",
            "lora",
            "quantization",
            allow,
            "sharding",
        )
        head = f"memfit plan {self.model} --task {self.task} --seq-len {self.seq_len}"
        return " ".join([head, *_flags(values, order)])

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
        values = {
            **self.chosen.knobs.job_values(self.seq_len),
            **self._job_values(s, all_labels=True),
            "effective_batch_size": self.effective_batch_size,
            "micro_batch_size": s["micro_batch_size"],
            # the length the plan was sized for: longer rows would not fit
            "max_seq_len": s["max_seq_len"],
            "mini_batch_size": s["mini_batch_size"],
            "world_size": s["world_size"] if s["world_size"] > 1 else None,
            "sharding": None if s["sharding"] == "none" else s["sharding"],
        }
        order = (
            "effective_batch_size",
            "micro_batch_size",
            "precision",
            "optimizer",
            "checkpointing",
            "truncation",
            "num_labels",
            "loss",
            "mini-batch",
            "lora",
            "quantization",
            "sharding",
        )
        parts = [
            f"memfit train --model {shlex.quote(self.model)} --task {self.task}",
            f"--train-file {train_file} --output-dir {shlex.quote(output_dir or 'OUTPUT_DIR')}",
            *([self.data_flags] if self.data_flags else []),
            *_flags(values, order),
        ]
        return " ".join(parts)


def _flags(
    values: Mapping[str, Any],
    order: Sequence[str | list[str]],
    renames: Mapping[str, str] | None = None,
) -> list[str]:
    """The flags of ``values`` (the job's fields) in a command's ``order``: a lever's name (its
    flags, :meth:`~memfit.levers.base.Lever.flags`), one field of a lever or of the job, or
    flags written out; the order each command has always printed them in. A lever no item
    names (a new one) follows, in the levers' order."""
    out: list[str] = []
    named = set()
    for item in order:
        if isinstance(item, list):
            out.extend(item)
            continue
        lever = BY_NAME.get(item) or lever_of(item)
        if lever is None:
            if values.get(item) is not None:
                out.append(f"{_JOB_FLAGS[item]} {values[item]}")
            continue
        named.add(lever.name)
        out.extend(lever.flags(values if item == lever.name else {item: values.get(item)}, renames))
    for lever in LEVERS:
        if lever.name not in named:
            out.extend(lever.flags(values, renames))
    return out
