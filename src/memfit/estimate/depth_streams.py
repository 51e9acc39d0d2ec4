"""Label a trace by layer group: every list of it as a stream of depth-free tokens.

Step 2 of :mod:`memfit.estimate.depth`: every event gets the group of layers it happens
in, and every reference it holds (the allocation it frees, the parameter a gradient belongs to, a
block mark) becomes relative to that group, so that the streams of two depths differ only in how
often the middle groups' runs repeat. :mod:`memfit.estimate.depth` compresses the streams, checks
them and writes them out at full depth.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.estimate.step_trace import (
    ALLOC,
    BLOCK,
    BLOCK_BACKWARD_START,
    BLOCK_FORWARD_START,
    FREE,
    FREE_PREV,
    FREE_RES,
    MARK,
    Segment,
    StepTrace,
)


class NotRepeating(Exception):
    """The shallow traces do not repeat by layer: trace the whole model instead."""


@dataclass
class Labels:
    """Group and index-within-group of everything a trace refers to, for one depth."""

    groups: int
    period: int
    block_group: list[int | None]
    block_ordinal: list[int]
    param_group: list[int | None]
    param_ordinal: list[int]
    alloc_group: list[int | None] = field(default_factory=list)  # by global id
    alloc_ordinal: list[int] = field(default_factory=list)
    _counts: dict[int | None, int] = field(default_factory=dict)

    def add_alloc(self, group: int | None) -> None:
        self.alloc_group.append(group)
        self.alloc_ordinal.append(self._counts.get(group, 0))
        self._counts[group] = self._counts.get(group, 0) + 1

    # outside the layers, groups are counted from the end when the last layer ran last (the
    # head after an ascending sweep), else from the start (the embeddings' backward)
    from_end: bool = False

    def rel(self, group: int | None, context: int | None) -> Hashable:
        """``group`` as seen from ``context``: an offset, or a position from either end."""
        if group is None:
            return "root"
        if context is None:
            # the first and the last group are themselves at every depth
            if group == 0:
                return ("start", 0)
            if group == self.groups - 1 or self.from_end:
                return ("end", group - self.groups)
            return ("start", group)
        return group - context

    def follow(self, context: int | None) -> None:
        """Note the group an event happened in (where counting from the end starts to apply)."""
        if context is not None:
            self.from_end = context == self.groups - 1

    def alloc_ref(self, alloc: int, context: int | None) -> Hashable:
        # by recency: the k-th latest allocation of its group so far. The first layer allocates
        # a few things more than the others (a mask on first use), so counting from the start
        # of a group would make the second layer's references to the first differ
        group = self.alloc_group[alloc]
        return (self.rel(group, context), self._counts[group] - 1 - self.alloc_ordinal[alloc])

    def param_ref(self, param: int, context: int | None) -> Hashable:
        if param < 0:
            return None
        return (self.rel(self.param_group[param], context), self.param_ordinal[param])

    def block_ref(self, block: int, context: int | None) -> Hashable:
        if block < 0:
            return None
        return (self.rel(self.block_group[block], context), self.block_ordinal[block])


def _ordinals(groups: Sequence[int | None]) -> list[int]:
    counts: dict[int | None, int] = {}
    out = []
    for g in groups:
        out.append(counts.get(g, 0))
        counts[g] = counts.get(g, 0) + 1
    return out


def label_trace(trace: StepTrace, period: int) -> Labels:
    """The groups of ``trace``'s blocks and parameters, layers grouped by ``period``."""
    layers = trace.block_layers
    block_group = [None if layer < 0 else layer // period for layer in layers]
    n_layers = sum(layer >= 0 for layer in layers)
    param_group = [None if p.block < 0 else block_group[p.block] for p in trace.params]
    labels = Labels(
        groups=-(-n_layers // period),
        period=period,
        block_group=block_group,
        block_ordinal=_ordinals(block_group),
        param_group=param_group,
        param_ordinal=_ordinals(param_group),
    )
    return labels


class NamedFormula:
    """A size formula, compared by name (as ``Segment.signature`` does), carried along."""

    __slots__ = ("function", "name")

    def __init__(self, function: Callable[..., int]) -> None:
        self.function = function
        # a functools.partial has no __qualname__: its repr names the function and arguments
        self.name = getattr(function, "__qualname__", None) or repr(function)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedFormula) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


# An item of a stream: (the group it happens in, or None; a token that no longer names depths)
Item = tuple[int | None, Any]


def _segment_contexts(
    seg: Segment, labels: Labels, trace: StepTrace, optimizer: bool
) -> list[int | None]:
    """The group each event of ``seg`` happens in (before its allocations are labelled)."""
    layers = trace.block_layers
    period = labels.period
    contexts: list[int | None] = []
    if optimizer:
        return contexts  # decided while labelling: by origin, and sticky
    open_layers: list[int] = []
    last_closed: int | None = None
    pending: list[int] = []  # events with no open layer since the last close
    for position, (kind, ref) in enumerate(seg.events):
        if kind == BLOCK and layers[ref // 4] >= 0:
            layer, stage = layers[ref // 4], ref % 4
            if stage in (BLOCK_FORWARD_START, BLOCK_BACKWARD_START):
                # a gap between two neighbouring layers belongs to the earlier one
                if not open_layers and last_closed is not None and abs(layer - last_closed) == 1:
                    for i in pending:
                        contexts[i] = last_closed // period
                pending = []
                open_layers.append(layer)
                contexts.append(layer // period)
            else:
                for i in range(len(open_layers) - 1, -1, -1):
                    if open_layers[i] == layer:
                        del open_layers[i]
                        break
                # an end mark belongs to the layer still running (the backward of the layer
                # below starts before this one's ends), else to the one it ends
                contexts.append((open_layers[-1] if open_layers else layer) // period)
                if not open_layers:
                    last_closed, pending = layer, []
            continue
        if kind == MARK:
            last_closed, pending = None, []
        if open_layers:
            contexts.append(open_layers[-1] // period)
        else:
            contexts.append(None)
            pending.append(position)
    return contexts


def trace_streams(trace: StepTrace, labels: Labels, steps: int) -> dict[str, list[Item]]:
    """Every list of the trace as a stream of items; labels every allocation on the way."""
    if allocs_through(trace, len(trace.steps)) != len(trace.resident_sizes):
        raise NotRepeating("allocations outside the traced steps")
    streams: dict[str, list[Item]] = {}
    blocks: list[Item] = []
    for b, group in enumerate(labels.block_group):
        layer = trace.block_layers[b]
        blocks.append((group, ("block", None if layer < 0 else layer % labels.period)))
    streams["blocks"] = blocks

    n_initial = len(trace.initial)
    param_of_alloc = {p.alloc: i for i, p in enumerate(trace.params)}
    residents: list[Item] = []
    for g in range(n_initial):
        block = trace.resident_blocks[g]
        group = None if block < 0 else labels.block_group[block]
        labels.add_alloc(group)
    for g in range(n_initial):
        group = labels.alloc_group[g]
        token: Any = (
            "resident",
            trace.resident_sizes[g],
            trace.resident_categories[g],
            labels.param_ref(param_of_alloc.get(g, -1), group),
            labels.block_ref(trace.resident_blocks[g], group),
        )
        residents.append((group, token))
    streams["residents"] = residents

    params: list[Item] = []
    for i, p in enumerate(trace.params):
        group = labels.param_group[i]
        token = (
            "param",
            p.shape,
            p.itemsize,
            p.trainable,
            labels.alloc_ref(p.alloc, group) if p.alloc >= 0 else None,
            labels.block_ref(p.block, group),
        )
        params.append((group, token))
    streams["params"] = params

    base = n_initial
    for index, (shape, fb, opt) in enumerate(trace.steps[:steps]):
        fb_base = base
        streams[f"{index}.fb"] = _segment_stream(fb, base, None, labels, trace, False)
        base += len(fb.sizes)
        if opt is not None:
            streams[f"{index}.opt"] = _segment_stream(opt, base, fb_base, labels, trace, True)
            base += len(opt.sizes)
        streams[f"{index}.shape"] = [(None, ("shape", shape, opt is not None))]
    return streams


def _segment_stream(
    seg: Segment,
    base: int,
    fb_base: int | None,
    labels: Labels,
    trace: StepTrace,
    optimizer: bool,
) -> list[Item]:
    contexts = _segment_contexts(seg, labels, trace, optimizer)
    swept: dict[int, int] = {}  # position -> group: frees outside the layers that sweep them
    swept_to = 0  # the run of frees examined last ends here
    items: list[Item] = []
    sticky: int | None = None  # the previous event's group (optimizer step)
    last = labels.groups - 1
    for position, (kind, ref) in enumerate(seg.events):
        if kind == ALLOC:
            if optimizer:
                origin = seg.origins[ref]
                owner = seg.params[ref] if seg.params[ref] >= 0 else origin
                context = labels.param_group[owner] if owner >= 0 else sticky
            else:
                context = contexts[position]
            labels.add_alloc(context)
            formula = seg.formulas[ref]
            token: Any = (
                "alloc",
                seg.sizes[ref],
                seg.categories[ref],
                seg.ops[ref],
                seg.shapes[ref],
                seg.itemsizes[ref],
                None if formula is None else NamedFormula(formula),
                labels.param_ref(seg.params[ref], context),
                labels.param_ref(seg.origins[ref], context),
            )
        elif kind in (FREE, FREE_PREV, FREE_RES):
            if kind == FREE_PREV and fb_base is None:
                raise NotRepeating("a forward/backward frees an earlier segment")
            target = _free_target(kind, ref, base, fb_base)
            if target >= len(labels.alloc_group):
                raise NotRepeating("a free before its allocation")
            if not optimizer and contexts[position] is None and position >= swept_to:
                found, swept_to = _free_sweep(seg, position, contexts, base, labels)
                swept |= found
            if optimizer:
                context = labels.alloc_group[target]
                # a for-loop optimizer frees the previous parameter's temporaries while it
                # works on the next one (a reassigned variable): a free of the group before,
                # between two events of this group, goes with this group
                if context != sticky and _precedes(context, sticky, last):
                    following = _next_group(seg, position + 1, base, fb_base, labels)
                    if following == sticky:
                        context = sticky
            else:
                context = swept.get(position, contexts[position])
            token = (kind, labels.alloc_ref(target, context))
        elif kind == BLOCK:
            context = contexts[position] if not optimizer else sticky
            token = ("mark-block", ref % 4, labels.block_ref(ref // 4, context))
        else:
            context = contexts[position] if not optimizer else None
            token = ("mark", kind, ref)
        if optimizer:
            # an allocation no parameter explains (a scalar) goes with the event before it
            sticky = context
        labels.follow(context)
        items.append((context, token))
    labels.from_end = False
    return items


_UNKNOWN = object()


def _free_target(kind: int, ref: int, base: int, fb_base: int | None) -> int:
    """The global id a free event releases: a local of this segment (FREE), of the step's
    forward/backward (FREE_PREV), or a resident (FREE_RES, already global)."""
    if kind == FREE:
        return base + ref
    if kind == FREE_PREV:
        return (fb_base or 0) + ref
    return ref


def _free_sweep(
    seg: Segment, start: int, contexts: list[int | None], base: int, labels: Labels
) -> tuple[dict[int, int], int]:
    """Frees outside the layers that release something of every layer in order (autocast's
    cache of weight copies, emptied as the forward ends): each goes with its layer's group.

    Looks at the run of frees outside the layers that starts at ``start``; returns the positions
    of the sweep in it (with their groups), if there is one, and where the run ends.
    """
    run: list[tuple[int, int | None]] = []
    position = start
    while (
        position < len(seg.events)
        and seg.events[position][0] in (FREE, FREE_RES)
        and contexts[position] is None
    ):
        kind, ref = seg.events[position]
        target = _free_target(kind, ref, base, None)
        run.append(
            (position, labels.alloc_group[target] if target < len(labels.alloc_group) else None)
        )
        position += 1
    last = labels.groups - 1
    for i, (_, first) in enumerate(run):
        if first not in (0, last) or (i and run[i - 1][1] == first):
            continue
        for step in (1, -1):
            expected, j = first, i
            while (
                j < len(run) and run[j][1] is not None and run[j][1] in (expected, expected + step)
            ):
                expected = run[j][1]  # type: ignore[assignment]
                j += 1
            if expected == (last if step == 1 else 0) and expected != first:
                return {p: g for p, g in run[i:j] if g is not None}, position
    return {}, position


def _precedes(group: int | None, context: int | None, last: int) -> bool:
    """Whether ``group`` comes right before ``context`` in a sweep up the layers."""
    if context is None:
        return group == last
    if group is None:
        return context == 0
    return group == context - 1


def _next_group(seg: Segment, position: int, base: int, fb_base: int | None, labels: Labels) -> Any:
    """The group of the optimizer event at ``position`` as far as it is known before labelling."""
    if position >= len(seg.events):
        return _UNKNOWN
    kind, ref = seg.events[position]
    if kind == ALLOC:
        owner = seg.params[ref] if seg.params[ref] >= 0 else seg.origins[ref]
        return labels.param_group[owner] if owner >= 0 else _UNKNOWN
    if kind in (FREE, FREE_PREV, FREE_RES):
        target = _free_target(kind, ref, base, fb_base)
        return labels.alloc_group[target] if target < len(labels.alloc_group) else _UNKNOWN
    return None


def allocs_through(trace: StepTrace, steps: int) -> int:
    """How many allocations the trace holds up to the end of its first ``steps`` steps."""
    n = len(trace.initial)
    for _, fb, opt in trace.steps[:steps]:
        n += len(fb.sizes) + (len(opt.sizes) if opt is not None else 0)
    return n
