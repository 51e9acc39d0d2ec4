"""Trace a few layers, then write out the trace of the whole stack, exactly.

A transformer's step is a prologue (embeddings), L copies of one layer, an epilogue (final norm,
head, loss), a backward that walks the layers the other way, and an optimizer step whose foreach
ops each sweep the parameters in model order. Tracing every layer costs time linear in L; the
event stream of the L-layer model follows from the streams of two shallow ones.

How:

1. **Groups.** Layers are grouped by the period ``p`` of the model's per-layer settings (1 for
   most models; 2 for Gemma-2's alternating sliding and global attention, 3 for ModernBERT's
   global attention every third layer), and the shallow depths keep the remainder ``L mod p``:
   ``D_a = 3p + r`` and ``D_b = D_a + p`` hold the first group, at least one group in the middle
   and the last group(s).
2. **Labels.** Every event gets the group it happens in: between the tracer's block marks in the
   forward and backward (an allocation belongs to the group whose layer is running), by the
   parameter it was computed from in the optimizer step (foreach ops item by item). References
   (the allocation an event frees, the parameter a gradient or a state tensor belongs to, a block
   mark) become relative: ``(target group - this group, index within the target group)``.
   The labelled streams are built in :mod:`memfit.estimate.depth_streams`.
3. **Compress.** A stream is root events and *sweeps*: runs of events of groups 0, 1, …, n-1 (or
   n-1, …, 0). The first and last group of a sweep stay literal; the middle groups must all be
   the same run of relative events, the *template*.
4. **Check, then extrapolate.** The two shallow traces must compress to the same form (one more
   layer added one more copy of the template, nothing else), and writing out ``D_b`` from the
   form must give back the traced ``D_b`` exactly, every list of the trace. Then the form is
   written out at ``L``: the trace a full-depth run would record, allocation for allocation.

Anything that does not fit (a model whose layers do not repeat, an allocation that grows with the
depth, a reference that skips layers) raises :class:`NotRepeating`, and the caller traces the
whole model instead and says why.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.estimate.blocks import block_layers, fsdp_blocks
from memfit.estimate.depth_streams import (
    Item,
    NamedFormula,
    NotRepeating,
    allocs_through,
    label_trace,
    trace_streams,
)
from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    CAT,
    FREE,
    FREE_PREV,
    FREE_RES,
    ParamInfo,
    Segment,
    StepTrace,
)

# int config attributes that make every n-th layer different (a period of n layers)
_PERIOD_ATTRIBUTES = (
    "global_attn_every_n_layers",  # ModernBERT
    "sliding_window_pattern",  # Gemma-3 (older configs)
    "interleave_moe_layer_step",  # Llama-4
    "no_rope_layer_interval",  # Llama-4
)
# depths below this many layers are traced whole: two shallow traces would cost as much
_MIN_GROUPS = 5


@dataclass(frozen=True)
class DepthPlan:
    """How to trace a model of ``depth`` layers from two shallow copies."""

    key: str  # the config.json key of the number of layers
    depth: int
    period: int
    traced: tuple[int, int]  # (D_a, D_b)
    lists: tuple[str, ...] = ()  # per-layer config lists, cut to the shallow depth
    # groups kept literal at the start: 1, or more where the first layers' events differ from
    # the rest's for longer (activation offloading's forward stash spans several layers' saves)
    prefix: int = 1

    def groups(self, depth: int) -> int:
        return -(-depth // self.period)

    @property
    def suffix(self) -> int:
        """Groups kept literal at the end: the last, and the one before a partial last group."""
        return 1 if self.depth % self.period == 0 else 2


def plan_depth(config: Any, prefix: int = 1) -> tuple[DepthPlan | None, str]:
    """A plan for ``config``, or None and why the whole model must be traced. ``prefix``: the
    groups kept literal at the start (the shallow traces hold them, one group of the template
    and the last group(s))."""
    layout = _layout(config)
    if isinstance(layout, str):
        return None, layout
    key, depth, period, lists = layout
    remainder = depth % period
    shallow_a = (prefix + 2) * period + remainder
    shallow_b = shallow_a + period
    if period > 1 and depth // period < _MIN_GROUPS:
        names = ", ".join(lists) or "the per-layer settings"
        return None, f"the layers differ: {names} repeat only every {period} of {depth} layers"
    if depth // period < _MIN_GROUPS or depth <= shallow_b:
        return None, f"{depth} layers are few enough to trace whole"
    return DepthPlan(key, depth, period, (shallow_a, shallow_b), tuple(lists), prefix), ""


def few_layers(config: Any) -> bool:
    """Whether ``config`` is traced whole because it has few layers, all alike (fewer than a
    shallow trace of a deeper model has): its whole trace costs about what those cost."""
    layout = _layout(config)
    if isinstance(layout, str):
        return False
    _key, _depth, period, _lists = layout
    # with one period a valid layout is traced whole only for having few layers
    return period == 1 and plan_depth(config)[0] is None


def _layout(config: Any) -> tuple[str, int, int, list[str]] | str:
    """``config``'s layers: (the config key of their number, the number, the period of the
    repeating block, the per-layer config lists), or why they cannot be planned."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        return "the config names no number of layers (num_hidden_layers)"
    attribute_map = getattr(config, "attribute_map", {}) or {}
    key = attribute_map.get("num_hidden_layers", "num_hidden_layers")
    values = config.to_dict()
    if values.get(key) != depth:
        return f"the number of layers is not the config key {key!r}"
    period = 1
    lists = []
    for name, value in values.items():
        layer_keyed = isinstance(value, dict) and value and all(str(k).isdigit() for k in value)
        if layer_keyed and "layer" in name:
            return f"the config sets {name} layer by layer"
        if isinstance(value, list) and len(value) == depth and depth > 1:
            lists.append(name)
            period = math.lcm(period, _smallest_period(value))
    for name in _PERIOD_ATTRIBUTES:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            period = math.lcm(period, value)
    return key, depth, period, lists


def _smallest_period(values: Sequence[Any]) -> int:
    n = len(values)
    for p in range(1, n + 1):
        if all(values[i] == values[i + p] for i in range(n - p)):
            return p
    return n


def shallow_config(config: Any, plan: DepthPlan, depth: int) -> Any:
    """A copy of ``config`` with ``depth`` layers (per-layer lists cut to their first ``depth``)."""
    values = config.to_dict()
    values[plan.key] = depth
    for name in plan.lists:
        values[name] = list(values[name])[:depth]
    shallow = config.__class__.from_dict(values)
    if getattr(shallow, "num_hidden_layers", None) != depth:
        raise NotRepeating(f"could not set the number of layers to {depth}")
    return shallow


# --- compress and write out ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sweep:
    step: int  # +1 ascending groups, -1 descending
    head: tuple[tuple[Hashable, ...], ...]  # the literal runs before the template, sweep order
    template: tuple[Hashable, ...]
    tail: tuple[tuple[Hashable, ...], ...]
    # the first run is the previous sweep's last (a sweep that turns back at the end group:
    # the foreach temporaries of every parameter freed in reverse, then the next op's)
    joined: bool = False


def _compress(items: list[Item], groups: int, suffix: int, prefix: int = 1) -> tuple[Hashable, ...]:
    runs: list[tuple[int | None, list[Hashable]]] = []
    for context, token in items:
        if runs and runs[-1][0] == context:
            runs[-1][1].append(token)
        else:
            runs.append((context, [token]))
    out: list[Hashable] = []
    i = 0
    joined = False
    while i < len(runs):
        context, tokens = runs[i]
        if context is None:
            out.append(("root", tuple(tokens)))
            i += 1
            continue
        if context == 0:
            step = 1
        elif context == groups - 1:
            step = -1
        else:
            raise NotRepeating(f"a sweep over the layers starts in the middle (group {context})")
        sweep: list[tuple[Hashable, ...]] = []
        expected = context
        while i < len(runs) and runs[i][0] == expected and len(sweep) < groups:
            sweep.append(tuple(runs[i][1]))
            expected += step
            i += 1
        if len(sweep) != groups:
            raise NotRepeating("a sweep over the layers skips some of them")
        was_joined = joined
        # a sweep that turns back: its last run is also the first of the next one
        end = groups - 1 if step == 1 else 0
        joined = i < len(runs) and runs[i][0] == end - step
        if joined:
            i -= 1
        # literal: the first ``prefix`` groups and the last ``suffix`` groups; the rest must be
        # one template
        by_group = sweep if step == 1 else sweep[::-1]
        middle = by_group[prefix : groups - suffix]
        if not middle or any(run != middle[0] for run in middle[1:]):
            raise NotRepeating("the layers in the middle do not repeat")
        first = list(range(prefix))
        last = list(range(groups - suffix, groups))
        head_groups = first if step == 1 else last[::-1]
        tail_groups = last if step == 1 else first[::-1]
        out.append(
            _Sweep(
                step,
                tuple(by_group[g] for g in head_groups),
                middle[0],
                tuple(by_group[g] for g in tail_groups),
                was_joined,
            )
        )
    return tuple(out)


def _expand(form: tuple[Hashable, ...], groups: int, suffix: int, prefix: int = 1) -> list[Item]:
    items: list[Item] = []
    for part in form:
        if isinstance(part, _Sweep):
            middle = list(range(prefix, groups - suffix))
            if part.step == 1:
                order = list(enumerate(part.head))
                order += [(g, part.template) for g in middle]
                order += [(groups - suffix + k, run) for k, run in enumerate(part.tail)]
            else:
                order = [(groups - 1 - k, run) for k, run in enumerate(part.head)]
                order += [(g, part.template) for g in reversed(middle)]
                order += [(prefix - 1 - k, run) for k, run in enumerate(part.tail)]
            for group, run in order[1:] if part.joined else order:
                items.extend((group, token) for token in run)
        else:
            root_tokens: tuple[Any, ...] = part[1]  # type: ignore[index]
            items.extend((None, token) for token in root_tokens)
    return items


class _Writer:
    """Turns expanded streams back into a :class:`StepTrace` of ``groups`` groups."""

    def __init__(self, groups: int, period: int) -> None:
        self.groups = groups
        self.period = period
        self.block_index: dict[tuple[int | None, int], int] = {}
        self.param_index: dict[tuple[int | None, int], int] = {}
        self.alloc_index: dict[tuple[int | None, int], int] = {}
        self._alloc_counts: dict[int | None, int] = {}
        self.sizes: list[int] = []
        self.categories: list[int] = []
        self.alive: set[int] = set()

    def resolve(self, rel: Hashable, context: int | None) -> int | None:
        if rel == "root":
            return None
        if isinstance(rel, tuple):
            where, value = rel
            return value if where == "start" else self.groups + value
        if context is None:
            raise NotRepeating("a relative reference outside the layers")
        assert isinstance(rel, int)
        return context + rel

    def lookup(
        self, table: dict[tuple[int | None, int], int], ref: Any, context: int | None
    ) -> int:
        if ref is None:
            return -1
        rel, ordinal = ref
        key = (self.resolve(rel, context), ordinal)
        if key not in table:
            raise NotRepeating("a reference to something the extrapolated model does not have")
        return table[key]

    def lookup_alloc(self, ref: Any, context: int | None) -> int:
        rel, recency = ref
        group = self.resolve(rel, context)
        key = (group, self._alloc_counts.get(group, 0) - 1 - recency)
        if key not in self.alloc_index:
            raise NotRepeating("a reference to something the extrapolated model does not have")
        return self.alloc_index[key]

    def new_alloc(self, group: int | None, size: int, category: int) -> int:
        ordinal = self._alloc_counts.get(group, 0)
        self._alloc_counts[group] = ordinal + 1
        index = len(self.sizes)
        self.alloc_index[(group, ordinal)] = index
        self.sizes.append(size)
        self.categories.append(category)
        return index

    def write(self, streams: dict[str, list[Item]], template: StepTrace) -> StepTrace:
        block_layers: list[int] = []
        counts: dict[int | None, int] = {}
        for group, (_, offset) in streams["blocks"]:
            ordinal = counts.get(group, 0)
            counts[group] = ordinal + 1
            self.block_index[(group, ordinal)] = len(block_layers)
            block_layers.append(-1 if group is None else group * self.period + offset)

        counts = {}
        params_stream = streams["params"]
        for i, (group, _) in enumerate(params_stream):
            ordinal = counts.get(group, 0)
            counts[group] = ordinal + 1
            self.param_index[(group, ordinal)] = i

        resident_blocks: list[int] = []
        param_links: dict[int, int] = {}
        for group, token in streams["residents"]:
            _, size, category, param_ref, block_ref = token
            g = self.new_alloc(group, size, category)
            resident_blocks.append(self.lookup(self.block_index, block_ref, group))
            if param_ref is not None:
                param_links[g] = self.lookup(self.param_index, param_ref, group)
        n_initial = len(self.sizes)
        parameter_bytes = sum(
            s for s, c in zip(self.sizes, self.categories, strict=True) if c == CAT["parameters"]
        )

        params: list[ParamInfo] = []
        for group, token in params_stream:
            _, shape, itemsize, trainable, alloc_ref, block_ref = token
            alloc = -1 if alloc_ref is None else self.lookup_alloc(alloc_ref, group)
            block = self.lookup(self.block_index, block_ref, group)
            params.append(ParamInfo(alloc, shape, itemsize, trainable, block))

        steps: list[tuple[tuple[int, int], Segment, Segment | None]] = []
        segment_params: dict[int, int] = {}  # global id -> parameter, from the segments
        self.alive = set(range(n_initial))  # every event must free something alive
        first_optimizer_globals: list[int] = []
        steady: list[int] = []
        index = 0
        while f"{index}.fb" in streams:
            (_, (_, shape, has_opt)) = streams[f"{index}.shape"][0]
            live = set(range(n_initial)) if index == 0 else set()
            fb_base = len(self.sizes)
            fb = self._segment(streams[f"{index}.fb"], None, segment_params, live)
            opt = None
            if has_opt:
                opt_base = len(self.sizes)
                opt = self._segment(streams[f"{index}.opt"], fb_base, segment_params, live)
                if index == 0:
                    first_optimizer_globals = list(range(opt_base, len(self.sizes)))
            if index == 0:
                steady = sorted(live)
            steps.append((shape, fb, opt))
            index += 1

        links = param_links | segment_params
        trainable = [p for p in params if p.trainable]
        return StepTrace(
            resident_sizes=list(self.sizes),
            resident_categories=list(self.categories),
            steps=steps,
            num_parameters=sum(p.numel for p in params),
            parameter_bytes=parameter_bytes,
            trainable_parameters=sum(p.numel for p in trainable),
            trainable_gradient_bytes=sum(p.numel * p.itemsize for p in trainable),
            initial=list(range(n_initial)),
            steady=steady,
            first_optimizer_globals=first_optimizer_globals,
            params=params,
            resident_params={g: links[g] for g in steady if g in links},
            largest_module_parameters=template.largest_module_parameters,
            block_layers=block_layers,
            resident_blocks=resident_blocks,
        )

    def _segment(
        self,
        items: list[Item],
        fb_base: int | None,
        segment_params: dict[int, int],
        live: set[int],
    ) -> Segment:
        seg = Segment()
        base = len(self.sizes)
        for context, token in items:
            kind = token[0]
            if kind == "alloc":
                (_, size, category, op, shape, itemsize, formula, param_ref, origin_ref) = token
                g = self.new_alloc(context, size, category)
                local = g - base
                seg.events.append((ALLOC, local))
                seg.sizes.append(size)
                seg.categories.append(category)
                seg.ops.append(op)
                seg.shapes.append(shape)
                seg.itemsizes.append(itemsize)
                seg.formulas.append(None if formula is None else formula.function)
                param = self.lookup(self.param_index, param_ref, context)
                seg.params.append(param)
                seg.origins.append(self.lookup(self.param_index, origin_ref, context))
                if param >= 0:
                    segment_params[g] = param
                live.add(g)
                self.alive.add(g)
            elif kind in (FREE, FREE_PREV, FREE_RES):
                target = self.lookup_alloc(token[1], context)
                if kind == FREE:
                    ref = target - base
                elif kind == FREE_PREV:
                    assert fb_base is not None
                    ref = target - fb_base
                else:
                    ref = target
                if ref < 0:
                    raise NotRepeating("a free refers outside its segment")
                seg.events.append((kind, ref))
                if target not in self.alive:
                    raise NotRepeating("an extrapolated free of something not alive")
                self.alive.discard(target)
                live.discard(target)
            elif kind == "mark-block":
                _, stage, block_ref = token
                block = self.lookup(self.block_index, block_ref, context)
                seg.events.append((BLOCK, block * 4 + stage))
            else:
                _, mark_kind, ref = token
                seg.events.append((mark_kind, ref))
        return seg


def _forms(trace: StepTrace, plan: DepthPlan, steps: int) -> dict[str, Any]:
    labels = label_trace(trace, plan.period)
    if labels.groups < plan.prefix + 2:
        raise NotRepeating("too few layers traced")
    streams = trace_streams(trace, labels, steps)
    forms = {
        name: _compress(items, labels.groups, plan.suffix, plan.prefix)
        for name, items in streams.items()
    }
    return forms


def _write(forms: dict[str, Any], plan: DepthPlan, depth: int, template: StepTrace) -> StepTrace:
    groups = plan.groups(depth)
    streams = {
        name: _expand(form, groups, plan.suffix, plan.prefix) for name, form in forms.items()
    }
    return _Writer(groups, plan.period).write(streams, template)


def check_model(trace: StepTrace, model: Any, plan: DepthPlan) -> None:
    """Hold an extrapolated trace against the model itself, built with every layer (on meta).

    The shallow traces cannot see a layer that differs by its absolute index beyond them (a
    mixture-of-experts layer from the fourth on, a layer named in a list of indices): its
    parameters, or the settings its modules keep, differ. Every parameter must be the traced one,
    and every layer after the first group must be built like the one a period before it.
    """
    blocks = fsdp_blocks(model)
    block_index: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            block_index.setdefault(id(p), index)
    params = [
        (
            tuple(int(d) for d in p.shape),
            p.element_size(),
            p.requires_grad,
            block_index.get(id(p), -1),
        )
        for p in model.parameters()
    ]
    traced = [(p.shape, p.itemsize, p.trainable, p.block) for p in trace.params]
    if params != traced:
        raise NotRepeating("the model's parameters are not the extrapolated ones")
    if block_layers(model, blocks) != trace.block_layers:
        raise NotRepeating("the model's layers are not the extrapolated ones")
    layers = [
        blocks[b]
        for b, layer in sorted(enumerate(trace.block_layers), key=lambda x: x[1])
        if layer >= 0
    ]
    signatures = [_layer_signature(layer) for layer in layers]
    for i in range(2 * plan.period, len(signatures)):
        if signatures[i] != signatures[i - plan.period]:
            raise NotRepeating(f"layer {i} is built unlike layer {i - plan.period}")


_SIMPLE = (int, float, str, bool, type(None))


def _layer_signature(layer: Any) -> tuple[Any, ...]:
    """What a layer's modules are and keep (settings, parameter shapes), its index left out."""
    parts = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted(
                (key, value)
                for key, value in vars(module).items()
                if not key.startswith("_")
                and "layer_id" not in key
                and "layer_idx" not in key
                and (
                    isinstance(value, _SIMPLE)
                    or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value))
                )
            )
        )
        shapes = tuple(tuple(p.shape) for p in module.parameters(recurse=False))
        parts.append((name, type(module).__name__, settings, shapes))
    return tuple(parts)


def extrapolate(shallow: StepTrace, deeper: StepTrace, plan: DepthPlan) -> StepTrace:
    """The trace of ``plan.depth`` layers from traces of ``plan.traced`` layers.

    ``deeper`` may hold fewer steps than ``shallow`` (the first ones): it is the check. Raises
    :class:`NotRepeating` where the two do not differ by exactly one more copy of the template.
    """
    checked = len(deeper.steps)
    forms_a = _forms(shallow, plan, len(shallow.steps))
    forms_b = _forms(deeper, plan, checked)
    for name, form in forms_b.items():
        if forms_a.get(name) != form:
            raise NotRepeating(f"one more layer changed more than one layer's events ({name})")
    check_names = {name: forms_a[name] for name in forms_b}
    rebuilt = _write(check_names, plan, plan.traced[1], shallow)
    if not same_trace(rebuilt, deeper):
        raise NotRepeating(f"the {plan.traced[1]}-layer trace was not written back exactly")
    if shallow.largest_module_parameters != deeper.largest_module_parameters:
        raise NotRepeating("the largest module differs between depths")
    return _write(forms_a, plan, plan.depth, shallow)


def same_trace(a: StepTrace, b: StepTrace) -> bool:
    """Equal in everything the estimator reads (the steps both hold)."""
    steps = min(len(a.steps), len(b.steps))
    # the resident list runs through every traced step: compare what both have
    a_n = allocs_through(a, steps)
    if a_n != allocs_through(b, steps):
        return False
    if len(a.steps) == len(b.steps) and len(a.resident_sizes) != len(b.resident_sizes):
        return False
    for x, y in zip(a.steps[:steps], b.steps[:steps], strict=True):
        if x[0] != y[0] or not _same_segment(x[1], y[1]):
            return False
        if (x[2] is None) != (y[2] is None):
            return False
        if x[2] is not None and y[2] is not None and not _same_segment(x[2], y[2]):
            return False
    return (
        a.resident_sizes[:a_n] == b.resident_sizes[:a_n]
        and a.resident_categories[:a_n] == b.resident_categories[:a_n]
        and a.initial == b.initial
        and a.steady == b.steady
        and a.first_optimizer_globals == b.first_optimizer_globals
        and a.params == b.params
        and a.resident_params == b.resident_params
        and a.num_parameters == b.num_parameters
        and a.parameter_bytes == b.parameter_bytes
        and a.trainable_parameters == b.trainable_parameters
        and a.trainable_gradient_bytes == b.trainable_gradient_bytes
        and a.block_layers == b.block_layers
        and a.resident_blocks == b.resident_blocks
        and a.largest_module_parameters == b.largest_module_parameters
    )


def _same_segment(a: Segment, b: Segment) -> bool:
    return (
        a.events == b.events
        and a.sizes == b.sizes
        and a.categories == b.categories
        and a.ops == b.ops
        and a.shapes == b.shapes
        and a.itemsizes == b.itemsizes
        and a.params == b.params
        and a.origins == b.origins
        and [None if f is None else NamedFormula(f) for f in a.formulas]
        == [None if f is None else NamedFormula(f) for f in b.formulas]
    )
