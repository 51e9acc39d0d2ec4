"""``memfit.estimate``: the peak memory of one steady-state training (or eval) step."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from memfit.devices.profiles import CudaProfile, cuda_profile
from memfit.errors import UsageError
from memfit.estimate import device as dev
from memfit.estimate import workload
from memfit.estimate.fit import FittedSegment, fit_trace, grid_shapes
from memfit.estimate.sharding import SCHEMES, Buffers, ShardLayout, ddp_bucket_sizes, none_details
from memfit.estimate.sharding import layout as sharding_layout
from memfit.estimate.trace import (
    ALLOC,
    BLOCK,
    CAT,
    CATEGORIES,
    FREE,
    FREE_PREV,
    MARK,
    PHASES,
    Segment,
    StepTrace,
    trace_steps,
)
from memfit.estimate.workload import StepSpec
from memfit.units import parse_size

BREAKDOWN_KEYS = (*CATEGORIES, "allocator_overhead", "runtime_overhead")


@dataclass(frozen=True)
class Estimate:
    """The predicted peak of one step, and what is alive at that moment.

    ``breakdown`` sums to ``total_bytes``. On CUDA ``total_bytes`` is what ``max_memory_reserved``
    plus the CUDA context would show; on the CPU, the process's peak memory for tensors.
    """

    total_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    budget_bytes: int | None
    fits: bool | None
    model: str
    spec: StepSpec
    batch_size: int
    seq_len: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def biggest_part(self) -> str:
        return max(self.breakdown, key=lambda k: self.breakdown[k])

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` contract (plus a ``details`` object)."""
        return {
            "total_bytes": self.total_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "details": dict(self.details),
        }


def validate(
    *,
    task: str,
    batch_size: Any,
    seq_len: Any,
    precision: str,
    optimizer: str,
    attn_implementation: str,
    mode: str,
    device: str,
    num_labels: Any,
    loss: str | None,
    mini_batch_size: Any = None,
    lora_rank: Any = None,
    max_seq_len: Any = None,
    world_size: Any = 1,
    sharding: Any = "none",
    lora_target_modules: Any = None,
) -> tuple[StepSpec, list[str]]:
    """Check every knob at once; return the spec and the list of problems (empty when fine)."""
    problems: list[str] = []

    def choice(flag: str, value: Any, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            problems.append(f"{flag}: unknown value {value!r}; choose one of {', '.join(allowed)}")

    choice("--task", task, workload.TASKS)
    choice("--precision", precision, workload.PRECISIONS)
    choice("--optimizer", optimizer, workload.OPTIMIZERS)
    choice("--attn-implementation", attn_implementation, workload.ATTN_IMPLEMENTATIONS)
    choice("--mode", mode, workload.MODES)
    choice("--device", device, workload.DEVICES)
    choice("--sharding", sharding, SCHEMES)
    for flag, value in (
        ("--batch-size", batch_size),
        ("--seq-len", seq_len),
        ("--num-labels", num_labels),
    ):
        if not _whole(value):
            problems.append(f"{flag}: must be a whole number ≥ 1, got {value!r}")
    for flag, value in (
        ("--mini-batch-size", mini_batch_size),
        ("--max-seq-len", max_seq_len),
        ("--world-size", world_size),
    ):
        if value is not None and not _whole(value):
            problems.append(f"{flag}: must be a whole number ≥ 1, got {value!r}")
    if lora_rank is not None and (not _whole(lora_rank, minimum=0)):
        problems.append(f"--lora-rank: must be a whole number ≥ 0, got {lora_rank!r}")
    resolved_loss = workload.resolve_loss(task, loss, problems)
    if mini_batch_size is not None and resolved_loss != "cached-mnrl":
        problems.append("--mini-batch-size: only the cached loss (--loss cached-mnrl) has one")
    spec = StepSpec(
        task=task,
        precision=precision,
        optimizer=optimizer,
        gradient_checkpointing=False,
        attn_implementation=attn_implementation,
        mode=mode,
        device=device,
        num_labels=num_labels if isinstance(num_labels, int) else 2,
        loss=resolved_loss,
        lora_rank=lora_rank if _whole(lora_rank, minimum=0) else 0,
        lora_targets=tuple(str(x).strip() for x in lora_target_modules or () if str(x).strip()),
    )
    if spec.lora_targets and not spec.lora_rank:
        problems.append("--lora-target-modules: give --lora-rank too (no adapters without a rank)")
    return spec, problems


def _whole(value: Any, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def estimate(
    model: str,
    *,
    task: str,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    mode: str = "train",
    device: str = "cuda",
    gpu_memory: int | str | None = None,
    num_labels: int = 2,
    loss: str | None = None,
    mini_batch_size: int | None = None,
    lora_rank: int | None = None,
    max_seq_len: int | None = None,
    world_size: int = 1,
    gpu: str | None = None,
    gradient_accumulation_steps: int = 1,
    sharding: str = "none",
    lora_target_modules: Sequence[str] | None = None,
    trace_depth: str = "auto",
) -> Estimate:
    """Predict the peak memory of one steady-state step (optimizer state already exists).

    Traces the real transformers model code on fake tensors the first time a model and set of
    knobs is seen (seconds), then answers other batch sizes and sequence lengths in milliseconds.

    The knobs a plan chooses are all here: ``loss="cached-mnrl"`` with ``mini_batch_size`` (the
    gradient-cached in-batch-negatives loss; ``batch_size`` is then the whole batch),
    ``lora_rank`` (LoRA adapters via peft; 0 or None: full fine-tuning), ``max_seq_len``
    (truncation: sequences are cut to it) and ``world_size`` with ``sharding`` (the memory of one
    of ``world_size`` ranks; ``sharding`` none | zero1 | zero2 | zero3 | fsdp says how they
    divide parameters, gradients and optimizer state: see :mod:`memfit.estimate.sharding`;
    none is memfit's data parallelism, gradients all-reduced in place). ``gpu`` names a catalog
    GPU (see ``memfit plan --gpu``):
    its generation's cuBLAS workspace, and its memory as the budget unless ``gpu_memory`` is given.
    ``lora_target_modules``: the adapters' targets as ``memfit train --lora-target-modules``
    takes them (groups attention/mlp, module names, all-linear; default attention).
    ``gradient_accumulation_steps`` > 1: the micro-batches after the first run forward and
    backward while the gradients of the earlier ones are alive (and add theirs in place).
    ``trace_depth``: ``auto`` traces two shallow copies of the model (3 and 4 layers, or more
    where layers alternate) and writes out the trace of every layer exactly (see
    :mod:`memfit.estimate.depth`; ``details["trace_depth"]`` says what was done), falling back
    to the whole model where the layers do not repeat; ``full`` always traces every layer.
    """
    from memfit.models import resolve_model

    spec, problems = validate(
        task=task,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        attn_implementation=attn_implementation,
        mode=mode,
        device=device,
        num_labels=num_labels,
        loss=loss,
        mini_batch_size=mini_batch_size,
        lora_rank=lora_rank,
        max_seq_len=max_seq_len,
        world_size=world_size,
        sharding=sharding,
        lora_target_modules=lora_target_modules,
    )
    budget = None
    if gpu_memory is not None:
        try:
            budget = parse_size(gpu_memory, name="--gpu-memory")
        except UsageError as exc:
            problems.append(str(exc))
    profile = None
    if gpu is not None:
        from memfit.devices.catalog import find_gpu

        try:
            card = find_gpu(gpu)
            profile = cuda_profile(card.compute_capability)
            if budget is None:
                budget = card.memory_bytes
        except UsageError as exc:
            problems.append(str(exc))
    model_spec = None
    try:
        model_spec = resolve_model(model)
    except UsageError as exc:
        problems.append(str(exc))
    if isinstance(seq_len, int) and isinstance(max_seq_len, int):
        seq_len = min(seq_len, max_seq_len)
    if model_spec is not None and isinstance(seq_len, int) and seq_len > model_spec.max_positions:
        problems.append(
            f"--seq-len: {seq_len} is beyond the {model_spec.max_positions} positions {model_spec.name} can use; "
            f"use --seq-len {model_spec.max_positions} or less"
        )
    if (
        not isinstance(gradient_accumulation_steps, int)
        or isinstance(gradient_accumulation_steps, bool)
        or gradient_accumulation_steps < 1
    ):
        problems.append(
            f"--gradient-accumulation-steps: expected a whole number ≥ 1, got {gradient_accumulation_steps!r}"
        )
    if trace_depth not in TRACE_DEPTHS:
        problems.append(
            f"--trace-depth: unknown value {trace_depth!r}; choose one of {', '.join(TRACE_DEPTHS)}"
        )
    if problems:
        raise UsageError("; ".join(problems))
    assert model_spec is not None
    accumulate = gradient_accumulation_steps > 1 and spec.mode == "train"
    spec = StepSpec(**{**spec.__dict__, "gradient_checkpointing": bool(gradient_checkpointing)})

    started = time.perf_counter()
    traced_batch = batch_size
    extra_rows = 0
    if spec.loss == "cached-mnrl":
        mini = min(mini_batch_size or workload.DEFAULT_MINI_BATCH_SIZE, batch_size)
        chunks = -(-batch_size // mini)
        # traced with two mini-batches (one when the batch is one): the embeddings and cached
        # gradients of the other rows are added exactly below
        spec = dataclasses.replace(spec, cached_chunks=min(chunks, 2))
        traced_batch = mini
        extra_rows = batch_size - mini * spec.cached_chunks
    traced = _traced(model_spec, spec, trace_depth, (traced_batch, seq_len))
    world = world_size or 1
    peak = traced.replay(
        traced_batch,
        seq_len,
        world_size=world,
        profile=profile,
        accumulate=accumulate,
        sharding=sharding,
    )
    if extra_rows and peak.phase != "optimizer_step":
        peak = _with_cached_rows(peak, extra_rows, model_spec.config, spec)
    total = peak.total_bytes
    details: dict[str, Any] = {
        "num_parameters": traced.trace.num_parameters,
        "trainable_parameters": traced.trace.trainable_parameters,
        "effective_seq_len": seq_len,
        "world_size": world_size or 1,
        "gradient_accumulation_steps": gradient_accumulation_steps if spec.mode == "train" else 1,
        "allocated_peak_bytes": peak.allocated_peak_bytes,
        "phase_peak_bytes": dict(peak.phase_peaks),
        "reserved_peak_bytes": peak.reserved_peak_bytes,
        "context_bytes": peak.context_bytes,
        "device_profile": (profile or traced.profile).name if spec.device == "cuda" else "cpu",
        "method": traced._variant(traced_batch, seq_len).method,
        "trace_depth": dict(traced.used(traced_batch, seq_len).depth),
        "trace_seconds": round(traced.trace_seconds, 3),
        "estimate_seconds": round(time.perf_counter() - started, 4),
    }
    if traced.changed():
        save_traces()
    if spec.loss == "cached-mnrl":
        details["mini_batch_size"] = traced_batch
    if spec.lora_rank:
        details["lora_rank"] = spec.lora_rank
    details |= _sharding_details(traced, sharding, world)
    return Estimate(
        total_bytes=total,
        breakdown=peak.breakdown,
        peak_phase=peak.phase,
        budget_bytes=budget,
        fits=None if budget is None else total <= budget,
        model=model_spec.name,
        spec=spec,
        batch_size=batch_size,
        seq_len=seq_len,
        details=details,
    )


def _sharding_details(traced: _Traced, sharding: str, world_size: int) -> dict[str, Any]:
    """What the scheme divides and what it adds, by the paper's categories and DeepSpeed's."""
    trace, spec = traced.trace, traced.spec
    details: dict[str, Any] = {"sharding": sharding}
    if sharding == "none":
        details |= none_details(trace, spec, world_size)
        if spec.mode == "train":
            # torch DDP's reducer would keep every gradient a second time, in flat buckets
            # (bucket_cap_mb=25, the first 1 MiB); memfit's data parallelism does not
            details["ddp_bucket_bytes"] = sum(ddp_bucket_sizes(trace.trainable_gradient_bytes))
    else:
        shard = sharding_layout(
            trace, spec, sharding, world_size, hidden_size=_hidden_size(traced.config)
        )
        details |= shard.details
        if world_size == 1:
            details["sharding_note"] = (
                f"--sharding {sharding} on one GPU divides nothing: it only adds its buffers; "
                "give --world-size"
            )
    return details


# --- tracing, cached per model and knobs -------------------------------------------------------------
@dataclass
class _Peak:
    total_bytes: int
    breakdown: dict[str, int]
    phase: str
    allocated_peak_bytes: int
    reserved_peak_bytes: int | None
    context_bytes: int
    # the highest tensor bytes of each phase (allocated, not reserved, on CUDA)
    phase_peaks: dict[str, int] = field(default_factory=dict)


@dataclass
class _Traced:
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
    _exact: dict[tuple[int, int], _Traced] = field(default_factory=dict)
    _variants: dict[tuple[bool, bool], _Traced] = field(default_factory=dict)
    _dirty: bool = True  # traced (or extended) since the disk cache last saw it

    def changed(self) -> bool:
        """True when this trace or a variant of it is newer than the disk cache's copy."""
        nested = [*self._variants.values(), *self._exact.values()]
        return self._dirty or any(t.changed() for t in nested)

    def mark_saved(self) -> None:
        self._dirty = False
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
    ) -> _Peak:
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
                self.trace, self.spec, sharding, world_size, hidden_size=_hidden_size(self.config)
            )
        return _replay(
            self.trace,
            self.fitted.template,
            fb_sizes,
            self.spec,
            profile or self.profile,
            world_size,
            accumulate,
            shard,
        )

    def used(self, batch_size: int, seq_len: int) -> _Traced:
        """The trace that answered this shape (a variant's, or an exact one)."""
        variant = self._variant(batch_size, seq_len)
        if variant.fitted is None and (batch_size, seq_len) in variant._exact:
            return variant._exact[(batch_size, seq_len)]
        return variant

    def _variant(self, batch_size: int, seq_len: int) -> _Traced:
        """The fit that covers this shape: a batch of one, and misaligned lengths, have their own.

        A single sample takes other code paths (views instead of copies); a sequence length that
        is no multiple of 8 makes CUDA's memory-efficient attention copy its mask.
        """
        if self.variant_key is not None:
            return self
        key = (batch_size == 1, seq_len % 8 == 0)
        if key == self.home_key:
            return self
        if key not in self._variants:
            if _ONLY_CACHED.get():
                raise NotTraced
            started = time.perf_counter()
            check, grid, second = grid_shapes(
                self.max_positions, batch_size=1 if key[0] else None, aligned=key[1]
            )
            trace, depth = _trace(self.config, self.spec, [check, *grid, second], self.trace_depth)
            fitted = fit_trace(trace)
            self._dirty = True
            self._variants[key] = _Traced(
                self.config,
                self.spec,
                trace,
                fitted,
                self.profile,
                time.perf_counter() - started,
                "fitted" if fitted is not None else "exact-trace",
                self.max_positions,
                variant_key=key,
                depth=depth,
                trace_depth=self.trace_depth,
            )
        return self._variants[key]

    def _exact_trace(self, batch_size: int, seq_len: int) -> _Traced:
        # the fit could not be trusted: trace this very shape (seconds, cached per shape)
        key = (batch_size, seq_len)
        if key not in self._exact:
            if _ONLY_CACHED.get():
                raise NotTraced
            started = time.perf_counter()
            trace, depth = _trace(self.config, self.spec, [key, key], self.trace_depth)
            exact = _Traced(
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


def _hidden_size(config: Any) -> int:
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


_CACHE: dict[tuple[str, StepSpec, str], _Traced] = {}
_LOCK = threading.Lock()


def _disk_load(key: tuple[str, StepSpec, str], config: Any) -> _Traced | None:
    """The trace of ``key`` from the disk cache (data only: see :mod:`memfit.estimate.cache`)."""
    from memfit.estimate import cache

    path = cache.path_for(key)
    if path is None or not path.is_file():
        return None
    loaded = cache.read(path, key, config, _Traced)
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
    from memfit.estimate import cache

    with _LOCK:
        for key, traced in _CACHE.items():
            if not traced.changed():
                continue
            path = cache.path_for(key)
            if path is None:
                return
            # written or not (a read-only or full disk), it is not tried again in this process
            cache.write(path, traced, key)
            traced.mark_saved()


class NotTraced(Exception):
    """Raised inside :func:`is_traced` when answering would need a new trace."""


_ONLY_CACHED: contextvars.ContextVar[bool] = contextvars.ContextVar("only_cached", default=False)


def is_traced(model: str, **knobs: Any) -> bool:
    """Whether ``estimate(model, **knobs)`` would answer from a trace in memory or on disk."""
    token = _ONLY_CACHED.set(True)
    try:
        estimate(model, **knobs)
    except NotTraced:
        return False
    finally:
        _ONLY_CACHED.reset(token)
    return True


def _traced(
    model_spec: Any,
    spec: StepSpec,
    trace_depth: str = "auto",
    shape: tuple[int, int] | None = None,
) -> _Traced:
    """The traces of a model and knobs; a first trace fits the kind of ``shape`` asked."""
    key = (model_spec.cache_key(), spec, trace_depth)
    with _LOCK:
        if key not in _CACHE and (loaded := _disk_load(key, model_spec.config)) is not None:
            _CACHE[key] = loaded
        if key not in _CACHE and _ONLY_CACHED.get():
            raise NotTraced
        if key not in _CACHE:
            started = time.perf_counter()
            home = (False, True) if shape is None else (shape[0] == 1, shape[1] % 8 == 0)
            check, grid, second = grid_shapes(
                model_spec.max_positions, batch_size=1 if home[0] else None, aligned=home[1]
            )
            trace, depth = _trace(model_spec.config, spec, [check, *grid, second], trace_depth)
            fitted = fit_trace(trace)
            _CACHE[key] = _Traced(
                model_spec.config,
                spec,
                trace,
                fitted,
                cuda_profile(),
                time.perf_counter() - started,
                "fitted" if fitted is not None else "exact-trace",
                model_spec.max_positions,
                depth=depth,
                trace_depth=trace_depth,
                home_key=home,
            )
        return _CACHE[key]


TRACE_DEPTHS = ("auto", "full")


def _trace(
    config: Any, spec: StepSpec, shapes: list[tuple[int, int]], trace_depth: str = "auto"
) -> tuple[StepTrace, dict[str, Any]]:
    """Trace ``shapes`` (the first two also run the optimizer); how deep, in ``details``.

    ``auto`` traces two shallow copies of the model and writes out the trace of every layer
    (:mod:`memfit.estimate.depth`): the same trace, allocation for allocation, in a fraction of
    the time. Where the layers do not repeat, it traces the whole model and says why.
    """
    from memfit import progress
    from memfit.estimate import depth as depth_

    plan, reason = depth_.plan_depth(config)
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
        except Exception as exc:  # a config that cannot be cut short, a shallow model that fails
            reason = f"a shallow copy could not be traced ({type(exc).__name__}: {exc})"
    progress.report(f"tracing all {layers} layers ({len(shapes)} shapes)")
    info: dict[str, Any] = {"mode": "full", "depth": layers, "reason": reason}
    return _run_trace(config, spec, shapes), info


def _run_trace(config: Any, spec: StepSpec, shapes: list[tuple[int, int]]) -> StepTrace:
    autocast, step_modes = _device_modes(spec)
    backward_modes = None
    if spec.device == "cuda" and spec.precision != "fp32":
        from memfit.estimate import cuda_emulation

        dtype = workload.PRECISION_DTYPES[spec.precision]
        # checkpointed recompute in backward re-enters autocast: the emulation must answer it
        backward_modes = lambda: cuda_emulation.CudaAutocast(dtype, enabled=False)  # noqa: E731
    return trace_steps(
        config,
        spec,
        shapes,
        autocast=autocast,
        step_modes=step_modes,
        backward_modes=backward_modes,
    )


def _device_modes(
    spec: StepSpec,
) -> tuple[
    Callable[[], contextlib.AbstractContextManager[Any]] | None,
    Callable[[], contextlib.AbstractContextManager[Any]] | None,
]:
    """On CPU the fake CPU trace is the device; for CUDA, emulate its autocast and SDPA kernels."""
    if spec.device == "cpu":
        return None, None
    from memfit.estimate import cuda_emulation

    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    if spec.precision != "fp32":
        dtype = workload.PRECISION_DTYPES[spec.precision]
        autocast = lambda: cuda_emulation.CudaAutocast(dtype)  # noqa: E731
    else:
        autocast = contextlib.nullcontext

    def step_modes() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(cuda_emulation.CudaSdpa())
        # CUDA's dropout keeps a 1-byte bool mask for backward; the CPU kernel keeps a float one
        stack.enter_context(_CudaDropout())
        return stack

    return autocast, step_modes


class _CudaDropout(torch.overrides.TorchFunctionMode):
    """``F.dropout`` in training as CUDA runs it: ``native_dropout``, whose saved mask is bool."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False)) | kwargs
            p, training = bound.get("p", 0.5), bound.get("training", True)
            if training and p > 0 and not bound.get("inplace", False):
                return torch.native_dropout(bound["input"], p, True)[0]
        from memfit.estimate.cuda_emulation import _redispatch

        # a Python function (Tensor.backward, whose checkpoint recompute calls dropout again)
        # runs with this mode still active
        return _redispatch(self, func, types, args, kwargs)


# --- replay -------------------------------------------------------------------------------------------
_PHASE_NAMES = {PHASES.index("setup"): "forward"} | {
    i: name for i, name in enumerate(PHASES) if name != "setup"
}


def _replay(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    spec: StepSpec,
    profile: CudaProfile,
    world_size: int = 1,
    accumulate: bool = False,
    shard: ShardLayout | None = None,
) -> _Peak:
    """Replay the steady step; ``shard`` resizes it for a sharding scheme (one rank's share).

    Without sharding and with several ranks, memfit's data parallelism all-reduces each gradient
    in place after the step's micro-batches: no second copy of the gradients (torch DDP's reducer
    would keep one in buckets; ``estimate`` reports its size as ``ddp_bucket_bytes``).
    """
    optimizer_segments = (
        (trace.steps[0][2], trace.steps[1][2]) if spec.mode == "train" else (None, None)
    )
    replay = _Sharded(shard)
    fb_sizes = replay.sizes(fb, fb_sizes)
    if spec.device == "cpu":
        return _replay_cpu(trace, fb, fb_sizes, optimizer_segments[1], spec, replay, accumulate)
    return _replay_cuda(
        trace, fb, fb_sizes, optimizer_segments, spec, profile, replay, world_size, accumulate
    )


class _Sharded:
    """The replay's view of a :class:`ShardLayout` (or of no sharding at all)."""

    def __init__(self, shard: ShardLayout | None) -> None:
        self.shard = shard
        self.buffers = None if shard is None else Buffers(shard)
        self.handles: dict[str, Any] = {}  # buffer name -> its allocator handle

    def sizes(self, seg: Segment, sizes: list[int]) -> list[int]:
        return sizes if self.shard is None else self.shard.segment_sizes(seg, sizes)

    def pieces(self, alloc: int, size: int, category: int) -> tuple[tuple[int, int], ...]:
        if self.shard is None:
            return ((size, category),)
        return self.shard.pieces(alloc, size, category)

    def conversions(self, fb: Segment) -> tuple[list[tuple[int, int, int]], int]:
        """Gradients that shrink as backward ends, and the transient buffer that does it."""
        if self.shard is None:
            return [], 0
        return self.shard.conversions(fb), self.shard.root_reduce_scatter

    def actions(self, kind: int, ref: int) -> list[tuple[str, str, int, int]]:
        """The scheme's buffers to allocate and free at a phase or block mark, in order."""
        if self.buffers is None:
            return []
        return self.buffers.mark(ref) if kind == MARK else self.buffers.block(ref)


def _with_cached_rows(peak: _Peak, rows: int, config: Any, spec: StepSpec) -> _Peak:
    """Add (or take away) the cached-loss rows the trace did not hold.

    Each row of each column keeps its float32 embedding and that embedding's cached gradient
    (hidden size × 4 bytes each) from the first pass to the end of backward.
    """
    extra = rows * 2 * 2 * int(config.hidden_size) * 4
    breakdown = dict(peak.breakdown)
    breakdown["activations"] += extra
    return dataclasses.replace(
        peak,
        total_bytes=peak.total_bytes + extra,
        breakdown=breakdown,
        allocated_peak_bytes=peak.allocated_peak_bytes + extra,
        reserved_peak_bytes=None
        if peak.reserved_peak_bytes is None
        else peak.reserved_peak_bytes + extra,
        # the rows live from the first pass to the end of backward
        phase_peaks={
            k: v + extra if k != "optimizer_step" else v for k, v in peak.phase_peaks.items()
        },
    )


def _replay_cpu(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    opt: Segment | None,
    spec: StepSpec,
    replay: _Sharded,
    accumulate: bool = False,
) -> _Peak:
    """The steady-state step on the CPU: resident tensors, then forward/backward and optimizer.

    ``accumulate``: a second forward/backward (a later micro-batch) runs while the first one's
    gradients are alive; its own gradients are added in place, so each is a transient.
    """
    sizes = trace.resident_sizes
    cats = trace.resident_categories
    resident_ids = trace.steady if spec.mode == "train" else trace.initial
    raw = [0] * len(CATEGORIES)
    rounded = 0
    for g in resident_ids:
        for size, cat in replay.pieces(g, sizes[g], cats[g]):
            raw[cat] += size
            rounded += _cpu_bytes(size)
    best = rounded
    best_raw = list(raw)
    best_phase = "forward"
    phases: dict[str, int] = {}
    phase = "forward"
    fb_cats = fb.categories
    grads = CAT["gradients"]
    segments: list[tuple[Segment, list[int], bool]] = [(fb, fb_sizes, False)]
    if accumulate:
        segments.append((fb, fb_sizes, True))
    if opt is not None:
        segments.append((opt, replay.sizes(opt, opt.sizes), False))
    conversions, conversion_buffer = replay.conversions(fb)
    fb_after = list(fb_sizes)  # fb's sizes once backward is over (the optimizer frees these)
    for j, _, after in conversions:
        fb_after[j] = after
    for number, (seg, seg_sizes, transient_grads) in enumerate(segments):
        seg_cats = seg.categories
        if number == 1 and conversions:
            # backward ends: FSDP's root reduce-scatters its whole gradients into fp32 shards
            # through a reduce-scatter input, then frees them
            raw[grads] += conversion_buffer
            rounded += _cpu_bytes(conversion_buffer)
            if rounded > phases.get(phase, 0):
                phases[phase] = rounded
            if rounded > best:
                best, best_raw, best_phase = rounded, list(raw), phase
            for _, before, after in conversions:
                raw[grads] += after - before
                rounded += _cpu_bytes(after) - _cpu_bytes(before)
            raw[grads] -= conversion_buffer
            rounded -= _cpu_bytes(conversion_buffer)
        for kind, ref in seg.events:
            if kind == ALLOC:
                size = seg_sizes[ref]
                raw[seg_cats[ref]] += size
                rounded += _cpu_bytes(size)
                if rounded > phases.get(phase, 0):
                    phases[phase] = rounded
                if rounded > best:
                    best, best_raw, best_phase = rounded, list(raw), phase
                if transient_grads and seg_cats[ref] == grads:
                    raw[grads] -= size
                    rounded -= _cpu_bytes(size)
                continue
            if transient_grads and kind == FREE and seg_cats[ref] == grads:
                continue
            if kind in (MARK, BLOCK):
                if kind == MARK:
                    phase = _PHASE_NAMES[ref]
                for action, _, size, cat in replay.actions(kind, ref):
                    # a sharding scheme's buffer: gathered parameters, reduce buckets
                    sign = 1 if action == "alloc" else -1
                    raw[cat] += sign * size
                    rounded += sign * _cpu_bytes(size)
                    if rounded > phases.get(phase, 0):
                        phases[phase] = rounded
                    if rounded > best:
                        best, best_raw, best_phase = rounded, list(raw), phase
                continue
            if kind == FREE:
                freed = [(seg_sizes[ref], seg_cats[ref])]
            elif kind == FREE_PREV:
                freed = [(fb_after[ref], fb_cats[ref])]
            else:
                freed = list(replay.pieces(ref, sizes[ref], cats[ref]))
            for size, cat in freed:
                raw[cat] -= size
                rounded -= _cpu_bytes(size)
    breakdown = {name: best_raw[i] for i, name in enumerate(CATEGORIES)}
    breakdown["allocator_overhead"] = best - sum(best_raw)
    breakdown["runtime_overhead"] = 0
    return _Peak(best, breakdown, best_phase, best, None, 0, phases)


def _cpu_bytes(size: int) -> int:
    # an allocation a sharding scheme removed (a weight cast) takes nothing
    return dev.cpu_allocation_bytes(size) if size else 0


def _replay_cuda(
    trace: StepTrace,
    fb: Segment,
    fb_sizes: list[int],
    optimizer_segments: tuple[Segment | None, Segment | None],
    spec: StepSpec,
    profile: CudaProfile,
    replay: _Sharded,
    world_size: int,
    accumulate: bool = False,
) -> _Peak:
    allocator = dev.CachingAllocator()
    sizes = trace.resident_sizes
    cats = trace.resident_categories
    handles: dict[int, list[int]] = {}  # global id -> block addresses (of its pieces)
    raw = [0] * len(CATEGORIES)
    none = -1  # the handle of an allocation a sharding scheme removed

    def malloc(size: int) -> int:
        return allocator.malloc(size) if size else none

    def free(handle: int) -> None:
        if handle != none:
            allocator.free(handle)

    # the model is moved to the GPU parameter by parameter
    for g in trace.initial:
        handles[g] = []
        for size, cat in replay.pieces(g, sizes[g], cats[g]):
            handles[g].append(malloc(size))
            raw[cat] += size
    # the first matmul creates the cuBLAS (and cuBLASLt) workspace; it stays for the process.
    # Handles are per thread: backward runs on the autograd engine's device thread, whose first
    # matmul creates a second workspace
    threads = 2 if spec.mode == "train" else 1
    workspace = threads * (profile.cublas_workspace_bytes + profile.cublaslt_workspace_bytes)
    for _ in range(threads):
        allocator.malloc(profile.cublas_workspace_bytes)
        if profile.cublaslt_workspace_bytes:
            allocator.malloc(profile.cublaslt_workspace_bytes)

    first_opt, steady_opt = optimizer_segments
    state: dict[str, Any] = {"phase": "forward", "best": -1, "raw": list(raw), "at": "forward"}

    phases: dict[str, int] = {}

    def track() -> None:
        # called on every allocation of the reported step: keep the common case cheap
        allocated = allocator.allocated
        phase = state["phase"]
        if allocated > phases.get(phase, 0):  # type: ignore[call-overload]
            phases[phase] = allocated  # type: ignore[index]
            if allocated > state["best"]:  # type: ignore[operator]
                state["best"], state["raw"], state["at"] = allocated, list(raw), phase

    conversions, conversion_buffer = replay.conversions(fb)
    fb_after = list(fb_sizes)  # fb's sizes once backward is over (the optimizer frees these)
    for j, _, after in conversions:
        fb_after[j] = after

    def run(
        seg: Segment,
        seg_sizes: list[int],
        prev: list[int] | None,
        globals_: list[int] | None,
        tracking: bool,
        transient_grads: bool = False,
    ) -> list[int]:
        # transient_grads: a later micro-batch of an accumulated step, whose gradients are
        # computed and added in place into the first micro-batch's (alive all along)
        local = [0] * len(seg_sizes)
        seg_cats = seg.categories
        grads = CAT["gradients"]
        for kind, ref in seg.events:
            if kind == ALLOC:
                size = seg_sizes[ref]
                local[ref] = malloc(size)
                raw[seg_cats[ref]] += size
                if globals_ is not None:
                    handles[globals_[ref]] = [local[ref]]
                if tracking:
                    track()
                if transient_grads and seg_cats[ref] == grads:
                    free(local[ref])
                    raw[grads] -= size
                continue
            if transient_grads and kind == FREE and seg_cats[ref] == grads:
                continue
            elif kind in (MARK, BLOCK):
                if kind == MARK:
                    state["phase"] = _PHASE_NAMES[ref]
                for action, name, size, cat in replay.actions(kind, ref):
                    # a sharding scheme's buffer: gathered parameters, reduce buckets
                    if action == "alloc":
                        replay.handles[name] = malloc(size)
                        raw[cat] += size
                        if tracking:
                            track()
                    else:
                        free(replay.handles.pop(name))
                        raw[cat] -= size
            elif kind == FREE:
                free(local[ref])
                raw[seg_cats[ref]] -= seg_sizes[ref]
            elif kind == FREE_PREV:
                assert prev is not None
                free(prev[ref])
                raw[fb.categories[ref]] -= fb_after[ref]
            else:
                for handle in handles[ref]:
                    free(handle)
                for size, cat in replay.pieces(ref, sizes[ref], cats[ref]):
                    raw[cat] -= size
        return local

    def convert(handles_: list[int], tracking: bool) -> None:
        # backward ends: FSDP's root reduce-scatters its whole gradients into fp32 shards
        # through a reduce-scatter input, then frees them
        if not conversions:
            return
        grads = CAT["gradients"]
        buffer = malloc(conversion_buffer)
        raw[grads] += conversion_buffer
        if tracking:
            track()
        for j, before, after in conversions:
            free(handles_[j])
            handles_[j] = malloc(after)
            raw[grads] += after - before
        free(buffer)
        raw[grads] -= conversion_buffer

    if spec.mode == "train":
        assert first_opt is not None and steady_opt is not None
        first_sizes = replay.sizes(first_opt, first_opt.sizes)
        steady_sizes = replay.sizes(steady_opt, steady_opt.sizes)
        # step 1 creates the optimizer state; step 2 is the steady state we report
        for tracking, opt_seg, opt_sizes, globals_ in (
            (False, first_opt, first_sizes, trace.first_optimizer_globals),
            (True, steady_opt, steady_sizes, None),
        ):
            fb_handles = run(fb, fb_sizes, None, None, tracking)
            convert(fb_handles, tracking)
            if accumulate:
                run(fb, fb_sizes, None, None, tracking, transient_grads=True)
                # the later micro-batch's root gradients are reduce-scattered as well (added
                # into the shards in place): the transient run already freed them
            run(opt_seg, opt_sizes, fb_handles, globals_, tracking)
            if not tracking:
                allocator.max_allocated, allocator.max_reserved = (
                    allocator.allocated,
                    allocator.reserved,
                )
    else:
        run(fb, fb_sizes, None, None, False)  # a first batch warms the cache
        allocator.max_allocated, allocator.max_reserved = allocator.allocated, allocator.reserved
        run(fb, fb_sizes, None, None, True)
    best_raw: list[int] = state["raw"]  # type: ignore[assignment]
    breakdown = {name: best_raw[i] for i, name in enumerate(CATEGORIES)}
    reserved = allocator.max_reserved
    breakdown["allocator_overhead"] = reserved - sum(best_raw) - workspace
    # NCCL's communicator buffers live outside the caching allocator
    nccl = profile.nccl_bytes if world_size > 1 else 0
    context = profile.context_for(spec.mode, spec.precision, spec.attn_implementation)
    breakdown["runtime_overhead"] = context + workspace + nccl
    total = reserved + context + nccl
    return _Peak(
        total, breakdown, str(state["at"]), allocator.max_allocated, reserved, context, phases
    )


def clear_cache() -> None:
    """Forget every trace (tests use it to time a first trace)."""
    with _LOCK:
        _CACHE.clear()


__all__ = [
    "BREAKDOWN_KEYS",
    "CAT",
    "Estimate",
    "clear_cache",
    "estimate",
    "save_traces",
    "validate",
]
