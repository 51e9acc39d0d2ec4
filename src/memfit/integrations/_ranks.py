"""Several ranks (``torchrun``) under the Trainer integrations: one OOM, every rank's decision.

The Trainer wraps the model in DDP (through accelerate), whose reducer all-reduces the gradients
inside the last backward of an optimizer step. A rank that runs out of memory never reaches that
backward, and the others would wait inside the all-reduce for ever. So, as ``memfit train`` does
(:mod:`memfit.train.distributed`), the guard takes the reduction out of the backward:

* every forward and backward of a step runs on the module DDP wraps (``model.module``): no
  reducer, no buffer broadcast, no collective at all inside the model;
* the ranks meet at *sync points* (a MAX all-reduce of a flag, :meth:`SyncPoints.anyone`): after
  every chunk of every Trainer call, the same number of times on every rank
  (:meth:`SyncPoints.most` of the chunk counts, asked before anything is allocated), and before
  the gradient reduction;
* a rank that runs out of memory drops its gradients and joins the next sync point with its flag
  up; the others raise :class:`~memfit.guard.guard.PeerOutOfMemory` there; all adopt the smallest
  proposed chunk size (:func:`memfit.guard.policy.agree`) and re-run the step's calls so far;
* after the step's last call the gradients are all-reduced in place
  (:meth:`SyncPoints.finish_gradients`) and divided by the number of ranks, as DDP averages them;
  the Trainer's clipping and optimizer step then run on them as usual.

Every collective is preceded by a sync point with nothing allocated in between, so a rank that
failed is always met where the others wait. What the guard cannot cover is said by
:func:`ranks_problem`: a setup whose collectives run inside the forward or backward (DeepSpeed,
FSDP, tensor parallelism, a loss that gathers embeddings across ranks) steps aside with one warning.

:class:`SyncPoints` is the part of ``memfit train``'s ``memfit.train.distributed.Ranks`` that
the guard needs (the package map keeps ``integrations`` from importing ``train``): the same
protocol, so the same agreement (:func:`memfit.guard.policy.agree`), and the same collectives
(:mod:`memfit.guard.sync`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.guard.guard import PeerOutOfMemory
from memfit.guard.sync import any_flag, reduce_ints, sum_gradients

# accelerate's data-parallel kinds: a DDP wrapper and nothing else communicating
_DATA_PARALLEL = {
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_HPU",
}


def ranks_problem(trainer: Any) -> str | None:
    """Why the guard cannot agree an OOM across ``trainer``'s ranks (None: it can)."""
    if int(trainer.args.world_size) <= 1:
        return None
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed (its engine communicates inside the backward)"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP (it gathers and scatters weights inside the forward and backward)"
    kind = getattr(getattr(trainer, "accelerator", None), "distributed_type", None)
    name = getattr(kind, "name", str(kind))
    if name not in _DATA_PARALLEL:
        return f"accelerate's {name} (only DDP's data parallelism is covered)"
    tp_size = getattr(trainer, "get_tp_size", lambda: 1)()
    if int(tp_size or 1) > 1:
        return "tensor parallelism (its collectives run inside the forward)"
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return "a model sharded at load time (its collectives run inside the forward)"
    return None


class SyncPoints:
    """The ranks' sync points on a gloo group (the default group when it is gloo), on the CPU.

    Every tensor a sync point or the gradient reduction writes is allocated here, before any
    memory cap starts, and only written in place afterwards: a sync point never allocates.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, timeout_minutes: float = 30.0) -> None:
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # flags on the CPU over gloo: a host round trip, never a GPU synchronisation, and never
        # interleaved with NCCL's collectives
        self.group: Any = None
        if dist.get_backend() != "gloo":
            timeout = datetime.timedelta(minutes=timeout_minutes)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.params = list(params)
        self._flags = torch.zeros(2, dtype=torch.int64)
        self._ints = torch.zeros(2, dtype=torch.int64)
        self._used = torch.zeros(len(self.params), dtype=torch.uint8)
        # sync points so far (tests read it)
        self.syncs = 0

    def buffers(self) -> list[torch.Tensor]:
        """What the sync points write into (a memory cap counts them as held already)."""
        return [self._flags, self._ints, self._used]

    def anyone(self, failed: bool) -> bool:
        """A sync point: whether any rank (this one included) reports a failure."""
        self.syncs += 1
        return any_flag(self._flags, failed, self.group)

    def check(self) -> None:
        """A sync point for a rank that is fine: PeerOutOfMemory if another is not."""
        if self.anyone(False):
            raise PeerOutOfMemory("another rank ran out of memory; every rank backs off together")

    def most(self, value: int) -> int:
        """The largest of the ranks' ``value``."""
        return self._reduce(value, op=dist.ReduceOp.MAX)[0]

    def least(self, *values: int) -> tuple[int, ...]:
        """The smallest of each of the ranks' values (the size every rank adopts)."""
        return self._reduce(*values, op=dist.ReduceOp.MIN)

    def _reduce(self, *values: int, op: Any) -> tuple[int, ...]:
        return reduce_ints(self._ints, values, op, self.group)

    def finish_gradients(self) -> None:
        """After a step's last call: give every rank the same set of gradients (zeros where only
        another rank has one), agree nobody ran out of memory, then sum each ``.grad`` in place
        and divide by the ranks, as DDP averages them."""
        grads = sum_gradients(self.params, self._used, self.check, self.group)
        with torch.no_grad():
            for grad in grads:
                grad.div_(self.world_size)


def join_ranks(params: Sequence[torch.Tensor]) -> SyncPoints:
    """The sync points of the process group the Trainer set up, allocated now (before any memory
    cap starts) on every rank alike."""
    return SyncPoints(params)


def inner_module(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (the model itself when it is not wrapped)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def broadcasts_buffers(model: nn.Module) -> bool:
    """Whether DDP would broadcast ``model``'s buffers from rank 0 in its forward."""
    return (
        isinstance(model, DistributedDataParallel)
        and bool(getattr(model, "broadcast_buffers", False))
        and any(True for _ in model.module.buffers())
    )


def reduce_gradients(ranks: SyncPoints, buffers_of: nn.Module | None) -> None:
    """After a step's last call: the gradients averaged over the ranks; ``buffers_of``: rank 0's
    buffers on every rank too (what DDP's forward does with ``broadcast_buffers``)."""
    ranks.finish_gradients()
    if buffers_of is not None:
        with torch.no_grad():
            for buffer in buffers_of.buffers():
                # in place, right after the gradients' reduction: nothing allocated in between
                dist.broadcast(buffer, src=0)
