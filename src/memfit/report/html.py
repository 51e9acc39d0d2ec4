"""``memfit report RUN_DIR``: one self-contained HTML page about a run, and its plots as PNG files.

The page carries everything inside it (inline CSS, the plots as base64 data URIs): it can be
mailed, attached to an issue or opened offline. The PNG files beside it are the same bytes.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.report import plots, run_files
from memfit.report.console import PART_LABELS
from memfit.report.events import agreed_events
from memfit.report.plots import train_lines
from memfit.report.run_files import MAX_BYTES
from memfit.report.shapes import positive_int, run_width
from memfit.units import format_bytes

PLOTS = ("memory.png", "breakdown.png", "training.png")
# events listed in the page's table (checkpoints and evals are routine: counted, not listed)
_LISTED_EVENTS = ("probe", "oom", "backoff", "grow", "resume", "stop")


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run folder's metrics, events and run.json, every field the page reads checked
    (:mod:`memfit.report.run_files`): lines that are not what memfit train writes are skipped,
    and ``notes`` names each file and line left out; a usage error if it is not a run folder."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise UsageError(
            f"RUN_DIR: {folder} is not a folder (give the --output-dir of memfit train)"
        )
    metrics_file = folder / "metrics.jsonl"
    if not metrics_file.is_file():
        raise UsageError(
            f"RUN_DIR: {folder} has no metrics.jsonl; is it the --output-dir of a memfit train run?"
        )
    notes: list[str] = []
    found = run_files.read_jsonl(metrics_file, "metrics")
    metrics, skipped = found.rows, len(found.bad)
    if found.bad:
        notes.append(run_files.skipped_note(metrics_file, found.bad))
    events: list[dict[str, Any]] = []
    if (folder / "events.jsonl").is_file():
        found = run_files.read_jsonl(folder / "events.jsonl", "events")
        # several ranks log each agreed back-off once each: keep one
        events, skipped = agreed_events(found.rows), skipped + len(found.bad)
        if found.bad:
            notes.append(run_files.skipped_note(folder / "events.jsonl", found.bad))
    run: dict[str, Any] = {}
    if (folder / "run.json").is_file():
        try:
            run, run_notes = run_files.read_run_json(folder / "run.json")
        except (ValueError, UnicodeDecodeError) as exc:
            raise UsageError(f"RUN_DIR: {folder / 'run.json'} is not JSON: {exc}") from None
        notes += run_notes
    return {
        "folder": folder,
        "metrics": metrics,
        "events": events,
        "run": run,
        "skipped_lines": skipped,
        "notes": notes,
    }


def budget_of(run: Mapping[str, Any]) -> tuple[int | None, str]:
    """The budget line: the memory cap, else the GPU memory given, else the plan's budget."""
    config = run.get("config") or {}
    for key, label in (("memory_cap", "memory cap"), ("gpu_memory", "GPU memory")):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, label
    planned = run.get("plan") or {}
    for holder in (planned, planned.get("plan") or {}):
        if isinstance(holder, Mapping):
            value = holder.get("budget_bytes")
            if isinstance(value, int) and value > 0:
                return value, "plan budget"
    return None, ""


@dataclass(frozen=True)
class Measure:
    """What metrics.jsonl's ``peak_bytes`` counts on the run's device (see
    :class:`memfit.train.memory.PeakMemory`)."""

    kind: str  # "cuda-allocated" | "cap-live-tensors" | "process-rss"
    name: str  # short, for cards, legends and bar labels
    counts: str  # what it counts and how memfit train reads it, one clause


MEASURES = {
    "cuda-allocated": Measure(
        "cuda-allocated",
        "CUDA allocated",
        "the bytes PyTorch's CUDA allocator had handed to tensors at the step's height "
        "(torch.cuda.max_memory_allocated); not the allocator's cached free blocks, not the "
        "CUDA context",
    ),
    "cap-live-tensors": Measure(
        "cap-live-tensors",
        "live tensors, memory cap",
        "the bytes of tensor storage alive at once, as --memory-cap counts them",
    ),
    "process-rss": Measure(
        "process-rss",
        "process RSS",
        "the CPU process's peak resident memory (VmHWM): the Python interpreter, PyTorch and "
        "the other libraries, the data, the tokenizer and the allocator's caches, besides the "
        "tensors",
    ),
}


def measure_of(run: Mapping[str, Any]) -> Measure:
    """What the run's ``peak_bytes`` are: CUDA allocated bytes, the CPU cap's live tensor bytes,
    or the CPU process's peak RSS (a CPU run without ``--memory-cap``)."""
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    device = str(resolved.get("device") or config.get("device") or "cpu")
    if device.startswith("cuda"):
        return MEASURES["cuda-allocated"]
    cap = config.get("memory_cap")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
        return MEASURES["cap-live-tensors"]
    return MEASURES["process-rss"]


@dataclass(frozen=True)
class RunShapes:
    """The largest step the run fed: its micro-batch's rows and padded width, and where each
    figure was read (in words, for the page)."""

    micro_batch_size: int
    seq_len: int
    gradient_accumulation_steps: int
    batch_source: str
    seq_source: str


def run_shapes(
    run: Mapping[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> RunShapes:
    """The shapes of the largest micro-batch the run fed: the most rows its steps ran with
    (no more than the data holds) at the padded width of the micro-batch holding the longest
    row (run.json's ``resolved.seq_len``; older run folders: the probe's longest row, then
    ``--max-seq-len``)."""
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    width = run_width(run, events, metrics)
    row = f" (its longest row: {width.longest_tokens} tokens)" if width.longest_tokens else ""
    seq_len, seq_source = width.seq_len, f"{width.seq_len} tokens: {width.source}{row}"
    steps = train_lines(metrics)
    ran = [(m, size) for m in steps if (size := positive_int(m.get("micro_batch_size")))]
    if ran:
        batch = max(size for _, size in ran)
        accumulation = max(
            positive_int(m.get("gradient_accumulation_steps")) or 1
            for m, size in ran
            if size == batch
        )
        batch_source = f"micro-batch {batch}: the largest the logged steps ran"
    else:
        batch = (
            positive_int(resolved.get("micro_batch_size"))
            or positive_int(config.get("micro_batch_size"))
            or positive_int(config.get("effective_batch_size"))
            or 1
        )
        accumulation = 1
        batch_source = f"micro-batch {batch}: run.json's (no step logged)"
    rows = positive_int(resolved.get("train_rows"))
    world = positive_int(resolved.get("world_size")) or 1
    if rows and batch > -(-rows // world):
        batch = -(-rows // world)
        batch_source = f"micro-batch {batch}: all the data's {rows} rows" + (
            f" over {world} ranks" if world > 1 else ""
        )
    return RunShapes(batch, seq_len, accumulation, batch_source, seq_source)


def run_estimate(
    run: Mapping[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any] | None, str]:
    """The estimate at the shapes the run fed (:func:`run_shapes`): (``{"total_bytes",
    "breakdown", "allocated_peak_bytes", "reserved_peak_bytes"}``, note).

    run.json's own ``estimate`` wins; else ``memfit.estimate`` is asked, and a failure becomes
    the note (the report then shows the measured peak alone).
    """
    stored = run.get("estimate")
    if isinstance(stored, Mapping) and isinstance(stored.get("breakdown"), Mapping):
        return dict(stored), "the estimate memfit train recorded in run.json"
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    model = config.get("model")
    if not model or not config.get("task"):
        return None, "no estimate: run.json does not name the model and task"
    device = "cuda" if str(resolved.get("device", "cpu")).startswith("cuda") else "cpu"
    shapes = run_shapes(run, metrics, events)
    knobs: dict[str, Any] = {
        "task": config["task"],
        "batch_size": shapes.micro_batch_size,
        "seq_len": shapes.seq_len,
        "precision": resolved.get("precision") or "fp32",
        "gradient_checkpointing": bool(resolved.get("gradient_checkpointing")),
        "device": device,
    }
    described = f"micro-batch {shapes.micro_batch_size} × {shapes.seq_len} tokens"
    if config.get("task") == "sentence-embedding" and config.get("loss") == "cached-mnrl":
        # the guard's micro-batch is GradCache's mini-batch; the loss sees the whole batch
        effective = positive_int(config.get("effective_batch_size")) or shapes.micro_batch_size
        whole = -(-effective // int(resolved.get("world_size") or 1))
        knobs |= {"batch_size": max(whole, shapes.micro_batch_size)}
        knobs["mini_batch_size"] = shapes.micro_batch_size
        described = (
            f"batch {knobs['batch_size']} in mini-batches of {shapes.micro_batch_size} × "
            f"{shapes.seq_len} tokens"
        )
    elif shapes.gradient_accumulation_steps > 1:
        knobs["gradient_accumulation_steps"] = shapes.gradient_accumulation_steps
    if config.get("task") == "classification" and config.get("num_labels"):
        knobs["num_labels"] = int(config["num_labels"])
    if config.get("task") == "sentence-embedding" and config.get("loss"):
        knobs["loss"] = config["loss"]
    # the run's own lever settings (its optimizer, attention, LoRA, base weights, ...); the
    # shapes, the batches and what the run resolved are read above and below
    knobs |= run_files.lever_settings(config, skip=run_files.FROM_THE_RUN)
    world = int(resolved.get("world_size") or 1)
    if world > 1:
        # the memory of one rank: sharded as the run was
        knobs["world_size"] = world
        knobs["sharding"] = str(resolved.get("sharding") or "none")
    described += f", {knobs['precision']}, on {device}"
    shapes_note = f" Shapes: {shapes.seq_source}; {shapes.batch_source}."
    try:
        # the estimator loads torch and transformers, which a page from a run's recorded
        # estimate needs not: imported here for start-up time
        from memfit.estimate import estimate

        result = estimate(str(model), **knobs)
    except Exception as exc:  # the report still stands without it: say why, show the measurement
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return None, f"no estimate ({described}): {reason}.{shapes_note}"
    details = result.details or {}
    return {
        "total_bytes": int(result.total_bytes),
        "breakdown": {k: int(v) for k, v in result.breakdown.items()},
        "allocated_peak_bytes": positive_int(details.get("allocated_peak_bytes")),
        "reserved_peak_bytes": positive_int(details.get("reserved_peak_bytes")),
        "micro_batch_size": shapes.micro_batch_size,
        "seq_len": shapes.seq_len,
    }, f"memfit.estimate for {described}.{shapes_note}"


def comparable_estimate(measure: Measure, predicted: Mapping[str, Any]) -> int | None:
    """The estimate's figure that counts what ``measure`` counts; None where none does (RSS)."""
    total = positive_int(predicted.get("total_bytes"))
    if measure.kind == "process-rss" or total is None:
        return None
    if measure.kind == "cap-live-tensors":
        return total  # on the CPU the estimate is the tensors' bytes (page-rounded)
    if allocated := positive_int(predicted.get("allocated_peak_bytes")):
        return allocated
    # a recorded estimate without details: its tensors, without the cache and the context
    parts = predicted.get("breakdown") or {}
    overhead = int(parts.get("allocator_overhead", 0)) + int(parts.get("runtime_overhead", 0))
    return max(0, total - overhead) or None


def _share(measured: int, estimated: int) -> str:
    return f"{measured / estimated:.0%} of the estimate"


def comparison(
    measure: Measure,
    predicted: Mapping[str, Any] | None,
    *,
    measured_like: tuple[int, str] | None,
    budget: tuple[int | None, str] = (None, ""),
) -> str:
    """One paragraph: what the measured peak counts, and whether (and how) it compares with
    the estimate. ``measured_like``: the measured figure at the estimate's shapes and where it
    comes from (``"the steps at micro-batch 32 without an OOM"``)."""
    text = f"Measured peak: {measure.counts}."
    if not predicted:
        return text
    total = int(predicted.get("total_bytes") or 0)
    if measure.kind == "process-rss":
        return (
            f"{text} Not comparable with the estimate ({format_bytes(total)}), which counts only "
            "the tensors of the step, so no ratio is given: the process's own memory is not part "
            "of what the estimate predicts. Train with --memory-cap SIZE (any size above what "
            "the run needs) to measure live tensor bytes as the estimate counts them."
        )
    like = comparable_estimate(measure, predicted)
    if like is None:
        return text
    if measure.kind == "cuda-allocated":
        text += (
            f" Like for like, the estimate's allocated peak is {format_bytes(like)}; its peak "
            f"{format_bytes(total)} adds the allocator's cached free blocks and the CUDA context "
            "(what nvidia-smi shows), which allocated bytes do not count."
        )
    else:
        text += f" The estimate counts the same (tensor bytes): {format_bytes(like)}."
        if budget[0] and budget[1] == "memory cap":
            text += (
                f" No step can measure more than the cap ({format_bytes(budget[0])}): a "
                "micro-batch that needs more runs out of memory instead."
            )
    if measured_like:
        text += (
            f" Measured {format_bytes(measured_like[0])} ({measured_like[1]}): "
            f"{_share(measured_like[0], like)}."
        )
    return text


def measured_at(
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    micro_batch_size: int,
) -> tuple[int, str] | None:
    """The largest peak of the steps that ran ``micro_batch_size`` without an out-of-memory
    error (a step that hit one holds the failed attempt's bytes too), and those steps in words."""
    failed = {e.get("step") for e in events if e.get("type") == "oom"}
    peaks = [
        (int(m["peak_bytes"]), m["step"])
        for m in train_lines(metrics)
        if m.get("micro_batch_size") == micro_batch_size
        and m.get("step") not in failed
        and isinstance(m.get("peak_bytes"), int | float)
    ]
    if not peaks:
        return None
    where = "steps" if len(peaks) > 1 else "step"
    return max(peaks)[0], (
        f"the {where} at micro-batch {micro_batch_size} without an out-of-memory error"
    )


def write_report(
    run_dir: str | os.PathLike[str],
    *,
    estimate: bool = True,
    on_note: Callable[[str], object] | None = None,
) -> Path:
    """Write ``RUN_DIR/report.html`` and ``memory.png``, ``breakdown.png``, ``training.png``.

    ``estimate=False`` skips asking ``memfit.estimate`` (run.json's recorded estimate is still
    shown). ``on_note`` receives each line about what of the run files was left out (the page
    says it too). Returns the path of the page.
    """
    found = read_run(run_dir)
    for note in found["notes"]:
        if on_note is not None:
            on_note(note)
    folder: Path = found["folder"]
    metrics, events, run = found["metrics"], found["events"], found["run"]
    steps = plots.train_lines(metrics)
    budget, budget_label = budget_of(run)
    measure = measure_of(run)
    peaks = [int(m["peak_bytes"]) for m in steps if isinstance(m.get("peak_bytes"), int | float)]
    reserved = [
        int(m["reserved_bytes"]) for m in steps if isinstance(m.get("reserved_bytes"), int | float)
    ]
    measured = max(peaks) if peaks else None
    if estimate or isinstance(run.get("estimate"), Mapping):
        predicted, estimate_note = run_estimate(run, metrics, events)
    else:
        predicted, estimate_note = None, "no estimate: --no-estimate"
    at = positive_int((predicted or {}).get("micro_batch_size"))
    at = at or run_shapes(run, metrics, events).micro_batch_size
    compared = comparison(
        measure,
        predicted,
        measured_like=measured_at(metrics, events, at),
        budget=(budget, budget_label),
    )
    like = comparable_estimate(measure, predicted) if predicted else None
    figures = {
        "memory.png": plots.memory_plot(
            metrics,
            events,
            budget,
            budget_label=budget_label or "budget",
            peak_label=f"peak: {measure.name}",
        ),
        "breakdown.png": plots.breakdown_plot(
            predicted["breakdown"] if predicted else None,
            measured,
            reserved_peak=max(reserved) if reserved else None,
            budget=budget,
            note=estimate_note,
            measured_label=f"measured peak\n({measure.name})",
            comparable=(
                ("estimated allocated", like)
                if like and predicted and like != predicted.get("total_bytes")
                else None
            ),
            title=(
                "Estimated tensors and measured process RSS\n(not comparable: see the report page)"
                if measure.kind == "process-rss" and predicted
                else None
            ),
            budget_label=budget_label or "budget",
        ),
        "training.png": plots.training_plot(metrics),
    }
    images: dict[str, bytes] = {}
    for name, fig in figures.items():
        images[name] = plots.figure_png(fig)
        plots.write_atomic(folder / name, images[name])
    page = render_html(
        folder,
        metrics=metrics,
        events=events,
        run=run,
        images=images,
        budget=(budget, budget_label),
        measured_peak=measured,
        predicted=predicted,
        estimate_note=estimate_note,
        skipped_lines=found["skipped_lines"],
        notes=found["notes"],
        measure=measure,
        comparison_text=compared,
    )
    return plots.write_atomic(folder / "report.html", page.encode("utf-8"))


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; background: #fff; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.oom td { background: #fde0e0; } tr.backoff td { background: #fff0dc; }
img { max-width: 100%; border: 1px solid #eee; }
.summary { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.5em 0.9em; background: #fafafa; }
.card b { display: block; font-size: 1.2em; } .note { color: #555; font-size: 0.9em; }
.compare { border-left: 4px solid #1f77b4; padding: 0.3em 0.8em; background: #f5f9fd; }
code { background: #f3f3f3; padding: 0 0.2em; white-space: nowrap; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _sized(value: Any) -> bool:
    """A whole number of bytes the page can show as a size (not a count beyond any memory)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES


def _cell(key: str, value: Any) -> str:
    if _sized(value) and key.endswith("bytes"):
        return f'<td class="num">{_e(format_bytes(value))} <span class="note">({value:,} B)</span></td>'
    if key in ("memory_cap", "gpu_memory") and _sized(value):
        return f'<td class="num">{_e(format_bytes(value))}</td>'
    if isinstance(value, dict | list):
        return f"<td><code>{_e(json.dumps(value))}</code></td>"
    if value is None:
        return '<td class="note">—</td>'
    return f"<td>{_e(value)}</td>"


def _table(rows: Mapping[str, Any]) -> str:
    if not rows:
        return '<p class="note">(none)</p>'
    body = "".join(f"<tr><th>{_e(k)}</th>{_cell(k, v)}</tr>" for k, v in rows.items())
    return f"<table>{body}</table>"


def _figures_table(rows: Sequence[tuple[str, int, str]]) -> str:
    """The estimate's parts and the measured figures: name, bytes, what each counts."""
    if not rows:
        return '<p class="note">(none)</p>'
    body = "".join(
        f'<tr><th>{_e(name)}</th>{_cell("bytes", value)}<td class="note">{_e(what)}</td></tr>'
        for name, value, what in rows
    )
    return f"<table><tr><th>figure</th><th>size</th><th>what it counts</th></tr>{body}</table>"


def _event_rows(events: Sequence[Mapping[str, Any]]) -> str:
    listed = [e for e in events if e.get("type") in _LISTED_EVENTS]
    if not listed:
        return '<p class="note">No out-of-memory error, back-off or probe in this run.</p>'
    rows = []
    for event in listed:
        details = {k: v for k, v in event.items() if k not in ("type", "step", "time")}
        text = ", ".join(f"{k}: {v}" for k, v in details.items())
        rows.append(
            f'<tr class="{_e(event.get("type"))}"><td>{_e(event.get("type"))}</td>'
            f'<td class="num">{_e(event.get("step", ""))}</td><td>{_e(text)}</td></tr>'
        )
    return (
        "<table><tr><th>event</th><th>step</th><th>details</th></tr>" + "".join(rows) + "</table>"
    )


def _figure(images: Mapping[str, bytes], name: str, alt: str) -> str:
    data = base64.b64encode(images[name]).decode("ascii")
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></p><p class="note">{_e(name)}</p>'


def _estimate_label(measure: Measure) -> str:
    if measure.kind == "cuda-allocated":
        return "estimated peak (reserved + CUDA context)"
    return "estimated peak (tensors)"


def _figure_rows(
    measure: Measure,
    predicted: Mapping[str, Any] | None,
    measured_peak: int | None,
    reserved_peak: int | None,
) -> list[tuple[str, int, str]]:
    """The rows of the estimate-and-measurement table."""
    rows: list[tuple[str, int, str]] = []
    if predicted:
        for part, value in (predicted.get("breakdown") or {}).items():
            what = PART_LABELS.get(part, part.replace("_", " "))
            rows.append((f"estimate: {part.replace('_', ' ')}", int(value), f"part: {what}"))
        total = int(predicted.get("total_bytes") or sum(v for _, v, _ in rows))
        rows.append((_estimate_label(measure), total, "the sum of the parts above"))
        like = comparable_estimate(measure, predicted)
        if measure.kind == "cuda-allocated" and like and like != total:
            rows.append(
                (
                    "estimated allocated peak",
                    like,
                    "what torch.cuda.max_memory_allocated would show",
                )
            )
        reserved = positive_int(predicted.get("reserved_peak_bytes"))
        if measure.kind == "cuda-allocated" and reserved:
            rows.append(
                (
                    "estimated reserved peak",
                    reserved,
                    "what torch.cuda.max_memory_reserved would show",
                )
            )
    if measured_peak:
        rows.append((f"measured peak ({measure.name})", measured_peak, measure.counts))
    if reserved_peak:
        rows.append(
            (
                "measured reserved (CUDA)",
                reserved_peak,
                "torch.cuda.max_memory_reserved: allocated bytes plus the allocator's cached free blocks",
            )
        )
    return rows


def render_html(
    folder: Path,
    *,
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    images: Mapping[str, bytes],
    budget: tuple[int | None, str],
    measured_peak: int | None,
    predicted: Mapping[str, Any] | None,
    estimate_note: str,
    skipped_lines: int = 0,
    measure: Measure | None = None,
    notes: Sequence[str] = (),
    comparison_text: str = "",
) -> str:
    """The page: a summary, the three plots, the events, the estimate, the plan and the config."""
    measure = measure or measure_of(run)
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    planned = run.get("plan") or {}
    steps = train_lines(metrics)
    counts = {
        kind: sum(e.get("type") == kind for e in events) for kind in ("oom", "backoff", "grow")
    }
    last = steps[-1] if steps else {}
    cards = [
        ("model", config.get("model", "?")),
        ("task", config.get("task", "?")),
        ("device", resolved.get("device", "?")),
        ("optimizer steps", len(steps)),
        ("samples seen", last.get("samples_seen", "—")),
        (f"measured peak ({measure.name})", format_bytes(measured_peak) if measured_peak else "—"),
        (budget[1] or "budget", format_bytes(budget[0]) if budget[0] else "none"),
        ("OOM errors survived", counts["oom"]),
        ("back-offs / grows", f"{counts['backoff']} / {counts['grow']}"),
    ]
    if predicted:
        total = format_bytes(int(predicted.get("total_bytes") or 0))
        cards.insert(6, (_estimate_label(measure), total))
    summary = "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
    reserved = [m["reserved_bytes"] for m in steps if isinstance(m.get("reserved_bytes"), int)]
    figure_rows = _figure_rows(measure, predicted, measured_peak, max(reserved, default=None))
    # flags in code, unbroken: "--memory-cap" must not wrap after its dashes
    flagged = re.sub(r"(--[a-z][a-z-]*)", r"<code>\1</code>", _e(comparison_text))
    compare = f'<p class="compare">{flagged}</p>' if comparison_text else ""
    plan_rows: dict[str, Any] = {k: v for k, v in planned.items() if k != "plan"}
    plan_rows.update({f"plan.{k}": v for k, v in (planned.get("plan") or {}).items()})
    skipped = (
        f'<p class="note">{skipped_lines} line(s) of metrics.jsonl / events.jsonl were skipped: '
        "half a line of a run stopped mid-write, or fields memfit train does not write.</p>"
        if skipped_lines
        else ""
    )
    # what of the run files was left out, file and line (and run.json's fields)
    skipped += "".join(f'<p class="note">{_e(note)}</p>' for note in notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>memfit report: {_e(folder.name)}</title>
<style>{_CSS}</style></head>
<body>
<h1>memfit report: {_e(folder.name)}</h1>
<p class="note">Run folder <code>{_e(folder.resolve())}</code>. Plots are also saved beside this page as
memory.png, breakdown.png and training.png.</p>
<div class="summary">{summary}</div>{compare}{skipped}
<h2>Memory</h2>
<p class="note">Peak memory of each optimizer step (measured as {_e(measure.name)}), the budget line, and the guard's events: OOM errors in red (at the size the failed allocation
would have brought the total to, where its message says), back-offs in orange, grows in green,
the probe (step 0) in purple. Below: the micro-batch size each step ran with.</p>
{_figure(images, "memory.png", "memory per optimizer step with OOM and back-off events")}
<h2>Events</h2>
{_event_rows(events)}
<h2>Estimate and measurement</h2>
<p class="note">{_e(estimate_note)}</p>
{compare}
{_figure(images, "breakdown.png", "estimated memory breakdown beside the measured peak")}
{_figures_table(figure_rows)}
<h2>Training</h2>
{_figure(images, "training.png", "loss, eval metrics and throughput per optimizer step")}
<h2>Plan</h2>
{_table(plan_rows)}
<h2>Resolved settings</h2>
{_table(resolved)}
<h2>Configuration</h2>
{_table(config)}
<h2>Versions</h2>
{_table(run.get("versions") or {})}
<p class="note">Written by memfit report.</p>
</body></html>
"""
