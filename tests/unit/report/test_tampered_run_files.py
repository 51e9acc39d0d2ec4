"""Run files edited by hand (or by a tool) never crash `memfit report` or `memfit doctor`: every
field they read is checked on reading; a bad line is skipped with a note naming the file, the line
and the field, a bad run.json field is left out with a note naming it; exit 0 (or 2 with one
line), never a traceback."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from cli_run import run_cli
from memfit.errors import UsageError
from memfit.report import doctor, html

MiB = 2**20
CAP_ERROR = (
    "memfit memory cap: tried to hold 440.75 MiB, the cap is 439.98 MiB (simulated CPU out of "
    "memory. Raised by aten.mm.default)"
)
CUDA_ERROR = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB of "
    "which 1.06 GiB is free. Including non-PyTorch memory, this process has 14.69 GiB memory in "
    "use. Of the allocated memory 10.25 GiB is allocated by PyTorch, and 4.02 GiB is reserved by "
    "PyTorch but unallocated."
)


def _metric(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "epoch": 0,
        "loss": 1.0 / step,
        "samples_seen": 8 * step,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_tokens_per_micro_batch": None,
        "tokens": 500,
        "padded_tokens": 512,
        "peak_bytes": (100 + step) * MiB,
        "rank_peak_bytes": [(100 + step) * MiB, 99 * MiB],  # two ranks
        "forward_peak_bytes": 90 * MiB,
        "reserved_bytes": 120 * MiB,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "seconds": 0.5,
        "samples_per_second": 16.0,
        "what": "micro_batch",
    }


EVAL = {"step": 3, "samples_seen": 24, "eval_accuracy": 0.75}

EVENTS: list[dict[str, Any]] = [
    {
        "time": 1.0,
        "type": "probe",
        "step": 0,
        "rows": 8,
        "longest_tokens": 30,
        "ooms": 1,
        "micro_batch_size": 8,
        "max_tokens_per_micro_batch": None,
        "changed": True,
    },
    {"time": 2.0, "type": "oom", "step": 2, "micro_batch_size": 8, "error": CUDA_ERROR},
    {"time": 2.1, "type": "backoff", "step": 2, "from": 8, "to": 4, "what": "micro_batch"},
    {"time": 3.0, "type": "grow", "step": 3, "from": 4, "to": 8},
    {
        "time": 4.0,
        "type": "oom",
        "step": 5,
        "rank": 1,
        "micro_batch_size": 4,
        "max_tokens": 4096,
        "padded_tokens": 2048,
        "phase": "eval",
        "error": CAP_ERROR,
    },
    {"time": 4.1, "type": "backoff", "step": 5, "max_tokens_from": 4096, "max_tokens_to": 2048},
    {"time": 4.2, "type": "backoff", "step": 5, "cure": "gradient checkpointing"},
    {"time": 5.0, "type": "stop", "step": 6, "reason": "done", "seconds": 3.0},
]


def _run_json(model: str) -> dict[str, Any]:
    return {
        "config": {
            "model": model,
            "task": "classification",
            "loss": None,
            "optimizer": "adamw",
            "precision": None,
            "device": "cuda",
            "padding": "longest",
            "attn_implementation": "sdpa",
            "quantization": None,
            "double_quant": None,
            "gradient_checkpointing": None,
            "effective_batch_size": 8,
            "micro_batch_size": None,
            "seq_len": None,
            "max_seq_len": 64,
            "num_labels": 3,
            "world_size": 1,
            "lora_rank": 4,
            "lora_target_modules": ["query"],
            "labels": ["a", "b", "c"],
            "memory_cap": None,
            "gpu_memory": 128 * MiB,
        },
        "resolved": {
            "device": "cuda:0",
            "precision": "bf16",
            "sharding": "none",
            "gradient_checkpointing": False,
            "micro_batch_size": 8,
            "train_rows": 48,
            "world_size": 1,
            "seq_len": 32,
            "longest_tokens": 30,
            "pad_to_multiple_of": 8,
        },
        "plan": {"source": "memfit plan", "budget_bytes": 100 * MiB, "plan": {"budget_bytes": 1}},
        "estimate": {
            "total_bytes": 110 * MiB,
            "allocated_peak_bytes": 100 * MiB,
            "reserved_peak_bytes": 105 * MiB,
            "micro_batch_size": 8,
            "seq_len": 32,
            "breakdown": {"parameters": 10 * MiB, "activations": 100 * MiB},
        },
        "versions": {"torch": "2.x"},
    }


def raw(text: str) -> str:
    """A value written into the file as this JSON text (``Infinity``, a 400-digit number), not
    as the JSON string it is here."""
    return f"@@raw:{text}@@"


def dumps(value: Any) -> str:
    return re.sub(r'"@@raw:(.*?)@@"', r"\1", json.dumps(value))


def _write(folder: Path, metrics: list[Any], events: list[Any], run: Any) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(dumps(m) + "\n" for m in metrics))
    (folder / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))
    (folder / "run.json").write_text(dumps(run))
    return folder


# what a tamperer writes: not finite, negative, of another type, null, huge
BAD: dict[str, Any] = {
    "NaN": raw("NaN"),
    "Infinity": raw("Infinity"),
    "-Infinity": raw("-Infinity"),
    "-1": -1,
    "string": "x",
    "list": [1],
    "object": {"a": 1},
    "null": None,
    "true": True,
    "1e308": 1e308,
    "10^30": 10**30,
    "400 digits": raw("9" * 400),
    "5000 digits": raw("9" * 5000),  # beyond Python's int conversion limit
}


# each field gets these (the slow test below: every value of BAD in every field at once)
FIELD_BAD = ["NaN", "Infinity", "-1", "string", "list", "null", "10^30", "400 digits"]


def _base_metrics() -> list[dict[str, Any]]:
    return [_metric(step) for step in range(1, 7)] + [EVAL]


METRIC_FIELDS = sorted(set(_metric(1)) | set(EVAL))
EVENT_FIELDS = sorted({(e["type"], k) for e in EVENTS for k in e} - {("stop", "type")})
RUN_FIELDS = [
    *sorted(
        (section, key)
        for section, fields in _run_json("m").items()
        for key in (fields if isinstance(fields, dict) else [None])
    ),
    ("plan", None),
    ("estimate", None),
    ("config", None),
    ("estimate.breakdown", "parameters"),
]


def _kept(value: Any, check: Any) -> bool:
    """Whether ``value`` is what memfit train may write (so the line stays); ``check`` None:
    a field the readers do not read."""
    return check is None or check(value) is None


def _nullable(check: Any, nullable: bool) -> Any:
    """``check``, passing null where the writer may leave a field null (every field but a
    metrics line's ``step`` and an event's ``type``)."""
    if check is None:
        return None
    return lambda value: None if value is None and nullable else check(value)


def _value(value: Any) -> Any:
    """The value ``json.loads`` reads back from the file for a BAD entry."""
    return json.loads(dumps(value))


@pytest.mark.parametrize("bad", FIELD_BAD)
@pytest.mark.parametrize("field", METRIC_FIELDS)
def test_a_bad_metrics_field_skips_its_line_with_a_note(
    tmp_path: Path, field: str, bad: str
) -> None:
    metrics: list[Any] = _base_metrics()
    target = 6 if field.startswith("eval_") or field not in _metric(1) else 2
    metrics[target] = {**metrics[target], field: BAD[bad]}
    folder = _write(tmp_path / "run", metrics, EVENTS, _run_json(str(tmp_path / "no-model")))
    found = html.read_run(folder)
    try:
        value = _value(BAD[bad])
    except ValueError:  # more digits than Python converts: not JSON memfit reads
        value, check = object(), (lambda v: "not JSON")
    else:
        from memfit.report import run_files

        check = _nullable(run_files._field_check(field, run_files.METRICS), field != "step")
    if _kept(value, check):
        assert len(found["metrics"]) == len(metrics) and not found["notes"]
    else:
        assert len(found["metrics"]) == len(metrics) - 1
        (note,) = found["notes"]
        assert f"{folder / 'metrics.jsonl'}: skipped 1 line" in note
        assert f"line {target + 1}:" in note
        assert field in note or "not JSON" in note
    _render(found)


@pytest.mark.parametrize("bad", FIELD_BAD)
@pytest.mark.parametrize(("kind", "field"), EVENT_FIELDS)
def test_a_bad_events_field_skips_its_line_with_a_note(
    tmp_path: Path, kind: str, field: str, bad: str
) -> None:
    events: list[Any] = [dict(e) for e in EVENTS]
    target = next(i for i, e in enumerate(events) if e["type"] == kind and field in e)
    events[target][field] = BAD[bad]
    folder = _write(tmp_path / "run", _base_metrics(), events, _run_json(str(tmp_path / "nm")))
    found = html.read_run(folder)
    try:
        value = _value(BAD[bad])
    except ValueError:
        value, check = object(), (lambda v: "not JSON")
    else:
        from memfit.report import run_files

        check = _nullable(run_files._field_check(field, run_files.EVENTS), field != "type")
    if _kept(value, check):
        assert not found["notes"]
    else:
        (note,) = found["notes"]
        assert f"{folder / 'events.jsonl'}: skipped 1 line (line {target + 1}:" in note
    _render(found)
    # the doctor reads the same lines: the diagnosis (naming what it left out), or a usage error
    text = _doctor(folder)
    if text is not None and not _kept(value, check):
        assert f"{folder / 'events.jsonl'}: skipped 1 line" in text


@pytest.mark.parametrize("bad", FIELD_BAD)
@pytest.mark.parametrize(("section", "field"), RUN_FIELDS)
def test_a_bad_run_json_field_is_left_out_with_a_note(
    tmp_path: Path, section: str, field: str | None, bad: str
) -> None:
    run = _run_json(str(tmp_path / "no-model"))
    if section == "estimate.breakdown":
        run["estimate"]["breakdown"][field] = BAD[bad]
    elif field is None:
        run[section] = BAD[bad]
    else:
        run[section][field] = BAD[bad]
    folder = _write(tmp_path / "run", _base_metrics(), EVENTS, run)
    try:
        found = html.read_run(folder)
    except Exception as exc:  # only a run.json that is not JSON: one line, naming it
        assert bad == "5000 digits" and "run.json is not JSON" in str(exc)
    else:
        for note in found["notes"]:
            assert note.startswith(f"{folder / 'run.json'}: left out {section}")
        _render(found)
    _doctor(folder)


def _doctor(folder: Path) -> str | None:
    """``memfit doctor RUN``'s text, or None where it is a usage error (exit 2, one line)."""
    try:
        result = doctor.from_run_dir(str(folder))
    except UsageError as exc:
        assert "\n" not in str(exc)
        return None
    text = doctor.format_text(result)
    json.dumps(result.to_dict())  # --json: every figure is JSON
    return text


def _render(found: dict[str, Any]) -> None:
    """What the page computes from the run files, and the page itself (the plots are drawn in
    the command-line tests below: they take a second each)."""
    metrics, events, run = found["metrics"], found["events"], found["run"]
    measure = html.measure_of(run)
    budget = html.budget_of(run)
    shapes = html.run_shapes(run, metrics, events)
    predicted, note = html.run_estimate(run, metrics, events)
    compared = html.comparison(
        measure,
        predicted,
        measured_like=html.measured_at(metrics, events, shapes.micro_batch_size),
        budget=budget,
    )
    page = html.render_html(
        found["folder"],
        metrics=metrics,
        events=events,
        run=run,
        images=dict.fromkeys(html.PLOTS, b""),
        budget=budget,
        measured_peak=None,
        predicted=predicted,
        estimate_note=note,
        skipped_lines=found["skipped_lines"],
        measure=measure,
        comparison_text=compared,
        notes=found["notes"],
    )
    assert page.startswith("<!DOCTYPE html>")


def _one_line_or_ok(code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert out == "" and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("bad", list(BAD))
def test_report_and_doctor_of_a_tampered_folder(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every field of every file poisoned at once, one line each: the commands draw what is
    left, say what was left out, exit 0 (or 2, one line), never a traceback."""
    metrics: list[Any] = _base_metrics()
    for i, field in enumerate(METRIC_FIELDS):
        metrics.append({**_metric(10 + i), field: BAD[bad]})
    events: list[Any] = [dict(e) for e in EVENTS]
    for kind, field in EVENT_FIELDS:
        event = next(e for e in EVENTS if e["type"] == kind and field in e)
        events.append({**event, field: BAD[bad]})
    run = _run_json(str(tmp_path / "no-model"))
    for section, fields in run.items():
        if isinstance(fields, dict) and section != "versions":
            for key in list(fields):
                fields[key] = BAD[bad]
    folder = _write(tmp_path / "run", metrics, events, run)
    code, out, err = run_cli(capsys, "report", str(folder), "--no-estimate")
    _one_line_or_ok(code, out, err)
    if code == 0:
        assert (folder / "report.html").is_file()
        if bad != "null":
            assert f"memfit: {folder / 'metrics.jsonl'}: skipped" in err
    code, out, err = run_cli(capsys, "doctor", str(folder))
    _one_line_or_ok(code, out, err)


def test_the_two_reported_crashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``"peak_bytes": Infinity`` (OverflowError in the page) and an oom event's
    ``"micro_batch_size": [1]`` (TypeError in the doctor)."""
    metrics: list[Any] = _base_metrics()
    metrics[3] = {**metrics[3], "peak_bytes": raw("Infinity")}
    events: list[Any] = [dict(e) for e in EVENTS]
    events.append({"time": 9.0, "type": "oom", "step": 7, "micro_batch_size": [1], "error": "x"})
    folder = _write(tmp_path / "run", metrics, events, _run_json(str(tmp_path / "no-model")))
    found = html.read_run(folder)
    assert found["notes"] == [
        f"{folder / 'metrics.jsonl'}: skipped 1 line (line 4: "
        "peak_bytes: Infinity is not a number of bytes (a whole number from 0 to 2^60))",
        f"{folder / 'events.jsonl'}: skipped 1 line (line 9: "
        "micro_batch_size: [1] is not a whole number from 0 to 2^53)",
    ]
    _render(found)
    diagnosis = doctor.from_run_dir(str(folder))
    text = "\n".join(diagnosis.diagnosis)
    assert f"{folder / 'events.jsonl'}: skipped 1 line" in text
    # the last oom that was written whole is diagnosed: the eval one of step 5
    assert diagnosis.report.kind == "memfit-cap"
    code, out, err = run_cli(capsys, "doctor", str(folder))
    assert code == 0 and "Traceback" not in err and "line 9: micro_batch_size" in out
    assert math.isfinite(max(m["peak_bytes"] for m in found["metrics"] if "peak_bytes" in m))
