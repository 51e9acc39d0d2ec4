"""Run files edited by hand (or by a tool) never crash `memfit report` or `memfit doctor`: every
field they read is checked on reading; a bad line is skipped with a note naming the file, the line
and the field, a bad run.json field is left out with a note naming it; exit 0 (or 2 with one
line), never a traceback."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
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

        schema = run_files.event_schema(kind)
        check = _nullable(run_files._field_check(field, schema), field != "type")
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


# --- what memfit writes is never "not what memfit train writes" -------------------------------
# The tests above decide what must pass with run_files' own checks; these take what the writers
# really emit (a real run, and the writers' own functions) and require every line kept.


def _lines(path: Path, rows: list[dict[str, Any]]) -> Path:
    # json.dumps as memfit's JsonlLog writes (NaN and Infinity as Python writes them)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rank_peaks() -> list[int | None]:
    """``rank_peak_bytes`` as memfit train's ``_gather`` makes it: rank 1 had no peak figure
    (its device reports none), so its entry is null."""
    from memfit.train.loop import TrainingRun

    class TwoRanks:
        def gather_floats(self, values: list[float | None]) -> list[list[float | None]]:
            # what Ranks.gather_floats returns: each rank's values, None where it had none
            return [list(values), [0.25, 10, 16, None, None, None, None, None]]

    run = SimpleNamespace(ranks=TwoRanks())
    gathered = TrainingRun._gather(run, 0.5, 10, 16, 123, {})  # type: ignore[arg-type]
    return gathered[-1]


def _written_lines() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Metrics and events lines exactly as memfit's writers make them (the guard's policy
    functions called for real; the loop's lines as loop.py builds them)."""
    from memfit.errors import NothingFitsError
    from memfit.guard.policy import back_off, optimizer_stop
    from memfit.metrics import perplexity

    events: list[dict[str, Any]] = []

    def emit(event: dict[str, Any]) -> None:  # TrainingRun.on_event: stamped, with the rank
        events.append({"time": 1764200000.123, "rank": 0, **event})

    # an eval's OOM (the guard's step is None in eval) and a training one, backed off
    back_off(8, 8, CAP_ERROR, emit=emit, stop=_no_stop, step=None, phase="eval")
    back_off(4, 4, CUDA_ERROR, emit=emit, stop=_no_stop, step=3)
    assert isinstance(optimizer_stop(5, CUDA_ERROR, emit=emit, cures="x"), NothingFitsError)
    events += [
        # loop.load: a resume's --lr (the old peak and the new, floats)
        {"time": 1764200001.0, "type": "lr", "step": 2, "from": 5e-05, "to": 1e-05},
        {"time": 1764200001.0, "type": "lr", "step": 2, "from": 0.1, "to": 1e305},
        # loop.stop_not_finite, loop.resume, loop.skip, memory.snapshot_writer, setup.make_guard
        {"time": 1.0, "type": "not_finite", "step": 3, "problems": ["the loss is nan"]},
        {"time": 1.0, "type": "resume", "step": 0, "checkpoint": None, "note": "no checkpoint"},
        {"time": 1.0, "type": "checkpoint_skipped", "checkpoint": "c", "reason": "r", "moved_to": "m"},
        {"time": 1.0, "type": "memory_snapshot", "path": "p", "error": "e"},
        {"time": 1.0, "type": "lock", "note": "n"},
        # loop.evaluate: a diverged model's eval, its perplexity past 1e300 (exp(700)), and inf
        {"time": 1.0, "type": "eval", "step": 4, "eval_loss": 700.0, "eval_perplexity": perplexity(700.0)},
        {"time": 1.0, "type": "eval", "step": 4, "eval_loss": math.nan, "eval_perplexity": perplexity(math.nan)},
        # predict/embed --events (memfit.infer.run)
        {"time": 1.0, "type": "plan", "phase": "predict", "batch_size": 8, "source": "given", "rows": 3, "longest_tokens": 9, "budget_bytes": None, "predicted_peak_bytes": None, "memory_cap_bytes": None},
        {"time": 1.0, "type": "done", "phase": "predict", "rows": 3, "batch_size": 4, "ooms": 1, "backoffs": 1, "seconds": 0.1, "peak_bytes": None},
        # the Trainer integrations' GradCache back-off (memfit_events.jsonl, the same shape)
        {"time": 1.0, "type": "oom", "step": 1, "micro_batch_size": 8, "mini_batch_size": 4, "error": "x"},
        {"time": 1.0, "type": "backoff", "step": 1, "from": 4, "to": 2, "loss": "cached mnrl"},
    ]  # fmt: skip
    metrics = [
        # loop.train_step with several ranks: rank 1 had no peak figure
        {**_metric(1), "world_size": 2, "rank_peak_bytes": _rank_peaks()},
        # an fp16 step its loss scaler skipped: the loss and norm not finite, logged
        {**_metric(2), "loss": math.nan, "grad_norm": math.inf},
        # --lr 1e305 (finite: accepted) and a loss near a float's largest: any float
        {**_metric(3), "lr": 1e305, "loss": 1.5e308},
        # loop.evaluate's line: exp(700) is past 1e300; a loss below 0 (a loss may be any float)
        {"step": 3, "samples_seen": 24, "eval_loss": 700.0, "eval_perplexity": perplexity(700.0)},
        {"step": 3, "samples_seen": 24, "eval_loss": -0.5, "eval_accuracy": 1},
    ]
    return metrics, events


def _no_stop(error: str) -> Any:
    raise AssertionError(error)


def test_the_rank_peaks_gather_writes_hold_a_null() -> None:
    assert _rank_peaks() == [123, None]


def test_every_line_the_writers_emit_is_kept(tmp_path: Path) -> None:
    from memfit.report import run_files

    metrics, events = _written_lines()
    kept = run_files.read_jsonl(_lines(tmp_path / "metrics.jsonl", metrics), "metrics")
    assert kept.bad == [] and len(kept.rows) == len(metrics)
    kept = run_files.read_jsonl(_lines(tmp_path / "events.jsonl", events), "events")
    assert kept.bad == [] and len(kept.rows) == len(events)
    # and each field still means what its type's writer means: sizes stay whole counts
    bad: list[dict[str, Any]] = [
        {"type": "backoff", "step": 1, "from": 0.5, "to": 2},
        {"type": "grow", "step": 1, "from": 2, "to": 4.5},
        {"type": "lr", "step": 1, "from": -0.1, "to": 0.1},
        {"type": "lr", "step": 1, "from": 0.1, "to": "x"},
        {"type": "oom", "step": 1, "micro_batch_size": 8.5},
        {"type": "not_finite", "step": 1, "problems": [1]},
        {"type": "other", "step": [1]},
    ]
    found = run_files.read_jsonl(_lines(tmp_path / "bad.jsonl", bad), "events")
    assert [n for n, _ in found.bad] == list(range(1, len(bad) + 1)), found.bad
    metrics_bad = [{**_metric(1), "rank_peak_bytes": [123, -1]}, {**_metric(1), "loss": "x"}]
    found = run_files.read_jsonl(_lines(tmp_path / "bad-m.jsonl", metrics_bad), "metrics")
    assert [n for n, _ in found.bad] == [1, 2]


def _written_run(model: str) -> dict[str, Any]:
    """run.json as memfit train writes it for flags it takes: ``--lora-rank 0`` (full
    fine-tuning), ``--memory-cap 99999999999999999999999`` and ``--gpu-memory 2000000TiB`` (any
    number of bytes above 0: beyond 2^60), a longest row of no token (padded width 0)."""
    run = _run_json(model)
    run["config"].update(lora_rank=0, memory_cap=99999999999999991611392)
    run["config"]["gpu_memory"] = 2000000 * 2**40
    run["resolved"]["seq_len"] = 0
    return run


def test_a_run_json_as_the_writers_make_it_is_whole(tmp_path: Path) -> None:
    from memfit.report import run_files

    run = _written_run("m")
    (tmp_path / "run.json").write_text(json.dumps(run))
    loaded, notes = run_files.read_run_json(tmp_path / "run.json")
    assert notes == [] and loaded == run


def test_report_and_doctor_of_the_writers_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The writers' lines, extreme ones included, drawn and diagnosed: no note, exit 0."""
    metrics, events = _written_lines()
    folder = _write(tmp_path / "run", _base_metrics() + metrics, EVENTS + events, _written_run("m"))
    found = html.read_run(folder)
    assert found["notes"] == [] and found["skipped_lines"] == 0
    code, out, err = run_cli(capsys, "report", str(folder), "--no-estimate")
    assert code == 0 and "Traceback" not in err, err
    assert "skipped" not in err and "left out" not in err, err
    code, out, err = run_cli(capsys, "doctor", str(folder))
    assert code == 0 and "Traceback" not in err, err
    assert "skipped" not in out and "left out" not in out, out


TRAIN_ROWS = "text,label\n" + "the cat sat,0\na good movie,1\nthe dog ran,0\ngreat film,1\n" * 2


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT (random weights, dropout off) whose tokenizer knows the rows' words."""
    from tiny_models import save_bert

    folder = tmp_path_factory.mktemp("bert")
    words = sorted({w for line in TRAIN_ROWS.splitlines()[1:] for w in line[:-2].split()})
    save_bert(folder, words)
    return str(folder)


@pytest.mark.slow  # two real training runs
def test_a_real_run_resumed_with_another_lr_is_reported_whole(
    bert_dir: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real `memfit train` under a memory cap (one real OOM, caught by the guard), evals and
    checkpoints, then `--resume` with another --lr and more steps (the ``lr`` event, floats):
    `report` and `doctor` on its folder keep every line, and say nothing is left out."""
    import torch

    from memfit.train.recipes.classification import ClassificationRecipe

    loss, fired = ClassificationRecipe.loss, list[int]()

    def one_oom(self: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        if len(rows) > 1 and not fired:
            fired.append(len(rows))
            torch.ones(2**24)  # 64 MiB, past the 32 MiB cap: the cap raises a real OOM
        return loss(self, rows, *args, **kwargs)

    monkeypatch.setattr(ClassificationRecipe, "loss", one_oom)
    data = tmp_path / "train.csv"
    data.write_text(TRAIN_ROWS)
    out = tmp_path / "out"
    argv = [
        "train", "--task", "classification", "--model", bert_dir, "--train-file", str(data),
        "--eval-file", str(data), "--eval-every", "1", "--save-every", "1",
        "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
        "--effective-batch-size", "4", "--optimizer", "sgd", "--memory-cap", "32MiB",
    ]  # fmt: skip
    code, _, err = run_cli(capsys, *argv, "--lr", "0.1", "--max-steps", "2")
    assert code == 0 and fired, err[-2000:]
    code, _, err = run_cli(capsys, *argv, "--lr", "0.05", "--max-steps", "4", "--resume")
    assert code == 0, err[-2000:]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    kinds = {e["type"] for e in events}
    assert {"probe", "oom", "backoff", "checkpoint", "eval", "resume", "lr", "stop"} <= kinds
    (lr,) = [e for e in events if e["type"] == "lr"]
    assert (lr["from"], lr["to"]) == (0.1, 0.05)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_accuracy" in m for m in metrics)
    assert any("forward_peak_bytes" in m for m in metrics)  # the cap's phase peaks
    found = html.read_run(out)
    assert found["notes"] == [] and found["skipped_lines"] == 0
    assert len(found["metrics"]) == len(metrics) and len(found["events"]) == len(events)
    code, _, err = run_cli(capsys, "report", str(out), "--no-estimate")
    assert code == 0 and (out / "report.html").is_file(), err
    assert "skipped" not in err and "left out" not in err, err
    code, text, err = run_cli(capsys, "doctor", str(out))
    assert code == 0 and "Traceback" not in err, err
    assert "1 out-of-memory event" in text
    assert "skipped" not in text and "left out" not in text, text


def test_a_figure_past_what_a_plot_places_is_named_as_written() -> None:
    """A perplexity of exp(700) (finite, past 1e300) is not placed on the axis (matplotlib's
    ticks overflow there), but the legend's "last" is the figure as written, not inf."""
    from memfit.metrics import perplexity
    from memfit.report import plots

    metrics, _ = _written_lines()
    fig = plots.training_plot(_base_metrics() + metrics)
    plots.figure_png(fig)
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert f"perplexity (last {perplexity(700.0):.3g}, right axis)" in labels, labels


def test_an_eval_metric_null_in_every_line_is_not_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Null passes the checks (a writer leaves a figure out so); an eval metric that is null
    wherever it occurs has nothing to draw (it was an IndexError in the training plot)."""
    metrics = [_metric(step) for step in range(1, 4)]
    metrics.append({"step": 3, "samples_seen": 24, "eval_accuracy": None})
    folder = _write(tmp_path / "run", metrics, EVENTS, _run_json("m"))
    code, _, err = run_cli(capsys, "report", str(folder), "--no-estimate")
    assert code == 0 and "Traceback" not in err and not err.startswith("memfit: /"), err
    assert (folder / "training.png").read_bytes()[:4] == b"\x89PNG"
