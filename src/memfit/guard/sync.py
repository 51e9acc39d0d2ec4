"""The collectives of a sync point, shared by ``memfit train``'s ranks
(:class:`memfit.train.distributed.Ranks`) and the Trainer integrations'
(``memfit.integrations._ranks.SyncPoints``).

Each writes only into tensors its caller allocated once, before any memory cap started: a sync
point never allocates, so it never runs out of memory. See :mod:`memfit.train.distributed` for
why every collective of a step is preceded by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def any_flag(flags: torch.Tensor, failed: bool, group: Any = None) -> bool:
    """A sync point: whether any rank (this one included) reports a failure (MAX of a flag)."""
    # in place, no Python scalar turned into a tensor
    flags.fill_(0)
    flags[0:1].fill_(int(bool(failed)))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0].item())


def reduce_ints(
    ints: torch.Tensor, values: Sequence[int], op: Any, group: Any = None
) -> tuple[int, ...]:
    """The ranks' ``values`` reduced with ``op`` (MIN, MAX), through ``ints`` (written in place)."""
    if len(values) > len(ints):
        raise ValueError(f"at most {len(ints)} values, got {len(values)}")
    ints.fill_(0)
    for i, value in enumerate(values):
        ints[i : i + 1].fill_(int(value))
    dist.all_reduce(ints, op=op, group=group)
    return tuple(int(x) for x in ints[: len(values)].tolist())


def sum_gradients(
    params: Sequence[torch.Tensor],
    used: torch.Tensor,
    check: Callable[[], None],
    group: Any = None,
) -> list[torch.Tensor]:
    """Make every rank hold the same set of gradients, meet at a sync point (``check``), then
    all-reduce (SUM) each ``.grad`` in place; returns the gradients reduced.

    A parameter that got no gradient on this rank gets zeros, but only if some rank has one: a
    parameter no rank used keeps ``grad = None``, as in one process. ``used`` (one uint8 per
    parameter) carries the marks.
    """
    if len(used) != len(params):
        raise RuntimeError("the gradient marks were made for other parameters")
    for i, param in enumerate(params):
        used[i : i + 1].fill_(int(param.grad is not None))
    # every rank has passed the last micro-batch's sync point, and allocated nothing since
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    for param, anyone_used in zip(params, used.tolist(), strict=True):
        if anyone_used and param.grad is None:
            # the only allocation before the reduction: the sync point below covers it
            param.grad = torch.zeros_like(param)
    check()
    grads = [p.grad for p in params if p.grad is not None]
    # after the sync point no rank allocates before joining: each in-place reduction is safe
    works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True) for g in grads]
    for work in works:
        assert work is not None
        work.wait()
    return grads
