"""The job: every knob of a fine-tuning step, its allowed values, its flag and its checks, once.

``estimate``, ``plan``, ``train`` (whose :class:`~memfit.train.TrainConfig` is a :class:`Job` with
the run's own settings added), ``infer``, the doctor, ``integrations.plan``, the config files and
the CLI take their vocabulary and validation from here. A knob is one field of :class:`Job`: its
docstring says what it means, its metadata the flag and the help line the CLI shows, and
:meth:`Job.problems` checks it. The job's own knobs (the model, the task, the data's length) are
declared here; each lever's are declared by its module of :mod:`memfit.levers`, with what it
combines with, and the job inherits them.

Nothing here imports torch or transformers: the CLI's quick verbs read it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from memfit import levers
from memfit.knobs import (
    choice_problem,
    field_problems,
    finite_problem,
    flag_of,
    knob,
    positions_problem,
    whole,
    whole_problem,
)
from memfit.levers.activation_offloading import ActivationOffloadingKnobs
from memfit.levers.attention import ATTN_IMPLEMENTATIONS, AttentionKnobs
from memfit.levers.batch import BatchKnobs
from memfit.levers.checkpointing import CheckpointingKnobs
from memfit.levers.cross_entropy import CROSS_ENTROPIES, CrossEntropyKnobs
from memfit.levers.lora import LoraKnobs
from memfit.levers.mini_batch import DEFAULT_MINI_BATCH_SIZE, MiniBatchKnobs
from memfit.levers.optimizer import (
    OPTIMIZER_TABLE,
    OPTIMIZERS,
    SWAP_OPTIMIZERS,
    Optimizer,
    OptimizerKnobs,
)
from memfit.levers.optimizer_offload import OPTIMIZER_OFFLOADS, OptimizerOffloadKnobs
from memfit.levers.packing import PACKING_STRATEGIES, PackingKnobs
from memfit.levers.precision import PRECISIONS, PrecisionKnobs
from memfit.levers.quantization import FOUR_BIT, QUANTIZATIONS, QuantizationKnobs
from memfit.levers.sharding import DEEPSPEED_SCHEMES, SHARDING_SCHEMES, ShardingKnobs
from memfit.levers.truncation import TruncationKnobs
from memfit.levers.weights import WEIGHTS_DTYPES, WeightsKnobs

# --- the vocabulary ---------------------------------------------------------------------------------
TASKS = ("classification", "causal-lm", "sentence-embedding")
MODES = ("train", "eval")
DEVICES = ("cuda", "cpu")
TRACE_DEPTHS = ("auto", "full")


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


# --- the job ----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class JobKnobs:
    """The job's own knobs: what is trained, on what, and where."""

    model: str = knob(
        "A registry name (memfit models), a Hub id (fetched when online), or a model folder.",
        required=True,
    )
    """The model: a registry name or id, or a folder holding ``config.json``."""
    task: str = knob(
        "classification | causal-lm | sentence-embedding.", choices=TASKS, required=True
    )
    """What is trained: a sequence classifier, a causal language model, a sentence embedder."""
    num_labels: int | None = knob(
        "Classification: the number of labels.", minimum=1, shown_default="2"
    )
    """Classification: the size of the head."""
    loss: str | None = knob(
        "Sentence-embedding: mnrl | cached-mnrl | cosent | cosine | softmax.",
        shown_default="mnrl",
    )
    """The loss (sentence-transformers' names); each task has one default. Checked per task."""
    seq_len: int | None = knob("Tokens per sequence (the longest the step sees).", minimum=1)
    """The sequence length the step is sized for (the longest row of a micro-batch, padded)."""


@dataclass(kw_only=True)
class DeviceKnobs:
    device: str | None = knob("cuda | cpu: the device the step runs on.", choices=DEVICES)
    """The device the step runs on."""


# a dataclass's fields come from its bases in reverse order: the job's own first, then each
# lever's in the order the CLI has always listed them, the device last
@dataclass(kw_only=True)
class Job(
    DeviceKnobs,
    PackingKnobs,
    ActivationOffloadingKnobs,
    OptimizerOffloadKnobs,
    CrossEntropyKnobs,
    WeightsKnobs,
    QuantizationKnobs,
    LoraKnobs,
    AttentionKnobs,
    CheckpointingKnobs,
    OptimizerKnobs,
    PrecisionKnobs,
    ShardingKnobs,
    MiniBatchKnobs,
    BatchKnobs,
    TruncationKnobs,
    JobKnobs,
):
    """A fine-tuning job's knobs: what decides the memory of one step on one rank.

    None means "not given": ``memfit estimate`` and ``plan`` fill in their defaults (fp32, sdpa,
    2 labels, ...), ``memfit train`` plans what is missing before step 0. Every field is one flag;
    :meth:`problems` returns every problem at once, each naming its flag. The levers' fields are
    declared by their modules (:mod:`memfit.levers`).
    """

    def problems(
        self,
        *,
        typed: bool = False,
        flags: Mapping[str, str] | None = None,
        required: Iterable[str] = (),
        run: bool = False,
    ) -> list[str]:
        """Every problem with the knobs at once, one message each, naming its flag.

        ``flags`` renames a field's flag for a verb that spells it otherwise (``memfit estimate``
        calls the micro-batch ``--batch-size``); ``typed``: see :func:`whole_problem`;
        ``required``: fields that must be given (for a verb that has no default for them);
        ``run``: also what memfit's own runner cannot run (``memfit train``, and what a plan or
        the doctor proposes).
        """
        flags = dict(flags or {})
        problems = field_problems(
            self, dataclasses.fields(Job), typed=typed, flags=flags, required=required
        )
        resolve_loss(self.task, self.loss, problems)
        for problem in levers.problems(self, run=run):
            # a verb's own spelling of a flag (memfit estimate's --batch-size)
            for name, flag in flags.items():
                default = "--" + name.replace("_", "-")
                if problem.startswith(default + ":"):
                    problem = flag + problem[len(default) :]
            problems.append(problem)
        return problems

    @property
    def resolved_loss(self) -> str:
        """The canonical loss (the task's default when none was given)."""
        return resolve_loss(self.task, self.loss, [])

    def knobs(self) -> dict[str, Any]:
        """The job's fields and values (a subclass's own fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Job)}


JOB_FIELDS = tuple(f.name for f in dataclasses.fields(Job))
# memfit.estimate() prices one definite step on one rank: a knob not given is this (memfit
# estimate's and memfit doctor's flags show the same defaults); the other knobs' None is the
# step's plain default (no adapters, full-precision weights, the task's loss, ...)
STEP_DEFAULTS: dict[str, Any] = {
    "num_labels": 2,
    "precision": "fp32",
    "gradient_checkpointing": False,
    "attn_implementation": "sdpa",
    "device": "cuda",
    "world_size": 1,
    "gradient_accumulation_steps": 1,
}
# the job's fields the estimate of a step does not take: the model is its first argument, the
# step is one micro-batch (its ``batch_size``) whatever the effective batch, and a token budget
# per micro-batch is the planner's
NOT_STEP_FIELDS = ("model", "effective_batch_size", "max_tokens_per_micro_batch")
STEP_FIELDS = tuple(name for name in JOB_FIELDS if name not in NOT_STEP_FIELDS)


__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CACHED_LOSSES",
    "CROSS_ENTROPIES",
    "DEEPSPEED_SCHEMES",
    "DEFAULT_LOSS",
    "DEFAULT_MINI_BATCH_SIZE",
    "DEVICES",
    "FOUR_BIT",
    "IN_BATCH_NEGATIVE_LOSSES",
    "JOB_FIELDS",
    "LOSSES",
    "LOSS_ALIASES",
    "MODES",
    "NOT_STEP_FIELDS",
    "OPTIMIZERS",
    "OPTIMIZER_OFFLOADS",
    "OPTIMIZER_TABLE",
    "PACKING_STRATEGIES",
    "PRECISIONS",
    "QUANTIZATIONS",
    "SEQ_LEN_MULTIPLE",
    "SHARDING_SCHEMES",
    "STEP_DEFAULTS",
    "STEP_FIELDS",
    "SWAP_OPTIMIZERS",
    "TASKS",
    "TRACE_DEPTHS",
    "WEIGHTS_DTYPES",
    "Job",
    "Optimizer",
    "choice_problem",
    "finite_problem",
    "flag_of",
    "knob",
    "parse_target_modules",
    "positions_problem",
    "resolve_loss",
    "round_seq_len",
    "whole",
    "whole_problem",
]
