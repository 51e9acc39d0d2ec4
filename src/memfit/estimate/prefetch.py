"""Trace several knob sets at once, one worker process each, into the disk cache.

A cold ``memfit plan`` needs a trace per knob set it compares (precision × checkpointing: four by
default), each seconds to tens of seconds of single-threaded Python. Traces of different knob sets
are independent, so they run side by side in worker processes (spawned: a CUDA context the parent
may hold is never forked); each worker writes its trace to the disk cache, from which the planner
then reads. Nothing happens when the disk cache is off, when fewer than two traces are missing or
when the machine has one core: then the planner traces as before, in its own process.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from memfit.estimate.api import estimate, is_traced

MAX_WORKERS = 8


def cache_enabled() -> bool:
    return os.environ.get("MEMFIT_NO_CACHE", "") in ("", "0")


def prefetch(model: str, calls: Sequence[dict[str, Any]]) -> int:
    """Trace the knob sets of ``calls`` (``estimate`` keyword arguments) that are not cached yet.

    Returns how many were traced in workers. Errors are left for the caller's own ``estimate``
    call to report (a worker that fails only loses its head start).
    """
    cpus = os.cpu_count() or 1
    if not cache_enabled() or cpus < 2:
        return 0
    pending: list[dict[str, Any]] = []
    for call in calls:
        try:
            if not is_traced(model, **call) and call not in pending:
                pending.append(call)
        except Exception:  # bad input: the caller's own estimate says what is wrong
            return 0
    if len(pending) < 2:
        return 0
    workers = min(len(pending), cpus, MAX_WORKERS)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(_trace, model, call) for call in pending]
        done = sum(1 for f in futures if f.exception() is None and f.result())
    return done


def _trace(model: str, call: dict[str, Any]) -> bool:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)  # tracing is Python-bound; the workers share the cores
    try:
        estimate(model, **call)
    except Exception:
        return False
    return True
