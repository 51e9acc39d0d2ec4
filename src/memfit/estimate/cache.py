"""The disk cache of traces: data only, never code.

A trace file holds numbers, strings and lists (JSON, zlib-compressed): the allocations of a traced
step, its shape fit and how it was traced. Nothing in it is executed when it is read: the few size
formulas a trace carries (kernels whose scratch is no product of the shape's dims) are stored by
name and arguments and looked up in :data:`FORMULAS`, and a file that names anything else, or is
not what memfit writes, is ignored (the model is traced again). The config is not stored: the file
name hashes it, and the caller's own config is attached on reading.

Nor are its numbers trusted: a file is a file, and an edited one (sizes negated, zeroed, or
10^30) would change every verdict made from it. A trace's figures are redundant, and a file is
used only when they agree as memfit writes them (:func:`_check_traced`): every size a whole
number of bytes from 0 to :data:`MAX_SIZE`, every allocation's size its tensor's elements times
their size (or its formula's), the parameters' bytes the sum of the parameters, the fitted
dims giving back the traced steps' sizes, the device profile's figures within a device. Any
other file is traced again, as a damaged one is.

``MEMFIT_CACHE_DIR`` moves the cache (default ``~/.cache/memfit``); ``MEMFIT_NO_CACHE=1`` turns it
off. File names hash the model's config, the knobs, how deep it was traced, the torch and
transformers versions and memfit's estimator source, so a changed model, library or estimator
never reads a stale trace.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.devices.profiles import CudaProfile
from memfit.estimate import sdpa_kernels
from memfit.estimate.fit import FittedSegment
from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    CAT,
    CATEGORIES,
    FREE,
    FREE_PREV,
    FREE_RES,
    MARK,
    PHASES,
    ParamInfo,
    Segment,
    StepTrace,
)
from memfit.estimate.workload import StepSpec
from memfit.step import linear_ce, trl_head

FORMAT = 1
# a trace file inflates to at most this much (a 48-layer model's is a few MB)
MAX_BYTES = 256 * 2**20
# the size formulas a trace may name: functions of sdpa_kernels bound to plain arguments, and the
# fused-linear loss's chunk slots (memfit.step.linear_ce.declared_chunks) and TRL's head's tiles
# (memfit.step.trl_head), plain functions
_FUNCTIONS = {
    name: getattr(sdpa_kernels, name)
    for name in ("_split_kv_bytes", "_rounded_bytes", "_padded_mask_bytes", "_workspace_formula")
} | {"slot_bytes": linear_ce.slot_bytes, "tile_bytes": trl_head.tile_bytes}
FORMULAS = frozenset(_FUNCTIONS)


class _NotData(Exception):
    """Something that cannot be written as data (a formula memfit does not know)."""


def path_for(key: tuple[Any, ...]) -> Path | None:
    """Where the trace of ``key`` (config hash, knobs, trace depth) is kept; None when off."""
    # start-up: transformers takes a second or more to import; only its version is needed here
    import transformers

    if os.environ.get("MEMFIT_NO_CACHE", "") not in ("", "0"):
        return None
    root = Path(os.environ.get("MEMFIT_CACHE_DIR") or Path.home() / ".cache" / "memfit")
    digest = hashlib.sha256(
        repr((key, torch.__version__, transformers.__version__, _source_digest())).encode()
    ).hexdigest()[:32]
    return root / "traces" / f"{digest}.json.z"


@functools.cache
def _source_digest() -> str:
    """The code that shapes a traced step: the estimator's, the recipes' losses it traces
    (``memfit.step``), the levers' (their bitsandbytes settings, ...) and the knobs; and which
    sentence-transformers the losses come from (without it the estimator uses its own copies)."""
    package = Path(__file__).parent.parent
    h = hashlib.sha256()
    sources = [
        *sorted(Path(__file__).parent.glob("*.py")),
        *sorted((package / "levers").glob("*.py")),
        *sorted((package / "step").glob("*.py")),
        package / "knobs.py",
    ]
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    try:
        h.update(importlib.metadata.version("sentence-transformers").encode())
    except importlib.metadata.PackageNotFoundError:
        h.update(b"no sentence-transformers")
    return h.hexdigest()


def write(path: Path, traced: Any, key: tuple[Any, ...]) -> bool:
    """Write ``traced`` (a ``traces.Traced`` of ``key``) to ``path``, never half-written.

    False when it cannot be written (a read-only or full disk, something that is not data).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    try:
        payload = {"key": repr(key), **_traced_data(traced)}
        data = zlib.compress(json.dumps(payload).encode(), 1)
    except (_NotData, TypeError, ValueError):
        return False
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)  # never a half-written cache file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:  # a read-only or full disk: keep working without the cache
        return False
    return True


def read(path: Path, key: tuple[Any, ...], config: Any, make: Any) -> Any | None:
    """The traced object of ``key`` stored at ``path`` (built by ``make(**fields)``), or None.

    A missing, damaged or foreign file, or one of another key, is None: the caller traces again.
    """
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(path.read_bytes(), MAX_BYTES)
        if inflater.unconsumed_tail:
            return None  # larger than any trace memfit writes
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        if data.get("key") != repr(key):
            return None
        traced = _traced_from(data, config, make)
        _check_traced(traced)
        return traced
    except Exception:  # anything a damaged, foreign or edited file can raise: trace again
        return None


# --- to data ---------------------------------------------------------------------------------------
def _traced_data(traced: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "spec": dataclasses.asdict(traced.spec),
        "trace": _trace_data(traced.trace),
        "fitted": None if traced.fitted is None else _fitted_data(traced.fitted),
        "profile": dataclasses.asdict(traced.profile),
        "trace_seconds": traced.trace_seconds,
        "method": traced.method,
        "max_positions": traced.max_positions,
        "variant_key": traced.variant_key,
        "home_key": traced.home_key,
        "depth": traced.depth,
        "trace_depth": traced.trace_depth,
        "exact": [[list(k), _traced_data(v)] for k, v in traced._exact.items()],
        "variants": [[list(k), _traced_data(v)] for k, v in traced._variants.items()],
    }


def _trace_data(trace: StepTrace) -> dict[str, Any]:
    return {
        "resident_sizes": trace.resident_sizes,
        "resident_categories": trace.resident_categories,
        "steps": [
            [list(shape), _segment_data(fb), None if opt is None else _segment_data(opt)]
            for shape, fb, opt in trace.steps
        ],
        "num_parameters": trace.num_parameters,
        "parameter_bytes": trace.parameter_bytes,
        "trainable_parameters": trace.trainable_parameters,
        "trainable_gradient_bytes": trace.trainable_gradient_bytes,
        "initial": trace.initial,
        "steady": trace.steady,
        "first_optimizer_globals": trace.first_optimizer_globals,
        "params": [
            [p.alloc, list(p.shape), p.itemsize, p.trainable, p.block] for p in trace.params
        ],
        "resident_params": [[g, p] for g, p in trace.resident_params.items()],
        "largest_module_parameters": trace.largest_module_parameters,
        "block_layers": trace.block_layers,
        "resident_blocks": trace.resident_blocks,
    }


def _segment_data(seg: Segment) -> dict[str, Any]:
    return {
        "events": [x for event in seg.events for x in event],
        "sizes": seg.sizes,
        "categories": seg.categories,
        "ops": seg.ops,
        "shapes": [list(s) for s in seg.shapes],
        "itemsizes": seg.itemsizes,
        "formulas": [None if f is None else _formula_data(f) for f in seg.formulas],
        "params": seg.params,
        "origins": seg.origins,
    }


def _formula_data(formula: Any) -> list[Any]:
    bound = isinstance(formula, functools.partial)
    function = formula.func if bound else formula
    name = getattr(function, "__name__", None)
    if name not in _FUNCTIONS or _FUNCTIONS[name] is not function:
        raise _NotData(f"size formula {formula!r}")
    return [
        name,
        [_plain(a) for a in formula.args] if bound else [],
        {k: _plain(v) for k, v in formula.keywords.items()} if bound else {},
    ]


def _plain(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, tuple) and all(isinstance(v, int | float) for v in value):
        return {"tuple": list(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    raise _NotData(f"formula argument {value!r}")


def _fitted_data(fitted: FittedSegment) -> dict[str, Any]:
    return {
        "template": _segment_data(fitted.template),
        "coefficients": fitted.coefficients.tolist(),
        "ranks": fitted.ranks.tolist(),
        "itemsizes": fitted.itemsizes.tolist(),
        "per_sequence_only": fitted.per_sequence_only,
        "multiples": None if fitted.multiples is None else fitted.multiples.tolist(),
    }


# --- from data -------------------------------------------------------------------------------------
def _traced_from(data: dict[str, Any], config: Any, make: Any) -> Any:
    spec = data["spec"]
    traced = make(
        config=config,
        spec=StepSpec(**{**spec, "lora_targets": tuple(spec["lora_targets"])}),
        trace=_trace_from(data["trace"]),
        fitted=None if data["fitted"] is None else _fitted_from(data["fitted"]),
        profile=CudaProfile(**data["profile"]),
        trace_seconds=float(data["trace_seconds"]),
        method=str(data["method"]),
        max_positions=int(data["max_positions"]),
        variant_key=None if data["variant_key"] is None else tuple(data["variant_key"]),
        home_key=tuple(data["home_key"]),
        depth=dict(data["depth"]),
        trace_depth=str(data["trace_depth"]),
    )
    for key, value in data["exact"]:
        traced._exact[tuple(key)] = _traced_from(value, config, make)
    for key, value in data["variants"]:
        traced._variants[tuple(key)] = _traced_from(value, config, make)
    traced.mark_saved()
    return traced


def _trace_from(data: dict[str, Any]) -> StepTrace:
    return StepTrace(
        resident_sizes=_ints(data["resident_sizes"]),
        resident_categories=_ints(data["resident_categories"]),
        steps=[
            (
                (int(shape[0]), int(shape[1])),
                _segment_from(fb),
                None if opt is None else _segment_from(opt),
            )
            for shape, fb, opt in data["steps"]
        ],
        num_parameters=int(data["num_parameters"]),
        parameter_bytes=int(data["parameter_bytes"]),
        trainable_parameters=int(data["trainable_parameters"]),
        trainable_gradient_bytes=int(data["trainable_gradient_bytes"]),
        initial=_ints(data["initial"]),
        steady=_ints(data["steady"]),
        first_optimizer_globals=_ints(data["first_optimizer_globals"]),
        params=[
            ParamInfo(int(a), tuple(_ints(shape)), int(i), bool(t), int(b))
            for a, shape, i, t, b in data["params"]
        ],
        resident_params={int(g): int(p) for g, p in data["resident_params"]},
        largest_module_parameters=int(data["largest_module_parameters"]),
        block_layers=_ints(data["block_layers"]),
        resident_blocks=_ints(data["resident_blocks"]),
    )


def _segment_from(data: dict[str, Any]) -> Segment:
    flat = _ints(data["events"])
    return Segment(
        events=list(zip(flat[0::2], flat[1::2], strict=True)),
        sizes=_ints(data["sizes"]),
        categories=_ints(data["categories"]),
        ops=[str(op) for op in data["ops"]],
        shapes=[tuple(_ints(s)) for s in data["shapes"]],
        itemsizes=_ints(data["itemsizes"]),
        formulas=[None if f is None else _formula_from(f) for f in data["formulas"]],
        params=_ints(data["params"]),
        origins=_ints(data["origins"]),
    )


def _formula_from(data: list[Any]) -> Any:
    name, args, keywords = data
    if name not in FORMULAS:
        raise ValueError(f"unknown size formula {name!r}")
    function = _FUNCTIONS[name]
    if not args and not keywords:
        return function  # a plain function (written as one)
    return functools.partial(
        function, *(_unplain(a) for a in args), **{k: _unplain(v) for k, v in keywords.items()}
    )


def _unplain(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        dtypes = {
            str(d).removeprefix("torch."): d
            for d in vars(torch).values()
            if isinstance(d, torch.dtype)
        }
        return dtypes[str(value["dtype"])]
    if isinstance(value, dict):
        return tuple(value["tuple"])
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise ValueError(f"formula argument {value!r}")


def _fitted_from(data: dict[str, Any]) -> FittedSegment:
    return FittedSegment(
        template=_segment_from(data["template"]),
        coefficients=np.array(data["coefficients"], dtype=np.float64),
        ranks=np.array(data["ranks"], dtype=np.int64),
        itemsizes=np.array(data["itemsizes"], dtype=np.int64),
        per_sequence_only=bool(data["per_sequence_only"]),
        multiples=None
        if data["multiples"] is None
        else np.array(data["multiples"], dtype=np.int64),
    )


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or any(type(v) is not int for v in values):
        raise TypeError("a list of whole numbers expected")
    return values


# --- checks: a file is used only when its figures agree as memfit writes them ---------------------
# no allocation, and no device figure, is larger than this (1 PiB: more than any device holds)
MAX_SIZE = 2**50


class _Untrusted(ValueError):
    """A trace file whose figures memfit cannot have written (edited or damaged)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise _Untrusted(what)


def _sizes_ok(values: list[int]) -> bool:
    return all(0 <= v <= MAX_SIZE for v in values)


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_traced(traced: Any) -> None:
    """Raise :class:`_Untrusted` unless ``traced`` (and its exact traces and variants) are
    consistent as memfit writes them: see the module's docstring."""
    trace: StepTrace = traced.trace
    _check_trace(trace)
    if traced.fitted is not None:
        _check_fitted(traced.fitted, trace)
    profile = traced.profile
    for f in dataclasses.fields(profile):
        value = getattr(profile, f.name)
        if isinstance(value, int) and not isinstance(value, bool):
            _require(0 <= value <= MAX_SIZE, f"profile {f.name}")
    _require(math.isfinite(traced.trace_seconds) and traced.trace_seconds >= 0, "trace_seconds")
    _require(traced.max_positions >= 1, "max_positions")
    for nested in [*traced._exact.values(), *traced._variants.values()]:
        _check_traced(nested)


def _check_trace(trace: StepTrace) -> None:
    residents = trace.resident_sizes
    _require(_sizes_ok(residents), "resident sizes")
    _require(len(trace.resident_categories) == len(residents), "resident categories")
    _require(all(0 <= c < len(CATEGORIES) for c in trace.resident_categories), "categories")
    parameters = [
        s
        for s, c in zip(residents, trace.resident_categories, strict=True)
        if c == CAT["parameters"]
    ]
    _require(trace.parameter_bytes == sum(parameters), "parameter bytes")
    for p in trace.params:
        _require(0 <= p.alloc < len(residents), "parameter allocation")
        _require(all(d >= 0 for d in p.shape) and p.itemsize > 0, "parameter shape")
        _require(residents[p.alloc] == p.numel * p.itemsize, "parameter size")
    trainable = [p for p in trace.params if p.trainable]
    if trace.params:
        _require(trace.num_parameters == sum(p.numel for p in trace.params), "parameters")
        _require(trace.trainable_parameters == sum(p.numel for p in trainable), "trainable")
        _require(
            trace.trainable_gradient_bytes == sum(p.numel * p.itemsize for p in trainable),
            "trainable gradient bytes",
        )
    _require(0 <= trace.largest_module_parameters <= max(trace.num_parameters, 0), "largest")
    for shape, fb, opt in trace.steps:
        _require(shape[0] >= 1 and shape[1] >= 1, "step shape")
        _check_segment(fb, len(residents))
        if opt is not None:
            _check_segment(opt, len(residents))


def _check_segment(seg: Segment, residents: int) -> None:
    n = len(seg.sizes)
    lengths = {
        len(seg.categories),
        len(seg.ops),
        len(seg.shapes),
        len(seg.itemsizes),
        len(seg.formulas),
        len(seg.params),
        len(seg.origins),
    }
    _require(lengths == {n}, "segment lengths")
    _require(_sizes_ok(seg.sizes), "sizes")
    _require(all(0 <= c < len(CATEGORIES) for c in seg.categories), "categories")
    for size, shape, itemsize, formula in zip(
        seg.sizes, seg.shapes, seg.itemsizes, seg.formulas, strict=True
    ):
        _require(all(d >= 0 for d in shape), "dims")
        if formula is not None:
            _require(formula(*shape) == size, "a formula's size")
        elif itemsize > 0:
            _require(_numel(shape) * itemsize == size, "a size")
        else:
            _require(itemsize == 0, "an element size")
    for kind, ref in seg.events:
        if kind == ALLOC:
            _require(0 <= ref < n, "an allocation event")
        elif kind == FREE:
            _require(ref < n and -ref - 1 < residents, "a free event")
        elif kind == MARK:
            _require(0 <= ref < len(PHASES), "a phase")
        else:  # freeing the forward's allocation or a resident one; a block's start or end
            _require(kind in (FREE_PREV, FREE_RES, BLOCK) and ref >= 0, "an event")


def _check_fitted(fitted: FittedSegment, trace: StepTrace) -> None:
    """The fit's own figures, and its dims giving back the sizes of every traced step it fits."""
    _check_segment(fitted.template, len(trace.resident_sizes))
    n = len(fitted.template.sizes)
    _require(bool(np.isfinite(fitted.coefficients).all()), "coefficients")
    _require(fitted.coefficients.ndim == 3 and fitted.coefficients.shape[0] == n, "coefficients")
    _require(fitted.ranks.shape == (n,) and fitted.itemsizes.shape == (n,), "fit lengths")
    _require(bool((fitted.itemsizes >= 0).all()), "fit element sizes")
    # some traced step of the fit's kind (its allocations) is what the fit predicts at its shape:
    # an edited coefficient predicts other sizes at every shape
    given_back = any(
        len(fb.sizes) == n and fitted.sizes(batch, seq).tolist() == fb.sizes
        for (batch, seq), fb, _ in trace.steps
    )
    _require(given_back, "a fit that gives back no traced step")
