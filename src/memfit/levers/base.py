"""What a lever is: its knobs (fields of the job), what it combines with, its flags, its place in
the plan's order and its names in the Hugging Face / peft / TRL vocabulary.

A lever is one module of :mod:`memfit.levers`; this module says what each must declare, so that
the planner, the doctor, the explanations, the CLI and ``apply_plan`` iterate over
:data:`memfit.levers.LEVERS` and none of them names one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import flag_of
from memfit.levers.cure import Fix, Patient


@dataclass(frozen=True)
class Room:
    """What a plan tries a lever's values within (:meth:`Lever.plan_options`): the job as
    given (its pinned values), the levers ``memfit plan --allow`` names, the GPU's mixed
    precision and the data's length percentiles (None: no data was read)."""

    job: Job
    allowed: tuple[str, ...] = ()
    mixed_precision: str = "bf16"
    percentile: Callable[[float], int] | None = None
    fused_loss_problem: str | None = None
    """Why a fused linear cross-entropy cannot compute the model's loss (its head scales the
    logits: :func:`memfit.step.fused_linear_config_problem`); None: it can."""


@dataclass(frozen=True)
class Chosen:
    """A plan's chosen configuration as a lever's explanation sees it (:meth:`Lever.plan_lines`):
    its numbers come from the plan's search (its estimates) and its cost model."""

    values: Mapping[str, Any]
    """Every lever's values in the configuration, in the plan's words (rank 0, ``none``)."""
    base: Mapping[str, Any]
    """The job's own values of the levers the plan varies (each lever's first option)."""
    micro: int
    """The micro-batch (the mini-batch, under the cached loss) it was estimated at."""
    peak_bytes: int
    usable: int
    """The budget less the safety margin."""
    samples_per_step: int
    """The effective batch: samples per optimizer step over all GPUs."""
    shape: Any
    """The cost model's view of the model (:class:`memfit.plan.cost.ModelShape`)."""
    gpu: Any
    """The GPU the throughput is ranked on (:class:`memfit.devices.catalog.Gpu`)."""
    peak: Callable[[Mapping[str, Any]], int]
    """The predicted peak of other values at the same micro-batch."""
    speed: Callable[[Mapping[str, Any]], float]
    """The predicted samples per second of other values at the same micro-batch."""
    least: Sequence[tuple[Mapping[str, Any], int]] = ()
    """The least configurations (every lever at its most frugal) and their peaks."""


class Lever:
    """One memory lever. Subclasses set the class attributes and override what they need.

    ``knobs`` is the dataclass of the lever's fields of :class:`~memfit.job.Job` (the job
    inherits them): from them come its flags in every verb, its config-file keys and its
    keywords in the Python API.
    """

    name: ClassVar[str]
    """The lever's name (``memfit plan --allow``'s, for a lever used only when allowed)."""
    knobs: ClassVar[type]
    """The dataclass holding the lever's fields of the job."""
    allow: ClassVar[bool] = False
    """True: the lever changes what the job learns (or its data), so a plan uses it only when
    ``--allow`` names it; False: the plan searches it freely (it keeps the job's result)."""
    tier: ClassVar[int] = 0
    """Its place in the plan's order of harm: 0 for the exact levers, then 1, 2, ... for the
    levers used only when allowed (a configuration's tier is its most harmful such lever)."""
    summary: ClassVar[str] = ""
    """What the lever does, in a few words (explanations, ``--help``)."""
    pins: ClassVar[tuple[str, ...]] = ()
    """Fields a job may give ``memfit plan`` (and :func:`memfit.plan.plan`) for the plan to keep
    as given: the job itself, not a lever (a LoRA rank, quantized base weights)."""
    in_training_arguments: ClassVar[bool] = True
    """Whether Hugging Face ``TrainingArguments`` can set the lever (``apply_plan`` sets it
    there); False: it changes the model or the tokenizer, which ``apply_plan`` leaves to the user."""
    argument_fields: ClassVar[tuple[str, ...]] = ()
    """Fields of some ``TrainingArguments`` subclasses that set a lever not in
    ``TrainingArguments`` itself (TRL's ``model_init_kwargs``): ``apply_plan`` sets it through
    them when the arguments have one."""
    outside_note: ClassVar[str] = ""
    """Where the lever is set instead, when not in ``TrainingArguments`` (``apply_plan``'s
    refusal says it)."""
    negatable: ClassVar[tuple[str, ...]] = ()
    """Boolean fields whose False is written out as ``--no-FLAG`` in the commands memfit prints
    (the verbs take both forms; a False not listed here is written as nothing)."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the lever's fields of the job, in order."""
        return tuple(f.name for f in dataclasses.fields(self.knobs))

    def values(self, source: Any) -> dict[str, Any]:
        """The lever's fields and their values in ``source`` (a job, memfit train's config, a
        step's spec: anything that holds them as attributes), field → value."""
        return {name: getattr(source, name) for name in self.fields}

    def problems(self, job: Job) -> list[str]:
        """What the lever's values do not combine with (other knobs, the task, the device): the
        checks every verb makes. Each message names its flag."""
        return []

    def run_problems(self, job: Job) -> list[str]:
        """What memfit's own runner (``memfit train``) cannot run with the lever's values, beyond
        :meth:`problems`: a plan and the doctor never propose these, ``memfit train`` refuses
        them, ``memfit estimate`` still prices them (another trainer may run them)."""
        return []

    def flags(
        self, values: Mapping[str, Any], renames: Mapping[str, str] | None = None
    ) -> list[str]:
        """The command-line flags that set the lever's ``values`` (a missing or None value: no
        flag; a boolean: ``--flag`` when true; a list: comma-separated). ``renames``: a verb's
        own spelling of a field's flag (``memfit estimate --batch-size``)."""
        renames = renames or {}
        out: list[str] = []
        for f in dataclasses.fields(self.knobs):
            value = values.get(f.name)
            if value is None:
                continue
            flag = renames.get(f.name) or flag_of(f)
            if isinstance(value, bool):
                if value:
                    out.append(flag)
                elif f.name in self.negatable:
                    out.append("--no-" + flag.removeprefix("--"))
            elif isinstance(value, list | tuple):
                out.append(f"{flag} {','.join(str(v) for v in value)}")
            else:
                out.append(f"{flag} {value}")
        return out

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        """The values of the lever's fields a plan tries in ``room``, the job's own first;
        ``({},)``: the plan does not vary the lever (its values are the job's, or the search's
        own: the micro-batch, the ranks)."""
        return ({},)

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        """``options`` ordered least memory first, when one of them always needs least (the
        least configuration takes the first that memfit train can run with the rest); None: which
        needs least depends on the model, so the least configuration tries each."""
        return None

    def last_resort(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
        """Whether ``values`` (``base``: the job's own) are taken only when nothing else of
        their tier fits (they cost time the memory does not show: a paged optimizer)."""
        return False

    def allow_problems(self, allowed: Sequence[str], job: Job) -> list[str]:
        """What is wrong with ``memfit plan --allow`` naming the lever with ``allowed`` (another
        lever it needs, not allowed)."""
        return []

    def allow_with(self, job: Job) -> tuple[str, ...]:
        """The other levers a hint that proposes allowing this one must allow too."""
        return ()

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        """How ``memfit plan``'s nothing-fits hint names allowing the lever, from the least
        configuration's ``values`` with it (after ``--allow NAME``, in parentheses)."""
        return self.summary

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The lever's fields in ``values`` (a plan's words: ``none`` for plain base weights) as
        the job's fields say them: what the plan leaves off is None, not given."""
        return {name: values[name] for name in self.fields if name in values}

    def pass_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any) -> float:
        """Seconds the lever's ``values`` add to each pass over the weights (forward, backward,
        recomputed forward) that no FLOP count shows, on ``gpu`` for a model of ``shape``
        (:class:`memfit.plan.cost.ModelShape`); the plan's cost model adds them up. 0: none."""
        return 0.0

    def micro_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any, tokens: int) -> float:
        """Seconds the lever's ``values`` add to each micro-batch of ``tokens`` tokens (what
        depends on the tokens, not on the passes over the weights: a loss computed in chunks);
        the plan's cost model adds them up. 0: none."""
        return 0.0

    def step_seconds(self, values: Mapping[str, Any], shape: Any, gpu: Any) -> float:
        """Seconds the lever's ``values`` add to each optimizer step, once per effective batch
        whatever its micro-batches (an update that runs on the CPU, state or gradients crossing
        the host link: optimizer offload); the plan's cost model adds them up. 0: none."""
        return 0.0

    def time_words(self, values: Mapping[str, Any]) -> str | None:
        """What :meth:`pass_seconds` charges for ``values``, in a few words (the plan's
        throughput line: "plus ..."); None: nothing."""
        return None

    def plan_lines(self, chosen: Chosen) -> list[str]:
        """What ``memfit plan``'s explanation says of the lever in the ``chosen`` configuration
        (what it saves and costs, why the plan needed it); [] when nothing."""
        return []

    def describe(self, values: Mapping[str, Any]) -> str | None:
        """The lever's ``values`` (a plan's settings) in a few words, for the list of a plan's
        alternatives (``micro-batch 4 × 2``, ``LoRA r=8``); None: nothing to say (not used)."""
        return None

    def cure(self, patient: Patient) -> Fix | None:
        """``memfit doctor``'s fix for an out-of-memory error with this lever (None: none, or
        the job uses it already; a reason to leave it out goes to ``patient.notes``). The fix's
        ``settings`` are the job's fields it changes: the doctor proposes it only where
        ``memfit train`` takes the job so changed."""
        return None

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        """What ``memfit estimate`` says of the lever under its breakdown, from the estimate's
        ``details`` (:attr:`memfit.estimate.Estimate.details`); [] when nothing."""
        return []

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The lever's ``values`` as Hugging Face ``TrainingArguments`` (and peft/TRL) settings,
        for :func:`memfit.integrations.plan.apply_plan`; {} when it has none."""
        return {}

    def __repr__(self) -> str:
        return f"<lever {self.name}>"
