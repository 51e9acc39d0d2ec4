"""Pictures of a run and of an estimate (matplotlib, drawn off-screen).

Every function returns a ``matplotlib.figure.Figure`` built without pyplot: no global figure
state, no window, the Agg renderer whatever backend the caller's session uses. Event markers are
``Line2D`` objects whose ``gid`` names the event type (``"oom"``, ``"backoff"``, ``"grow"``,
``"probe"``, ``"resume"``, ``"stop"``) and whose x data are the events' steps, so a test (or a
notebook) can ask the figure where it drew them. The OOM markers are drawn in data units, at the
bytes the failed allocation would have brought the step to (:func:`oom_bytes`), where the
error's message says.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import UsageError
from memfit.extras import missing_line
from memfit.report.oom_message import parse_oom
from memfit.units import format_bytes

try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError:  # pragma: no cover - matplotlib is in memfit[all]
    Figure = None  # type: ignore[assignment,misc]
if TYPE_CHECKING:
    from matplotlib.axes import Axes

# the estimate's categories, bottom to top of the stacked bar, with fixed colours
CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "transient",
    "allocator_overhead",
    "runtime_overhead",
)
_CATEGORY_COLOURS = {
    "parameters": "#4c72b0",
    "buffers": "#8da0cb",
    "gradients": "#55a868",
    "optimizer_state": "#c9a227",
    "activations": "#dd8452",
    "transient": "#e5ae8a",
    "allocator_overhead": "#8c8c8c",
    "runtime_overhead": "#b3b3b3",
}
# event type -> (colour, marker, label); OOM red, back-off orange, grow green, probe purple
EVENT_STYLES = {
    "oom": ("#d62728", "X", "OOM"),
    "backoff": ("#ff7f0e", "v", "back-off"),
    "grow": ("#2ca02c", "^", "grow"),
    "probe": ("#9467bd", "D", "probe (step 0)"),
    "resume": ("#7f7f7f", "o", "resume"),
    "stop": ("#000000", "s", "stop"),
}


def _require_matplotlib() -> None:
    if Figure is None:
        raise UsageError(missing_line("matplotlib", "memfit report (and --plot)"))


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit an axis whose largest value is ``largest`` bytes reads best in."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def train_lines(metrics: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The optimizer-step lines of metrics.jsonl (eval lines carry ``eval_*`` keys, no loss)."""
    return [m for m in metrics if "step" in m and ("loss" in m or "peak_bytes" in m)]


def eval_lines(metrics: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The eval lines of metrics.jsonl: those with an ``eval_<metric>`` key."""
    return [m for m in metrics if "step" in m and any(k.startswith("eval_") for k in m)]


# a figure beyond this is placed nowhere on an axis (matplotlib's ticks overflow near a float's
# largest, and a loss or perplexity may be any float): drawn as inf is, not at all
_DRAWN = 1e300


def _series(lines: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [
        (float(m["step"]), _drawn(float(m[key])))
        for m in lines
        if isinstance(m.get(key), int | float) and not isinstance(m.get(key), bool)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _drawn(value: float) -> float:
    """``value``, or ±inf past :data:`_DRAWN` (NaN stays NaN)."""
    return math.copysign(math.inf, value) if math.isfinite(value) and abs(value) > _DRAWN else value


def _last(lines: Sequence[Mapping[str, Any]], key: str) -> float:
    """The last figure of ``key`` as written (a legend's "last", never the drawn ±inf)."""
    values = [
        m[key]
        for m in lines
        if isinstance(m.get(key), int | float) and not isinstance(m.get(key), bool)
    ]
    return float(values[-1])


def _event_label(event: Mapping[str, Any]) -> str:
    kind = event.get("type")
    if kind == "oom" and event.get("phase") == "optimizer":
        return "OOM in the optimizer step"
    if kind == "oom":
        size = event.get("micro_batch_size")
        tokens = event.get("max_tokens")
        where = f" (rank {event['rank']})" if event.get("rank") is not None else ""
        return f"OOM mb {size}" + (f", {tokens} tok" if tokens else "") + where
    if kind in ("backoff", "grow"):
        if "cure" in event:
            return str(event["cure"])
        if "max_tokens_from" in event:
            return f"budget {event.get('max_tokens_from')}→{event.get('max_tokens_to')} tok"
        return f"mb {event.get('from')}→{event.get('to')}"
    if kind == "probe":
        return f"probe mb {event.get('micro_batch_size')}"
    return str(kind)


def _step_label(kind: str, found: Sequence[Mapping[str, Any]]) -> str:
    """One label for the events of one kind at one step: ``OOM at mb 8, 4``, ``mb 8→4→2``
    (``mini-batch 32→16`` where the guard lowered GradCache's mini-batch)."""
    unit = "mini-batch" if any(e.get("what") == "mini_batch" for e in found) else "mb"
    if kind == "oom" and all("max_tokens" not in e and "phase" not in e for e in found):
        label = f"OOM at {unit} " + ", ".join(str(e.get("micro_batch_size")) for e in found)
        ranks = sorted({e["rank"] for e in found if e.get("rank") is not None})
        return label + (f" (rank {', '.join(map(str, ranks))})" if ranks else "")
    if kind == "backoff" and all(
        "from" in e and "to" in e and "max_tokens_from" not in e for e in found
    ):
        chain = [found[0]["from"]] + [e["to"] for e in found]
        return f"back-off {unit} " + "→".join(str(x) for x in chain)
    texts = [_event_label(e) for e in found]
    return texts[0] + (f" (+{len(texts) - 1})" if len(texts) > 1 else "")


def memory_plot(
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]] = (),
    budget: int | None = None,
    *,
    budget_label: str = "budget",
    peak_label: str = "measured peak",
) -> Figure:
    """Peak memory per optimizer step, the budget line, and OOM / back-off / grow / probe events.

    Below it, the micro-batch size per step, where a back-off shows as a drop. Optional keys
    (``reserved_bytes``, ``forward_peak_bytes``, ``backward_peak_bytes``,
    ``optimizer_peak_bytes``) are drawn when the metrics have them. ``peak_label`` names what
    ``peak_bytes`` counts on the run's device (``"peak: CUDA allocated"``). The legends sit
    outside the axes, so no marker hides behind them.
    """
    _require_matplotlib()
    steps = train_lines(metrics)
    fig = Figure(figsize=(11, 6.2), layout="constrained")
    memory_ax, batch_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    # events: a vertical line at each step, one marker per event type, labelled
    by_type: dict[str, list[Mapping[str, Any]]] = {}
    for event in events:
        if event.get("type") in EVENT_STYLES and isinstance(event.get("step"), int):
            by_type.setdefault(str(event["type"]), []).append(event)
    failed = [size for e in by_type.get("oom", []) if (size := oom_bytes(e)) is not None]
    size = _draw_memory(memory_ax, steps, budget, budget_label, peak_label, failed)
    event_steps = [int(e["step"]) for found in by_type.values() for e in found]
    all_steps = [float(m["step"]) for m in steps] + event_steps
    if all_steps:
        low, high = min(all_steps), max(all_steps)
        pad = max(0.5, (high - low) * 0.03)
        memory_ax.set_xlim(low - pad, high + pad)
    _draw_events(memory_ax, by_type, size)
    if memory_ax.get_legend_handles_labels()[0]:
        memory_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _draw_micro_batch(batch_ax, steps, by_type)
    return fig


def oom_bytes(event: Mapping[str, Any]) -> int | None:
    """The bytes an out-of-memory event's failed allocation would have brought the step to, as
    its error's message says: the cap's "tried to hold X"; CUDA's (and MPS's) allocated bytes
    plus the "Tried to allocate" request. None where the message does not say (the CPU
    allocator gives the request alone, which is not a total)."""
    report = parse_oom(str(event.get("error") or ""))
    if report is None:
        return None
    if report.kind == "memfit-cap":
        return report.allocated_bytes
    if report.allocated_bytes is None or report.requested_bytes is None:
        return None
    if report.kind in ("cuda-new", "cuda-old", "mps"):
        return report.allocated_bytes + report.requested_bytes
    return None


def _draw_memory(
    memory_ax: Axes,
    steps: Sequence[Mapping[str, Any]],
    budget: int | None,
    budget_label: str,
    peak_label: str,
    failed: Sequence[int] = (),
) -> int:
    """The memory curves of each step and the budget line; returns the axis' unit in bytes.

    The axis reaches the failed allocations' sizes too, and leaves a band above the data for
    the guard's event markers."""
    curves = [
        ("peak_bytes", peak_label, "#1f77b4", "-", 2.0),
        ("reserved_bytes", "peak reserved (CUDA)", "#17becf", "-", 1.5),
        ("forward_peak_bytes", "forward peak", "#aec7e8", "--", 1.0),
        ("backward_peak_bytes", "backward peak", "#98df8a", "--", 1.0),
        ("optimizer_peak_bytes", "optimizer peak", "#c5b0d5", "--", 1.0),
    ]
    drawn = {key: _series(steps, key) for key, *_ in curves}
    values = [v for _, ys in drawn.values() for v in ys] + ([budget] if budget else [])
    values += [float(v) for v in failed]
    unit, size = byte_unit(max(values, default=0))
    for key, label, colour, style, width in curves:
        xs, ys = drawn[key]
        if not xs:
            continue
        marker = "o" if len(xs) <= 40 else None
        memory_ax.plot(
            xs,
            [y / size for y in ys],
            style,
            color=colour,
            lw=width,
            marker=marker,
            ms=3,
            label=label,
            gid=f"memory:{key}",
        )
    if budget:
        memory_ax.axhline(
            budget / size,
            color="#d62728",
            ls="--",
            lw=1.5,
            label=f"{budget_label} {format_bytes(budget)}",
            gid="budget",
        )
    if not steps:
        memory_ax.text(
            0.5, 0.5, "no optimizer steps logged", ha="center", transform=memory_ax.transAxes
        )
    memory_ax.set_ylabel(f"memory ({unit})")
    # the data stays under 3/4 of the height: the band above is the guard's event markers'
    memory_ax.set_ylim(bottom=0, top=max(values, default=1) / size * 1.35 or 1)
    memory_ax.grid(alpha=0.3)
    memory_ax.set_title("Memory per optimizer step")
    return size


# in axes fractions: the band above the data for the guard's events, the bottom for resume and
# stop; an OOM whose message gives no size goes to the top of the band
_EVENT_HEIGHTS = {
    "oom": 0.95,
    "backoff": 0.88,
    "grow": 0.88,
    "probe": 0.81,
    "resume": 0.05,
    "stop": 0.05,
}


def _draw_events(
    memory_ax: Axes, by_type: Mapping[str, Sequence[Mapping[str, Any]]], size: int = 1
) -> None:
    """A vertical line at each event's step and one marker per step and event type, labelled;
    an OOM's marker at the size its failed allocation would have reached (``size``: the
    axis' unit in bytes), drawn over the curves."""
    top = memory_ax.get_ylim()[1]
    for kind, found in by_type.items():
        colour, marker, label = EVENT_STYLES[kind]
        at = sorted({int(e["step"]) for e in found})
        for step in at:
            memory_ax.axvline(
                step, color=colour, lw=1.2 if kind == "oom" else 0.8, ls=":", alpha=0.8
            )
        failed: dict[int, int | None] = {}
        if kind == "oom":
            # data units: the largest failed allocation at each step, else the top of the band
            for step in at:
                known = [b for e in found if e["step"] == step if (b := oom_bytes(e)) is not None]
                failed[step] = max(known, default=None)
            ys = [top * _EVENT_HEIGHTS[kind] if (b := failed[s]) is None else b / size for s in at]
            transform = memory_ax.transData
        else:
            ys = [_EVENT_HEIGHTS[kind]] * len(at)
            transform = memory_ax.get_xaxis_transform()
        memory_ax.plot(
            at,
            ys,
            linestyle="none",
            marker=marker,
            ms=11 if kind == "oom" else 8,
            color=colour,
            markeredgecolor="black" if kind in ("oom", "stop") else colour,
            transform=transform,
            label=f"{label} ({len(found)})",
            gid=kind,
            zorder=6,  # over the curves, the budget line and the grid
            clip_on=False,
        )
        if kind in ("oom", "backoff", "probe"):
            for step, y in list(zip(at, ys, strict=True))[:12]:  # a run with many keeps the first
                text = _step_label(kind, [e for e in found if e["step"] == step])
                if kind == "oom":
                    failed_bytes = failed[step]
                    text += (
                        " (size not in its message)"
                        if failed_bytes is None
                        else f": would have held {format_bytes(failed_bytes)}"
                    )
                # in the right half the label goes left of its marker, inside the axes
                low, high = memory_ax.get_xlim()
                right = high > low and (step - low) / (high - low) > 0.5
                memory_ax.annotate(
                    text,
                    (step, y),
                    xycoords=transform,
                    xytext=(-9 if right else 7, 4 if kind == "oom" else -3),
                    ha="right" if right else "left",
                    textcoords="offset points",
                    fontsize=8,
                    color=colour,
                    fontweight="bold" if kind == "oom" else "normal",
                    zorder=6,
                )


def _draw_micro_batch(
    batch_ax: Axes,
    steps: Sequence[Mapping[str, Any]],
    by_type: Mapping[str, Sequence[Mapping[str, Any]]],
) -> None:
    """The micro-batch size per step, the events' steps, and the micro-batches that ran out
    (the GradCache mini-batch where the loss takes the whole step: in-batch negatives)."""
    mini = any(r.get("what") == "mini_batch" for r in [*steps, *by_type.get("oom", [])])
    unit = "GradCache mini-batch" if mini else "micro-batch"
    xs, ys = _series(steps, "micro_batch_size")
    if xs:
        batch_ax.step(
            xs, ys, where="mid", color="#444444", label=f"{unit} size", gid="micro_batch_size"
        )
        batch_ax.set_ylim(bottom=0, top=max(ys) * 1.25)
    for kind in ("oom", "backoff", "grow"):
        for step in sorted({int(e["step"]) for e in by_type.get(kind, [])}):
            batch_ax.axvline(step, color=EVENT_STYLES[kind][0], lw=0.8, ls=":")
    # the micro-batch sizes that ran out of memory, where they were tried
    tried = [
        (int(e["step"]), float(e["micro_batch_size"]))
        for e in by_type.get("oom", [])
        if isinstance(e.get("micro_batch_size"), int | float)
    ]
    if tried:
        batch_ax.plot(
            [t[0] for t in tried],
            [t[1] for t in tried],
            linestyle="none",
            marker="X",
            color=EVENT_STYLES["oom"][0],
            markeredgecolor="black",
            label=f"{unit} that ran out of memory",
            gid="oom:micro_batch_size",
        )
        batch_ax.set_ylim(bottom=0, top=max([*ys, *(t[1] for t in tried)]) * 1.25)
    if xs or tried:
        batch_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    batch_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    batch_ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    batch_ax.set_ylabel("mini-batch" if mini else "micro-batch")
    batch_ax.set_xlabel("optimizer step (0: the probe)" if "probe" in by_type else "optimizer step")
    batch_ax.grid(alpha=0.3)


def breakdown_plot(
    breakdown: Mapping[str, int] | None,
    measured_peak: int | None = None,
    *,
    reserved_peak: int | None = None,
    budget: int | None = None,
    title: str | None = None,
    note: str | None = None,
    measured_label: str = "measured peak",
    comparable: tuple[str, int] | None = None,
    budget_label: str = "budget",
) -> Figure:
    """The estimate's breakdown as a stacked bar, beside the measured peak (when there is one).

    ``breakdown`` None (no estimate) draws the measured bars alone, with ``note`` saying why.
    ``measured_label`` names what the measured bar counts (``"measured peak\n(process RSS)"``);
    ``comparable`` (label, bytes) marks on the estimate's bar the part of it the measurement
    counts (on CUDA: the allocated peak, below the reserved bytes and the context).
    """
    _require_matplotlib()
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.subplots()
    parts = {k: int(v) for k, v in (breakdown or {}).items() if int(v) > 0}
    order = [k for k in CATEGORIES if k in parts] + sorted(k for k in parts if k not in CATEGORIES)
    heights = [sum(parts.values()), measured_peak or 0, reserved_peak or 0, budget or 0]
    unit, size = byte_unit(max(heights))
    labels: list[str] = []
    if breakdown is not None:
        total = sum(parts.values())
        bottom = 0.0
        x = len(labels)
        for name in order:
            value = parts[name]
            ax.bar(
                x,
                value / size,
                bottom=bottom,
                width=0.6,
                color=_CATEGORY_COLOURS.get(name, "#cccccc"),
                edgecolor="white",
                label=f"{name.replace('_', ' ')} {format_bytes(value)}",
                gid=f"estimate:{name}",
            )
            if total and value / total >= 0.05:
                ax.text(
                    x,
                    (bottom + value / size / 2),
                    format_bytes(value),
                    ha="center",
                    va="center",
                    fontsize=8,
                )
            bottom += value / size
        ax.text(x, bottom, f"{format_bytes(total)}\n", ha="center", va="bottom", fontsize=9)
        if comparable is not None:
            name, value = comparable
            ax.plot(
                [x - 0.38, x + 0.38],
                [value / size] * 2,
                color="black",
                lw=2,
                ls="-.",
                label=f"{name} {format_bytes(value)}",
                gid="estimate:comparable",
                zorder=4,
            )
        labels.append("estimate")
    for measured, name, colour in (
        (measured_peak, "measured peak", "#1f77b4"),
        (reserved_peak, "measured reserved", "#17becf"),
    ):
        if measured is None:
            continue
        bar_label = measured_label if name == "measured peak" else f"{name}\n(CUDA)"
        x = len(labels)
        ax.bar(
            x,
            measured / size,
            width=0.6,
            color=colour,
            gid=name,
            label=f"{bar_label.replace(chr(10), ' ')} {format_bytes(measured)}",
        )
        ax.text(
            x, measured / size, f"{format_bytes(measured)}\n", ha="center", va="bottom", fontsize=9
        )
        labels.append(bar_label)
    if budget:
        ax.axhline(
            budget / size,
            color="#d62728",
            ls="--",
            lw=1.5,
            label=f"{budget_label} {format_bytes(budget)}",
            gid="budget",
        )
    if not labels:
        labels.append("(nothing measured)")
        ax.bar(0, 0)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.7, max(len(labels), 2) - 0.3)
    ax.set_ylim(0, max(max(heights), 1) / size * 1.2)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title or "Estimated breakdown and measured peak")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if note:
        ax.set_xlabel(note, fontsize=8, color="#555555", wrap=True)
    return fig


# the eval scores' styles, in turn: each its own marker, size and line, the later ones hollow,
# so a score equal to another (accuracy and macro-F1 on a balanced set) still shows under it
_SCORE_STYLES = (
    ("o", 9, "-", "full"),
    ("s", 6, "--", "none"),
    ("^", 7, ":", "none"),
    ("D", 5, "-.", "none"),
    ("v", 7, (0, (5, 1)), "none"),
    ("P", 7, (0, (1, 3)), "none"),
)


def eval_scores(metrics: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """The eval keys split by axis: scores that stay within 0…1 (accuracy, F1, retrieval
    accuracy), and the rest (perplexity, and anything else unbounded); ``eval_loss`` is in
    neither: it is drawn with the training loss."""
    lines = eval_lines(metrics)
    found = {k for m in lines for k in m if k.startswith("eval_")}
    # the sentence-embedding eval logs its accuracy@1 also as retrieval_accuracy (the key older
    # runs have): drawn once
    same = {"eval_retrieval_accuracy"} if "eval_accuracy@1" in found else set()
    keys = sorted(found - {"eval_loss"} - same)
    scores: list[str] = []
    others: list[str] = []
    for key in keys:
        _, ys = _series(lines, key)
        if not ys:
            continue  # null in every line that has it: nothing to draw
        (scores if all(0.0 <= y <= 1.0 for y in ys) else others).append(key)
    return scores, others


def training_plot(metrics: Sequence[Mapping[str, Any]]) -> Figure:
    """Loss (training and eval), eval scores and throughput over optimizer steps (a panel each).

    Eval loss shares the training loss' axis (the same quantity), never the 0…1 scores'; an eval
    metric outside 0…1 (perplexity) gets a right-hand axis of its own on the scores' panel.
    """
    _require_matplotlib()
    steps = train_lines(metrics)
    evals = eval_lines(metrics)
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    loss_ax, eval_ax, speed_ax = fig.subplots(3, 1, sharex=True)

    xs, ys = _series(steps, "loss")
    if xs:
        loss_ax.plot(
            xs,
            ys,
            color="#1f77b4",
            marker="o" if len(xs) <= 40 else None,
            ms=3,
            label="training loss",
            gid="loss",
        )
    ex, ey = _series(evals, "eval_loss")
    if ex:
        loss_ax.plot(
            ex, ey, color="#d62728", ls="--", marker="s", ms=6, label="eval loss", gid="eval_loss"
        )
    if xs or ex:
        loss_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        loss_ax.text(0.5, 0.5, "no loss logged", ha="center", transform=loss_ax.transAxes)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("Training")
    loss_ax.grid(alpha=0.3)
    _draw_eval(eval_ax, evals)

    xs, ys = _series(steps, "samples_per_second")
    if xs:
        speed_ax.plot(xs, ys, color="#2ca02c", label="samples/s", gid="samples_per_second")
        speed_ax.set_ylabel("samples / s")
        tokens = [
            (float(m["step"]), float(m["tokens"]) / float(m["seconds"]))
            for m in steps
            if isinstance(m.get("tokens"), int | float) and m.get("seconds")
        ]
        token_ax = speed_ax.twinx() if tokens else None
        if token_ax is not None:
            token_ax.plot(
                [t[0] for t in tokens],
                [t[1] for t in tokens],
                color="#8c564b",
                ls="--",
                label="tokens/s",
                gid="tokens_per_second",
            )
            token_ax.set_ylabel("tokens / s (real, no padding)")
        # one legend for both axes, clear of the right-hand axis' labels
        handles = speed_ax.get_lines() + (token_ax.get_lines() if token_ax is not None else [])
        speed_ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.08 if tokens else 1.01, 1.0),
            fontsize=8,
        )
    else:
        speed_ax.text(0.5, 0.5, "no throughput logged", ha="center", transform=speed_ax.transAxes)
    speed_ax.set_xlabel("optimizer step")
    speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    speed_ax.grid(alpha=0.3)
    return fig


def _draw_eval(eval_ax: Axes, evals: Sequence[Mapping[str, Any]]) -> None:
    """The eval scores on a 0…1 axis, each in its own style; other eval metrics on a second."""
    scores, others = eval_scores(evals)
    if not scores and not others:
        eval_ax.text(0.5, 0.5, "no eval in this run", ha="center", transform=eval_ax.transAxes)
    for index, key in enumerate(scores):
        marker, ms, style, fill = _SCORE_STYLES[index % len(_SCORE_STYLES)]
        ex, ey = _series(evals, key)
        eval_ax.plot(
            ex,
            ey,
            ls=style,
            marker=marker,
            ms=ms,
            fillstyle=fill,
            mew=1.5,
            label=f"{key.removeprefix('eval_')} (last {_last(evals, key):.3f})",
            gid=key,
            zorder=3 + index,  # the later (hollow, smaller) markers on top
        )
    eval_ax.set_ylabel("eval score (0–1)")
    if scores:
        eval_ax.set_ylim(-0.03, 1.03)
    eval_ax.grid(alpha=0.3)
    handles, labels = eval_ax.get_legend_handles_labels()
    if others:
        other_ax = eval_ax.twinx()
        for index, key in enumerate(others):
            ex, ey = _series(evals, key)
            other_ax.plot(
                ex,
                ey,
                color="#8c564b",
                ls="--",
                marker="xP*"[index % 3],
                ms=7,
                label=f"{key.removeprefix('eval_')} (last {_last(evals, key):.3g}, right axis)",
                gid=key,
            )
        other_ax.set_ylabel(", ".join(k.removeprefix("eval_") for k in others))
        more_handles, more_labels = other_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        beside = 1.08 if others else 1.01  # clear of the right-hand axis' labels
        eval_ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(beside, 1.0), fontsize=8)


def figure_png(fig: Figure, *, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (the Agg renderer)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to a temporary name beside ``path``, then rename: never half-written."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a report is for reading
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


# each format's writer field names memfit, and memfit knows a picture of its own by those bytes
# (memfit.paths.destination_problems: a later --plot replaces it without --overwrite)
PLOT_METADATA = {
    "png": {"Software": "memfit"},
    "svg": {"Creator": "memfit"},
    "pdf": {"Creator": "memfit"},
}
PLOT_MARKS = (b"tEXtSoftware\x00memfit", b"<dc:title>memfit</dc:title>", b"/Creator (memfit)")


def save_figure(fig: Figure, path: str | os.PathLike[str], *, flag: str = "FILE") -> Path:
    """Save as PNG, SVG or PDF (by the suffix), atomically; a missing folder is a usage error."""
    target = Path(path)
    formats = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
    fmt = formats.get(target.suffix.lower())
    if fmt is None:
        raise UsageError(f"{flag}: {target} must end in .png, .svg or .pdf")
    if not target.parent.is_dir():
        raise UsageError(f"{flag}: the folder {target.parent} does not exist; create it first")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=100, metadata=PLOT_METADATA[fmt])
    return write_atomic(target, buffer.getvalue())
