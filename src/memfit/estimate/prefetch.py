"""Trace several knob sets at once, one worker process each, into the disk cache.

A cold ``memfit plan`` needs a trace per knob set it compares (precision × checkpointing: four by
default), each seconds to tens of seconds of single-threaded Python. Traces of different knob sets
are independent, so they run side by side in worker processes (spawned: a CUDA context the parent
may hold is never forked); each worker writes its trace to the disk cache, from which the planner
then reads. Nothing happens when the disk cache is off, when fewer than two traces are missing or
when the machine has one core: then the planner traces as before, in its own process.

:class:`Ahead` is the planner's: the knob sets a search will ask for, traced ahead of it by
workers while the main process traces what the search asks (so the main process is never idle
while there is work), with the count and the time left for the status line.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from memfit.estimate import depth
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


# a spawned worker's start: importing torch, transformers and the estimator (measured on the
# 2-core machine under load: 5.0 s wall, 2.2 s of CPU)
WORKER_START_SECONDS = 5.0
# tracing one layer at one shape on fake tensors (measured, loaded 2-core machine: 0.12-0.24 s
# for BERT-base, GPT-2 medium and Llama-3.1-8B alike: the cost is per operation, not per byte)
SECONDS_PER_LAYER_SHAPE = 0.15
# the shapes of a first trace (the check, a grid of four, a second check) and of a depth check
GRID_SHAPES, CHECK_SHAPES = 6, 2


def trace_seconds(config: Any, kinds: int, trace_depth: str = "auto") -> float:
    """About how long ``kinds`` traces (kinds of shape) of one knob set of ``config`` take: the
    layers each traces × the shapes it traces them at (two shallow copies for a model whose
    depth is extrapolated, every layer otherwise)."""
    plan = None if trace_depth == "full" else depth.plan_depth(config)[0]
    if plan is None:
        layers = getattr(config, "num_hidden_layers", None) or 12
        per_kind = layers * GRID_SHAPES
    else:
        shallow, deeper = plan.traced
        per_kind = shallow * GRID_SHAPES + deeper * CHECK_SHAPES
    return kinds * per_kind * SECONDS_PER_LAYER_SHAPE


def worth_workers(seconds: float) -> bool:
    """Whether ``seconds`` of tracing pay for worker processes: each starts in
    :data:`WORKER_START_SECONDS`, then takes its share; the main process traces meanwhile, so a
    worker pays once it can take a few traces' worth (three starts of work: a worker that
    ends up tracing one set speculatively has still not cost the main process anything)."""
    return seconds >= 3 * WORKER_START_SECONDS


@dataclass
class _Unit:
    key: Hashable
    calls: list[dict[str, Any]]
    state: str = ""  # "": nobody's yet; "main"; "worker"; "done"; "lost" (its worker died)
    started: float = 0.0


class Ahead:
    """The knob sets a search will ask for, in its order, traced ahead of it side by side.

    The main process runs the search and traces what it asks, in order; before each knob set it
    calls :meth:`need`. Worker processes (started by :meth:`start`) take the next knob sets no
    one has taken yet, each traced in one process (a knob set's traces share a cache file: two
    processes writing it would drop each other's kinds of shape), into the disk cache, from which
    the search then reads them. When the search needs a knob set a worker is still tracing, the
    main process traces the next free one meanwhile rather than wait, and waits only when none is
    left. A worker that fails or dies only loses its head start: the search's own estimate of
    that knob set traces it again and says what is wrong.

    It also counts for the status line (``say``): "tracing k of about n knob sets" with the time
    left at the pace of those traced so far; n is what the search is expected to ask, and grows
    when it asks more.
    """

    def __init__(self, model: str, say: Callable[[str], None] | None = None) -> None:
        self.model = model
        self._say = say
        self._units: list[_Unit] = []
        self._by_key: dict[Hashable, _Unit] = {}
        self._cond = threading.Condition()
        self._seconds: list[float] = []  # how long each knob set traced took
        self._workers: list[Any] = []  # (process, task queue, unit in flight or None)
        self._done_queue: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._main: _Unit | None = None  # the knob set the search is tracing now
        self._pending_ready: set[int] = set()  # workers waiting for a knob set to be expected
        self._started = time.perf_counter()

    # about how long one kind of shape of one knob set takes to trace (:func:`trace_seconds`)
    seconds_per_kind = 0.0

    def pending(self) -> int:
        """Knob sets expected that no one has taken yet."""
        with self._cond:
            return sum(1 for u in self._units if not u.state)

    def expected_seconds(self) -> float:
        """About how long the knob sets no one has taken yet take to trace, one after another."""
        with self._cond:
            kinds = sum(len(u.calls) for u in self._units if not u.state)
        return kinds * self.seconds_per_kind

    # -- what the search will ask

    def expect(self, key: Hashable, calls: Sequence[dict[str, Any]]) -> None:
        """The search will likely ask for ``key`` (``estimate`` keyword arguments ``calls``):
        queue it unless it is known or every call of it is traced already."""
        with self._cond:
            unit = self._by_key.get(key)
            if unit is not None:
                if not unit.state:
                    unit.calls += [c for c in calls if c not in unit.calls]
                return
        pending = [c for c in calls if not _traced(self.model, c)]
        if not pending:
            return
        with self._cond:
            if key not in self._by_key:
                unit = _Unit(key, list(pending))
                self._units.append(unit)
                self._by_key[key] = unit
                self._cond.notify_all()
        self._tell()

    def drop_untaken(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget the knob sets no one has taken for which ``keep`` is false (a round of the
        search is over: they are no longer expected)."""
        with self._cond:
            gone = [u for u in self._units if not u.state and not keep(u.key)]
            for unit in gone:
                self._units.remove(unit)
                del self._by_key[unit.key]
        self._tell()

    def need(self, key: Hashable) -> None:
        """The search asks for ``key`` now: return when it may (nobody else is tracing it)."""
        self._finish_main()
        with self._cond:
            unit = self._by_key.get(key)
            if unit is None or unit.state in ("done", "lost", "main"):
                if unit is None:  # more than expected: the count grows
                    unit = _Unit(key, [])
                    self._units.append(unit)
                    self._by_key[key] = unit
                if unit.state != "done":
                    unit.state, unit.started = "main", time.perf_counter()
                    self._main = unit
            elif not unit.state:
                unit.state, unit.started = "main", time.perf_counter()
                self._main = unit
        if unit.state != "worker":
            self._tell()
            return
        # a worker holds it: trace the next free ones meanwhile, then wait for it
        while True:
            with self._cond:
                if unit.state == "lost":
                    # its worker died while the search waited: the search traces it itself
                    unit.state, unit.started = "main", time.perf_counter()
                    self._main = unit
                if unit.state != "worker":
                    break
                free = next((u for u in self._units if not u.state), None)
                if free is None:
                    self._cond.wait(0.5)
                    continue
                free.state, free.started = "main", time.perf_counter()
            self._tell()
            for call in free.calls:
                try:
                    estimate(self.model, **call)
                except Exception:  # the search's own estimate says what is wrong, if it asks
                    break
            self._done(free)
        self._tell()

    def _finish_main(self) -> None:
        unit, self._main = self._main, None
        if unit is not None:
            self._done(unit)

    def _done(self, unit: _Unit, seconds: float | None = None) -> None:
        with self._cond:
            if unit.state != "done":
                unit.state = "done"
                spent = time.perf_counter() - unit.started if seconds is None else seconds
                if spent > 0.05:  # a cached one read from disk is no pace
                    self._seconds.append(spent)
            self._cond.notify_all()
        self._tell()

    # -- the status line

    def counts(self) -> tuple[int, int, float | None]:
        """Knob sets traced (or read), those expected in all, and about how many seconds are
        left (None: no pace yet)."""
        with self._cond:
            done = sum(1 for u in self._units if u.state == "done")
            total = len(self._units)
            busy = sum(1 for u in self._units if u.state in ("main", "worker"))
            processes = 1 + sum(1 for w in self._workers if w[0].is_alive())
        if not self._seconds:
            return done, total, None
        pace = sum(self._seconds) / len(self._seconds)
        # those in flight are half done, on average
        left = (total - done - busy / 2) * pace / processes
        return done, total, max(0.0, left)

    def text(self) -> str:
        done, total, left = self.counts()
        line = f"tracing {min(done + 1, total)} of about {total} knob sets"
        if left is not None and done < total:
            line += f", about {_seconds(left)} left"
        return line

    def _tell(self) -> None:
        if self._say is not None:
            self._say(self.text())

    # -- the workers

    def start(self, workers: int) -> int:
        """Start ``workers`` worker processes (spawned); returns how many started."""
        if workers < 1 or self._workers:
            return 0
        context = multiprocessing.get_context("spawn")
        self._done_queue = context.Queue()
        for wid in range(workers):
            tasks = context.Queue()
            process = context.Process(
                target=_serve, args=(self.model, tasks, self._done_queue, wid), daemon=True
            )
            try:
                process.start()
            except OSError:  # no process to spare: the main process traces everything
                break
            self._workers.append([process, tasks, None])
        if self._workers:
            self._thread = threading.Thread(target=self._dispatch, daemon=True)
            self._thread.start()
        return len(self._workers)

    def _dispatch(self) -> None:
        """Hand each ready worker the next free knob set; notice workers that died."""
        while not self._closed:
            try:
                wid, index, seconds = self._done_queue.get(timeout=0.5)
            except queue.Empty:
                self._reap()
                continue
            except (EOFError, OSError):  # the queue closed under us: the search goes on alone
                return
            worker = self._workers[wid]
            if index is not None:
                unit = worker[2]
                worker[2] = None
                if unit is not None:
                    self._done(unit, seconds if seconds >= 0 else None)
            self._give(worker)

    def _give(self, worker: list[Any]) -> None:
        with self._cond:
            if self._closed:
                return
            unit = next((u for u in self._units if not u.state), None)
            if unit is None:
                worker[2] = None
                self._pending_ready.add(id(worker))
                return
            unit.state, unit.started = "worker", time.perf_counter()
            worker[2] = unit
        worker[1].put((id(unit), unit.calls))
        self._tell()

    def _reap(self) -> None:
        """A worker that died: its knob set goes back to the search; one waiting gets work."""
        for worker in self._workers:
            unit = worker[2]
            if not worker[0].is_alive() and unit is not None:
                worker[2] = None
                with self._cond:
                    unit.state = "lost"
                    self._cond.notify_all()
        # workers idle for want of work get the knob sets expected since
        for worker in self._workers:
            if id(worker) in self._pending_ready and worker[0].is_alive():
                with self._cond:
                    has_work = any(not u.state for u in self._units)
                if has_work:
                    self._pending_ready.discard(id(worker))
                    self._give(worker)

    def close(self) -> None:
        """The search is done: stop the workers (a speculative trace in flight is cut short)."""
        self._finish_main()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for _process, tasks, _ in self._workers:
            with contextlib.suppress(Exception):
                tasks.put(None)
        for process, _, _ in self._workers:
            process.join(timeout=0.2)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=2)


def _seconds(left: float) -> str:
    if left < 90:
        return f"{max(1, round(left))} s"
    return f"{round(left / 60)} min"


def _traced(model: str, call: dict[str, Any]) -> bool:
    """Whether ``call`` answers from a trace already; True for a call that cannot be answered at
    all (bad input: the search's own estimate says so, no worker need try)."""
    try:
        return is_traced(model, **call)
    except Exception:
        return True


def _serve(model: str, tasks: Any, done: Any, wid: int) -> None:
    """A worker: trace each knob set it is handed into the disk cache, say when, until None."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["MEMFIT_NO_PROGRESS"] = "1"
    # the parent's status line owns the terminal: a worker's warnings would garble it, and its
    # errors are the parent's to report (its own estimate of the knob set says them again)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the worker's whole life
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # tracing is Python-bound; the processes share the cores
    done.put((wid, None, 0.0))  # ready
    while (task := tasks.get()) is not None:
        index, calls = task
        started = time.perf_counter()
        failed = False
        for call in calls:
            try:
                estimate(model, **call)
            except Exception:
                failed = True
                break
        done.put((wid, index, -1.0 if failed else time.perf_counter() - started))
