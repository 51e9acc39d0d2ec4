"""Several ranks (``torchrun`` / ``accelerate launch``): one optimizer step for all, OOM agreed by all.

Data parallelism in memfit keeps the guard's promise across processes:

- **One step, chosen once.** Every rank draws the same seeded permutation, so each optimizer step's
  samples are the same on every rank; :func:`shard_rows` then deals them out (longest first, in a
  snake order, so every rank gets a similar share of tokens). Each rank's loss is its rows' summed
  loss over the *whole step's* units, so the ranks' gradients add up (a SUM all-reduce, no
  averaging) to the gradient of the step's mean loss: the result does not depend on the number of
  ranks, up to float summation order.
- **OOM is everyone's decision.** A collective that one rank never joins hangs the others, so no
  rank starts a collective on its own once something may have gone wrong. Ranks meet at *sync
  points*: after each micro-batch, before the gradient reduction, and (under FSDP) before every
  all-gather and reduce-scatter. At a sync point every rank all-reduces a flag (MAX) on a separate
  gloo group. A rank that runs out of memory abandons its work and joins the *next* sync point
  with the flag raised: since every collective is preceded by a sync point with no allocation in
  between, the others are always waiting at that very sync point, never inside a collective. Every
  rank then learns of the OOM at the same moment, drops the step, and all adopt the smallest
  proposed micro-batch (:meth:`Ranks.least`).
- **No DDP reducer.** DDP all-reduces gradients *inside* the last backward, which a rank that ran
  out of memory never reaches. memfit runs every micro-batch without communication, agrees, then
  all-reduces each ``.grad`` in place: no bucket copy of the gradients (DDP keeps one), at the
  price of not overlapping the reduction with the backward.

The flag tensors are allocated once, before any memory cap starts, and only ever written in place,
so a sync point itself never allocates (and never runs out of memory).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from memfit.guard.guard import PeerOutOfMemory
from memfit.guard.sync import any_flag, reduce_ints, sum_gradients
from memfit.runtime import launched_rank
from memfit.train.peers import rank_timeout


def shard_rows(
    rows: Sequence[Any], lengths: Sequence[int] | None, rank: int, world: int
) -> list[Any]:
    """This rank's share of a step's rows: longest first, dealt in snake order (0, 1, …, W-1,
    W-1, …, 0, …) so every rank gets about the same tokens; round robin without lengths.

    A pure function of its arguments: every rank computes every other rank's share the same way.
    """
    if world == 1:
        return list(rows)
    order = list(range(len(rows)))
    if lengths is not None:
        # stable: equal lengths keep the step's order
        order.sort(key=lambda i: -int(lengths[i]))
    mine = []
    for position, index in enumerate(order):
        lap, offset = divmod(position, world)
        owner = offset if lap % 2 == 0 else world - 1 - offset
        if owner == rank:
            mine.append(rows[index])
    return mine


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run without the active dispatch modes (the CPU memory cap): for object collectives that
    pickle into temporary tensors, which are no part of the training step's memory."""
    with _disable_current_modes():
        yield


@dataclass
class Ranks:
    """The process group as the training loop and the guard use it (see the module docstring)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # flags and small vectors on their own gloo group, on the CPU: a sync point costs a host
    # round trip, never a GPU synchronisation, and never interleaves with the model's collectives
    flag_group: Any = None
    _flags: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64))
    _ints: torch.Tensor = field(default_factory=lambda: torch.zeros(4, dtype=torch.int64))
    _gathered: list[torch.Tensor] = field(default_factory=list)
    _vector: torch.Tensor = field(default_factory=lambda: torch.zeros(16, dtype=torch.float64))
    _mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))
    # sync points so far (tests and the benchmark read it)
    syncs: int = 0
    # FSDP reduce-scatters the gradients in its backward: nothing left to reduce after the step
    reduces_in_backward: bool = False
    # whether memfit started the process group (and so ends it in close()): a script that joined
    # the ranks itself before calling memfit.train keeps its group for its own work after it
    owns_group: bool = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        """Allocate what the sync points and the gradient reduction write into, once, before a
        memory cap starts (so that none of them can run out of memory later)."""
        self._mask = torch.zeros(len(params), dtype=torch.uint8)
        self._gathered = [torch.zeros_like(self._vector) for _ in range(self.world_size)]

    def buffers(self) -> list[torch.Tensor]:
        """The tensors the sync points write into (a memory cap tracks them as held already)."""
        return [self._flags, self._ints, self._vector, self._mask, *self._gathered]

    # -- agreement -----------------------------------------------------------------------------
    def anyone(self, failed: bool) -> bool:
        """A sync point: whether any rank (this one included) reports a failure."""
        self.syncs += 1
        return any_flag(self._flags, failed, self.flag_group)

    def check(self) -> None:
        """A sync point for a rank that is fine: raise :class:`PeerOutOfMemory` if another is not."""
        if self.anyone(False):
            raise PeerOutOfMemory("another rank ran out of memory; every rank backs off together")

    def most(self, value: int) -> int:
        """The largest of the ranks' ``value`` (e.g. micro-batches in a step)."""
        return self._reduce_ints((value,), dist.ReduceOp.MAX)[0]

    def least(self, *values: int) -> tuple[int, ...]:
        """The smallest of each of the ranks' values (the back-off every rank adopts)."""
        return self._reduce_ints(values, dist.ReduceOp.MIN)

    def _reduce_ints(self, values: Sequence[int], op: Any) -> tuple[int, ...]:
        return reduce_ints(self._ints, values, op, self.flag_group)

    # -- gradients -----------------------------------------------------------------------------
    def finish_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """After a step's micro-batches: make every rank hold the same set of gradients, agree
        nobody ran out of memory, then all-reduce (SUM) each ``.grad`` in place.

        A parameter that got no gradient on this rank (it had no rows, or no row used it) gets
        zeros, but only if some rank has one: a parameter no rank used keeps ``grad = None``, as in
        a one-process run (the optimizer then skips it).
        """
        if self.reduces_in_backward:
            self.check()
            return
        if len(self._mask) != len(params):
            raise RuntimeError("Ranks.prepare(params) must be called with the trained parameters")
        sum_gradients(params, self._mask, self.check, self.flag_group)

    # -- metrics and objects -------------------------------------------------------------------
    def gather_floats(self, values: Sequence[float | None]) -> list[list[float | None]]:
        """Every rank's ``values`` (None travels as NaN), in rank order."""
        vector = self._vector
        if len(values) > len(vector):
            raise ValueError(f"at most {len(vector)} values, got {len(values)}")
        if len(self._gathered) != self.world_size:
            raise RuntimeError("Ranks.prepare(params) must be called before gather_floats")
        vector.fill_(float("nan"))
        for i, value in enumerate(values):
            if value is not None:
                vector[i : i + 1].fill_(float(value))
        dist.all_gather(self._gathered, vector, group=self.flag_group)
        out: list[list[float | None]] = []
        for tensor in self._gathered:
            row = tensor[: len(values)].tolist()
            out.append([None if x != x else x for x in row])  # NaN → None
        return out

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list[Any] = [None] * self.world_size
        with outside_modes():
            dist.all_gather_object(out, obj, group=self.flag_group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        with outside_modes():
            dist.broadcast_object_list(box, src=0, group=self.flag_group)
        return box[0]

    def barrier(self) -> None:
        with outside_modes():
            dist.barrier(group=self.flag_group)

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's weights and buffers on every rank (a fresh classifier head is random)."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        with contextlib.suppress(Exception):
            if self.owns_group:
                dist.destroy_process_group()
            elif self.flag_group is not None:
                dist.destroy_process_group(self.flag_group)


def init_ranks(device_type: str, *, timeout_minutes: float | None = None) -> Ranks:
    """Join the process group the launcher set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``): gloo on the CPU, NCCL on GPUs, plus a gloo group for the
    guard's flags. A collective waits ``timeout_minutes`` for the other ranks (default:
    ``MEMFIT_RANK_TIMEOUT``, else 30 minutes; see :mod:`memfit.train.peers`). ``RANK`` is the
    rank among all hosts' processes, ``LOCAL_RANK`` this host's GPU. A script that started the
    process group itself keeps it, with the timeout it gave it: memfit joins it and leaves it up
    (the flags' own group is memfit's)."""
    # a bad MEMFIT_RANK_TIMEOUT is refused before any rank waits for another
    timeout = (
        rank_timeout() if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
    )
    rank = launched_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend=backend, timeout=timeout)
    flag_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Ranks(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        flag_group=flag_group,
        owns_group=owns_group,
    )
