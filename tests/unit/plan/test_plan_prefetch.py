"""A plan's traces on both cores (:class:`memfit.estimate.prefetch.Ahead`, the planner's
:func:`~memfit.plan.planner.prefetch`) and its status line: "tracing k of about n knob sets"."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from memfit import progress
from memfit.estimate import prefetch as prefetching
from memfit.estimate.prefetch import Ahead, trace_seconds, worth_workers
from memfit.models import resolve_model
from memfit.plan import planner

two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="workers need two cores")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def nothing_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every knob set expected is still to trace (no estimate runs to find out)."""
    monkeypatch.setattr(prefetching, "_traced", lambda model, call: False)


def test_the_expected_trace_cost_counts_the_layers_each_trace_runs() -> None:
    from transformers import BertConfig

    llama = resolve_model("meta-llama/Llama-3.1-8B").config
    # the 8B plan with LoRA and quantization allowed traces about 24 kinds of shape at the start
    # (the least configurations at a batch of one, the first round's at the whole batch)
    per_kind = trace_seconds(llama, 1)
    assert 2 <= per_kind <= 10  # three and four layers traced, not 32
    assert worth_workers(24 * per_kind)
    assert worth_workers(4 * per_kind)  # even four knob sets pay for one start
    # one knob set does not: its worker would start about when the main process is done
    assert not worth_workers(per_kind)
    # a model traced whole costs its every layer
    assert trace_seconds(llama, 1, "full") > 5 * per_kind
    tiny = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2)
    assert trace_seconds(tiny, 1) < per_kind


def _ahead(kinds: int, per_kind: float) -> Ahead:
    ahead = Ahead("some-model")
    for i in range(kinds):
        ahead.expect(("knobs", i), [{"batch_size": 1}])
    ahead.seconds_per_kind = per_kind
    return ahead


def test_workers_start_for_what_pays_and_never_without_the_disk_cache(
    monkeypatch: pytest.MonkeyPatch, nothing_traced: None
) -> None:
    started: list[int] = []
    monkeypatch.setattr(Ahead, "start", lambda self, n: started.append(n) or n)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    llama = resolve_model("meta-llama/Llama-3.1-8B").config
    # one worker on two cores: the main process traces too
    assert planner.prefetch("m", _ahead(12, trace_seconds(llama, 1))) == 1
    assert started == [1]
    # a few-layer model's plan (seconds_per_kind 0: the planner's rule), or one knob set: none
    assert planner.prefetch("m", _ahead(12, 0.0)) == 0
    assert planner.prefetch("m", _ahead(1, 100.0)) == 0
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    assert planner.prefetch("m", _ahead(12, 100.0)) == 0
    monkeypatch.delenv("MEMFIT_NO_CACHE")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert planner.prefetch("m", _ahead(12, 100.0)) == 0
    assert started == [1]


def test_the_count_grows_when_the_search_asks_more_than_expected(nothing_traced: None) -> None:
    said: list[str] = []
    ahead = Ahead("some-model", say=said.append)
    for i in range(3):
        ahead.expect(i, [{"batch_size": 1}])
    assert said[-1] == "tracing 1 of about 3 knob sets"
    ahead.need(0)
    ahead._units[0].started -= 2.0  # it took two seconds
    ahead.need(1)
    assert said[-1] == "tracing 2 of about 3 knob sets, about 3 s left"
    ahead.need(2)
    ahead.need("more")  # not expected: n grows
    assert said[-1].startswith("tracing 4 of about 4 knob sets")
    # an expected knob set already traced is no work: not counted
    ahead.expect(0, [{"batch_size": 2}])
    ahead.close()
    assert ahead.counts()[:2] == (4, 4)
    # a round over: the knob sets nobody took are no longer expected
    later = Ahead("some-model", say=said.append)
    for i in range(3):
        later.expect(i, [{"batch_size": 1}])
    later.need(0)
    later.drop_untaken(lambda key: False)
    assert said[-1] == "tracing 1 of about 1 knob sets"
    later.close()


def test_the_plan_line_keeps_its_count_against_the_tracer_s_reports(
    monkeypatch: pytest.MonkeyPatch, nothing_traced: None
) -> None:
    for name in (progress.OFF_VARIABLE, "CI", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    with (
        contextlib.redirect_stderr(FakeTerminal()),
        progress.status("loading torch", subject="memfit plan gpt2"),
    ):
        assert progress._shown is not None
        with progress.status("tracing", steady=True):
            ahead = Ahead("gpt2", say=progress.say)
            ahead.expect("a", [{"batch_size": 1}])
            ahead.expect("b", [{"batch_size": 1}])
            ahead.need("a")
            line = progress._shown.levels[-1][1]
            assert line == "tracing 1 of about 2 knob sets"
            progress.report("tracing 3 of 32 layers (4 shapes)")  # the tracer's, inside
            assert progress._shown.levels[-1][1] == line
            ahead.close()
        # the command's own line takes reports again
        progress.report("writing the plan")
        assert progress._shown.levels[-1][1] == "writing the plan"


@two_cores
@pytest.mark.slow
def test_a_worker_that_fails_or_dies_leaves_the_knob_set_to_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nothing_traced: None
) -> None:
    from memfit.errors import UsageError
    from memfit.estimate.api import estimate

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    bad = {"task": "classification", "batch_size": 2, "seq_len": 10**9}  # over the positions
    ahead = Ahead("bert-base-uncased")
    ahead.expect("bad", [bad])
    assert ahead.start(1) == 1
    deadline = time.monotonic() + 120
    while ahead._units[0].state != "worker" and time.monotonic() < deadline:
        time.sleep(0.1)
    ahead.need("bad")  # back when the worker has failed: nothing waits for ever
    # the search's own estimate says what is wrong
    with pytest.raises(UsageError, match="--seq-len"):
        estimate("bert-base-uncased", **bad)
    # a worker killed mid-trace: its knob set goes back to the search
    ahead.expect("slow", [{"task": "classification", "batch_size": 2, "seq_len": 16}])
    while ahead._units[-1].state != "worker" and time.monotonic() < deadline:
        time.sleep(0.05)
    ahead._workers[0][0].kill()
    ahead.need("slow")
    assert ahead._units[-1].state in ("main", "done")
    ahead.close()


def _plan_tiny_deep(folder: Path) -> dict[str, Any]:
    from tiny_models import bert_config

    bert_config(2311, layers=12).save_pretrained(folder)  # 12 layers: depth extrapolated
    result = planner.plan(
        str(folder),
        task="classification",
        seq_len=32,
        effective_batch_size=8,
        gpu_memory="1GiB",
    )
    return json.loads(json.dumps(result.to_dict(), default=str))


@two_cores
@pytest.mark.slow
def test_the_plan_is_the_same_with_workers_tracing_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.estimate import traces

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "alone"))
    monkeypatch.setattr(planner, "worth_workers", lambda seconds: False)
    traces.clear_cache()
    alone = _plan_tiny_deep(tmp_path / "bert")
    started: list[int] = []
    start = Ahead.start
    monkeypatch.setattr(Ahead, "start", lambda self, n: started.append(start(self, n)) or 1)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "side-by-side"))
    monkeypatch.setattr(planner, "worth_workers", lambda seconds: True)
    traces.clear_cache()
    together = _plan_tiny_deep(tmp_path / "bert")
    assert started == [1]
    # the workers' traces are on disk, read by the search
    assert list((tmp_path / "side-by-side" / "traces").glob("*.json.z"))
    assert together == alone


def test_a_plan_traces_nothing_ahead_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan asks the shapes it needs itself: its estimates run with the background tracing of
    other kinds of shape off, even in a process where it is on (a notebook)."""
    from types import SimpleNamespace

    from memfit.estimate import background
    from memfit.plan import plan, search

    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    assert background.enabled()
    seen: list[bool] = []

    def estimate(model: str, **kwargs: Any) -> Any:
        seen.append(background.enabled())
        return SimpleNamespace(
            total_bytes=2**30,
            details={"model_state": {"total_bytes": 2**29}},
            breakdown={"parameters": 2**29, "buffers": 0},
        )

    monkeypatch.setattr(search, "estimate", estimate)
    plan("gpt2", task="causal-lm", seq_len=64, effective_batch_size=4, gpu_memory="16GiB")
    assert seen and not any(seen)
    assert background.enabled()  # on again after the plan
