"""The traces of a model and knobs: traced once, at the depth chosen, and kept in memory and on disk.

A :class:`Traced` holds the trace of one model and set of knobs (:class:`StepSpec`) and its shape fit;
it replays any (batch size, sequence length) in milliseconds, tracing a variant the first time a
kind of shape its fit does not cover is asked (a batch of one, a misaligned length), or the very
shape where the fit cannot be trusted. :func:`traced` keeps them per model and knobs in this
process (and in the disk cache, :mod:`memfit.estimate.cache`); :func:`trace_model` chooses how deep
to trace (:mod:`memfit.estimate.depth`).

After the first trace of a model and knobs, the other kinds of shape are traced in the background
on the machine's other core (:mod:`memfit.estimate.background`), so that a later batch of one or odd
length is arithmetic too; :func:`trace_kinds` traces them all in this process (a plan's worker).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from memfit import progress
from memfit.devices.profiles import CudaProfile, cuda_profile
from memfit.errors import UsageError
from memfit.estimate import background, cache, workload
from memfit.estimate import depth as depth_
from memfit.estimate.cuda_modes import trace_modes
from memfit.estimate.fit import FittedSegment, fit_trace, grid_shapes
from memfit.estimate.replay import Peak, replay_step
from memfit.estimate.sharding import layout as sharding_layout
from memfit.estimate.trace import StepTrace, trace_steps
from memfit.estimate.workload import StepSpec
from memfit.step import offload

__all__ = [
    "KINDS",
    "NotTraced",
    "Traced",
    "clear_cache",
    "hidden_size",
    "only_cached",
    "save_traces",
    "trace_kinds",
    "trace_model",
    "traced",
]

# the kinds of shape with a fit of their own: (a batch of one, a length that is a multiple of 8)
KINDS: tuple[tuple[bool, bool], ...] = ((False, True), (True, True), (False, False), (True, False))


@dataclass
class Traced:
    """A model and knobs, traced once; replays any (batch size, sequence length)."""

    config: Any
    spec: StepSpec
    trace: StepTrace
    fitted: FittedSegment | None
    profile: CudaProfile
    trace_seconds: float
    method: str = "fitted"
    max_positions: int = 512
    variant_key: tuple[bool, bool] | None = None
    # the (batch of one, aligned length) kind of shape this trace fits itself: the kind the first
    # estimate asked for (a batch-1 job traces the batch-1 fit only)
    home_key: tuple[bool, bool] = (False, True)
    # how deep the model was traced (``details["trace_depth"]``) and what was asked
    depth: dict[str, Any] = field(default_factory=dict)
    trace_depth: str = "auto"
    _exact: dict[tuple[int, int], Traced] = field(default_factory=dict)
    _variants: dict[tuple[bool, bool], Traced] = field(default_factory=dict)
    _dirty: bool = True  # traced (or extended) since the disk cache last saw it
    # its key in this process's traces (:func:`traced`), once its other kinds are traced in the
    # background: the jobs' keys
    _background_key: tuple[Any, ...] | None = None
    # kinds that arrived from the background and are not on disk yet: written when the process
    # exits (:func:`_write_arrivals`), not by the next request (a write is up to a second there)
    _unsaved_arrivals: bool = False

    def changed(self) -> bool:
        """True when this trace or a variant of it is newer than the disk cache's copy."""
        nested = [*self._variants.values(), *self._exact.values()]
        return self._dirty or any(t.changed() for t in nested)

    def mark_saved(self) -> None:
        self._dirty = False
        self._unsaved_arrivals = False
        for t in [*self._variants.values(), *self._exact.values()]:
            t.mark_saved()

    def replay(
        self,
        batch_size: int,
        seq_len: int,
        world_size: int = 1,
        profile: CudaProfile | None = None,
        accumulate: bool = False,
        sharding: str = "none",
    ) -> Peak:
        variant = self._variant(batch_size, seq_len)
        if variant is not self:
            return variant.replay(batch_size, seq_len, world_size, profile, accumulate, sharding)
        if self.fitted is None:
            exact = self._exact_trace(batch_size, seq_len)
            return exact.replay(batch_size, seq_len, world_size, profile, accumulate, sharding)
        fb_sizes = self.fitted.sizes(batch_size, seq_len).tolist()
        shard = None
        if sharding != "none":
            # a replay-time transform of this very trace: no new trace per scheme or world size
            shard = sharding_layout(
                self.trace, self.spec, sharding, world_size, hidden_size=hidden_size(self.config)
            )
        return replay_step(
            self.trace,
            self.fitted.template,
            fb_sizes,
            self.spec,
            profile or self.profile,
            world_size,
            accumulate,
            shard,
        )

    def used(self, batch_size: int, seq_len: int) -> Traced:
        """The trace that answered this shape (a variant's, or an exact one)."""
        variant = self._variant(batch_size, seq_len)
        if variant.fitted is None and (batch_size, seq_len) in variant._exact:
            return variant._exact[(batch_size, seq_len)]
        return variant

    def _variant(self, batch_size: int, seq_len: int) -> Traced:
        """The fit that covers this shape: a batch of one, and misaligned lengths, have their own.

        A single sample takes other code paths (views instead of copies); a sequence length that
        is no multiple of 8 makes CUDA's memory-efficient attention copy its mask.
        """
        if self.variant_key is not None:
            return self
        key = (batch_size == 1, seq_len % 8 == 0)
        if key == self.home_key:
            return self
        if key not in self._variants and self._background_key is not None:
            _adopt(self)  # arrived from the background while the traces' lock was held
        if key not in self._variants:
            if _ONLY_CACHED.get():
                raise NotTraced
            if self._background_key is not None:
                # traced in the background now: waited for, never traced twice; not begun yet
                # (or failed): traced here, as without it
                background.wait_for((self._background_key, key))
                _adopt(self)
            if key not in self._variants:
                variant = _trace_kind(
                    self.config,
                    self.spec,
                    self.trace_depth,
                    self.max_positions,
                    self.profile,
                    key,
                )
                with _LOCK:  # the background's results arrive under it too
                    self._variants.setdefault(key, variant)
                    self._dirty = True
        return self._variants[key]

    def _exact_trace(self, batch_size: int, seq_len: int) -> Traced:
        # the fit could not be trusted: trace this very shape (seconds, cached per shape)
        key = (batch_size, seq_len)
        if key not in self._exact:
            if _ONLY_CACHED.get():
                raise NotTraced
            started = time.perf_counter()
            trace, depth = trace_model(self.config, self.spec, [key, key], self.trace_depth)
            exact = Traced(
                self.config,
                self.spec,
                trace,
                None,
                self.profile,
                time.perf_counter() - started,
                "exact-trace",
                self.max_positions,
                variant_key=(batch_size == 1, seq_len % 8 == 0),
                depth=depth,
                trace_depth=self.trace_depth,
            )
            exact.fitted = _identity_fit(trace)
            self._exact[key] = exact
            self._dirty = True
        return self._exact[key]


def _trace_kind(
    config: Any,
    spec: StepSpec,
    trace_depth: str,
    max_positions: int,
    profile: CudaProfile,
    key: tuple[bool, bool],
    home: bool = False,
) -> Traced:
    """The fit of one kind of shape, from its own grid: a variant of a :class:`Traced`, or (with
    ``home``) a first trace, whose home kind it is."""
    started = time.perf_counter()
    check, grid, second = grid_shapes(
        max_positions, batch_size=1 if key[0] else None, aligned=key[1]
    )
    trace, depth = trace_model(config, spec, [check, *grid, second], trace_depth)
    fitted = fit_trace(trace)
    return Traced(
        config,
        spec,
        trace,
        fitted,
        profile,
        time.perf_counter() - started,
        "fitted" if fitted is not None else "exact-trace",
        max_positions,
        variant_key=None if home else key,
        home_key=key if home else (False, True),
        depth=depth,
        trace_depth=trace_depth,
    )


def _background_kind(*args: Any) -> Traced:
    """:func:`_trace_kind` in the background's worker: the config stays home (it is the
    caller's own object; pickling it back would be a copy)."""
    variant = _trace_kind(*args)
    variant.config = None
    return variant


_KIND_LABELS = {
    (True, True): "the batch-1 shapes",
    (False, False): "the sequence lengths that are no multiple of 8",
    (True, False): "the batch-1 shapes of lengths that are no multiple of 8",
    (False, True): "the shapes of batch 2 or more",
}


def _submit_kinds(
    key: tuple[Any, ...],
    config: Any,
    spec: StepSpec,
    trace_depth: str,
    max_positions: int,
    profile: CudaProfile,
    home: tuple[bool, bool],
    have: Any = (),
) -> list[Any]:
    """Trace the kinds of shape but ``home`` (and those in ``have``) in the background; the
    jobs' keys (none where the background is off: :func:`background.enabled`)."""
    if not background.enabled():
        return []
    submitted: list[Any] = []
    # the kinds nearest the home one first: a batch of one (a plan's micro-batch 1), then the
    # other lengths (a slider over lengths), then both
    for kind in sorted(
        (k for k in KINDS if k != home and k not in have),
        key=lambda k: ((k[0] != home[0]) + (k[1] != home[1]), k[1] != home[1]),
    ):
        job_key = (key, kind)
        job = background.submit(
            job_key,
            _KIND_LABELS[kind],
            (__name__, "_background_kind"),
            (config, spec, trace_depth, max_positions, profile, kind),
            functools.partial(_arrived, key, kind),
            # the model's code (transformers' modeling module: seconds to import)
            preload=(type(config).__module__.replace(".configuration_", ".modeling_"),),
        )
        if job is not None:  # (None: a job of that key is known already, someone else's)
            submitted.append(job_key)
    return submitted


def _start_background(entry: Traced, key: tuple[Any, ...]) -> None:
    """The kinds of shape ``entry`` has no fit for, traced in the background (see the module)."""
    if entry._background_key is None and entry.fitted is not None and entry.variant_key is None:
        # (a model no grid fits has every shape traced on its own: nothing to trace ahead)
        have = set(entry._variants)
        args = (entry.spec, entry.trace_depth, entry.max_positions, entry.profile)
        if _submit_kinds(key, entry.config, *args, entry.home_key, have):
            entry._background_key = key
    if entry._background_key is not None:
        _adopt(entry)


# kinds traced in the background that arrived while this process held the traces' lock (tracing
# another model, or this one's first kind): taken in by the next to look (:func:`_adopt`)
_ARRIVED: dict[tuple[Any, ...], Traced] = {}
_ARRIVED_LOCK = threading.Lock()


def _arrived(key: tuple[Any, ...], kind: tuple[bool, bool], variant: Traced) -> None:
    """A kind traced in the background: into its trace's variants, marked for the disk cache
    (written by this process's next estimate: :func:`save_traces`). In the background's thread:
    nothing else here, while a trace may be running in this process (a collection would fire
    the weak references of that trace's garbage at a random point of it; a save would read
    traces being extended without the lock)."""
    with _ARRIVED_LOCK:
        _ARRIVED[(key, kind)] = variant
    # never waiting for the lock: its holder may be waiting for this very job (:meth:`_variant`
    # takes it in after the wait), and the background goes on with the next kind meanwhile
    if not _LOCK.acquire(blocking=False):
        return
    try:
        entry = _CACHE.get(key)
        if entry is not None:
            _adopt(entry)
    finally:
        _LOCK.release()


def _adopt(entry: Traced) -> bool:
    """Take in the kinds of ``entry`` that have arrived from the background (True if any)."""
    key = entry._background_key
    with _ARRIVED_LOCK:
        kinds = [k for k in _ARRIVED if k[0] == key]
        arrived = {kind: _ARRIVED.pop((key, kind)) for _, kind in kinds}
    with _LOCK:
        for kind, variant in arrived.items():
            variant.config = entry.config
            if entry._variants.setdefault(kind, variant) is variant:
                variant.mark_saved()  # not by the next request: at exit
                entry._unsaved_arrivals = True
        if arrived:
            _write_arrivals_at_exit()
    return bool(arrived)


_WRITE_AT_EXIT: list[bool] = []


def _write_arrivals_at_exit() -> None:
    if not _WRITE_AT_EXIT:
        _WRITE_AT_EXIT.append(True)
        atexit.register(_write_arrivals)


def _write_arrivals() -> None:
    """Write the traces whose kinds arrived from the background to the disk cache (at exit)."""
    with _LOCK:
        for entry in _CACHE.values():
            if entry._unsaved_arrivals:
                entry._dirty = True
    save_traces()


def _after_fork_in_child() -> None:
    # the background's thread may have held it: a forked child has no such thread
    global _ARRIVED_LOCK
    _ARRIVED_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def trace_kinds(
    model_spec: Any,
    spec: StepSpec,
    trace_depth: str = "auto",
    kinds: tuple[tuple[bool, bool], ...] = KINDS,
) -> Traced:
    """The traces of ``kinds`` of shape (:data:`KINDS`: the first is the home one), all traced in
    this process and written to the disk cache: for a worker that traces ahead for a parent (a
    plan asks micro-batch 1 as well as the per-rank batch), where the background is off."""
    first = kinds[0] if kinds else KINDS[0]
    with background.off():
        entry = traced(model_spec, spec, trace_depth, (1 if first[0] else 2, 8 if first[1] else 7))
    for kind in kinds:
        entry._variant(1 if kind[0] else 2, 8 if kind[1] else 7)
    if entry.changed():
        save_traces()
    return entry


def hidden_size(config: Any) -> int:
    """The model's hidden size (DeepSpeed's bucket sizes follow it)."""
    for name in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1024


def _identity_fit(trace: StepTrace) -> FittedSegment:
    """A 'fit' that returns the traced sizes of the steady step whatever the shape asked."""
    template = dataclasses.replace(trace.steps[1][1])
    # the traced sizes are final: no formula to evaluate
    template.formulas = [None] * len(template.sizes)
    n = len(template.sizes)
    coefficients = np.zeros((n, 1, 4))
    coefficients[:, 0, 0] = template.sizes
    return FittedSegment(
        template, coefficients, np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    )


_CACHE: dict[tuple[str, StepSpec, str], Traced] = {}
# reentrant: a variant's trace is kept under it, and a trace read from disk replays under it
_LOCK = threading.RLock()


def _disk_load(key: tuple[str, StepSpec, str], config: Any) -> Traced | None:
    """The trace of ``key`` from the disk cache (data only: see :mod:`memfit.estimate.cache`)."""
    path = cache.path_for(key)
    if path is None or not path.is_file():
        return None
    loaded = cache.read(path, key, config, Traced)
    if loaded is None:
        return None
    try:
        # a file that reads as data may still not replay (a field of the wrong kind): one
        # replay of a shape it fits proves it, else the model is traced again
        if loaded.fitted is not None:
            loaded.replay(*loaded.trace.steps[-1][0])
    except Exception:
        return None
    return loaded


def save_traces() -> None:
    """Write every trace that gained something since it was loaded to the disk cache."""
    with _LOCK:
        for key, entry in _CACHE.items():
            if not entry.changed():
                continue
            path = cache.path_for(key)
            if path is None:
                return
            # written or not (a read-only or full disk), it is not tried again in this process
            cache.write(path, entry, key)
            entry.mark_saved()


class NotTraced(Exception):
    """Raised inside :func:`only_cached` when answering would need a new trace."""


_ONLY_CACHED: contextvars.ContextVar[bool] = contextvars.ContextVar("only_cached", default=False)


@contextlib.contextmanager
def only_cached() -> Iterator[None]:
    """Inside it, anything that would need a new trace raises :class:`NotTraced` instead."""
    token = _ONLY_CACHED.set(True)
    try:
        yield
    finally:
        _ONLY_CACHED.reset(token)


def traced(
    model_spec: Any,
    spec: StepSpec,
    trace_depth: str = "auto",
    shape: tuple[int, int] | None = None,
) -> Traced:
    """The traces of a model and knobs; a first trace fits the kind of ``shape`` asked."""
    key = (model_spec.cache_key(), spec, trace_depth)
    with _LOCK:
        if key not in _CACHE and (loaded := _disk_load(key, model_spec.config)) is not None:
            _CACHE[key] = loaded
        if key not in _CACHE and _ONLY_CACHED.get():
            raise NotTraced
        if key not in _CACHE:
            home = (False, True) if shape is None else (shape[0] == 1, shape[1] % 8 == 0)
            profile = cuda_profile()
            # on by default, for the Python API too: a process that asked one shape of a model
            # asks others next (a notebook's next cell, a server's next request), each an answer the
            # fit must give in milliseconds; the other kinds are traced on the other core while
            # this one is (the worker's start, importing torch, is seconds: begun now, it is
            # done by the time this trace is). Off with MEMFIT_NO_BACKGROUND=1 (which the CLI
            # sets: a command exits after its answer), in a pool's workers, and on one core
            # (:func:`background.enabled`)
            args = (model_spec.config, spec, trace_depth, model_spec.max_positions, profile)
            ahead = _submit_kinds(key, *args, home)
            try:
                _CACHE[key] = _trace_kind(*args, home, home=True)
            except BaseException:
                background.drop(ahead)  # the job's own problem: theirs would fail too
                raise
            if ahead:
                _CACHE[key]._background_key = key
        entry = _CACHE[key]
        if not _ONLY_CACHED.get():
            # read from disk without its other kinds: traced now (see above)
            _start_background(entry, key)
        return entry


def trace_model(
    config: Any, spec: StepSpec, shapes: list[tuple[int, int]], trace_depth: str = "auto"
) -> tuple[StepTrace, dict[str, Any]]:
    """Trace ``shapes`` (the first two also run the optimizer); how deep, in ``details``.

    ``auto`` traces two shallow copies of the model and writes out the trace of every layer
    (:mod:`memfit.estimate.depth`): the same trace, allocation for allocation, in a fraction of
    the time. Where the layers do not repeat, it traces the whole model and says why.
    """
    plan, reason = depth_.plan_depth(config, prefix=_literal_prefix(spec))
    layers = getattr(config, "num_hidden_layers", None)
    if trace_depth == "full":
        reason = "--trace-depth full"
    elif plan is not None:
        shallow_a, shallow_b = plan.traced
        try:
            progress.report(f"tracing {shallow_a} of {layers} layers ({len(shapes)} shapes)")
            shallow = _run_trace(depth_.shallow_config(config, plan, shallow_a), spec, shapes)
            progress.report(f"tracing {shallow_b} of {layers} layers (the check)")
            deeper = _run_trace(depth_.shallow_config(config, plan, shallow_b), spec, shapes[:2])
            progress.report(f"writing out the trace of {layers} layers")
            trace = depth_.extrapolate(shallow, deeper, plan)
            with torch.device("meta"):
                depth_.check_model(trace, workload.build_model(config, spec), plan)
            return trace, {
                "mode": "extrapolated",
                "depth": plan.depth,
                "period": plan.period,
                "traced_depths": list(plan.traced),
            }
        except depth_.NotRepeating as exc:
            reason = f"the layers do not repeat: {exc}"
        except UsageError:
            raise  # the job's own problem (a loss the model's head refuses): the whole model's too
        except Exception as exc:  # a config that cannot be cut short, a shallow model that fails
            reason = f"a shallow copy could not be traced ({type(exc).__name__}: {exc})"
    progress.report(f"tracing all {layers} layers ({len(shapes)} shapes)")
    info: dict[str, Any] = {"mode": "full", "depth": layers, "reason": reason}
    return _run_trace(config, spec, shapes), info


def _literal_prefix(spec: StepSpec) -> int:
    """The layers at the start whose events the depth extrapolation keeps literal. Activation
    offloading's forward stash frees a save's device tensor ``FORWARD_STASH`` saves later; with
    checkpointing a layer saves as little as its input, so the first layers' events differ from
    the rest's for that many layers (one more for the first layer's own)."""
    if spec.activation_offloading and spec.gradient_checkpointing and spec.mode == "train":
        return 1 + offload.FORWARD_STASH
    return 1


def _run_trace(config: Any, spec: StepSpec, shapes: list[tuple[int, int]]) -> StepTrace:
    modes = trace_modes(spec)
    return trace_steps(
        config,
        spec,
        shapes,
        autocast=modes.autocast,
        step_modes=modes.step_modes,
        backward_modes=modes.backward_modes,
    )


def clear_cache() -> None:
    """Forget every trace (tests use it to time a first trace)."""
    background.forget()
    with _LOCK:
        _CACHE.clear()
    with _ARRIVED_LOCK:
        _ARRIVED.clear()
