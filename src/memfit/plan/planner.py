"""``memfit.plan``: the cheapest cures that fit a job into a memory budget, effective batch kept.

Levers, least harmful first:

1. micro-batch × gradient accumulation (exact for per-sample and per-token losses; for
   in-batch-negative losses the gradient-cached loss instead, which is exact too);
2. mixed precision (bf16 where the GPU has it, else fp16 with loss scaling), unless pinned;
3. gradient checkpointing;
4. only when allowed: an 8-bit AdamW or Adafactor optimizer, truncation, LoRA, quantized base
   weights under LoRA (QLoRA's recipe: NF4 with double quantization), in that order of harm: a
   configuration's *tier* is the most harmful lever it uses (:data:`TIERS`). Quantization needs
   LoRA (only adapters train on a quantized base): ``--allow quantization`` comes with
   ``--allow lora`` or a ``--lora-rank``.

A paged optimizer (bitsandbytes' paged AdamW, 8- or 32-bit: its state in CUDA unified memory,
outside PyTorch's allocator, evicted to host memory when the GPU runs short) is an ``optimizer``
swap too, but it is taken only when no configuration of the same tier without one fits: it saves
GPU memory by paging over the host link, which is slow (:mod:`memfit.plan.cost` charges it), so a
plain 8-bit AdamW or Adafactor that fits always wins. Each tier's configurations are searched in
two rounds, those without a paged swap first.

Knobs the job pins (``precision``, ``lora_rank``, ``quantization`` with ``double_quant``) are kept
as given: a pinned LoRA rank or quantization is the job itself, not a lever.

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

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.devices.catalog import ASSUMED_GPU, Gpu, catalog, detect_gpu, find_gpu
from memfit.errors import UsageError
from memfit.estimate import depth, workload
from memfit.estimate.api import estimate
from memfit.estimate.prefetch import prefetch
from memfit.estimate.sharding import SCHEME_ORDER, SCHEMES
from memfit.extras import problems as missing_packages
from memfit.job import (
    CACHED_LOSSES,
    IN_BATCH_NEGATIVE_LOSSES,
    SWAP_OPTIMIZERS,
    TRACE_DEPTHS,
    Job,
    choice_problem,
    positions_problem,
)
from memfit.plan import cost
from memfit.plan.configuration import LORA_RANK, QLORA, TIERS, Candidate, Levers, Plan
from memfit.plan.data_profile import DataProfile
from memfit.units import format_bytes, parse_size

if TYPE_CHECKING:
    from memfit.models import ModelSpec

LEVERS = ("optimizer", "truncation", "lora", "quantization")  # --allow's, least harmful first
# the largest effective batch a plan takes: the micro-batches are its divisors, from its prime
# factors, instant below it (Pollard's rho needs a few thousand steps for the hardest 18 digits)
MAX_EFFECTIVE_BATCH = 10**18
# the most one micro-batch (an in-batch-negatives loss: one rank's whole step) is tried with: no
# device holds the activations of more, and the estimate's dims (rows × tokens × vocabulary,
# rows × heads × tokens², rows²) stay far inside 64-bit integers below these
MAX_MICRO_ROWS = 2**24
MAX_MICRO_TOKENS = 2**32
__all__ = [
    "LEVERS",
    "LORA_RANK",
    "QLORA",
    "TIERS",
    "Candidate",
    "Levers",
    "Plan",
    "plan",
    "plan_problems",
]


# --- the search --------------------------------------------------------------------------------------
@dataclass
class Search:
    """One plan's search: the job's fixed settings, the budget, and the estimates made so far."""

    model: str
    task: str
    seq_len: int
    per_rank: int
    world_size: int
    loss: str
    num_labels: int
    attn_implementation: str
    base_optimizer: str
    gpu: Gpu
    gpu_name: str | None  # passed to estimate (its profile); None: generic
    usable: int
    shape: cost.ModelShape
    columns: int
    frugal_precision: str = "fp32"
    sharding: str = "none"
    trace_depth: str = "auto"
    # the job's own LoRA rank and quantization (0 and none: full fine-tuning of plain weights)
    base_rank: int = 0
    base_quantization: str = "none"
    # the least configurations (every lever at its most frugal, micro-batch 1) and their peaks
    least: dict[Levers, int] = field(default_factory=dict)
    _estimates: dict[tuple[Levers, int], int] = field(default_factory=dict)
    _model_states: dict[tuple[Levers, int], int] = field(default_factory=dict)

    @property
    def in_batch_negatives(self) -> bool:
        return self.loss in IN_BATCH_NEGATIVE_LOSSES

    def tier(self, knobs: Levers) -> int:
        """The most harmful lever ``knobs`` use beyond the job's own values (:data:`TIERS`)."""
        return knobs.tier(self.base_optimizer, self.seq_len, self.base_rank, self.base_quantization)

    def order(self, knobs: Levers) -> tuple[int, bool]:
        """The search's order: the tier, then a paged optimizer swap after the tier's others."""
        return self.tier(knobs), knobs.paged_swap(self.base_optimizer)

    def estimate_kwargs(self, knobs: Levers, micro: int) -> dict[str, Any]:
        """The ``estimate`` arguments of these knobs at micro-batch (or mini-batch) ``micro``."""
        kwargs: dict[str, Any] = {}
        batch = micro
        loss: str | None = None if self.task != "sentence-embedding" else self.loss
        if self.in_batch_negatives:
            batch = self.per_rank
            if micro < self.per_rank:
                loss = CACHED_LOSSES.get(self.loss, self.loss)
                kwargs["mini_batch_size"] = micro
            else:
                loss = self.loss
        else:
            # the later micro-batches run while the earlier ones' gradients are alive
            kwargs["gradient_accumulation_steps"] = self.per_rank // micro
        if knobs.quantization != "none":
            # the estimate's defaults otherwise, so that plain plans ask what they always asked
            kwargs.update(quantization=knobs.quantization, double_quant=knobs.double_quant)
        return dict(
            task=self.task,
            batch_size=batch,
            seq_len=self.seq_len,
            precision=knobs.precision,
            optimizer=knobs.optimizer,
            gradient_checkpointing=knobs.gradient_checkpointing,
            attn_implementation=self.attn_implementation,
            num_labels=self.num_labels,
            loss=loss,
            lora_rank=knobs.lora_rank or None,
            max_seq_len=knobs.max_seq_len if knobs.max_seq_len < self.seq_len else None,
            world_size=self.world_size,
            sharding=self.sharding,
            gpu=self.gpu_name,
            **kwargs,
            **({} if self.trace_depth == "auto" else {"trace_depth": self.trace_depth}),
        )

    def peak(self, knobs: Levers, micro: int) -> int:
        """Predicted peak for these knobs at micro-batch ``micro`` (mini-batch, for the cached loss)."""
        key = (knobs, micro)
        if key not in self._estimates:
            result = estimate(self.model, **self.estimate_kwargs(knobs, micro))
            self._estimates[key] = result.total_bytes
            self._model_states[key] = result.details["model_state"]["total_bytes"]
        return self._estimates[key]

    def model_state(self, knobs: Levers, micro: int) -> int:
        """Parameters, gradients and optimizer state on one rank (plus the scheme's buffers)."""
        self.peak(knobs, micro)
        return self._model_states[(knobs, micro)]

    def candidate(self, knobs: Levers, micro: int) -> Candidate:
        cached = self.in_batch_negatives and micro < self.per_rank
        if self.in_batch_negatives:
            micro_batch, accumulation = self.per_rank, 1
            loss = CACHED_LOSSES.get(self.loss, self.loss) if cached else self.loss
            mini = micro if cached else None
        else:
            micro_batch, accumulation = micro, self.per_rank // micro
            loss, mini = self.loss, None
        return Candidate(
            knobs=knobs,
            micro_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation,
            world_size=self.world_size,
            loss=loss,
            mini_batch_size=mini,
            predicted_peak_bytes=self.peak(knobs, micro),
            predicted_samples_per_second=self.speed(knobs, micro),
            sharding=self.sharding,
        )

    def speed(self, knobs: Levers, micro: int) -> float:
        cached = self.in_batch_negatives and micro < self.per_rank
        micro_batch = self.per_rank if self.in_batch_negatives else micro
        return cost.samples_per_second(
            self.shape,
            self.gpu,
            precision=knobs.precision,
            micro_batch_size=micro_batch,
            accumulation_steps=self.per_rank // micro_batch,
            seq_len=knobs.max_seq_len,
            gradient_checkpointing=knobs.gradient_checkpointing,
            optimizer=knobs.optimizer,
            lora=bool(knobs.lora_rank),
            cached_loss=cached,
            world_size=self.world_size,
            columns=self.columns,
            mini_batch_size=micro if cached else None,
            quantization=knobs.quantization,
            double_quant=knobs.double_quant,
            lora_rank=knobs.lora_rank,
        )

    def micro_batches(self) -> list[int]:
        """The micro-batches (mini-batches, for the cached loss) a plan tries, smallest first:
        the divisors of the per-rank batch, up to :data:`MAX_MICRO_ROWS` rows and
        :data:`MAX_MICRO_TOKENS` tokens."""
        fits = [m for m in _divisors(self.per_rank) if _within(m, self.seq_len, self.columns)]
        return fits or [1]

    def largest_fitting(self, knobs: Levers, micros: Sequence[int]) -> int | None:
        """The largest micro-batch (of the sorted ``micros``) whose peak fits, by bisection."""
        lo, hi, best = 0, len(micros) - 1, None
        # try the largest first: it often fits, and then one estimate settles it
        if self.peak(knobs, micros[hi]) <= self.usable:
            return micros[hi]
        hi -= 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.peak(knobs, micros[mid]) <= self.usable:
                best, lo = micros[mid], mid + 1
            else:
                hi = mid - 1
        return best


def _within(rows: int, seq_len: int, columns: int) -> bool:
    """Whether a micro-batch of ``rows`` is one a plan may try (see :data:`MAX_MICRO_ROWS`)."""
    return rows <= MAX_MICRO_ROWS and rows * seq_len * columns <= MAX_MICRO_TOKENS


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (at least 1), smallest first, built from its prime factors: an
    effective batch may be any number a user types (trying every number up to it took a minute
    at 10^9 and hours at 10^10)."""
    divisors = [1]
    for prime, power in sorted(_prime_factors(n).items()):
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    return sorted(divisors)


# Miller–Rabin with these bases is exact below 3.3·10^24 (every batch the planner accepts)
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _some_factor(n: int) -> int:
    """A factor of the odd composite ``n`` other than 1 and ``n`` (Pollard's rho, Brent's cycle
    search): about n^¼ steps, milliseconds for the 18-digit numbers trial division cannot do."""
    for c in range(1, n):
        x = y = 2
        power = length = 1
        factor = 1
        while factor == 1:
            if power == length:  # Brent: restart the tortoise at the hare every power of two
                x, power, length = y, power * 2, 0
            y = (y * y + c) % n
            length += 1
            factor = math.gcd(abs(x - y), n)
        if factor != n:
            return factor
    raise AssertionError(f"no factor of {n} found")  # never: n is composite


def _prime_factors(n: int) -> dict[int, int]:
    """``n``'s prime factorization, ``{prime: power}`` (``{}`` for 1)."""
    factors: dict[int, int] = {}
    for p in (2, 3, 5, 7, 11, 13):  # the small primes batch sizes are made of, at once
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
        else:
            f = _some_factor(m)
            pending += [f, m // f]
    return factors


def _truncations(seq_len: int, profile: DataProfile | None) -> list[int]:
    """Shorter lengths to try: the data's 99th/95th/90th percentiles, or ¾ and ½ of the length."""
    if profile is not None:
        raw = [profile.percentile(q) for q in (99, 95, 90)]
    else:
        raw = [seq_len * 3 // 4, seq_len // 2]
    out = sorted({max(8, -(-x // 8) * 8) for x in raw if x < seq_len}, reverse=True)
    return [x for x in out if x < seq_len]


@dataclass(frozen=True)
class Space:
    """The lever values a plan may try: the pinned or the GPU's precisions, and the allowed
    optimizers, truncations, LoRA ranks and base-weight quantizations (the job's own values
    first; a quantization is tried only with a LoRA rank)."""

    precisions: tuple[str, ...]
    optimizers: tuple[str, ...]
    lengths: tuple[int, ...]
    ranks: tuple[int, ...]
    quantizations: tuple[tuple[str, bool], ...] = (("none", False),)

    def _weights(self, rank: int) -> list[tuple[str, bool]]:
        """The base weights' forms that go with ``rank``: quantized ones only under LoRA."""
        return [q for q in self.quantizations if rank or q[0] == "none"]

    def combos(self) -> list[Levers]:
        """Every combination of the levers, checkpointing off and on."""
        return [
            Levers(p, c, o, s, r, q, dq)
            for p in self.precisions
            for c in (False, True)
            for o in self.optimizers
            for s in self.lengths
            for r in self.ranks
            for q, dq in self._weights(r)
        ]

    def frugal(self) -> list[Levers]:
        """Every lever at its most frugal, for each precision, optimizer and base-weight form: the
        least configurations (which is smallest depends on the model: peft's k-bit preparation
        upcasts what is not quantized, which can outweigh the saving on a small model)."""
        length, rank = min(self.lengths), max(self.ranks)
        return [
            Levers(p, True, o, length, rank, q, dq)
            for p in self.precisions
            for o in self.optimizers
            for q, dq in self._weights(rank)
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
    lora_rank: int | None = None,
    quantization: str | None = None,
    double_quant: bool | None = None,
) -> Plan:
    """Choose micro-batch, accumulation, precision, checkpointing (and, when allowed, optimizer,
    truncation, LoRA, quantized base weights) so that one step fits ``budget × (1 −
    safety_margin)`` and the effective batch stays ``effective_batch_size`` exactly.

    ``lora_rank``, ``quantization`` and ``double_quant`` pin the job's own LoRA adapters and base
    weights (kept as given); ``allow`` may add ``lora`` (rank 8) and ``quantization`` (QLoRA's
    NF4 with double quantization; it needs LoRA: ``lora`` allowed too, or a ``lora_rank``).

    ``world_size`` GPUs share the effective batch; ``sharding`` (none | zero1 | zero2 | zero3 |
    fsdp) says how they divide parameters, gradients and optimizer state; the budget is per GPU.
    ``trace_depth``: as :func:`memfit.estimate`'s (``full`` traces every layer of every knob set).

    The budget is ``gpu_memory``, else the memory of the catalog GPU ``gpu``, else the free memory
    of this machine's GPU. Returns a :class:`Plan`; ``plan.fits`` is False (and ``plan.plan`` None)
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
        lora_rank=lora_rank,
        quantization=quantization,
        double_quant=double_quant,
    )
    model_spec, budget, card = _validate(
        job,
        allowed,
        safety_margin=safety_margin,
        gpu_memory=gpu_memory,
        gpu=gpu,
        trace_depth=trace_depth,
    )
    budget, card, gpu_name, notes = _resolve_budget(budget, card, precision)
    resolved_loss = job.resolved_loss
    if resolved_loss == "cached-mnrl":
        resolved_loss = "mnrl"  # the plan decides whether to cache
    spec = workload.StepSpec(task=task, num_labels=num_labels, loss=resolved_loss)
    profile = (
        data_profile
        if isinstance(data_profile, DataProfile) or data_profile is None
        else DataProfile(tuple(int(x) for x in data_profile), source="data_profile")
    )
    base_rank = lora_rank or 0
    base_weights = (quantization or "none", bool(double_quant))
    space = _space(card, precision, optimizer, allowed, seq_len, profile, base_rank, base_weights)
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
        shape=cost.model_shape(model_spec.config, spec, lora=max(space.ranks) > 0),
        columns=2 if task == "sentence-embedding" else 1,
        sharding=sharding,
        trace_depth=trace_depth,
        base_rank=base_rank,
        base_quantization=base_weights[0],
    )
    whole = trace_depth == "full" or depth.plan_depth(model_spec.config)[0] is None
    if whole and not depth.few_layers(model_spec.config):
        _prefetch(search, space)
    chosen, evaluated, min_required = _search(search, space)
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
        lora_rank=lora_rank or None,
        quantization=None if base_weights[0] == "none" else base_weights[0],
        double_quant=base_weights[1] or None,
    )
    _conclude(result, search, space, evaluated, profile, notes)
    return result


def _space(
    card: Gpu,
    precision: str | None,
    optimizer: str,
    allowed: Sequence[str],
    seq_len: int,
    profile: DataProfile | None,
    base_rank: int = 0,
    base_weights: tuple[str, bool] = ("none", False),
) -> Space:
    """The levers the plan may try: the pinned precision or the GPU's mixed one and fp32, and
    only the allowed swaps, truncations, LoRA and quantization beside the job's own values (a
    pinned LoRA rank or quantization is the only one tried)."""
    if base_rank:
        ranks: tuple[int, ...] = (base_rank,)
    else:
        ranks = (0,) + ((LORA_RANK,) if "lora" in allowed else ())
    weights: tuple[tuple[str, bool], ...] = (base_weights,)
    if base_weights[0] == "none" and "quantization" in allowed:
        weights += (QLORA,)
    return Space(
        precisions=(precision,) if precision else (card.mixed_precision(), "fp32"),
        optimizers=(optimizer,)
        + (tuple(o for o in SWAP_OPTIMIZERS if o != optimizer) if "optimizer" in allowed else ()),
        lengths=(seq_len,)
        + (tuple(_truncations(seq_len, profile)) if "truncation" in allowed else ()),
        ranks=ranks,
        quantizations=weights,
    )


def plan_problems(
    model: str,
    *,
    task: str,
    seq_len: int,
    effective_batch_size: int,
    gpu_memory: int | str | None = None,
    loss: str | None = None,
    num_labels: int = 2,
    lora_rank: int | None = None,
    quantization: str | None = None,
    double_quant: bool | None = None,
) -> list[str]:
    """Every problem :func:`plan` would refuse these arguments (``memfit plan``'s flags) with,
    one line each naming its flag; empty when it accepts them. For those that print a
    ``memfit plan`` command (``memfit doctor``): memfit never prints a command it refuses.
    Packages this machine lacks are not the command's problem and are left out."""
    job = Job(
        model=model,
        task=task,
        seq_len=seq_len,
        effective_batch_size=effective_batch_size,
        num_labels=num_labels,
        loss=loss,
        lora_rank=lora_rank,
        quantization=quantization,
        double_quant=double_quant,
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
) -> tuple[list[str], ModelSpec | None, int | None, Gpu | None]:
    """:func:`_validate`'s problems (``packages``: with those of packages not installed), the
    model, the budget and the card, without raising."""
    from memfit.models import resolve_model

    problems = job.problems()
    problems += _batch_problems(job)
    if not isinstance(safety_margin, int | float) or not 0 <= safety_margin < 1:
        problems.append(f"--safety-margin: must be in [0, 1), got {safety_margin!r}")
    for lever in allowed:
        if lever not in LEVERS:
            problems.append(f"--allow: unknown lever {lever!r}; choose from {', '.join(LEVERS)}")
    if "quantization" in allowed and "lora" not in allowed and not job.lora_rank:
        # allowing one lever never grants another: LoRA changes what is learned by itself
        problems.append(
            "--allow quantization: quantized base weights are frozen, so it needs LoRA adapters "
            "(QLoRA); allow both (--allow lora,quantization) or give --lora-rank R"
        )
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


def _prefetch(search: Search, space: Space) -> None:
    """Trace the knob sets the search starts with, and those of the least-memory check (at
    micro-batch 1, which has its own trace), side by side, one worker per knob set.

    Only whole-model traces of deep models are worth it: they take long enough to pay for a
    worker process each; shallow ones (a few seconds) cost less than a worker's start (importing
    torch and transformers), and so does the whole trace of a model with as few layers as a
    shallow trace has (a test's 2-layer model: the planner's tests ran 55 s longer with them).
    """
    frugal = set(space.frugal())
    first = [k for k in space.combos() if search.tier(k) == 0 and k not in frugal]
    prefetch(
        search.model,
        [search.estimate_kwargs(k, 1) for k in sorted(frugal, key=repr)]
        + [search.estimate_kwargs(k, search.per_rank) for k in first],
    )


def _search(search: Search, space: Space) -> tuple[Candidate | None, list[Candidate], int]:
    """The fastest configuration of the least harmful tier that fits (None: nothing fits), every
    configuration estimated on the way, and the least memory any allowed configuration needs.

    Each tier is searched in two rounds (:meth:`Search.order`): without a paged optimizer swap,
    then with one; a round that fits ends the search."""
    per_rank = search.per_rank
    combos = space.combos()
    micros = search.micro_batches()
    evaluated: list[Candidate] = []
    # the least any allowed configuration needs: when even that is over, skip the search
    min_required, _ = _min_required(search, space)
    rounds = sorted({search.order(k) for k in combos})
    for tier in rounds if min_required <= search.usable else []:
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
    # the explanations read this module's types; this module reads them only here
    from memfit.plan.explain import explain, suggest

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


def _min_required(search: Search, space: Space) -> tuple[int, str]:
    """The least memory any allowed configuration needs, and the precision that needs it: every
    lever at its most frugal, the smallest micro-batch, each precision and optimizer tried (which
    is smaller depends on the model: mixed precision halves activations but adds a half-precision
    copy of the weights)."""
    search.least = {k: search.peak(k, 1) for k in space.frugal()}
    need, precision = min((peak, k.precision) for k, peak in search.least.items())
    search.frugal_precision = precision
    return need, precision


SCALE_OUT_STEPS = 3  # world sizes priced beyond the one asked: ×2, ×4, ×8


def _scale_out(job: Search, space: Space) -> list[dict[str, Any]]:
    """The least configuration's memory per GPU on more GPUs and with each sharding scheme.

    World sizes: the one asked (other schemes; not when it is one GPU) and 2×, 4×, 8× it, those
    that divide the effective batch. The least configuration is the one ``min_required_bytes``
    prices (micro-batch 1, checkpointing, every allowed lever), at each precision and optimizer; sharding is a replay of
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
            need, knobs = min(
                ((other.peak(k, 1), k) for k in space.frugal()), key=lambda pair: pair[0]
            )
            rows.append(
                {
                    "world_size": world,
                    "sharding": scheme,
                    "predicted_peak_bytes": need,
                    "fits": need <= job.usable,
                    "precision": knobs.precision,
                    "optimizer": knobs.optimizer,
                    "quantization": knobs.quantization,
                }
            )
    return rows
