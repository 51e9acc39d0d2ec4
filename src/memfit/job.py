"""The job: every knob of a fine-tuning step, its allowed values, its flag and its checks, once.

``estimate``, ``plan``, ``train`` (whose :class:`~memfit.train.TrainConfig` is a :class:`Job` with
the run's own settings added), ``infer``, the doctor, ``integrations.plan``, the config files and
the CLI take their vocabulary and validation from here. A knob is one field of :class:`Job`: its
docstring says what it means, its metadata the flag and the help line the CLI shows, and
:meth:`Job.problems` checks it. What a knob does to memory is modelled in
:mod:`memfit.estimate.workload`; what it does to a run, in :mod:`memfit.train`.

Nothing here imports torch or transformers: the CLI's quick verbs read it too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# --- the vocabulary ---------------------------------------------------------------------------------
TASKS = ("classification", "causal-lm", "sentence-embedding")
PRECISIONS = ("fp32", "fp16", "bf16")
# flash_attention_2: the flash-attn package's kernel as transformers calls it (modelled on a CUDA
# GPU of sm80 or newer; it never runs on the CPU)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# the base weights as bitsandbytes holds them (QLoRA): 4-bit NormalFloat or float, LLM.int8()
QUANTIZATIONS = ("none", "nf4", "fp4", "int8")
FOUR_BIT = ("nf4", "fp4")
MODES = ("train", "eval")
DEVICES = ("cuda", "cpu")
# none: every rank holds the whole model (data parallelism); fsdp: PyTorch FSDP2; zero1|2|3:
# DeepSpeed ZeRO (see memfit.estimate.sharding for what each divides)
SHARDING_SCHEMES = ("none", "zero1", "zero2", "zero3", "fsdp")
DEEPSPEED_SCHEMES = ("zero1", "zero2", "zero3")
TRACE_DEPTHS = ("auto", "full")


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

LOSSES = {
    "classification": ("cross-entropy",),
    "causal-lm": ("cross-entropy",),
    # sentence-transformers' names: MultipleNegativesRankingLoss, CoSENTLoss, CosineSimilarityLoss,
    # SoftmaxLoss. mnrl is the default for (anchor, positive) pairs.
    "sentence-embedding": ("mnrl", "cached-mnrl", "cosent", "cosine", "softmax"),
}
DEFAULT_LOSS = {"classification": "cross-entropy", "causal-lm": "cross-entropy"} | {
    "sentence-embedding": "mnrl"
}
LOSS_ALIASES = {
    "multiplenegativesrankingloss": "mnrl",
    "multiple-negatives-ranking": "mnrl",
    "cosentloss": "cosent",
    "cosinesimilarityloss": "cosine",
    "cosine-similarity": "cosine",
    "softmaxloss": "softmax",
    "cachedmultiplenegativesrankingloss": "cached-mnrl",
    "cached-multiple-negatives-ranking": "cached-mnrl",
    "cachedmnrl": "cached-mnrl",
    "ce": "cross-entropy",
    "cross_entropy": "cross-entropy",
}
# losses whose every sample is compared with the rest of its batch: a smaller batch (gradient
# accumulation) changes the objective; their cached (GradCache) variant does not
IN_BATCH_NEGATIVE_LOSSES = ("mnrl", "cached-mnrl")
CACHED_LOSSES = {"mnrl": "cached-mnrl"}
# sentence-transformers' CachedMultipleNegativesRankingLoss default mini-batch
DEFAULT_MINI_BATCH_SIZE = 32
# sequence lengths are padded to a multiple of this (tensor cores, and fewer distinct shapes)
SEQ_LEN_MULTIPLE = 8


def resolve_loss(task: str, loss: str | None, problems: list[str]) -> str:
    """The canonical loss name for ``task`` (its default when None); a problem if it has none."""
    if task not in TASKS:
        return "cross-entropy"
    resolved = DEFAULT_LOSS[task] if loss is None else LOSS_ALIASES.get(loss.lower(), loss.lower())
    if resolved not in LOSSES[task]:
        problems.append(
            f"--loss: {loss!r} is not a loss for --task {task}; choose one of {', '.join(LOSSES[task])}"
        )
    return resolved


def round_seq_len(tokens: int, multiple: int = SEQ_LEN_MULTIPLE) -> int:
    """``tokens`` rounded up to a multiple of ``multiple`` (how runs pad their longest batch)."""
    return -(-int(tokens) // multiple) * multiple


def parse_target_modules(value: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """``--lora-target-modules a,b`` (or a list from a config file) as a list; None: default."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(x) for x in value]
    names = [x.strip() for x in items if x.strip()]
    return names or None


def positions_problem(flag: str, seq_len: Any, positions: int, model: str) -> str | None:
    """The problem with a sequence length past the ``positions`` ``model`` can embed, or None."""
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > positions:
        return (
            f"{flag}: {seq_len} is beyond the {positions} positions {model} can use; "
            f"use {flag} {positions} or less"
        )
    return None


def choice_problem(flag: str, value: Any, allowed: Iterable[str]) -> str | None:
    """The problem with ``value`` outside ``allowed``, or None."""
    allowed = tuple(allowed)
    if value in allowed:
        return None
    return f"{flag}: unknown value {value!r}; choose one of {', '.join(allowed)}"


def whole_problem(flag: str, value: Any, minimum: int = 1, *, typed: bool = False) -> str | None:
    """The problem with ``value`` if it is not a whole number ≥ ``minimum``, or None.

    ``typed``: the value came through the CLI or a config file, which already made it a number;
    the message for a count (``minimum`` ≥ 1) then names only the bound.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return None
    if typed and minimum >= 1 and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{flag}: must be ≥ {minimum}, got {value}"
    return f"{flag}: must be a whole number ≥ {minimum}, got {value!r}"


def finite_problem(flag: str, value: Any) -> str | None:
    """NaN passes every comparison that would refuse it, and inf trains a model of NaNs."""
    if isinstance(value, int | float) and not math.isfinite(value):
        return f"{flag}: must be a finite number, got {value}"
    return None


def knob(
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: int | None = None,
    default: Any = None,
    required: bool = False,
    cli: bool = True,
    **extra: Any,
) -> Any:
    """A dataclass field that is a knob: its help line, flag (default ``--field-name``), allowed
    values or lower bound (checked by :meth:`Job.problems`), and whether the CLI shows it."""
    metadata = {"help": help, "flag": flag, "choices": choices, "minimum": minimum, "cli": cli}
    metadata |= extra
    if required:
        return field(metadata=metadata)
    if isinstance(default, list | dict | set):
        raise TypeError("mutable defaults: use default_factory")
    return field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field[Any]) -> str:
    """The CLI flag of a dataclass field (its metadata's, else ``--name-with-dashes``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


# --- the job ----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Job:
    """A fine-tuning job's knobs: what decides the memory of one step on one rank.

    None means "not given": ``memfit estimate`` and ``plan`` fill in their defaults (fp32, sdpa,
    2 labels, ...), ``memfit train`` plans what is missing before step 0. Every field is one flag;
    :meth:`problems` returns every problem at once, each naming its flag.
    """

    model: str = knob(
        "A registry name (memfit models), a Hub id memfit knows, or a model folder.", required=True
    )
    """The model: a registry name or id, or a folder holding ``config.json``."""
    task: str = knob(
        "classification | causal-lm | sentence-embedding", choices=TASKS, required=True
    )
    """What is trained: a sequence classifier, a causal language model, a sentence embedder."""
    num_labels: int | None = knob("Classification: the number of labels (default 2).", minimum=1)
    """Classification: the size of the head."""
    loss: str | None = knob(
        "Sentence-embedding: mnrl | cached-mnrl | cosent | cosine | softmax (default mnrl)."
    )
    """The loss (sentence-transformers' names); each task has one default. Checked per task."""
    seq_len: int | None = knob("Tokens per sequence (the longest the step sees).", minimum=1)
    """The sequence length the step is sized for (the longest row of a micro-batch, padded)."""
    max_seq_len: int | None = knob("Truncate sequences to this many tokens.", minimum=1)
    """Truncation: rows are cut to this many tokens (a plan lever; harms long rows)."""
    effective_batch_size: int = knob(
        "Samples per optimizer step, over all ranks (kept exactly).", minimum=1, default=32
    )
    """Samples per optimizer step over every rank: what the job learns from; plans keep it."""
    micro_batch_size: int | None = knob("Rows per forward/backward on one rank.", minimum=1)
    """Rows per forward and backward on one rank (``memfit estimate --batch-size``)."""
    gradient_accumulation_steps: int | None = knob("Micro-batches per optimizer step.", minimum=1)
    """Micro-batches summed into one optimizer step on each rank."""
    mini_batch_size: int | None = knob(
        "cached-mnrl: rows per GradCache mini-batch (the batch stays whole).", minimum=1
    )
    """The cached in-batch-negatives loss: rows embedded at a time; the loss sees the whole batch."""
    max_tokens_per_micro_batch: int | None = knob(
        "Token budget per micro-batch (rows × padded length).", minimum=1
    )
    """A token budget per micro-batch instead of a row count (rows × padded length)."""
    world_size: int | None = knob("Data-parallel ranks (GPUs).", minimum=1)
    """Ranks that share the effective batch (None: what the launcher started, or 1)."""
    sharding: str = knob(
        "none | zero1 | zero2 | zero3 | fsdp", choices=SHARDING_SCHEMES, default="none"
    )
    """How the ranks divide parameters, gradients and optimizer state."""
    precision: str | None = knob(
        "fp32 | fp16 | bf16 (mixed precision, autocast).", choices=PRECISIONS
    )
    """Mixed precision: fp32 master weights, matmuls in fp16 (with a loss scaler) or bf16."""
    optimizer: str = knob(" | ".join(OPTIMIZERS), choices=OPTIMIZERS, default="adamw")
    """The optimizer (see :data:`OPTIMIZER_TABLE`)."""
    gradient_checkpointing: bool | None = knob("Recompute activations in backward.")
    """Activation checkpointing: keep each layer's input only, recompute the rest in backward."""
    attn_implementation: str | None = knob(
        "sdpa | eager | flash_attention_2 (the model's attention kernel).",
        choices=ATTN_IMPLEMENTATIONS,
    )
    """The attention implementation transformers runs (SDPA, the eager matmul-softmax, or the
    flash-attn package's FlashAttention 2)."""
    lora_rank: int | None = knob(
        "LoRA adapters of this rank (peft); 0: full fine-tuning.", minimum=0
    )
    """LoRA: the adapters' rank; the base weights are frozen."""
    lora_target_modules: list[str] | None = knob(  # noqa: RUF009 (a field, default None)
        "LoRA targets: attention | mlp | all-linear | module names (default attention)."
    )
    """Which layers get adapters (groups or module names); only with a rank."""
    quantization: str | None = knob(
        "none | nf4 | fp4 | int8: the frozen base weights quantized by bitsandbytes (QLoRA; "
        "only with --lora-rank).",
        choices=QUANTIZATIONS,
    )
    """Quantized base weights (bitsandbytes): 4-bit NF4/FP4 or LLM.int8(); only under LoRA."""
    double_quant: bool | None = knob("4-bit: quantize the quantization constants too (QLoRA).")
    """4-bit only: the per-block scales quantized again (``bnb_4bit_use_double_quant``)."""
    device: str | None = knob("cuda | cpu (default: cuda when there is one).", choices=DEVICES)
    """The device the step runs on."""

    def problems(
        self,
        *,
        typed: bool = False,
        flags: Mapping[str, str] | None = None,
        required: Iterable[str] = (),
    ) -> list[str]:
        """Every problem with the knobs at once, one message each, naming its flag.

        ``flags`` renames a field's flag for a verb that spells it otherwise (``memfit estimate``
        calls the micro-batch ``--batch-size``); ``typed``: see :func:`whole_problem`;
        ``required``: fields that must be given (for a verb that has no default for them).
        """
        flags = dict(flags or {})
        required = set(required)
        problems: list[str] = []
        # the named choices first, then the counts (the order every verb has always listed them)
        fields = sorted(dataclasses.fields(Job), key=lambda f: f.metadata.get("choices") is None)
        for f in fields:
            value = getattr(self, f.name)
            flag = flags.get(f.name) or flag_of(f)
            if value is None and f.name not in required:
                continue
            problem = None
            if f.metadata.get("choices") is not None:
                problem = choice_problem(flag, value, f.metadata["choices"])
            elif f.metadata.get("minimum") is not None:
                problem = whole_problem(flag, value, f.metadata["minimum"], typed=typed)
            if problem:
                problems.append(problem)
        problems.extend(self._relations(flags))
        return problems

    def _relations(self, flags: Mapping[str, str]) -> list[str]:
        """The checks between knobs."""
        problems: list[str] = []
        loss = resolve_loss(self.task, self.loss, problems)
        # a sentence-embedding job with no loss given may still be planned onto the cached one
        undecided = self.loss is None and self.task == "sentence-embedding"
        if self.mini_batch_size is not None and loss != "cached-mnrl" and not undecided:
            problems.append(
                f"{flags.get('mini_batch_size', '--mini-batch-size')}: only the cached loss "
                "(--loss cached-mnrl) has one"
            )
        if self.lora_target_modules and not _whole(self.lora_rank):
            problems.append("--lora-target-modules: only with --lora-rank R (LoRA adapters)")
        quantized = self.quantization not in (None, "none")
        if quantized and not _whole(self.lora_rank) and self.quantization in QUANTIZATIONS:
            problems.append(
                f"--quantization {self.quantization}: only with --lora-rank R (QLoRA: quantized "
                "base weights are frozen; only LoRA adapters train on them)"
            )
        if self.double_quant and self.quantization not in FOUR_BIT:
            problems.append("--double-quant: only with --quantization nf4 or fp4 (4-bit weights)")
        if self.attn_implementation == "flash_attention_2":
            # the flash-attn package: CUDA kernels (sm80+) that compute in fp16/bf16 only
            if self.device == "cpu":
                problems.append(
                    "--attn-implementation flash_attention_2: FlashAttention runs on CUDA GPUs "
                    "only, not --device cpu (use sdpa)"
                )
            if self.precision == "fp32":
                problems.append(
                    "--attn-implementation flash_attention_2: FlashAttention computes in fp16 or "
                    "bf16 only; give --precision bf16 (or fp16)"
                )
        ranks, batch = self.world_size, self.effective_batch_size
        if ranks is not None and _whole(ranks) and _whole(batch) and batch % ranks:
            problems.append(
                f"--effective-batch-size: {batch} does not split evenly over --world-size {ranks}"
            )
        return problems

    @property
    def resolved_loss(self) -> str:
        """The canonical loss (the task's default when none was given)."""
        return resolve_loss(self.task, self.loss, [])

    def knobs(self) -> dict[str, Any]:
        """The job's fields and values (a subclass's own fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Job)}


JOB_FIELDS = tuple(f.name for f in dataclasses.fields(Job))


def _whole(value: Any, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
