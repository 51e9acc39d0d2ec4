"""``memfit report RUN_DIR``: one self-contained HTML page about a run, and its plots as PNG files.

The page carries everything inside it (inline CSS, the plots as base64 data URIs): it can be
mailed, attached to an issue or opened offline. The PNG files beside it are the same bytes.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.job import OPTIMIZERS
from memfit.report.events import agreed_events
from memfit.units import format_bytes

PLOTS = ("memory.png", "breakdown.png", "training.png")
# events listed in the page's table (checkpoints and evals are routine: counted, not listed)
_LISTED_EVENTS = ("probe", "oom", "backoff", "grow", "resume", "stop")


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run folder's metrics, events and run.json; a usage error if it is not a run folder."""
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
    metrics, bad_metrics = _read_jsonl(metrics_file)
    events: list[dict[str, Any]] = []
    bad_events = 0
    if (folder / "events.jsonl").is_file():
        events, bad_events = _read_jsonl(folder / "events.jsonl")
        # several ranks log each agreed back-off once each: keep one
        events = agreed_events(events)
    run: dict[str, Any] = {}
    if (folder / "run.json").is_file():
        try:
            loaded = json.loads((folder / "run.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"RUN_DIR: {folder / 'run.json'} is not JSON: {exc}") from None
        if isinstance(loaded, dict):
            run = loaded
    return {
        "folder": folder,
        "metrics": metrics,
        "events": events,
        "run": run,
        "skipped_lines": bad_metrics + bad_events,
    }


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    # a run killed mid-write leaves a half line at the end: skip what does not parse, count it
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


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


def _longest_row_tokens(
    run: Mapping[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> int | None:
    config = run.get("config") or {}
    if config.get("max_seq_len"):
        return int(config["max_seq_len"])
    probes = [e.get("longest_tokens") for e in events if e.get("type") == "probe"]
    if probes and isinstance(probes[0], int) and probes[0] > 0:
        return probes[0]
    # padded tokens per row, averaged over a step: a lower bound of the longest row
    batch = config.get("effective_batch_size")
    per_row = (
        [
            math.ceil(m["padded_tokens"] / batch)
            for m in metrics
            if isinstance(m.get("padded_tokens"), int)
        ]
        if isinstance(batch, int) and batch > 0
        else []
    )
    return max(per_row) if per_row else None


def run_estimate(
    run: Mapping[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any] | None, str]:
    """The estimate for the run's first micro-batch size: (``{"total_bytes", "breakdown"}``, note).

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
    seq_len = _longest_row_tokens(run, metrics, events) or 128
    batch = int(resolved.get("micro_batch_size") or config.get("effective_batch_size") or 1)
    knobs: dict[str, Any] = {
        "task": config["task"],
        "batch_size": batch,
        "seq_len": int(seq_len),
        "precision": resolved.get("precision") or "fp32",
        "gradient_checkpointing": bool(resolved.get("gradient_checkpointing")),
        "device": device,
    }
    if config.get("optimizer") in OPTIMIZERS:
        knobs["optimizer"] = config["optimizer"]
    if config.get("task") == "classification" and config.get("num_labels"):
        knobs["num_labels"] = int(config["num_labels"])
    if config.get("task") == "sentence-embedding" and config.get("loss"):
        knobs["loss"] = config["loss"]
    if config.get("lora_rank"):
        knobs["lora_rank"] = int(config["lora_rank"])
        if config.get("lora_target_modules"):
            knobs["lora_target_modules"] = list(config["lora_target_modules"])
    world = int(resolved.get("world_size") or 1)
    if world > 1:
        # the memory of one rank: sharded as the run was
        knobs["world_size"] = world
        knobs["sharding"] = str(resolved.get("sharding") or "none")
    described = f"micro-batch {batch} × {seq_len} tokens, {knobs['precision']}, on {device}"
    try:
        from memfit.estimate import estimate

        result = estimate(str(model), **knobs)
    except Exception as exc:  # the report still stands without it: say why, show the measurement
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return None, f"no estimate ({described}): {reason}"
    return {
        "total_bytes": int(result.total_bytes),
        "breakdown": {k: int(v) for k, v in result.breakdown.items()},
    }, f"memfit.estimate for {described}"


def write_report(run_dir: str | os.PathLike[str], *, estimate: bool = True) -> Path:
    """Write ``RUN_DIR/report.html`` and ``memory.png``, ``breakdown.png``, ``training.png``.

    ``estimate=False`` skips asking ``memfit.estimate`` (run.json's recorded estimate is still
    shown). Returns the path of the page.
    """
    from memfit.report import plots

    found = read_run(run_dir)
    folder: Path = found["folder"]
    metrics, events, run = found["metrics"], found["events"], found["run"]
    steps = plots.train_lines(metrics)
    budget, budget_label = budget_of(run)
    peaks = [int(m["peak_bytes"]) for m in steps if isinstance(m.get("peak_bytes"), int | float)]
    reserved = [
        int(m["reserved_bytes"]) for m in steps if isinstance(m.get("reserved_bytes"), int | float)
    ]
    measured = max(peaks) if peaks else None
    if estimate or isinstance(run.get("estimate"), Mapping):
        predicted, estimate_note = run_estimate(run, metrics, events)
    else:
        predicted, estimate_note = None, "no estimate: --no-estimate"

    figures = {
        "memory.png": plots.memory_plot(
            metrics, events, budget, budget_label=budget_label or "budget"
        ),
        "breakdown.png": plots.breakdown_plot(
            predicted["breakdown"] if predicted else None,
            measured,
            reserved_peak=max(reserved) if reserved else None,
            budget=budget,
            note=estimate_note,
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
    )
    return plots.write_atomic(folder / "report.html", page.encode("utf-8"))


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; background: #fff; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.oom td { background: #fde0e0; } tr.backoff td { background: #fff0dc; }
img { max-width: 100%; border: 1px solid #eee; }
.summary { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.5em 0.9em; background: #fafafa; }
.card b { display: block; font-size: 1.2em; } .note { color: #555; font-size: 0.9em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("bytes"):
        return f'<td class="num">{_e(format_bytes(value))} <span class="note">({value:,} B)</span></td>'
    if key in ("memory_cap", "gpu_memory") and isinstance(value, int):
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
) -> str:
    """The page: a summary, the three plots, the events, the estimate, the plan and the config."""
    from memfit.report.plots import train_lines

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
        ("measured peak", format_bytes(measured_peak) if measured_peak else "—"),
        (budget[1] or "budget", format_bytes(budget[0]) if budget[0] else "none"),
        ("OOM errors survived", counts["oom"]),
        ("back-offs / grows", f"{counts['backoff']} / {counts['grow']}"),
    ]
    if predicted:
        cards.insert(6, ("estimated peak", format_bytes(int(predicted.get("total_bytes", 0)))))
    summary = "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
    estimate_rows: dict[str, Any] = {}
    if predicted:
        estimate_rows = {
            f"{k}_bytes": int(v) for k, v in (predicted.get("breakdown") or {}).items()
        }
        estimate_rows["total_bytes"] = int(
            predicted.get("total_bytes", sum(estimate_rows.values()))
        )
    if measured_peak:
        estimate_rows["measured_peak_bytes"] = measured_peak
    plan_rows: dict[str, Any] = {k: v for k, v in planned.items() if k != "plan"}
    plan_rows.update({f"plan.{k}": v for k, v in (planned.get("plan") or {}).items()})
    skipped = (
        f'<p class="note">{skipped_lines} line(s) of metrics.jsonl / events.jsonl did not parse '
        "(a run stopped mid-write) and were skipped.</p>"
        if skipped_lines
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>memfit report: {_e(folder.name)}</title>
<style>{_CSS}</style></head>
<body>
<h1>memfit report: {_e(folder.name)}</h1>
<p class="note">Run folder <code>{_e(folder.resolve())}</code>. Plots are also saved beside this page as
memory.png, breakdown.png and training.png.</p>
<div class="summary">{summary}</div>{skipped}
<h2>Memory</h2>
<p class="note">Peak memory of each optimizer step (on the CPU under a memory cap: live tensor bytes),
the budget line, and the guard's events: OOM errors in red, back-offs in orange, grows in green,
the probe (step 0) in purple. Below: the micro-batch size each step ran with.</p>
{_figure(images, "memory.png", "memory per optimizer step with OOM and back-off events")}
<h2>Events</h2>
{_event_rows(events)}
<h2>Estimate and measurement</h2>
<p class="note">{_e(estimate_note)}</p>
{_figure(images, "breakdown.png", "estimated memory breakdown beside the measured peak")}
{_table(estimate_rows)}
<h2>Training</h2>
{_figure(images, "training.png", "loss, eval metric and throughput per optimizer step")}
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
