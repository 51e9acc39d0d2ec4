"""memfit ui's answers (:mod:`memfit.ui.answers`): the estimate and the plan are the CLI's for
the same job (its --json and its lines), the curves come from the traces without a new one and
cross the budget where exact estimates do, and bad input is the CLI's one line."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cli_run import run_cli
from memfit.errors import UsageError
from memfit.estimate import estimate, traces
from memfit.ui import answers
from memfit.ui.job import PageJob, estimate_argv, plan_argv

BERT = PageJob()  # bert-base-uncased, classification, batch 8 × 128 on a T4
# keys of --json that say how long this very call took
TIMINGS = ("estimate_seconds", "trace_seconds")


def _without_timings(data: dict[str, Any]) -> dict[str, Any]:
    details = {k: v for k, v in data["details"].items() if k not in TIMINGS}
    return data | {"details": details}


def _cli_estimate(capsys: pytest.CaptureFixture[str], job: PageJob) -> tuple[dict[str, Any], str]:
    argv = estimate_argv(job, answers.resolve(job))
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    code, text, err = run_cli(capsys, *argv)
    assert code == 0, err
    return json.loads(out), text


def _same_words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    "job",
    [
        BERT,
        dataclasses.replace(BERT, gpu="t4", gpu_memory="3GiB", batch_size=16, seq_len=256),
        pytest.param(
            PageJob(
                model="gpt2",
                task="causal-lm",
                gpu=None,
                batch_size=4,
                seq_len=256,
                knobs={"lora_rank": 8, "precision": "fp16", "gradient_checkpointing": True},
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["bert-t4", "bert-short", "gpt2-lora-no-budget"],
)
def test_the_estimate_is_the_clis(capsys: pytest.CaptureFixture[str], job: PageJob) -> None:
    answer = answers.estimate_answer(job)
    data, text = _cli_estimate(capsys, job)
    assert answer.total_bytes == data["total_bytes"]
    assert _without_timings(answer.as_json) == _without_timings(data)
    # the lines under the CLI's table, word for word (the terminal wraps them)
    assert _same_words(text).endswith(_same_words(" ".join(answer.verdict)))
    assert answer.command == "memfit " + " ".join(estimate_argv(job, job.model))
    if job.gpu_memory == "3GiB":
        assert answer.fits is False and answer.headline.startswith("Does not fit in 3.00 GiB on")
    elif job.gpu is None:
        assert answer.budget_bytes is None and "no budget" in answer.headline
    else:
        assert answer.headline.startswith("Fits in a T4's 14.56 GiB: ")


@pytest.mark.slow  # the plan traces several knob sets (tens of seconds on two cores)
def test_the_plan_is_the_clis(capsys: pytest.CaptureFixture[str], tiny_bert: str) -> None:
    job = dataclasses.replace(BERT, model=tiny_bert, effective_batch_size=64, allow=("optimizer",))
    answer = answers.plan_answer(job)
    code, out, err = run_cli(capsys, *plan_argv(job, job.model), "--json")
    assert code == 0, err
    assert answer.as_json == json.loads(out)
    assert answer.fits and answer.chosen == answer.as_json["plan"]
    code, text, _ = run_cli(capsys, *plan_argv(job, job.model))
    assert _same_words(text).endswith(_same_words(" ".join(answer.lines)))
    assert answer.commands[0] == answer.as_json["train_command"]
    assert answer.commands[1].startswith(f"memfit estimate {tiny_bert}")
    assert answer.trainer_lines[0] == "from memfit.integrations import apply_plan"
    call = next(line for line in answer.trainer_lines if line.startswith("planned = "))
    assert call.startswith(f"planned = apply_plan(args, {tiny_bert!r}, seq_len=128")
    assert "must be 64" in " ".join(answer.trainer_lines)  # the effective batch args must say
    micro = answer.as_json["plan"]["micro_batch_size"]
    assert f"    per_device_train_batch_size={micro}," in answer.trainer_lines
    assert "args = TrainingArguments(" in answer.trainer_lines


@pytest.mark.slow  # nothing fits: the plan prices every knob set, and other world sizes
def test_a_plan_that_nothing_fits_answers_with_the_clis_lines(
    capsys: pytest.CaptureFixture[str], tiny_bert: str
) -> None:
    job = dataclasses.replace(BERT, model=tiny_bert, gpu=None, gpu_memory="1MiB")
    answer = answers.plan_answer(job)
    assert not answer.fits and answer.trainer_lines == [] and answer.chosen is None
    assert answer.lines[0].startswith("Nothing fits in ")
    code, out, _ = run_cli(capsys, *plan_argv(job, job.model), "--json")
    assert code == 3 and answer.as_json == json.loads(out)


def test_the_curves_are_exact_estimates_and_never_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_traces(monkeypatch)  # below: a kind of shape not traced is left out
    job = dataclasses.replace(BERT, gpu_memory="6GiB")
    answers.estimate_answer(job)

    def no_trace(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the curves traced")

    monkeypatch.setattr(traces, "trace_model", no_trace)
    seq, batch = answers.curves(job)
    assert seq.axis == "seq_len" and batch.axis == "batch_size"
    assert (
        seq.points[-1][0] == 512 and (128, answers.estimate_answer(job).total_bytes) in seq.points
    )
    for x, total in seq.points[::3]:
        exact = estimate("bert-base-uncased", task="classification", batch_size=8, seq_len=x,
                         gpu="t4", gpu_memory="6GiB")  # fmt: skip
        assert total == exact.total_bytes
    # the batch curve crosses the budget: the crossing fits, the next batch does not
    assert batch.budget_bytes == 6 * 2**30 and batch.crossing is not None
    assert batch.crossing == _largest_fitting(job, batch.budget_bytes)
    assert f"fits up to {batch.crossing:,} rows at 128 tokens in 6.00 GiB on a T4" in batch.note
    # a batch of one is another kind of shape, not traced without the background: left out
    assert batch.partial and batch.points[0][0] == 2


def _largest_fitting(job: PageJob, budget: int) -> int:
    """The largest batch that fits, by exact estimates one batch after another."""
    fitting = 2
    for size in range(2, 512):
        total = estimate("bert-base-uncased", task="classification", batch_size=size,
                         seq_len=job.seq_len, gpu="t4", gpu_memory="6GiB").total_bytes  # fmt: skip
        if total > budget:
            return fitting
        fitting = size
    return fitting


def _fresh_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """No trace of this process or of the session's disk cache: another test may have traced the
    kinds of shape (or the knobs) a test needs untraced."""
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    monkeypatch.setattr(traces, "_CACHE", {})
    # ... nor a total the page kept from them
    monkeypatch.setattr(answers, "_TOTALS", OrderedDict())
    monkeypatch.setattr(answers, "_BUDGETS", OrderedDict())


def test_curves_of_knobs_not_traced_are_empty_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_traces(monkeypatch)
    job = dataclasses.replace(BERT, knobs={"lora_rank": 4, "lora_dropout": 0.25})
    assert not answers.is_traced(job)

    def no_trace(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the curves traced")

    monkeypatch.setattr(traces, "trace_model", no_trace)
    seq, batch = answers.curves(job)
    assert seq.points == [] and batch.points == [] and seq.partial
    assert seq.note.startswith("no point at batch 8 is traced yet")


def test_bad_input_is_the_clis_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    unknown = dataclasses.replace(BERT, model="no-such-model-anywhere")
    with pytest.raises(UsageError) as caught:
        answers.estimate_answer(unknown)
    code, _, err = run_cli(capsys, *estimate_argv(unknown, unknown.model))
    assert code == 2 and err.strip() == f"memfit: error: {caught.value}"
    margin = dataclasses.replace(BERT, safety_margin=1.5)
    with pytest.raises(UsageError) as caught:
        answers.estimate_answer(margin)
    code, _, err = run_cli(capsys, *estimate_argv(margin, margin.model))
    assert code == 2 and err.strip() == f"memfit: error: {caught.value}"
    with pytest.raises(UsageError, match=r"^--gpu-memory"):
        answers.estimate_answer(dataclasses.replace(BERT, gpu_memory="lots"))


def test_an_uploaded_config_is_estimated_as_its_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from memfit.models import resolve_model

    config = resolve_model("bert-base-uncased").config.to_json_string()
    job = PageJob(config_json=config, seq_len=64, batch_size=4)
    path = answers.resolve(job)
    assert path.endswith("config.json") and answers.resolve(job) == path
    answer = answers.estimate_answer(job)
    data, _ = _cli_estimate(capsys, job)
    assert answer.total_bytes == data["total_bytes"]


@pytest.mark.parametrize(
    "text",
    [
        '{\n  "model_type": "bert",\n  oops\n}',  # broken JSON
        "",
        "[1, 2]",  # JSON, not an object
        '{"hidden_size": 8}',  # no model_type
        '{"model_type": "no-such-type"}',
    ],
    ids=["broken", "empty", "list", "no-model-type", "unknown-type"],
)
def test_a_refused_upload_is_the_line_memfit_estimate_prints_for_its_file(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    text: str,
) -> None:
    monkeypatch.setattr(answers, "UPLOADS", tmp_path / "uploads")
    with pytest.raises(UsageError) as caught:
        answers.resolve(PageJob(config_json=text))
    (tmp_path / "config.json").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    argv = ("estimate", "config.json", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "8")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.strip() == f"memfit: error: {caught.value}"
    assert "uploads" not in str(caught.value)  # the file, not the folder it was kept in


def test_an_answer_says_it_traced_and_leaves_the_collector_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    answer = answers.estimate_answer(BERT)  # a replay (traced by the tests above, or now)
    seconds = float(answer.as_json["details"]["estimate_seconds"])
    assert answer.traced is (seconds > 0.5)
    monkeypatch.setattr(answers, "_TRACED_SECONDS", -1.0)  # any estimate counts as a trace
    assert answers.estimate_answer(BERT).traced is True
    assert calls == []  # gc.freeze is the server's to call, not the answer's
    answers.keep_traces()
    assert calls == ["collect", "freeze"]


def test_the_memos_keep_only_the_newest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(answers, "UPLOADS", tmp_path)
    monkeypatch.setattr(answers, "_checked_uploads", OrderedDict())
    monkeypatch.setattr(answers, "_MEMO_LIMIT", 2)
    paths = [
        answers.resolve(PageJob(config_json=f'{{"model_type": "bert", "hidden_size": {h}}}'))
        for h in (64, 128, 256)
    ]
    assert list(answers._checked_uploads.values()) == paths[1:]
    monkeypatch.setattr(answers, "_TOTALS", OrderedDict())
    monkeypatch.setattr(answers, "_TOTALS_LIMIT", 3)
    for batch in range(1, 6):
        answers._remember(BERT, "bert-base-uncased", batch, 128, batch * 100)
    assert [key[1] for key in answers._TOTALS] == [3, 4, 5]
    assert answers._total(BERT, "bert-base-uncased", 5, 128) == 500


def _fake_plan(settings: dict[str, Any]) -> Any:
    """A plan that chose ``settings`` (what trainer_lines reads of memfit.plan.Plan)."""
    return SimpleNamespace(chosen=SimpleNamespace(settings=lambda: settings))


def test_the_trainer_lines_say_the_effective_batch_args_must_have() -> None:
    from memfit.integrations import apply_plan
    from memfit.report.console import PLAN_SAFETY_MARGIN

    chosen = {"micro_batch_size": 4, "gradient_accumulation_steps": 16, "world_size": 1}
    job = dataclasses.replace(BERT, effective_batch_size=64)
    lines = answers.trainer_lines(_fake_plan(chosen), job, "bert-base-uncased")
    assert (
        "# per_device_train_batch_size × gradient_accumulation_steps × world size must be 64"
        in (lines)
    )
    assert "    per_device_train_batch_size=4," in lines
    assert "    gradient_accumulation_steps=16," in lines
    # the safety margin is said only where it is not apply_plan's own default
    assert inspect.signature(apply_plan).parameters["safety_margin"].default == PLAN_SAFETY_MARGIN
    assert not any("safety_margin" in line for line in lines)
    other = dataclasses.replace(job, safety_margin=0.1)
    call = answers.trainer_lines(_fake_plan(chosen), other, "bert-base-uncased")
    assert any(line.endswith(", safety_margin=0.1)") for line in call)
