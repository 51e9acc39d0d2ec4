"""One plan's search space and its estimates: the lever values a plan may try
(:class:`Space`, from each lever's :meth:`~memfit.levers.base.Lever.plan_options`), and the
job's fixed settings with the budget and every estimate made so far (:class:`Search`).

The planner (:mod:`memfit.plan.planner`) searches with them and the explanations
(:mod:`memfit.plan.explain`) quote them; both import this module, neither imports the other.
Every configuration a space yields is one memfit train runs: it passes the job's checks with
the runner's (:meth:`memfit.job.Job.problems` with ``run=True``), on the ranks and the sharding
it is priced for.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.devices.catalog import Gpu
from memfit.estimate.api import estimate
from memfit.job import CACHED_LOSSES, IN_BATCH_NEGATIVE_LOSSES
from memfit.levers import LEVERS
from memfit.levers.base import Lever, Room
from memfit.plan import cost
from memfit.plan.configuration import Candidate, Levers, tier_of

# the levers that leave the device's weights as they are (the parameters and buffers a step
# holds throughout): configurations that differ only in these hold the same weights. Any other
# lever (precision, adapters, the base weights' form, a lever added later) may change them
_WEIGHT_NEUTRAL = frozenset(
    {
        "gradient_checkpointing",
        "optimizer",
        "max_seq_len",
        "cross_entropy",
        "activation_offloading",
        "optimizer_offload",
    }
)

# the most one micro-batch (an in-batch-negatives loss: one rank's whole step) is tried with: no
# device holds the activations of more, and the estimate's dims (rows × tokens × vocabulary,
# rows × heads × tokens², rows²) stay far inside 64-bit integers below these
MAX_MICRO_ROWS = 2**24
MAX_MICRO_TOKENS = 2**32


@dataclass(frozen=True)
class HostUse:
    """What an estimate keeps in host memory (``details["host"]``: an offloading lever): one
    rank's bytes, and how many ranks share the node's memory (``ranks_per_node``; 1 when the
    estimate does not say)."""

    per_rank: int
    ranks_per_node: int = 1

    @property
    def node_bytes(self) -> int:
        """What the node's ranks keep there together: the figure the host budget bounds."""
        return self.per_rank * self.ranks_per_node


def host_use(result: Any) -> HostUse | None:
    """What the estimate ``result`` keeps in host memory (None: nothing lives there)."""
    host = result.details.get("host")
    if not isinstance(host, Mapping) or host.get("total_bytes") is None:
        return None
    ranks = host.get("ranks_per_node")
    return HostUse(int(host["total_bytes"]), max(1, int(ranks)) if ranks is not None else 1)


@dataclass(frozen=True)
class Space:
    """The lever values a plan may try: each lever's options in ``room`` (the job's own values
    first), in the levers' order. A configuration is one option of each lever, kept only when
    memfit train runs it on the ranks and sharding asked (:meth:`runs`)."""

    room: Room
    options: tuple[tuple[Lever, tuple[Mapping[str, Any], ...]], ...]
    # what :meth:`runs` found, by values, ranks and sharding (the checks run once each)
    _runs: dict[tuple[Any, ...], bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, room: Room) -> Space:
        return cls(room, tuple((lever, lever.plan_options(room)) for lever in LEVERS))

    def allowing(self, *names: str) -> Space:
        """This space with the levers ``names`` allowed too."""
        allowed = self.room.allowed + tuple(n for n in names if n not in self.room.allowed)
        return Space.of(dataclasses.replace(self.room, allowed=allowed))

    def of_lever(self, lever: Lever) -> tuple[Mapping[str, Any], ...]:
        return dict(self.options)[lever]

    @functools.cached_property
    def base(self) -> dict[str, Any]:
        """The job's own values of the levers the plan varies (each lever's first option)."""
        out: dict[str, Any] = {}
        for _, options in self.options:
            out.update(options[0])
        return out

    def runs(self, values: Mapping[str, Any], world_size: int, sharding: str) -> bool:
        """Whether memfit train runs the job with ``values`` on ``world_size`` ranks with
        ``sharding``: the job's checks and the runner's (``Job.problems(run=True)``)."""
        key = (tuple(sorted(values.items(), key=lambda kv: kv[0])), world_size, sharding)
        if key not in self._runs:
            job = dataclasses.replace(
                self.room.job, world_size=world_size, sharding=sharding, **values
            )
            self._runs[key] = not job.problems(run=True)
        return self._runs[key]

    def _merged(self, choice: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for values in choice:
            out.update(values)
        return out

    def combos(self, world_size: int = 1, sharding: str = "none") -> list[Levers]:
        """Every combination of the levers' options that memfit train runs, in the levers'
        order (the first lever's options vary slowest)."""
        out = []
        for choice in itertools.product(*(options for _, options in self.options)):
            values = self._merged(choice)
            if self.runs(values, world_size, sharding):
                out.append(Levers.of(values))
        return out

    def frugal(self, world_size: int = 1, sharding: str = "none") -> list[Levers]:
        """The least configurations: every lever at its most frugal option that memfit train
        runs with the rest (:meth:`~memfit.levers.base.Lever.frugal`: checkpointing on, the
        shortest length, adapters), for each option of the levers whose least depends on the
        model (the precision, the optimizer, the base weights' form: peft's k-bit preparation
        upcasts what is not quantized, which can outweigh the saving on a small model)."""
        each: list[tuple[Mapping[str, Any], ...]] = []
        ordered: list[list[Mapping[str, Any]]] = []
        for lever, options in self.options:
            thrift = lever.frugal(options)
            if thrift is None:
                each.append(options)
            else:
                ordered.append(list(thrift))
        out: list[Levers] = []
        for fixed in itertools.product(*each):
            for rest in itertools.product(*ordered):
                values = self._merged((*fixed, *rest))
                if self.runs(values, world_size, sharding):
                    out.append(Levers.of(values))
                    break
        return out


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
    space: Space
    frugal_precision: str = "fp32"
    sharding: str = "none"
    trace_depth: str = "auto"
    # the job's own LoRA rank (0: full fine-tuning); its other pins are the space's base
    base_rank: int = 0
    # the budget on host memory, for what an offloading lever moves there (None: unchecked)
    host_budget: int | None = None
    # the least configurations (every lever at its most frugal, micro-batch 1) and their peaks
    least: dict[Levers, int] = field(default_factory=dict)
    _estimates: dict[tuple[Levers, int], int] = field(default_factory=dict)
    # host memory of the estimates that keep something there (``details["host"]``)
    _hosts: dict[tuple[Levers, int], HostUse] = field(default_factory=dict)
    _model_states: dict[tuple[Levers, int], int] = field(default_factory=dict)
    # the weights (parameters and buffers) one rank holds through every step, by
    # :meth:`weights_key`, from the estimates made so far (see :meth:`floor`)
    _weights: dict[tuple[Any, ...], int] = field(default_factory=dict)
    _orders: dict[Levers, tuple[int, bool]] = field(default_factory=dict)

    @property
    def in_batch_negatives(self) -> bool:
        return self.loss in IN_BATCH_NEGATIVE_LOSSES

    def combos(self) -> list[Levers]:
        """The space's configurations memfit train runs on this search's ranks and sharding."""
        return self.space.combos(self.world_size, self.sharding)

    def frugal(self, space: Space | None = None) -> list[Levers]:
        """The least configurations of ``space`` (this search's) on its ranks and sharding."""
        return (space or self.space).frugal(self.world_size, self.sharding)

    def tier(self, knobs: Levers) -> int:
        """The most harmful lever ``knobs`` use beyond the job's own values (:data:`TIERS`)."""
        return tier_of(knobs.values, self.space.base)

    def order(self, knobs: Levers) -> tuple[int, bool]:
        """The search's order: the tier, then a last-resort value (a paged optimizer swap)
        after the tier's others."""
        if knobs not in self._orders:
            values, base = knobs.values, self.space.base
            last = any(lever.last_resort(values, base) for lever in LEVERS)
            self._orders[knobs] = (self.tier(knobs), last)
        return self._orders[knobs]

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
        return dict(
            task=self.task,
            batch_size=batch,
            seq_len=self.seq_len,
            # the levers' values as the job says them (None: not given, the estimate's default)
            **knobs.job_values(self.seq_len),
            attn_implementation=self.attn_implementation,
            num_labels=self.num_labels,
            loss=loss,
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
            weights = self.weights_key(knobs)
            if weights is not None:
                held = result.breakdown["parameters"] + result.breakdown["buffers"]
                # the least seen: a bound whichever of them is asked
                self._weights[weights] = min(self._weights.get(weights, held), held)
            host = host_use(result)
            if host is not None:
                self._hosts[key] = host
        return self._estimates[key]

    def weights_key(self, knobs: Levers) -> tuple[Any, ...] | None:
        """What decides the weights ``knobs`` hold on a rank: their levers but the
        weight-neutral ones (None: a sharding scheme, which divides the weights by phase)."""
        if self.sharding != "none":
            return None
        return tuple(sorted((k, v) for k, v in knobs.values.items() if k not in _WEIGHT_NEUTRAL))

    def floor(self, knobs: Levers) -> int | None:
        """A lower bound of the peak of ``knobs`` at any micro-batch, known without estimating
        them: the weights an estimated configuration with the same weights holds through its
        whole step (None: none estimated yet). A configuration whose weights alone are over the
        budget fits at no micro-batch, so the search skips it without tracing it: on a 16 GiB
        card the 16-bit weights of an 8B model rule out every lever that keeps them (tests prove
        the bound never exceeds the peak)."""
        key = self.weights_key(knobs)
        return None if key is None else self._weights.get(key)

    def host(self, knobs: Levers, micro: int) -> int | None:
        """Host memory these knobs keep at micro-batch ``micro``, per rank (None: nothing lives
        there)."""
        self.peak(knobs, micro)
        use = self._hosts.get((knobs, micro))
        return None if use is None else use.per_rank

    def host_ranks(self, knobs: Levers, micro: int) -> int:
        """How many ranks share the node's host memory with these knobs' (1: nothing there or
        the estimate does not say)."""
        self.peak(knobs, micro)
        use = self._hosts.get((knobs, micro))
        return 1 if use is None else use.ranks_per_node

    def host_fits(self, knobs: Levers, micro: int) -> bool:
        """Whether what these knobs keep in host memory at micro-batch ``micro`` fits the host
        budget: every rank of the node's share of it (:class:`HostUse`)."""
        self.peak(knobs, micro)
        use = self._hosts.get((knobs, micro))
        return use is None or self.host_budget is None or use.node_bytes <= self.host_budget

    def fits(self, knobs: Levers, micro: int) -> bool:
        """Whether the step fits both budgets: its GPU peak the usable memory, and what its
        node's ranks keep in host memory (an offloading lever) the host budget."""
        floor = self.floor(knobs)
        if floor is not None and floor > self.usable:
            return False  # its weights alone are over: no estimate needed
        if self.peak(knobs, micro) > self.usable:
            return False
        return self.host_fits(knobs, micro)

    def model_state(self, knobs: Levers, micro: int) -> int:
        """Parameters, gradients and optimizer state on one rank (plus the scheme's buffers)."""
        self.peak(knobs, micro)
        return self._model_states[(knobs, micro)]

    def least_of(self, configurations: Sequence[Levers]) -> tuple[int, Levers] | None:
        """The least peak of ``configurations`` at micro-batch 1, and the one that needs it
        (None: there are none)."""
        return min(
            ((self.peak(k, 1), k) for k in configurations),
            key=lambda pair: pair[0],
            default=None,
        )

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
            lora_rank=knobs.lora_rank,
            values=knobs.values,
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
        if self.fits(knobs, micros[hi]):
            return micros[hi]
        hi -= 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.fits(knobs, micros[mid]):
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
