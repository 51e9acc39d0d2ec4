"""memfit ui's page (:mod:`memfit.ui.app`): the page builds with the elements the browser test
finds, and the handlers behind its events answer as the CLI does, called directly: a link's job,
a slider's move, a bad model, a broken upload, a bug in the answers, none of them raising."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from xml.etree import ElementTree

import pytest

gr = pytest.importorskip("gradio")

from cli_run import run_cli  # noqa: E402
from memfit.ui import answers  # noqa: E402
from memfit.ui import app as page  # noqa: E402
from memfit.ui.job import KNOB_GROUPS, PageJob, estimate_argv, knob_widget, to_query  # noqa: E402

OUT = {name: i for i, name in enumerate(page.ESTIMATE_OUTPUTS)}
PLAN_OUT = {name: i for i, name in enumerate(page.PLAN_OUTPUTS)}
CURVE_OUT = {name: i for i, name in enumerate(page.CURVE_OUTPUTS)}


def _skipped(value: Any) -> bool:
    """Whether an output is left as it was (gr.skip())."""
    return isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1


def _cli_total(capsys: pytest.CaptureFixture[str], job: PageJob, model: str) -> int:
    """The total ``memfit estimate … --json`` prints for ``job`` (the command the page shows)."""
    code, out, err = run_cli(capsys, *estimate_argv(job, model), "--json")
    assert code == 0, err
    return int(json.loads(out)["total_bytes"])


def _job(model: str, **changes: Any) -> PageJob:
    """A small job of ``model`` on the CPU with a 1 GiB budget (no card)."""
    base: dict[str, Any] = {
        "model": model,
        "gpu": None,
        "gpu_memory": "1GiB",
        "batch_size": 2,
        "seq_len": 32,
        "knobs": {"device": "cpu"},
    }
    return PageJob(**(base | changes))


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("memfit: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("memfit: error: ")


def test_the_page_builds_with_the_elements_the_browser_test_finds() -> None:
    demo = page.build_app()
    ids = {block.elem_id: block for block in demo.blocks.values() if block.elem_id}
    contract = {
        "model": gr.Dropdown, "config-upload": gr.File, "task": gr.Dropdown, "gpu": gr.Dropdown,
        "gpu-memory": gr.Textbox, "batch-size": gr.Slider, "seq-len": gr.Slider,
        "effective-batch-size": gr.Number, "allow": gr.CheckboxGroup, "plan-button": gr.Button,
        "error": gr.Markdown, "headline": gr.Markdown, "total-bytes": gr.Textbox,
        "verdict": gr.Markdown, "breakdown": gr.HTML, "seq-curve": gr.HTML,
        "batch-curve": gr.HTML, "curve-note": gr.Markdown, "cli-command": gr.Textbox,
        "link": gr.Textbox, "plan-out": gr.Markdown, "plan-commands": gr.Code,
        "plan-trainer": gr.Code, "plan-json": gr.Code,
    }  # fmt: skip
    for elem_id, kind in contract.items():
        assert isinstance(ids.get(elem_id), kind), elem_id
    # every knob, by its flag without "--", as the widget its kind needs
    kinds = {"choice": gr.Dropdown, "bool": gr.Checkbox, "int": gr.Number, "float": gr.Number}
    for name in (n for names in KNOB_GROUPS.values() for n in names):
        widget = knob_widget(name)
        assert isinstance(ids.get(widget.elem_id), kinds.get(widget.kind, gr.Textbox)), name
    assert not ids["total-bytes"].interactive
    # the estimator's work: one group of one, whatever the tab; the sliders' moves (from the fit)
    # skip the queue and answer the last move
    work = [f for f in demo.fns.values() if f.name and f.name.startswith("_gradio_")]
    sliders = {ids["batch-size"]._id, ids["seq-len"]._id}
    moved = [f for f in work if any(t[0] in sliders and t[1] == "change" for t in f.targets)]
    assert len(moved) == 2 and {f.trigger_mode for f in moved} == {"always_last"}
    # ... the verdict, then the curves (which never trace), both unqueued
    curves = [f for f in work if f.name == "_gradio_curves_moved"]
    assert len(curves) == 2 and not any(f.queue for f in moved + curves)
    queued = [f for f in work if f not in moved + curves]
    # every chained step answers its last trigger (Gradio's default, "once", would skip a newer
    # run while the older one is pending: the page would go on showing the older job)
    chained = [f for f in demo.fns.values() if any(t[1] == "then" for t in f.targets)]
    assert len(chained) > 50 and {f.trigger_mode for f in chained} == {"always_last"}
    assert queued and all(f.queue is not False for f in queued)
    assert {(f.concurrency_id, f.concurrency_limit) for f in queued} == {(page.ESTIMATOR, 1)}


def test_a_slider_move_waits_for_the_estimator_another_tab_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sliders skip Gradio's queue: their answer waits on the lock the queued work holds."""
    import threading
    import time

    entered = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def slow_plan(job: PageJob, listen: Any = None) -> Any:
        order.append("plan begins")
        entered.set()
        release.wait(10)
        order.append("plan ends")
        raise RuntimeError("stop here")

    def estimate(job: PageJob, listen: Any = None) -> Any:
        order.append("estimate")
        raise RuntimeError("stop here")

    monkeypatch.setattr(answers, "plan_answer", slow_plan)
    monkeypatch.setattr(answers, "estimate_answer", estimate)
    values = page.values_of(PageJob())
    planner = threading.Thread(target=page.answer_plan, args=values)
    planner.start()
    assert entered.wait(10)
    mover = threading.Thread(target=page.answer_estimate, args=values)
    mover.start()
    time.sleep(0.2)
    assert order == ["plan begins"]  # the move waits
    release.set()
    planner.join(10)
    mover.join(10)
    assert order == ["plan begins", "plan ends", "estimate"]


def test_a_link_loads_its_job_and_the_total_is_the_clis(
    tiny_bert: str, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tiny_bert, knobs={"device": "cpu", "precision": "bf16"})
    params = dict(pair.split("=", 1) for pair in to_query(job).split("&"))
    params["model"] = tiny_bert  # the query quotes the path
    out = page.load_page(params)
    (shown, kept, config), outputs = out[:3], out[3:]
    assert kept == page.values_of(job) and config is None  # what the sliders' moves answer
    # the inputs, set in the browser (a script), the length's slider with its range
    inputs = dict(zip(page.SHOWN, json.loads(shown), strict=True))
    assert inputs["model"] == tiny_bert and inputs["precision"] == "bf16"
    assert inputs["seq_len"] == {"__type__": "update", "maximum": 32_768, "value": 32}
    assert outputs[OUT["error"]] == ""
    total = int(outputs[OUT["total-bytes"]])
    assert total == _cli_total(capsys, job, tiny_bert)
    assert outputs[OUT["query"]] == to_query(job)
    # the breakdown's parts fill the bar to the total (the budget is the bar's length), with
    # the peak's phase in its caption
    bar = outputs[OUT["breakdown"]]
    assert "phase: " in bar
    widths = [float(w) for w in re.findall(r'class="memfit-part"[^>]*width:([0-9.]+)%', bar)]
    budget = 1 << 30  # the job's 1GiB
    assert sum(widths) == pytest.approx(100 * total / max(total, budget), abs=1e-3)
    assert 'left:100.0000%" title="the budget: ' in bar or total > budget


def test_a_slider_move_answers_as_the_cli_with_the_budget_on_the_curves(
    tiny_bert: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = page.answer_estimate(*page.values_of(_job(tiny_bert)))
    moved_job = _job(tiny_bert, seq_len=64)
    moved = page.answer_estimate(*page.values_of(moved_job))
    assert moved[OUT["error"]] == ""
    assert int(moved[OUT["total-bytes"]]) > int(first[OUT["total-bytes"]])
    assert int(moved[OUT["total-bytes"]]) == _cli_total(capsys, moved_job, tiny_bert)
    assert moved[OUT["cli-command"]].startswith("memfit estimate ")
    # then the curves, the event's second step
    tab = SimpleNamespace(session_hash="tab-curves")
    curves = page.answer_curves(*page.values_of(moved_job), request=tab)
    curve = ElementTree.fromstring(curves[CURVE_OUT["seq-curve"]])
    assert curve.get("data-axis") == "seq_len"
    (budget,) = curve.findall("line[@class='memfit-budget']")
    assert int(budget.get("data-bytes") or 0) == 1 << 30
    points = {
        int(c.get("data-x") or 0): int(c.get("data-bytes") or 0)
        for c in curve.findall("circle[@class='memfit-point']")
    }
    # each point is the estimate of its shape (the CLI's total)
    assert points[64] == int(moved[OUT["total-bytes"]])
    assert "at batch" in curves[CURVE_OUT["curve-note"]]
    # the length moves again: the length curve (at the same batch) is not sent again, the batch
    # curve (at the new length) is
    again = page.answer_curves(*page.values_of(_job(tiny_bert, seq_len=48)), request=tab)
    assert _skipped(again[CURVE_OUT["seq-curve"]])
    assert not _skipped(again[CURVE_OUT["batch-curve"]])
    # a refused job empties the curves (they would be another job's)
    refused = page.answer_curves(*page.values_of(PageJob(model="no-such-model-x")), request=tab)
    assert refused == ["", "", ""]


def test_a_bad_model_is_the_clis_line_and_the_rest_is_emptied(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no wait for the Hub
    out = page.answer_estimate(*page.values_of(PageJob(model="no-such-model-x")))
    line = _cli_error(capsys, "estimate", "no-such-model-x", "--task", "classification",
                      "--batch-size", "8", "--seq-len", "128")  # fmt: skip
    assert out[OUT["error"]] == line
    # no answer beside the inputs of another job (nor its link)
    assert all(v == "" for v in out[1:])


def test_a_broken_upload_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "bert", "hidden_size": ', encoding="utf-8")
    text, model_box = page.read_upload(str(broken))
    assert text is not None and model_box["interactive"] is False
    out = page.answer_estimate(*page.values_of(PageJob(config_json=text)))
    line = out[OUT["error"]]
    assert line and "\n" not in line and not line.startswith("internal error")
    assert "config" in line.lower()
    assert all(v == "" for v in out[1:])
    # cleared: the model box is the model again
    assert page.read_upload(None) == (None, gr.update(interactive=True))


def test_a_bad_link_or_value_is_one_line_with_the_page_at_its_defaults() -> None:
    out = page.load_page({"seq-len": "abc"})
    names = page.input_names()
    assert json.loads(out[0])[page.SHOWN.index("model")] == PageJob().model
    error = out[3 + OUT["error"]]
    assert error.startswith("link: seq-len: ") and "\n" not in error
    values = page.values_of(PageJob())
    values[names.index("batch_size")] = 2.5
    assert page.answer_estimate(*values)[OUT["error"]].startswith("--batch-size: ")


def test_a_bug_in_the_answers_is_said_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tracer fell over")

    monkeypatch.setattr(answers, "estimate_answer", broken)
    monkeypatch.setattr(answers, "plan_answer", broken)
    values = page.values_of(PageJob())
    out = page.answer_estimate(*values)
    assert out[OUT["error"]] == "internal error: RuntimeError: the tracer fell over"
    assert all(v == "" for v in out[1:])
    planned = page.answer_plan(*values)
    assert planned[PLAN_OUT["error"]] == "internal error: RuntimeError: the tracer fell over"
    # its traceback is the server's, on stderr
    assert "Traceback" in capsys.readouterr().err


def test_an_input_the_session_was_answered_already_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[PageJob] = []

    def answered(job: PageJob, listen: Any) -> list[Any]:
        calls.append(job)
        return ["", "h", "1", "v", None, "c", to_query(job)]

    monkeypatch.setattr(page, "_estimate_outputs", answered)
    request = SimpleNamespace(session_hash="tab-1")
    values = page.values_of(PageJob())
    page.answer_estimate(*values, request=request)
    again = page.answer_estimate(*values, request=request)  # the page set a slider to the same
    other_tab = page.answer_estimate(*values, request=SimpleNamespace(session_hash="tab-2"))
    assert len(calls) == 2 and all(_skipped(v) for v in again) and other_tab[2] == "1"


def test_a_slider_move_answers_only_from_traces_made_and_leaves_a_new_kind_to_the_queue(
    tiny_bert: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move skips Gradio's queue: it never traces (a new kind of shape: skipped there, answered
    by the queued step after it, which shows its progress)."""
    from memfit.estimate import traces

    # traces of this process and the session's disk cache left out: another test may have traced
    # the odd-length kind of these knobs already
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    monkeypatch.setattr(traces, "_CACHE", {})
    page.answer_estimate(*page.values_of(_job(tiny_bert)))  # traced: 2 × 32
    tab = SimpleNamespace(session_hash="tab-moves")
    moved = page.answer_estimate(
        *page.values_of(_job(tiny_bert, seq_len=48)), request=tab, cached_only=True
    )
    assert moved[OUT["error"]] == "" and int(moved[OUT["total-bytes"]]) > 0
    traced: list[Any] = []
    original = traces.trace_model
    monkeypatch.setattr(
        traces, "trace_model", lambda *a, **k: traced.append(a) or original(*a, **k)
    )
    odd = page.values_of(_job(tiny_bert, seq_len=33))  # a length that is no multiple of 8
    skipped = page.answer_estimate(*odd, request=tab, cached_only=True)
    assert all(_skipped(v) for v in skipped) and not traced
    # the queued step after it traces and answers
    answered = page.answer_estimate(*odd, request=tab)
    assert answered[OUT["error"]] == "" and int(answered[OUT["total-bytes"]]) > 0 and traced


def test_a_move_answers_the_inputs_the_tab_kept_with_the_sliders_own(tiny_bert: str) -> None:
    """A move sends the two sliders and the tab's kept inputs (not the forty inputs): its answer
    is the estimate of the kept job at the sliders' shape, its curves those of that job."""
    kept = page.keep_inputs(*page.values_of(_job(tiny_bert, knobs={"precision": "bf16"})))
    page.answer_estimate(*kept)  # traced: 2 × 32
    moved = page.answer_moved(4, 48, kept, request=SimpleNamespace(session_hash="tab-kept"))
    direct = page.answer_estimate(*page.values_of(_job(tiny_bert, batch_size=4, seq_len=48,
                                                       knobs={"precision": "bf16"})))  # fmt: skip
    assert moved[OUT["error"]] == "" and moved[OUT["total-bytes"]] == direct[OUT["total-bytes"]]
    assert "--precision bf16" in moved[OUT["cli-command"]]
    curves = page.curves_moved(4, 48, kept, request=SimpleNamespace(session_hash="tab-kept"))
    assert "(48 tokens)" in curves[CURVE_OUT["batch-curve"]]
    # before the page's load kept anything (or a state of another page's inputs): nothing sent,
    # the queued step after the move answers from every input
    for stale in (None, kept[:-1]):
        assert all(_skipped(v) for v in page.answer_moved(4, 48, stale))
        assert all(_skipped(v) for v in page.curves_moved(4, 48, stale))


def test_a_model_picked_sets_the_length_in_range_and_keeps_it_for_the_moves() -> None:
    names = page.input_names()
    values = page.values_of(PageJob(model="bert-base-uncased", seq_len=2048))
    slider, kept = page.model_picked(*values)
    assert slider["maximum"] == 512 and slider["value"] == 512
    assert kept[names.index("seq_len")] == 512 and kept[names.index("model")] == "bert-base-uncased"
    # a length in range is kept as it is
    slider, kept = page.model_picked(*page.values_of(PageJob(model="gpt2", seq_len=300)))
    assert "value" not in slider and kept[names.index("seq_len")] == 300


def test_a_page_served_to_others_reads_no_path_on_its_server(
    tiny_bert: str, tmp_path: Path
) -> None:
    try:
        page.build_app(local_paths=False)
        for model in (tiny_bert, "/etc", str(tmp_path / "config.json"), "./models/x"):
            out = page.answer_estimate(*page.values_of(_job(model)))
            assert out[OUT["error"]].startswith("model: this page is served to other machines")
        # names are fine
        assert page._path_problem("bert-base-uncased") is None
    finally:
        page.build_app(local_paths=True)
    out = page.answer_estimate(*page.values_of(_job(tiny_bert)))
    assert out[OUT["error"]] == ""
