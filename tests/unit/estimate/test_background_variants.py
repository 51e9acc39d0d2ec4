"""The other kinds of shape (a batch of one, odd lengths), traced in the background after a first
estimate (:mod:`memfit.estimate.background`): later asked, they take no trace in this process and
answer what a trace of their own says; a request while one is traced waits for it; the one-shot
CLI, ``MEMFIT_NO_BACKGROUND=1`` and a one-core machine start nothing."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import memfit.estimate as estimate_package
from cli_run import run_cli
from memfit import progress
from memfit.errors import UsageError
from memfit.estimate import background, estimate, traces
from memfit.estimate.api import is_traced
from memfit.models import resolve_model

SHAPES = [(1, 64), (3, 63), (1, 63)]  # batch 1, an odd length, both: each its own kind
# what differs between two answers of the same trace: how long things took
TIMINGS = ("trace_seconds", "estimate_seconds")


@pytest.fixture
def background_on(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The background on (two cores), no disk cache (the variants must come from the worker),
    and the in-process traces counted: each ``trace_model`` call's shapes."""
    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    calls: list[Any] = []
    original = traces.trace_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(traces, "trace_model", counted)
    traces.clear_cache()
    yield calls
    background.wait_all(300)
    traces.clear_cache()


def _answer(model: str, shape: tuple[int, int]) -> dict[str, Any]:
    result = estimate(model, task="classification", batch_size=shape[0], seq_len=shape[1])
    answer = result.to_dict()
    answer["details"] = {k: v for k, v in answer["details"].items() if k not in TIMINGS}
    return answer


@pytest.mark.slow
def test_later_kinds_take_no_trace_and_answer_as_their_own_trace(
    tiny_bert: str, background_on: list[Any]
) -> None:
    _answer(tiny_bert, (4, 64))
    assert len(background_on) == 1  # the first estimate's own trace
    assert background.wait_all(300)
    assert sorted(j.state for j in background._JOBS.values()) == ["done"] * 3
    answers = [_answer(tiny_bert, shape) for shape in SHAPES]
    assert len(background_on) == 1, "a kind traced in the background was traced again"

    # what this process traces of each kind itself, as before the background
    traces.clear_cache()
    with background.off():
        _answer(tiny_bert, (4, 64))
        expected = [_answer(tiny_bert, shape) for shape in SHAPES]
    assert len(background_on) == 2 + len(SHAPES)
    assert answers == expected


@pytest.mark.slow
def test_a_request_waits_for_the_kind_being_traced(
    tiny_gpt2: str, background_on: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(progress, "report", said.append)
    estimate(tiny_gpt2, task="causal-lm", batch_size=4, seq_len=64)
    assert len(background_on) == 1
    # the last kind the worker takes up (batch 1, an odd length): the others are traced first
    last = next(j for j in background._JOBS.values() if j.key[1] == (True, False))
    deadline = time.monotonic() + 120
    while last.state == "queued" and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker starting (importing torch), then tracing the others
    # on a loaded machine this thread may look only after the worker finished the kind (a CI
    # run saw "done"): then the request below has nothing to wait for, and only the rest holds
    running = last.state == "running"
    assert running or last.state == "done", last.state
    estimate(tiny_gpt2, task="causal-lm", batch_size=1, seq_len=63)
    assert last.state == "done"
    assert len(background_on) == 1, "the kind being traced in the background was traced twice"
    waiting = "waiting for the batch-1 shapes of lengths that are no multiple of 8, being traced"
    assert any(line.startswith(waiting) for line in said) == running


def test_a_kind_not_begun_is_taken_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the worker starts (seconds: torch), the caller is sooner: it does the work itself,
    and the worker never gets it."""
    starting, release = threading.Event(), threading.Event()
    asked: list[Any] = []

    def slow_start() -> None:
        starting.set()
        release.wait(10)
        return None  # and then it cannot start at all

    background.shutdown()  # a fresh thread, which starts the (fake) worker below
    monkeypatch.setattr(background, "_start_worker", slow_start)
    monkeypatch.setattr(background, "_ask", lambda worker, job: asked.append(job))
    job = background.submit(("test", "taken"), "a test", ("time", "sleep"), (0,), asked.append)
    assert job is not None and starting.wait(10)
    assert background.wait_for(("test", "taken")) is False
    assert job.state == "taken" and job.done.is_set()
    release.set()
    assert background.wait_all(10)
    assert asked == []
    background.forget()


def test_a_worker_that_cannot_start_leaves_the_work_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    background.shutdown()
    monkeypatch.setattr(background, "_start_worker", lambda: None)
    job = background.submit(("test", "failed"), "a test", ("time", "sleep"), (0,), print)
    assert job is not None and background.wait_all(10)
    assert job.state == "failed"
    assert background.wait_for(("test", "failed")) is False
    background.forget()


def _entry() -> Any:
    """What :func:`traces._start_background` reads of a first trace (batch 4 × 64's kind)."""
    return SimpleNamespace(
        _background_key=None,
        fitted=object(),
        variant_key=None,
        home_key=(False, True),
        _variants={},
        spec=None,
        trace_depth="auto",
        max_positions=128,
        profile=None,
        config=None,
    )


def test_started_with_the_nearest_kind_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    submitted: list[Any] = []
    monkeypatch.setattr(
        background, "submit", lambda key, *rest, **keywords: submitted.append(key[1])
    )
    traces._start_background(_entry(), ("model", None, "auto"))
    # a batch of one (a plan's micro-batch 1), then other lengths, then both
    assert submitted == [(True, True), (False, False), (True, False)]


@pytest.mark.parametrize("where", ["MEMFIT_NO_BACKGROUND=1", "one core", "off()"])
def test_nothing_started_where_off(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    if where == "MEMFIT_NO_BACKGROUND=1":
        monkeypatch.setenv(background.OFF_VARIABLE, "1")
    if where == "one core":
        monkeypatch.setattr(background, "_spare_core", background_spare_core)
        monkeypatch.setattr(background, "_cores", lambda: 1)
        monkeypatch.setattr(background, "_running_tasks", lambda: 1)
    submitted: list[Any] = []
    monkeypatch.setattr(background, "submit", lambda key, *rest, **keywords: submitted.append(key))
    if where == "off()":
        with background.off():
            traces._start_background(_entry(), ("model", None, "auto"))
    else:
        traces._start_background(_entry(), ("model", None, "auto"))
    assert submitted == []


background_spare_core = background._spare_core


@pytest.mark.parametrize(
    ("cores", "running", "spare"),
    [(1, 1, False), (2, 1, True), (2, 2, True), (2, 3, False), (8, 9, False), (2, None, True)],
)
def test_a_spare_core_is_an_idle_one(
    monkeypatch: pytest.MonkeyPatch, cores: int, running: int | None, spare: bool
) -> None:
    """Where more tasks run than there are cores (this process's own among them), a worker
    would only slow them all down."""
    monkeypatch.setattr(background, "_cores", lambda: cores)
    monkeypatch.setattr(background, "_running_tasks", lambda: running)
    assert background._spare_core() is spare


def test_cli_estimate_starts_no_background(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-shot CLI exits after its answer: no worker left behind, no core burnt after."""
    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    seen: list[bool] = []

    def fake_estimate(*args: Any, **kwargs: Any) -> Any:
        seen.append(background.enabled())
        raise UsageError("--seq-len: stop here")

    monkeypatch.setattr(estimate_package, "estimate", fake_estimate)
    code, _, err = run_cli(
        capsys, "estimate", "gpt2", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "8"
    )
    assert code == 2 and "stop here" in err
    assert seen == [False]
    assert background.enabled()  # and on again after it


@pytest.mark.slow
def test_trace_kinds_writes_every_kind_to_the_disk_cache(
    tiny_bert: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a plan's worker calls: every kind of shape it names is answered from the disk cache
    afterwards, in another process (here: this one, its memory forgotten)."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    monkeypatch.setenv(background.OFF_VARIABLE, "1")
    traces.clear_cache()
    shapes = [(2, 64), (1, 64), (3, 63), (1, 63)]  # the kinds of traces.KINDS, in its order
    knobs: dict[str, Any] = dict(task="classification")
    expected = [_answer(tiny_bert, shape) for shape in shapes]
    (key,) = traces._CACHE
    traces.clear_cache()
    for path in tmp_path.rglob("*.json.z"):
        path.unlink()
    traces.trace_kinds(resolve_model(tiny_bert), key[1], key[2])
    traces.clear_cache()
    assert all(is_traced(tiny_bert, **knobs, batch_size=b, seq_len=s) for b, s in shapes)
    assert [_answer(tiny_bert, shape) for shape in shapes] == expected
    traces.clear_cache()


def test_no_worker_starts_after_exit_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """At exit the worker is killed; its thread, seeing it gone, must not start another for the
    jobs still queued (an orphan importing torch after this process has ended)."""
    background.shutdown()
    monkeypatch.setattr(background, "_EXITING", False)  # (both set back after the test)
    monkeypatch.setattr(background, "_WORKER", None)
    started: list[object] = []
    running, killed = threading.Event(), threading.Event()

    def start() -> object:
        worker = object()
        started.append(worker)
        background._WORKER = worker  # type: ignore[assignment]
        return worker

    def ask(worker: object, job: Any) -> None:
        running.set()
        killed.wait(10)
        return None  # what a killed worker answers: nothing

    monkeypatch.setattr(background, "_start_worker", start)
    monkeypatch.setattr(background, "_ask", ask)
    monkeypatch.setattr(background, "_stop_worker", lambda worker: killed.set())
    first = background.submit(("test", "exit", 1), "a test", ("time", "sleep"), (0,), print)
    second = background.submit(("test", "exit", 2), "a test", ("time", "sleep"), (0,), print)
    assert first is not None and second is not None and running.wait(10)
    background._at_exit()
    assert background.wait_all(10)
    assert first.state == "failed" and second.state == "taken"
    assert len(started) == 1, "a worker was started after exit began"
    assert background.submit(("test", "exit", 3), "a test", ("time", "sleep"), (0,), print) is None
    background.forget()


def test_a_forked_child_leaves_its_parents_worker_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child inherits the parent's state: its exit must not kill the parent's worker,
    and it starts afresh."""
    killed: list[object] = []
    monkeypatch.setattr(background, "_stop_worker", killed.append)
    monkeypatch.setattr(background, "_WORKER", object())
    monkeypatch.setattr(background, "_OWNER", background._OWNER + 1)  # as in a forked child
    background._at_exit()
    background.shutdown()
    assert killed == []
    monkeypatch.undo()
    monkeypatch.setattr(background, "_WORKER", object())  # the parent's
    pid = os.fork()
    if pid == 0:  # the child: afresh, its own owner
        fresh = background._WORKER is None and background._JOBS == {}
        os._exit(0 if fresh and os.getpid() == background._OWNER else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _standalone_worker() -> subprocess.Popen[bytes]:
    """The worker's loop, loaded from its file alone (not the package: no torch, milliseconds)."""
    code = (
        "import importlib.util as u, sys; "
        f"s = u.spec_from_file_location('background_alone', {background.__file__!r}); "
        "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m._serve()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


def test_a_request_the_worker_cannot_load_fails_alone() -> None:
    """A request whose pickle names a class the worker cannot import (a model's remote code) is
    one failed job: the worker answers the next; and Ctrl-C is not the worker's."""
    worker = _standalone_worker()
    assert worker.stdin is not None and worker.stdout is not None
    try:
        assert pickle.loads(background._read_frame(worker.stdout) or b"") == "ready"
        worker.send_signal(signal.SIGINT)
        background._write_frame(worker.stdin, b"cno_such_module_of_remote_code\nConfig\n.")
        status, error = pickle.loads(background._read_frame(worker.stdout) or b"")
        assert status == "error" and "no_such_module_of_remote_code" in error
        background._write_frame(worker.stdin, pickle.dumps((("os", "getpid"), ())))
        assert pickle.loads(background._read_frame(worker.stdout) or b"") == ("ok", worker.pid)
    finally:
        worker.stdin.close()
        assert worker.wait(10) == 0  # its stdin closed: it ends by itself


def test_the_worker_starts_in_a_session_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A terminal's Ctrl-C goes to its foreground process group.) And memfit's folder is on its
    path only where it is not an installed one's site-packages, which would shadow the standard
    library."""
    asked: list[dict[str, Any]] = []

    def popen(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        raise OSError("not here")

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(background, "_EXITING", False)
    assert background._start_worker() is None
    assert asked[0]["start_new_session"] is True
    here = str(Path(background.__file__).resolve().parents[2])
    assert asked[0]["env"]["PYTHONPATH"].split(os.pathsep)[0] == here
    assert background._on_default_path(str(Path(sysconfig.get_path("purelib")).resolve()))
    assert not background._on_default_path(here)


def test_a_kind_someone_else_submitted_is_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit`` returns None for a key already known: not this trace's job (nor dropped by it)."""
    monkeypatch.delenv(background.OFF_VARIABLE, raising=False)
    monkeypatch.setattr(background, "_spare_core", lambda: True)
    monkeypatch.setattr(
        background, "submit", lambda key, *rest, **keywords: None if key[1][0] else object()
    )
    entry = _entry()
    assert traces._submit_kinds(
        ("model", None, "auto"), None, None, "auto", 128, None, (False, True)
    ) == [(("model", None, "auto"), (False, False))]
    monkeypatch.setattr(background, "submit", lambda *args, **keywords: None)
    traces._start_background(entry, ("model", None, "auto"))
    assert entry._background_key is None


def test_an_arrived_kind_is_taken_in_without_saving_or_collecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the background's thread, while this process may be tracing: the variant is put in its
    place and marked for the next save; no save (traces being extended unlocked), no collection
    (it would fire a running trace's weak references at a random point)."""
    done: list[str] = []
    monkeypatch.setattr(traces, "save_traces", lambda: done.append("saved"))
    monkeypatch.setattr(gc, "collect", lambda *args: done.append("collected"))
    key = ("model", None, "auto")
    entry = _entry()
    entry._background_key, entry._dirty, entry.config = key, False, "the config"
    monkeypatch.setitem(traces._CACHE, key, entry)  # type: ignore[arg-type]
    variant = SimpleNamespace(config=None, mark_saved=lambda: None)
    traces._arrived(key, (True, True), variant)  # type: ignore[arg-type]
    assert entry._variants == {(True, True): variant} and variant.config == "the config"
    assert done == []

    # the lock held (by a trace, or by a request waiting for this very job): never waited for
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with traces._LOCK:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    later = SimpleNamespace(config=None, mark_saved=lambda: None)
    traces._arrived(key, (False, False), later)  # type: ignore[arg-type]
    release.set()
    holder.join(10)
    assert (False, False) not in entry._variants
    assert traces._adopt(entry)  # the next to look takes it in
    assert entry._variants[(False, False)] is later and done == []


def test_arrived_kinds_are_written_at_exit_not_by_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next estimate after kinds arrived writes nothing (a write of a deep model's traces
    is up to a second on that request); the process's exit does."""
    registered: list[Any] = []
    monkeypatch.setattr(traces, "_WRITE_AT_EXIT", [])
    monkeypatch.setattr(traces.atexit, "register", registered.append)
    written: list[Any] = []
    monkeypatch.setattr(traces.cache, "path_for", lambda key: "a path")
    monkeypatch.setattr(traces.cache, "write", lambda path, entry, key: written.append(entry))
    key = ("model", None, "auto")
    entry = traces.Traced("the config", None, None, None, None, 0.0)  # type: ignore[arg-type]
    entry._background_key = key
    entry.mark_saved()
    monkeypatch.setattr(traces, "_CACHE", {key: entry})
    variant = traces.Traced(None, None, None, None, None, 0.0)  # type: ignore[arg-type]
    traces._arrived(key, (True, True), variant)
    assert entry._variants[(True, True)] is variant
    assert not entry.changed()  # the next request's save_traces() writes nothing
    traces.save_traces()
    assert written == []
    assert registered == [traces._write_arrivals]
    traces._write_arrivals()  # at exit
    assert written == [entry] and not entry.changed() and not entry._unsaved_arrivals
