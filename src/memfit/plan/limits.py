"""``memfit.limits``: how long a sequence and how large a micro-batch fit a budget, for a job as
given and with the levers a plan may use.

The peak of a step is a smooth function of the batch size B and the sequence length T: every dim
of every allocation is bilinear in (B, T) (:mod:`memfit.estimate.fit`), so the peak is a
polynomial of low degree (B·T for activations, B·T² for attention scores where the kernel keeps
them, B² for in-batch similarities) plus the allocator's rounding. Each question is answered by
fitting that polynomial (a quadratic in the one variable) through a few estimates, solving it for
the usable budget, and checking the solution with real estimates: the answer fits, the answer plus
one step does not. When a check disagrees with the fit (the allocator's rounding near the budget),
the checked point joins the fit and it is solved again, inside the bracket the checks have made;
after a few rounds the bracket is halved instead. So the answer is never a fitted guess, and it
takes a handful of estimates (milliseconds each once the job is traced), not a bisection over the
whole range.

Sequence lengths are answered in multiples of :data:`SEQ_LEN_STEP` (the lengths runs pad to; a
multiple of 8 also keeps the estimate on one traced fit), up to the model's positions, which bound
the answer when the budget does not. Micro-batches go up to :data:`memfit.plan.search.MAX_MICRO_ROWS`
rows and :data:`~memfit.plan.search.MAX_MICRO_TOKENS` tokens.

A budget on host memory (``host_memory``; default: this machine's) bounds the answers too when an
offloading lever moves something there (``Estimate.details["host"]``): one rank's bytes times the
ranks that share the node (``ranks_per_node``, 1 when the estimate does not say).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit import levers as levers_
from memfit import progress, step
from memfit.devices.catalog import ASSUMED_GPU, catalog, find_gpu
from memfit.errors import UsageError
from memfit.estimate.api import estimate, machine_memory_bytes, step_job, validate
from memfit.job import STEP_DEFAULTS, Job
from memfit.levers.base import Room
from memfit.models import resolve_model
from memfit.plan.configuration import TIERS, Levers, tier_of
from memfit.plan.search import MAX_MICRO_ROWS, MAX_MICRO_TOKENS, Space, host_use
from memfit.units import format_bytes, parse_size

# sequence lengths are answered in multiples of this (runs pad to it: tensor-core shapes)
SEQ_LEN_STEP = 8
# the levers a limits answer never varies: truncation is what it answers
NOT_VARIED = ("truncation",)
# rounds of fit-and-check before the bracket is halved instead
FIT_ROUNDS = 6

__all__ = ["Limit", "Limits", "limits", "machine_memory_bytes"]


@dataclass(frozen=True)
class Limit:
    """One answer: the largest value that fits, the peak there, and what stops it growing."""

    value: int | None
    """The longest sequence (tokens) or largest micro-batch (rows) that fits; None: not even
    the smallest does."""
    peak_bytes: int | None
    """The GPU peak at ``value`` (at the smallest value tried, when none fits)."""
    bound: str
    """What stops it: ``memory`` (the GPU budget), ``host-memory`` (the host budget), ``positions``
    (the model's position table), ``rows`` / ``tokens`` (the most a micro-batch is tried with)."""
    next_value: int | None = None
    """One step past ``value`` (8 tokens, or one row), which does not fit (None: a limit of the
    model or the search bounds the answer, not the budget)."""
    next_peak_bytes: int | None = None
    """The GPU peak at ``next_value``."""
    host_bytes: int | None = None
    """Host memory at ``value``, per rank (None: nothing lives there)."""
    next_host_bytes: int | None = None
    host_ranks: int = 1
    """How many ranks share the node's host memory (``details["host"]["ranks_per_node"]``): the
    host budget bounds ``host_bytes × host_ranks``."""
    settings: dict[str, Any] = field(default_factory=dict)
    """With levers: the configuration's lever values (field → value, as the job's flags say
    them) that differ from the job's own."""
    estimates: int = 0
    """How many estimates the answer took (the checks included)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "value": self.value,
            "peak_bytes": self.peak_bytes,
            "bound": self.bound,
            "next_value": self.next_value,
            "next_peak_bytes": self.next_peak_bytes,
            "host_bytes": self.host_bytes,
            "next_host_bytes": self.next_host_bytes,
            "host_ranks": self.host_ranks,
        }
        if self.settings:
            out["settings"] = dict(self.settings)
        return out


@dataclass
class Limits:
    """What :func:`limits` answers; ``to_dict`` is ``memfit limits --json``."""

    model: str
    task: str
    batch_size: int
    seq_len: int | None
    budget_bytes: int
    usable_bytes: int
    safety_margin: float
    host_budget_bytes: int
    max_positions: int
    max_seq_len: Limit
    max_micro_batch: Limit | None
    gpu: str | None = None
    allow: tuple[str, ...] = ()
    levers: dict[str, Limit] | None = None
    notes: list[str] = field(default_factory=list)
    world_size: int = 1
    """The job's ranks: the budgets are per GPU, the host figures per rank."""

    @property
    def fits(self) -> bool:
        """Whether anything fits: the smallest step (micro-batch 1, the shortest length) of the
        job as given, or of some configuration of the levers."""
        answers = [self.max_seq_len, *(self.levers or {}).values()]
        return any(a.value is not None for a in answers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "task": self.task,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "gpu": self.gpu,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "safety_margin": self.safety_margin,
            "host_budget_bytes": self.host_budget_bytes,
            "max_positions": self.max_positions,
            "fits": self.fits,
            "max_seq_len": self.max_seq_len.to_dict(),
            "max_micro_batch": None
            if self.max_micro_batch is None
            else self.max_micro_batch.to_dict(),
            "levers": None
            if self.levers is None
            else {
                "allow": list(self.allow),
                **{name: answer.to_dict() for name, answer in self.levers.items()},
            },
            "notes": list(self.notes),
        }


def limits(
    model: str,
    *,
    task: str,
    batch_size: int = 1,
    seq_len: int | None = None,
    gpu_memory: int | str | None = None,
    gpu: str | None = None,
    host_memory: int | str | None = None,
    safety_margin: float = 0.05,
    levers: bool = False,
    allow: Iterable[str] = (),
    trace_depth: str = "auto",
    **knobs: Any,
) -> Limits:
    """The longest sequence that fits at micro-batch ``batch_size``, and the largest micro-batch
    that fits at ``seq_len`` (when given), in ``budget × (1 − safety_margin)``.

    ``knobs``: the job's, as :func:`memfit.estimate.estimate` takes them (precision, LoRA,
    quantization, checkpointing, attention, the loss, the offloading levers, ...), the job as
    given. With ``levers`` (or any ``allow``) both questions are answered again over the
    configurations a plan may use: every exact lever (checkpointing, a fused cross-entropy,
    the precision where not pinned, offloading) and those ``allow`` names (as ``memfit plan
    --allow``; not truncation), the job's pinned values kept; the answer is the best
    configuration's, with only the costly levers it needs (each other one dropped while a real
    estimate at the answer still fits), and its settings.

    The budget is ``gpu_memory``, else the memory of the catalog GPU ``gpu``; the host budget
    ``host_memory``, else this machine's memory.
    """
    allowed = tuple(a.strip().lower() for a in allow if a.strip())
    with_levers = levers or bool(allowed)
    job_knobs = {k: v for k, v in knobs.items() if v is not None}
    job = Job(
        model=model,
        task=task,
        seq_len=seq_len,
        micro_batch_size=batch_size,
        effective_batch_size=batch_size,
        **job_knobs,
    )
    # the job's knobs as memfit estimate checks them (at a placeholder length when none is asked),
    # then limits' own: every problem at once
    _, problems = validate(
        step_job(
            model, batch_size=batch_size, task=task, seq_len=seq_len or SEQ_LEN_STEP, **job_knobs
        )
    )
    problems += _problems(job, allowed, safety_margin, gpu_memory, gpu, host_memory)
    model_spec = None
    try:
        model_spec = resolve_model(model)
    except UsageError as exc:
        problems.append(str(exc))
    if model_spec is not None and isinstance(seq_len, int) and seq_len > model_spec.max_positions:
        problems.append(
            f"--seq-len: {seq_len} is beyond {model_spec.name}'s {model_spec.max_positions} "
            "positions"
        )
    if problems:
        raise UsageError("; ".join(problems))
    assert model_spec is not None
    budget, gpu_name, notes = _budget(gpu_memory, gpu)
    host_budget = (
        machine_memory_bytes()
        if host_memory is None
        else parse_size(host_memory, name="--host-memory")
    )
    usable = int(budget * (1 - safety_margin))
    positions = int(model_spec.max_positions)
    base = {
        "task": task,
        "gpu": gpu,
        "trace_depth": trace_depth,
        **job_knobs,
    }
    solver = _Solver(model, usable, host_budget, positions)

    progress.report(f"the longest sequence at micro-batch {batch_size}")
    as_given = solver.longest(base, batch_size)
    largest = None
    if seq_len is not None:
        progress.report(f"the largest micro-batch at {seq_len} tokens")
        largest = solver.largest(base, seq_len)
    result = Limits(
        model=model,
        task=task,
        batch_size=batch_size,
        seq_len=seq_len,
        budget_bytes=budget,
        usable_bytes=usable,
        safety_margin=safety_margin,
        host_budget_bytes=host_budget,
        max_positions=positions,
        max_seq_len=as_given,
        max_micro_batch=largest,
        gpu=gpu_name,
        allow=allowed,
        notes=notes,
        world_size=job.world_size or 1,
    )
    if with_levers:
        result.levers = _with_levers(
            solver,
            job,
            base,
            allowed,
            model_spec,
            gpu,
            batch_size,
            seq_len,
            {"max_seq_len": as_given, "max_micro_batch": largest},
        )
    return result


def _problems(
    job: Job,
    allowed: tuple[str, ...],
    safety_margin: float,
    gpu_memory: int | str | None,
    gpu: str | None,
    host_memory: int | str | None,
) -> list[str]:
    """Every problem with the input at once, each naming its flag (the estimate checks the
    job's knobs at its first estimate)."""
    problems: list[str] = []
    if job.max_seq_len is not None:
        problems.append(
            "--max-seq-len: memfit limits answers the longest sequence itself; leave it out"
        )
    if not isinstance(safety_margin, int | float) or not 0 <= safety_margin < 1:
        problems.append(f"--safety-margin: must be in [0, 1), got {safety_margin!r}")
    for name in allowed:
        if name in NOT_VARIED:
            problems.append(
                f"--allow: {name} is not varied here: memfit limits answers the longest sequence"
            )
        elif name not in levers_.ALLOWABLE:
            problems.append(
                f"--allow: unknown lever {name!r}; choose from "
                + ", ".join(n for n in levers_.ALLOWABLE if n not in NOT_VARIED)
            )
    for lever in levers_.LEVERS:
        problems.extend(lever.allow_problems(list(allowed), job))
    for value, flag in ((gpu_memory, "--gpu-memory"), (host_memory, "--host-memory")):
        if value is not None:
            try:
                if parse_size(value, name=flag) <= 0:
                    problems.append(f"{flag}: must be more than 0 bytes, got {value!r}")
            except UsageError as exc:
                problems.append(str(exc))
    if gpu is not None:
        try:
            find_gpu(gpu)
        except UsageError as exc:
            problems.append(str(exc))
    elif gpu_memory is None:
        problems.append(
            "give the budget with --gpu-memory SIZE (e.g. 24GiB) or a GPU with --gpu NAME "
            "(memfit gpus lists them)"
        )
    return problems


def _budget(gpu_memory: int | str | None, gpu: str | None) -> tuple[int, str | None, list[str]]:
    """The budget, the catalog GPU it is on (None: --gpu-memory alone) and where it came from."""
    if gpu is None:
        assert gpu_memory is not None
        return parse_size(gpu_memory, name="--gpu-memory"), None, []
    card = find_gpu(gpu)
    if gpu_memory is not None:
        return parse_size(gpu_memory, name="--gpu-memory"), card.id, []
    return (
        card.memory_bytes,
        card.id,
        [f"Budget: {card.possessive} {format_bytes(card.memory_bytes)}."],
    )


def _with_levers(
    solver: _Solver,
    job: Job,
    base: Mapping[str, Any],
    allowed: tuple[str, ...],
    model_spec: Any,
    gpu: str | None,
    batch_size: int,
    seq_len: int | None,
    as_given: Mapping[str, Limit | None],
) -> dict[str, Limit]:
    """Both answers over the configurations a plan may use, each with only the levers it needs.

    A question is answered in three steps, its estimates bounded whatever the number of
    configurations: every least configuration (every lever at its most frugal, each option of
    those whose least depends on the model: :meth:`Space.frugal`) is estimated at the question's
    largest value (one estimate each); the answer is solved (fit and checks) only for the least
    harmful of those that reach it, else for the :data:`SOLVED` that come nearest (:func:`_best`);
    then the best answer's levers are dropped one at a time, the costliest first (the offloading
    levers, then those used only when allowed, most harmful first, then the others that cost
    time: checkpointing's recompute, a fused loss), a drop kept while a real estimate at the answer still fits
    (:func:`_needed`). Among equal answers the least harmful configuration (tier, then fewest
    changes) is the one kept.
    """
    mixed = (
        find_gpu(gpu).mixed_precision()
        if gpu is not None
        else catalog()[ASSUMED_GPU].mixed_precision()
    )
    room = Room(
        job=dataclasses.replace(job, seq_len=seq_len or model_spec.max_positions),
        allowed=allowed,
        mixed_precision=mixed,
        fused_loss_problem=step.fused_linear_config_problem(model_spec.config)
        if job.task == "causal-lm"
        else None,
    )
    space = Space.of(room)
    world, sharding = job.world_size or 1, job.sharding or "none"
    configurations = space.frugal(world, sharding)
    own = dict(base)

    def knobs_of(config: Levers) -> dict[str, Any]:
        values = config.job_values(room.job.seq_len or 1)
        values["max_seq_len"] = None  # what limits answers, never a cut
        return {**own, **{k: v for k, v in values.items() if v is not None or k in own}}

    def settings(config: Levers) -> dict[str, Any]:
        knobs = knobs_of(config)
        return {
            k: v
            for k, v in knobs.items()
            if k not in ("task", "gpu", "trace_depth")
            and v is not None
            and v != own.get(k, getattr(job, k, None) or STEP_DEFAULTS.get(k))
            # a lever's plain value the job left unsaid (no double quantization) is no change
            and not (k not in own and v in (False, 0, "none"))
        }

    def harm(config: Levers) -> tuple[int, int]:
        # the least harmful, then the fewest changes
        return tier_of(config.values, space.base), len(settings(config))

    out: dict[str, Limit] = {}
    for name in ("max_seq_len", "max_micro_batch"):
        if name == "max_micro_batch" and seq_len is None:
            continue
        question = (
            _Question.longest(solver, batch_size)
            if name == "max_seq_len"
            else (_Question.largest(solver, seq_len or 1))
        )
        started = solver.count
        progress.report(f"with levers: {question.what} over {len(configurations)} configurations")
        if not configurations:
            # memfit train runs no configuration of these levers with the job's other knobs
            out[name] = Limit(None, None, "memory")
            continue
        config, best = _best(question, configurations, knobs_of, harm)
        given = as_given.get(name)
        if given is not None and given.value is not None and (best.value or 0) <= given.value:
            # the job as given goes as far: no lever is needed for it
            out[name] = given
            continue
        if best.value is not None:
            progress.report(f"with levers: {question.what}: the levers {best.value:,} needs")
            config = _needed(question, space, config, best.value, knobs_of, world, sharding)
            best = question.solve(knobs_of(config))
        out[name] = dataclasses.replace(
            best, settings=settings(config), estimates=solver.count - started
        )
    return out


# how many configurations' answers are solved (fit and checks) when none reaches the largest value
SOLVED = 3


@dataclass(frozen=True)
class _Question:
    """One question of the solver: its smallest and largest value, a point at a value, and the
    answer (:meth:`_Solver.longest` or :meth:`_Solver.largest`)."""

    what: str
    low: int
    high: int
    at: Callable[[Mapping[str, Any], int], _Point]
    solve: Callable[[Mapping[str, Any]], Limit]

    @classmethod
    def longest(cls, solver: _Solver, batch: int) -> _Question:
        top = solver.positions
        return cls(
            "the longest sequence",
            min(SEQ_LEN_STEP, top),
            top,
            lambda knobs, n: solver.point(knobs, batch, n),
            lambda knobs: solver.longest(knobs, batch),
        )

    @classmethod
    def largest(cls, solver: _Solver, length: int) -> _Question:
        top = min(MAX_MICRO_ROWS, max(1, MAX_MICRO_TOKENS // max(1, length)))
        return cls(
            "the largest micro-batch",
            1,
            top,
            lambda knobs, b: solver.point(knobs, b, length),
            lambda knobs: solver.largest(knobs, length),
        )


def _best(
    question: _Question,
    configurations: list[Levers],
    knobs_of: Callable[[Levers], dict[str, Any]],
    harm: Callable[[Levers], tuple[int, int]],
) -> tuple[Levers, Limit]:
    """The configuration that goes furthest and its answer: one estimate of each at the largest
    value, then the answers (fit and checks) of the :data:`SOLVED` nearest it, unless some reach
    it (the least harmful of those is the answer). When none of those fits at all, the
    configuration nearest the budget at the smallest value, its answer saying by how much."""
    highs = {config: question.at(knobs_of(config), question.high) for config in configurations}
    reach = [config for config in configurations if highs[config].over <= 0]
    if reach:
        config = min(reach, key=harm)
        return config, question.solve(knobs_of(config))
    tried = sorted(configurations, key=lambda c: (highs[c].over, harm(c)))[:SOLVED]
    answers = [(config, question.solve(knobs_of(config))) for config in tried]
    config, best = min(answers, key=lambda pair: (-(pair[1].value or 0), harm(pair[0])))
    if best.value is None:
        lows = {config: question.at(knobs_of(config), question.low) for config in configurations}
        config = min(configurations, key=lambda c: (lows[c].over, harm(c)))
        best = question.solve(knobs_of(config))
    return config, best


# the levers that move memory to the host: dropped first (host memory and the host link's time)
OFFLOADING = ("activation-offloading", "optimizer-offload")


def _needed(
    question: _Question,
    space: Space,
    config: Levers,
    value: int,
    knobs_of: Callable[[Levers], dict[str, Any]],
    world_size: int,
    sharding: str,
) -> Levers:
    """``config`` with every costly lever ``value`` does not need set back to the job's own:
    each such lever that differs, the costliest first, is dropped when memfit train runs the rest and a
    real estimate at ``value`` still fits."""
    current = dict(config.values)
    base = space.base

    def changed(lever: Any) -> bool:
        return any(f in base and current.get(f) != base[f] for f in lever.fields)

    def cost(lever: Any) -> tuple[int, int]:
        if lever.name in OFFLOADING:
            return 0, 0
        if lever.allow and lever.name in TIERS:
            return 1, -TIERS.index(lever.name)
        if lever.name == "checkpointing" or lever.time_words(current):
            return 2, 0
        # no cost to drop it for (the precision, the attention kernel): kept as it is
        return 3, 0

    costly = sorted(
        (lever for lever in levers_.LEVERS if changed(lever) and cost(lever)[0] < 3), key=cost
    )
    # until a pass drops none: a later drop can make a lever kept earlier unneeded (memory is no
    # sum of the levers' savings: checkpointing with activation offloading can cost more than
    # offloading alone, as the allocator's blocks fall)
    dropped = True
    while dropped:
        dropped = False
        for lever in costly:
            if not changed(lever):
                continue
            trial = {**current, **{f: base[f] for f in lever.fields if f in base}}
            if not space.runs(trial, world_size, sharding):
                continue
            if question.at(knobs_of(Levers.of(trial)), value).over <= 0:
                current = trial
                dropped = True
    return Levers.of(current)


@dataclass
class _Point:
    """One estimate: the GPU peak, the host bytes, and how far over its budget it is."""

    peak: int
    host: int | None  # per rank
    ranks: int  # the ranks that share the node's host memory: the budget bounds host × ranks
    over: float  # > 0: over a budget (bytes of the GPU budget: the host's scaled to it)


class _Solver:
    """The fit-solve-check loop of one budget, its estimates kept (by knobs and shape)."""

    def __init__(self, model: str, usable: int, host_budget: int, positions: int) -> None:
        self.model, self.usable, self.host_budget = model, usable, host_budget
        self.positions = positions
        self._points: dict[tuple[Any, ...], _Point] = {}
        self.count = 0

    def point(self, knobs: Mapping[str, Any], batch: int, length: int) -> _Point:
        # by value: a list knob (the adapters' targets) is no dict key itself
        key = (repr(sorted(knobs.items(), key=lambda kv: kv[0])), batch, length)
        if key not in self._points:
            self.count += 1
            result = estimate(self.model, **knobs, batch_size=batch, seq_len=length)
            use = host_use(result)
            over = float(result.total_bytes - self.usable)
            if use is not None:
                over = max(
                    over, (use.node_bytes - self.host_budget) * self.usable / self.host_budget
                )
            self._points[key] = _Point(
                result.total_bytes,
                None if use is None else use.per_rank,
                1 if use is None else use.ranks_per_node,
                over,
            )
        return self._points[key]

    def longest(self, knobs: Mapping[str, Any], batch: int) -> Limit:
        """The longest sequence (a multiple of :data:`SEQ_LEN_STEP`, or the model's positions)
        that fits at micro-batch ``batch``."""
        top = self.positions
        steps = top // SEQ_LEN_STEP
        if steps == 0:
            # a toy position table shorter than one step: every length up to it
            return self._solve(lambda n: self.point(knobs, batch, n), 1, top, top, "positions", 1)
        answer = self._solve(
            lambda k: self.point(knobs, batch, k * SEQ_LEN_STEP),
            1,
            steps,
            steps,
            "positions",
            SEQ_LEN_STEP,
        )
        if answer.bound == "positions" and steps * SEQ_LEN_STEP < top:
            # the table's last positions, past the last whole step: the table itself, if it fits
            last = self.point(knobs, batch, top)
            if last.over <= 0:
                return dataclasses.replace(
                    answer,
                    value=top,
                    peak_bytes=last.peak,
                    host_bytes=last.host,
                    host_ranks=last.ranks,
                )
        return answer

    def largest(self, knobs: Mapping[str, Any], length: int) -> Limit:
        """The largest micro-batch that fits at ``length`` tokens."""
        by_tokens = max(1, MAX_MICRO_TOKENS // max(1, length))
        top = min(MAX_MICRO_ROWS, by_tokens)
        return self._solve(
            lambda b: self.point(knobs, b, length),
            1,
            top,
            top,
            "rows" if top == MAX_MICRO_ROWS else "tokens",
            1,
        )

    def _solve(
        self,
        at: Callable[[int], _Point],
        low: int,
        high: int,
        limit: int,
        limit_bound: str,
        scale: int,
    ) -> Limit:
        """The largest k in [low, high] with ``at(k)`` within the budgets, from a quadratic fit of
        the excess over the budget, checked at k and k + 1; ``scale``: what a unit of k is (the
        answer is ``k × scale``)."""
        started = self.count
        first = at(low)
        if first.over > 0:
            return Limit(
                None,
                first.peak,
                self._bound(first),
                host_bytes=first.host,
                host_ranks=first.ranks,
                estimates=self.count - started,
            )
        last = at(high)
        if last.over <= 0:
            return Limit(
                high * scale,
                last.peak,
                limit_bound,
                host_bytes=last.host,
                host_ranks=last.ranks,
                estimates=self.count - started,
            )
        # the bracket: ``fits`` fits, ``over`` does not; the fit's points, by k
        fits, over = low, high
        seen: dict[int, float] = {low: first.over, high: last.over}
        middle = max(low + 1, min(high - 1, int(math.sqrt(low * high))))
        if low < middle < high:
            seen[middle] = at(middle).over
            fits, over = (middle, over) if seen[middle] <= 0 else (fits, middle)
        rounds = 0
        while over - fits > 1:
            rounds += 1
            guess = _root(seen, fits, over) if rounds <= FIT_ROUNDS else None
            k = (fits + over) // 2 if guess is None else min(max(guess, fits + 1), over - 1)
            point = at(k)
            seen[k] = point.over
            if point.over <= 0:
                fits = k
                # the check one step past the answer: settles it when the fit was right
                if k + 1 < over:
                    seen[k + 1] = at(k + 1).over
                    if seen[k + 1] > 0:
                        over = k + 1
                    else:
                        fits = k + 1
            else:
                over = k
                if k - 1 > fits:
                    seen[k - 1] = at(k - 1).over
                    if seen[k - 1] <= 0:
                        fits = k - 1
                    else:
                        over = k - 1
        answer, past = at(fits), at(over)
        return Limit(
            fits * scale,
            answer.peak,
            self._bound(past),
            next_value=over * scale,
            next_peak_bytes=past.peak,
            host_bytes=answer.host,
            next_host_bytes=past.host,
            host_ranks=answer.ranks,
            estimates=self.count - started,
        )

    def _bound(self, point: _Point) -> str:
        """Which budget ``point`` is over: the GPU's, else the host's."""
        if point.peak > self.usable or point.host is None:
            return "memory"
        return "host-memory"


def _root(seen: Mapping[int, float], fits: int, over: int) -> int | None:
    """Where the quadratic through the three points nearest the bracket [fits, over] crosses
    zero, rounded down (None: no crossing inside it)."""
    near = sorted(seen, key=lambda k: min(abs(k - fits), abs(k - over)))[:3]
    xs = [float(k) for k in near]
    ys = [seen[k] for k in near]
    try:
        if len(xs) == 3 and len(set(xs)) == 3:
            a, b, c = _quadratic(xs, ys)
        else:
            raise ZeroDivisionError
    except ZeroDivisionError:
        # the line through the bracket's ends
        a, b, c = 0.0, (seen[over] - seen[fits]) / (over - fits), 0.0
        c = seen[fits] - b * fits
    roots = _zeros(a, b, c)
    inside = [r for r in roots if fits < r < over]
    if not inside:
        return None
    return math.floor(min(inside))


def _quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """a, b, c of ``a·x² + b·x + c`` through three points (Lagrange's form, expanded)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    a = y0 / d0 + y1 / d1 + y2 / d2
    b = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return a, b, c


def _zeros(a: float, b: float, c: float) -> list[float]:
    scale = max(abs(a), abs(b), abs(c), 1.0)
    if abs(a) <= 1e-12 * scale:
        return [] if b == 0 else [-c / b]
    disc = b * b - 4 * a * c
    if disc < 0:
        return []
    root = math.sqrt(disc)
    return [(-b - root) / (2 * a), (-b + root) / (2 * a)]
