"""``memfit.plan``: the cheapest cures that fit a job into a memory budget, effective batch kept.

Levers, least harmful first:

1. micro-batch × gradient accumulation (exact for per-sample and per-token losses; for
   in-batch-negative losses the gradient-cached loss instead, which is exact too);
2. mixed precision (bf16 where the GPU has it, else fp16 with loss scaling), unless pinned;
3. gradient checkpointing; for a causal LM, a fused linear cross-entropy (the loss from the
   hidden states and the head's weight chunk by chunk, never the full logits: the same loss and
   gradients, so it is searched freely);
4. only when allowed: an 8-bit AdamW or Adafactor optimizer, pure bf16 training (weights,
   gradients and optimizer state in bf16: small updates round away), truncation, LoRA, quantized
   base weights under LoRA (QLoRA's recipe: NF4 with double quantization), in that order of harm:
   a configuration's *tier* is the most harmful lever it uses (:data:`TIERS`). Quantization needs
   LoRA (only adapters train on a quantized base): ``--allow quantization`` comes with
   ``--allow lora`` or a ``--lora-rank``.

A paged optimizer (bitsandbytes' paged AdamW, 8- or 32-bit: its state in CUDA unified memory,
outside PyTorch's allocator, evicted to host memory when the GPU runs short) is an ``optimizer``
swap too, but it is taken only when no configuration of the same tier without one fits: it saves
GPU memory by paging over the host link, which is slow (:mod:`memfit.plan.cost` charges it), so a
plain 8-bit AdamW or Adafactor that fits always wins. Each tier's configurations are searched in
two rounds, those without a paged swap first.

Knobs the job pins (``precision``, and the levers' :attr:`~memfit.levers.base.Lever.pins`: a
LoRA rank, quantized base weights, the weights' dtype, the loss) are kept as given: they are the
job itself, not a lever.

The levers are :data:`memfit.levers.LEVERS`: each says which values a plan tries
(:meth:`~memfit.levers.base.Lever.plan_options`), which of them needs least memory, and what a
hint that allows it says; the search (:mod:`memfit.plan.search`) takes every combination that
memfit train runs (:meth:`memfit.job.Job.problems` with ``run=True``, on the ranks and sharding
priced), so no configuration, scale-out row or hint offers what ``memfit train`` refuses.

With ``world_size`` W and ``sharding`` (none | zero1 | zero2 | zero3 | fsdp) the plan is per rank:
micro-batch × accumulation × W = the effective batch, each rank's memory as the scheme divides
it (:mod:`memfit.estimate.sharding`). When nothing fits, the suggestions price scaling out: the
least configuration's memory per GPU on more GPUs and with each scheme (``scale_out``), and the
smallest world size with the least harmful scheme that fits, as a command to run.

Within the least harmful tier (and round) that fits, configurations are ranked by predicted
throughput (:mod:`memfit.plan.cost`). For fixed other knobs memory grows with the micro-batch,
and so does throughput, so each knob combination is tried at its largest fitting micro-batch,
found by bisection over the divisors of the per-rank batch. A combination is traced only when its best
possible throughput (the whole per-rank batch at once) could beat the best found so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memfit import levers, progress, step
from memfit.devices.catalog import ASSUMED_GPU, Gpu, catalog, detect_gpu, find_gpu
from memfit.errors import UsageError
from memfit.estimate import background, depth, workload
from memfit.estimate.api import machine_memory_bytes
from memfit.estimate.prefetch import (
    MAX_WORKERS,
    Ahead,
    cache_enabled,
    trace_seconds,
    worth_workers,
)
from memfit.estimate.sharding import SCHEME_ORDER, SCHEMES
from memfit.extras import problems as missing_packages
from memfit.job import (
    IN_BATCH_NEGATIVE_LOSSES,
    TRACE_DEPTHS,
    Job,
    choice_problem,
    positions_problem,
)
from memfit.levers.base import Room
from memfit.models import resolve_model
from memfit.plan import cost
from memfit.plan.configuration import LORA_RANK, QLORA, TIERS, Candidate, Levers, Plan
from memfit.plan.data_profile import DataProfile
from memfit.plan.explain import explain, suggest
from memfit.plan.search import (
    MAX_MICRO_ROWS,
    MAX_MICRO_TOKENS,
    Search,
    Space,
    _divisors,
    _within,
)
from memfit.units import format_bytes, parse_size

if TYPE_CHECKING:
    from memfit.models import ModelSpec

# the levers ``--allow`` names, least harmful first (:data:`memfit.levers.ALLOWABLE`)
LEVERS = levers.ALLOWABLE
# the job's fields a plan keeps as given (:attr:`memfit.levers.base.Lever.pins`): the keywords
# of :func:`plan` beside its own
PINS = tuple(name for lever in levers.LEVERS for name in lever.pins)
# the largest effective batch a plan takes: the micro-batches are its divisors, from its prime
# factors, instant below it (Pollard's rho needs a few thousand steps for the hardest 18 digits)
MAX_EFFECTIVE_BATCH = 10**18
__all__ = [
    "LEVERS",
    "LORA_RANK",
    "MAX_MICRO_ROWS",
    "MAX_MICRO_TOKENS",
    "PINS",
    "QLORA",
    "TIERS",
    "Candidate",
    "Levers",
    "Plan",
    "Search",
    "Space",
    "_divisors",
    "plan",
    "plan_problems",
]


def plan(
    model: str,
    *,
    task: str,
    seq_len: int,
    effective_batch_size: int,
    gpu_memory: int | str | None = None,
    gpu: str | None = None,
    loss: str | None = None,
    world_size: int = 1,
    allow: Iterable[str] = (),
    precision: str | None = None,
    data_profile: DataProfile | Sequence[int] | None = None,
    safety_margin: float = 0.05,
    num_labels: int = 2,
    optimizer: str = "adamw",
    attn_implementation: str = "sdpa",
    sharding: str = "none",
    trace_depth: str = "auto",
    host_memory: int | str | None = None,
    **pins: Any,
) -> Plan:
    """Choose micro-batch, accumulation, precision, checkpointing (and, when allowed, optimizer,
    truncation, LoRA, quantized base weights) so that one step fits ``budget × (1 −
    safety_margin)`` and the effective batch stays ``effective_batch_size`` exactly.

    ``pins``: the job's own values of the levers' :data:`PINS` (``lora_rank``, ``quantization``
    and its double quantization, ``weights_dtype``, ``cross_entropy``: the job's LoRA adapters,
    base weights and loss, kept as given); a
    keyword that is none of them is a TypeError, as a function's unknown keyword is. ``allow`` may
    add ``pure-16bit`` (bf16 weights, gradients and state, on a GPU with bf16), ``lora`` (rank
    8) and ``quantization`` (QLoRA's NF4 with double quantization; it needs LoRA: ``lora``
    allowed too, or a ``lora_rank``).

    ``world_size`` GPUs share the effective batch; ``sharding`` (none | zero1 | zero2 | zero3 |
    fsdp) says how they divide parameters, gradients and optimizer state; the budget is per GPU.
    ``trace_depth``: as :func:`memfit.estimate`'s (``full`` traces every layer of every knob set).

    The budget is ``gpu_memory``, else the memory of the catalog GPU ``gpu``, else the free memory
    of this machine's GPU. ``host_memory`` (default: this machine's total memory) is the budget
    of what an offloading lever keeps in host memory (``Estimate.details["host"]``): a
    configuration over it does not fit. Returns a :class:`Plan`; ``plan.fits`` is False (and ``plan.plan`` None)
    when nothing fits, with the least memory any configuration needs and suggestions.
    """
    allowed = [a.strip().lower() for a in allow if a.strip()]
    job = Job(
        model=model,
        task=task,
        seq_len=seq_len,
        effective_batch_size=effective_batch_size,
        world_size=world_size,
        num_labels=num_labels,
        loss=loss,
        precision=precision,
        optimizer=optimizer,
        sharding=sharding,
        attn_implementation=attn_implementation,
        **_pins("plan", pins),
    )
    model_spec, budget, card = _validate(
        job,
        allowed,
        safety_margin=safety_margin,
        gpu_memory=gpu_memory,
        gpu=gpu,
        trace_depth=trace_depth,
        host_memory=host_memory,
    )
    budget, card, gpu_name, notes = _resolve_budget(budget, card, precision)
    host_budget = (
        machine_memory_bytes()
        if host_memory is None
        else parse_size(host_memory, name="--host-memory")
    )
    resolved_loss = job.resolved_loss
    if resolved_loss == "cached-mnrl":
        resolved_loss = "mnrl"  # the plan decides whether to cache
    spec = workload.StepSpec(task=task, num_labels=num_labels, loss=resolved_loss)
    profile = (
        data_profile
        if isinstance(data_profile, DataProfile) or data_profile is None
        else DataProfile(tuple(int(x) for x in data_profile), source="data_profile")
    )
    # each lever's options in this room: the job's own values first, the allowed ones beside
    room = Room(
        job=job,
        allowed=tuple(allowed),
        mixed_precision=card.mixed_precision(),
        percentile=None if profile is None else profile.percentile,
        # a head the fused loss does not model: the plan does not try it (a pinned one is
        # refused above)
        fused_loss_problem=step.fused_linear_config_problem(model_spec.config)
        if task == "causal-lm"
        else None,
    )
    space = Space.of(room)
    # adapters anywhere in the space: the cost model counts them
    adapters = any(v.get("lora_rank") for _, options in space.options for v in options)
    search = Search(
        model=model,
        task=task,
        seq_len=seq_len,
        per_rank=effective_batch_size // world_size,
        world_size=world_size,
        loss=resolved_loss,
        num_labels=num_labels,
        attn_implementation=attn_implementation,
        base_optimizer=optimizer,
        gpu=card,
        gpu_name=gpu_name,
        usable=int(budget * (1 - safety_margin)),
        shape=cost.model_shape(model_spec.config, spec, lora=adapters),
        columns=2 if task == "sentence-embedding" else 1,
        space=space,
        sharding=sharding,
        trace_depth=trace_depth,
        base_rank=job.lora_rank or 0,
        host_budget=host_budget,
    )
    chosen, evaluated, min_required = _traced_ahead(search, space, model_spec.config)
    result = Plan(
        fits=chosen is not None,
        budget_bytes=budget,
        predicted_peak_bytes=None if chosen is None else chosen.predicted_peak_bytes,
        min_required_bytes=min_required,
        chosen=chosen,
        alternatives=[],
        explanation=[],
        suggestions=[],
        model=model,
        task=task,
        seq_len=seq_len,
        effective_batch_size=effective_batch_size,
        num_labels=num_labels,
        gpu=gpu_name,
        safety_margin=safety_margin,
        world_size=world_size,
        sharding=sharding,
        loss=loss if task == "sentence-embedding" else None,
        allow=tuple(allowed),
        pinned_precision=precision,
        base_optimizer=optimizer,
        attn_implementation=attn_implementation,
        pinned=_pinned(job),
        host_budget_bytes=host_budget,
        predicted_host_bytes=None
        if chosen is None
        else search.host(chosen.knobs, chosen.mini_batch_size or chosen.micro_batch_size),
    )
    _conclude(result, search, space, evaluated, profile, notes)
    return result


def plan_problems(
    model: str,
    *,
    task: str,
    seq_len: int,
    effective_batch_size: int,
    gpu_memory: int | str | None = None,
    loss: str | None = None,
    num_labels: int = 2,
    **pins: Any,
) -> list[str]:
    """Every problem :func:`plan` would refuse these arguments (``memfit plan``'s flags) with,
    one line each naming its flag; empty when it accepts them. For those that print a
    ``memfit plan`` command (``memfit doctor``): memfit never prints a command it refuses.
    Packages this machine lacks are not the command's problem and are left out. ``pins``: as
    :func:`plan`'s."""
    job = Job(
        model=model,
        task=task,
        seq_len=seq_len,
        effective_batch_size=effective_batch_size,
        num_labels=num_labels,
        loss=loss,
        **_pins("plan_problems", pins),
    )
    problems, _, _, _ = _problems(
        job,
        [],
        safety_margin=0.05,
        gpu_memory=gpu_memory,
        gpu=None,
        trace_depth="auto",
        packages=False,
    )
    return problems


def _pins(function: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The pins among ``function``'s keywords ``given``; one that is no pin is a TypeError, as a
    function's unknown keyword is."""
    for name in given:
        if name not in PINS:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return dict(given)


def _pinned(job: Job) -> dict[str, Any]:
    """The job's own values of the :data:`PINS`, as the commands a plan prints give them (None:
    not given, or the plain value: rank 0, plain weights; a fraction such as a dropout is its
    value even at 0)."""
    out: dict[str, Any] = {}
    for lever in levers.LEVERS:
        given = lever.as_given(lever.values(job))
        out |= {
            name: given[name] if _FRACTIONS.get(name) else given[name] or None
            for name in lever.pins
        }
    return out


# the job's fields that are fractions (a dropout): 0 is a value there, not "off"
_FRACTIONS = {f.name: bool(f.metadata.get("fraction")) for f in dataclasses.fields(Job)}


def _with_pins(function: Callable[..., Any]) -> None:
    """Give ``function`` the :data:`PINS` as keyword-only parameters in its signature, where it
    takes them as ``**pins`` (``help()``, and ``memfit doctor`` reads which it takes)."""
    hints = typing.get_type_hints(Job)
    signature = inspect.signature(function)
    parameters = [
        p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    parameters += [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[name]
        )
        for name in PINS
    ]
    function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]


_with_pins(plan)
_with_pins(plan_problems)


def _batch_problems(job: Job) -> list[str]:
    """An effective batch too large to plan: beyond :data:`MAX_EFFECTIVE_BATCH`, or (an
    in-batch-negatives loss, which holds a rank's whole step at once) a step per rank beyond
    what one micro-batch may hold."""
    effective, world = job.effective_batch_size, job.world_size or 1
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (effective, world)
    ):
        return []  # Job.problems names them
    if effective > MAX_EFFECTIVE_BATCH:
        return [
            f"--effective-batch-size: at most 10^18 samples per optimizer step, got {effective}"
        ]
    per_rank = effective // world
    columns = 2 if job.task == "sentence-embedding" else 1
    loss = job.resolved_loss if job.task == "sentence-embedding" else None
    seq_len = job.seq_len if isinstance(job.seq_len, int) and job.seq_len >= 1 else 1
    if loss in IN_BATCH_NEGATIVE_LOSSES and not _within(per_rank, seq_len, columns):
        return [
            f"--effective-batch-size: {per_rank} pairs per GPU in one step; the in-batch-negatives "
            f"loss {loss} holds them all at once, so at most {MAX_MICRO_ROWS} pairs and "
            f"{MAX_MICRO_TOKENS} tokens per GPU can be planned"
        ]
    return []


def _validate(
    job: Job,
    allowed: Sequence[str],
    *,
    safety_margin: float,
    gpu_memory: int | str | None,
    gpu: str | None,
    trace_depth: str,
    host_memory: int | str | None = None,
) -> tuple[ModelSpec, int | None, Gpu | None]:
    """Every problem with the input at once, as one :class:`UsageError`: the job's knobs
    (:meth:`memfit.job.Job.problems`), then the plan's own (margin, levers, budget, GPU, model,
    trace depth). Returns the model, the ``--gpu-memory`` budget and the ``--gpu`` card."""
    problems, model_spec, budget, card = _problems(
        job,
        allowed,
        safety_margin=safety_margin,
        gpu_memory=gpu_memory,
        gpu=gpu,
        trace_depth=trace_depth,
        host_memory=host_memory,
    )
    if problems:
        raise UsageError("; ".join(problems))
    assert model_spec is not None
    return model_spec, budget, card


def _problems(
    job: Job,
    allowed: Sequence[str],
    *,
    safety_margin: float,
    gpu_memory: int | str | None,
    gpu: str | None,
    trace_depth: str,
    packages: bool = True,
    host_memory: int | str | None = None,
) -> tuple[list[str], ModelSpec | None, int | None, Gpu | None]:
    """:func:`_validate`'s problems (``packages``: with those of packages not installed), the
    model, the budget and the card, without raising."""
    # the runner's checks too: a plan proposes only what memfit train runs
    problems = job.problems(run=True)
    problems += _batch_problems(job)
    if not isinstance(safety_margin, int | float) or not 0 <= safety_margin < 1:
        problems.append(f"--safety-margin: must be in [0, 1), got {safety_margin!r}")
    for name in allowed:
        if name not in LEVERS:
            problems.append(f"--allow: unknown lever {name!r}; choose from {', '.join(LEVERS)}")
    for lever in levers.LEVERS:
        problems.extend(lever.allow_problems(allowed, job))
    if packages and (job.lora_rank or "lora" in allowed):
        # LoRA candidates are estimated with peft's adapters on the model
        flag = "--lora-rank" if job.lora_rank else "--allow lora"
        problems.extend(missing_packages([("peft", flag)]))
    budget: int | None = None
    if gpu_memory is not None:
        try:
            budget = parse_size(gpu_memory, name="--gpu-memory")
            if budget <= 0:
                problems.append(f"--gpu-memory: must be more than 0 bytes, got {gpu_memory!r}")
        except UsageError as exc:
            problems.append(str(exc))
    if host_memory is not None:
        try:
            if parse_size(host_memory, name="--host-memory") <= 0:
                problems.append(f"--host-memory: must be more than 0 bytes, got {host_memory!r}")
        except UsageError as exc:
            problems.append(str(exc))
    card: Gpu | None = None
    if gpu is not None:
        try:
            card = find_gpu(gpu)
        except UsageError as exc:
            problems.append(str(exc))
    model_spec = None
    try:
        model_spec = resolve_model(job.model)
    except UsageError as exc:
        problems.append(str(exc))
    late: list[str | None] = [choice_problem("--trace-depth", trace_depth, TRACE_DEPTHS)]
    if model_spec is not None:
        positions = model_spec.max_positions
        late.insert(0, positions_problem("--seq-len", job.seq_len, positions, model_spec.name))
        if job.task == "causal-lm" and job.cross_entropy == "fused-linear":
            # the estimate's own refusal, before any estimate is spent
            late.insert(1, step.fused_linear_config_problem(model_spec.config))
    problems += [p for p in late if p]
    return problems, model_spec, budget, card


def _resolve_budget(
    budget: int | None, card: Gpu | None, precision: str | None
) -> tuple[int, Gpu, str | None, list[str]]:
    """The budget, the GPU the throughput is ranked on, its catalog id (None: generic) and a
    note saying where the budget came from: ``--gpu-memory``, else the ``--gpu`` card's memory,
    else the free memory of this machine's GPU."""
    notes: list[str] = []
    gpu_name: str | None = None
    if card is not None:
        gpu_name = card.id
        if budget is None:
            budget = card.memory_bytes
            notes.append(f"Budget: {card.possessive} {format_bytes(budget)}.")
    elif budget is None:
        found = detect_gpu()
        if found is None:
            raise UsageError(
                "no GPU on this machine: give the budget with --gpu-memory SIZE (e.g. 16GiB) "
                "or a GPU with --gpu NAME (memfit gpus lists them)"
            )
        card, _total, free = found
        budget = free
        gpu_name = card.id if card.id in catalog() else None
        notes.append(
            f"Budget: the free memory of this machine's {card.name}, {format_bytes(free)} "
            "(measured with a CUDA context of this process already open)."
        )
    else:
        card = catalog()[ASSUMED_GPU]
        notes.append(
            "Only --gpu-memory was given: assumed a GPU with bf16 and A100-class speed "
            "for the throughput ranking (give --gpu NAME to be exact)."
        )
    if precision == "bf16" and not card.bf16:
        raise UsageError(f"--precision: the {card.name} has no bf16; use fp16 or fp32")
    return budget, card, gpu_name, notes


def _traced_ahead(
    search: Search, space: Space, config: Any
) -> tuple[Candidate | None, list[Candidate], int]:
    """:func:`_search`, with the knob sets it will ask for traced ahead of it side by side
    (:func:`prefetch`) and its progress on the command's status line: "tracing 5 of about 24 knob
    sets, about 40 s left" (the tracer's own layer counts are kept off it)."""
    line = progress.status("tracing", steady=True) if progress.is_open() else None
    with line or contextlib.nullcontext():
        ahead = Ahead(search.model, say=progress.say if line is not None else None)
        # the first knob sets a search asks for: the least configurations at micro-batch 1
        # (:func:`_min_required`), then the first round's at the whole per-rank batch
        _expect_least(search, space, ahead)
        combos = search.combos()
        rounds = sorted({search.order(k) for k in combos})
        if rounds:
            _expect_round(search, combos, rounds[0], ahead)
        few = search.trace_depth != "full" and depth.few_layers(config)
        whole = search.trace_depth == "full" or depth.plan_depth(config)[0] is None
        # measured (cold Llama-3.1-8B plan, LoRA and quantization allowed, shared 2-core
        # machine): with a worker beside the main process 68-71 s, without 44 s; until the
        # worker's traces pay there, only whole traces of deep models get workers
        paying = whole and not few
        ahead.seconds_per_kind = trace_seconds(config, 1, search.trace_depth) if paying else 0.0
        try:
            prefetch(search.model, ahead)
            # a plan asks the shapes it needs itself: no other kind of shape traced ahead in
            # the background for each knob set (it would take the core the plan's work needs)
            with background.off():
                return _search(search, space, ahead)
        finally:
            ahead.close()


def prefetch(model: str, ahead: Ahead) -> int:
    """Start worker processes that trace ``ahead``'s knob sets beside the main process, when
    they pay; returns how many started.

    A worker pays when the traces expected take several times its start
    (:func:`memfit.estimate.prefetch.worth_workers`): the deep models' whole traces, and the
    shallow traces of every depth-extrapolated model when a plan needs many of them (an LLM's
    plan with LoRA and quantization allowed: a few dozen). A model traced whole for having few
    layers (a test's 2-layer model) never: the planner's tests ran 55 s longer with workers.
    None when the disk cache is off (the workers' traces would have nowhere to go) or on one
    core. One worker fewer than the cores: the main process traces too."""
    cpus = os.cpu_count() or 1
    if not cache_enabled() or cpus < 2:
        return 0
    if ahead.pending() < 2 or not worth_workers(ahead.expected_seconds()):
        return 0
    return ahead.start(min(cpus - 1, MAX_WORKERS))


def _expect_least(search: Search, space: Space, ahead: Ahead) -> None:
    for knobs in search.frugal(_without_last_resort(space)):
        ahead.expect(knobs, [search.estimate_kwargs(knobs, 1)])


def _expect_round(
    search: Search, combos: Sequence[Levers], order: tuple[int, bool], ahead: Ahead
) -> None:
    """Expect the round ``order``'s knob sets, most promising first (the search's order), at
    the whole per-rank batch (the first micro-batch it tries)."""
    ahead.drop_untaken(lambda key: False)  # the rounds before: no longer expected
    here = sorted(
        (k for k in combos if search.order(k) == order),
        key=lambda k: -search.speed(k, search.per_rank),
    )
    for knobs in here:
        ahead.expect(knobs, [search.estimate_kwargs(knobs, search.per_rank)])


def _search(
    search: Search, space: Space, ahead: Ahead | None = None
) -> tuple[Candidate | None, list[Candidate], int]:
    """The fastest configuration of the least harmful tier that fits (None: nothing fits), every
    configuration estimated on the way, and the least memory any allowed configuration needs.

    Each tier is searched in two rounds (:meth:`Search.order`): without a paged optimizer swap,
    then with one; a round that fits ends the search. ``ahead``: told each knob set before it is
    estimated (:meth:`Ahead.need`) and each round's before the round."""
    per_rank = search.per_rank
    combos = search.combos()
    micros = search.micro_batches()
    evaluated: list[Candidate] = []
    # the least any allowed configuration needs: when even that is over, skip the search
    min_required, _ = _min_required(search, space, ahead)
    rounds = sorted({search.order(k) for k in combos})
    for tier in rounds if min_required <= search.usable else []:
        if ahead is not None and tier != rounds[0]:  # the first is expected from the start
            _expect_round(search, combos, tier, ahead)
        tier_combos = [k for k in combos if search.order(k) == tier]
        # most promising first: the throughput each could reach with the whole batch at once
        tier_combos.sort(key=lambda k: -search.speed(k, per_rank))
        for knobs in tier_combos:
            best_here = max(
                (c for c in evaluated if search.order(c.knobs) == tier),
                key=lambda c: c.predicted_samples_per_second,
                default=None,
            )
            if (
                best_here is not None
                and search.speed(knobs, per_rank) <= best_here.predicted_samples_per_second
            ):
                continue
            if ahead is not None:
                ahead.need(knobs)
            micro = search.largest_fitting(knobs, micros)
            if micro is not None:
                evaluated.append(search.candidate(knobs, micro))
        fitting = [c for c in evaluated if search.order(c.knobs) == tier]
        if fitting:
            return (
                max(fitting, key=lambda c: c.predicted_samples_per_second),
                evaluated,
                min_required,
            )
    return None, evaluated, min_required


def _conclude(
    result: Plan,
    search: Search,
    space: Space,
    evaluated: Sequence[Candidate],
    profile: DataProfile | None,
    notes: Sequence[str],
) -> None:
    """Fill in ``result``'s alternatives, data, explanation, and (nothing fits) the scale-out
    prices and suggestions."""
    chosen = result.chosen
    result.alternatives = sorted(
        (c for c in evaluated if c is not chosen),
        key=lambda c: (search.order(c.knobs), -c.predicted_samples_per_second),
    )[:5]
    if profile is not None:
        result.data = {"source": profile.source, "samples": len(profile.lengths)}
    result.explanation = list(notes) + explain(search, result, profile)
    if chosen is None:
        result.scale_out = _scale_out(search, space)
        result.suggestions = suggest(search, result, space)


def _min_required(search: Search, space: Space, ahead: Ahead | None = None) -> tuple[int, str]:
    """The least memory any allowed configuration needs, and the precision that needs it: every
    lever at its most frugal, the smallest micro-batch, each precision and optimizer tried (which
    is smaller depends on the model: mixed precision halves activations but adds a half-precision
    copy of the weights).

    The last-resort values (offloading, a paged optimizer: their time the memory does not show)
    are searched only when nothing fits without them, so the least is first found without them:
    when that fits, the plan never needs them, and tracing their configurations would only slow
    it down. Only when it does not are they priced too (``min_required_bytes`` then counts them);
    a configuration over the host budget is no least. ``ahead``: told each knob set before it
    is estimated."""

    def peak(knobs: Levers) -> int:
        if ahead is not None:
            ahead.need(knobs)
        return search.peak(knobs, 1)

    plain = _without_last_resort(space)
    least = {k: peak(k) for k in search.frugal(plain)}
    if not least or min(least.values()) > search.usable:
        least |= {k: peak(k) for k in search.frugal()}
    within = {k: peak for k, peak in least.items() if _host_fits(search, k)}
    search.least = within or least
    need, precision = min((peak, k.precision) for k, peak in search.least.items())
    search.frugal_precision = precision
    return need, precision


def _without_last_resort(space: Space) -> Space:
    """``space`` without the values taken only as a last resort (:meth:`Lever.last_resort`)."""
    base = space.base
    options = tuple(
        (lever, kept or options[:1])
        for lever, options in space.options
        for kept in [tuple(o for o in options if not lever.last_resort(o, base))]
    )
    return dataclasses.replace(space, options=options, _runs={})


def _host_fits(search: Search, knobs: Levers) -> bool:
    """Whether what ``knobs`` keep in host memory at micro-batch 1 fits the host budget (every
    rank of the node's share: :meth:`Search.host_fits`)."""
    return search.host_fits(knobs, 1)


SCALE_OUT_STEPS = 3  # world sizes priced beyond the one asked: ×2, ×4, ×8


def _scale_out(job: Search, space: Space) -> list[dict[str, Any]]:
    """The least configuration's memory per GPU on more GPUs and with each sharding scheme.

    World sizes: the one asked (other schemes; not when it is one GPU) and 2×, 4×, 8× it, those
    that divide the effective batch. The least configuration is the one ``min_required_bytes``
    prices (micro-batch 1, checkpointing, every allowed lever), at each precision and optimizer,
    among those memfit train runs with that scheme (ZeRO and FSDP do not take LoRA adapters:
    full fine-tuning there; a scheme it runs none with is left out); sharding is a replay of
    the same traces, so this costs milliseconds per entry.
    """
    effective = job.per_rank * job.world_size
    # on one GPU a scheme divides nothing: only more GPUs are priced then
    first = 0 if job.world_size > 1 else 1
    worlds = [job.world_size * 2**k for k in range(first, SCALE_OUT_STEPS + 1)]
    rows: list[dict[str, Any]] = []
    for world in worlds:
        if effective % world:
            continue
        for scheme in sorted(SCHEMES, key=SCHEME_ORDER.__getitem__):
            if (world, scheme) == (job.world_size, job.sharding):
                continue  # what the plan just searched
            other = dataclasses.replace(
                job,
                world_size=world,
                per_rank=effective // world,
                sharding=scheme,
                _estimates={},
                _model_states={},
            )
            least = other.least_of(other.frugal())
            if least is None:
                continue  # memfit train runs no allowed configuration so: no offer
            need, knobs = least
            rows.append(
                {
                    "world_size": world,
                    "sharding": scheme,
                    "predicted_peak_bytes": need,
                    "fits": need <= job.usable,
                    "precision": knobs.precision,
                    "optimizer": knobs.optimizer,
                    "quantization": knobs.quantization,
                    "lora_rank": knobs.lora_rank or None,
                }
            )
    return rows
