"""Work done ahead of time on the machine's other core, in one worker process.

A long-lived process (a notebook, a long-lived server) that has traced a model will soon ask
other kinds of shape of it (a batch of one, an odd sequence length), each a trace of its own
(seconds): :mod:`memfit.estimate.traces` traces them here in the background, so that the answer
is arithmetic when it is asked. The tracer is single-threaded Python with module-level state, so
the work runs in a worker process, not a thread: one at a time, started with the first job and
ended when idle (:data:`IDLE_SECONDS`) or when this process ends.

A job is a function named by module and name, with arguments and result that pickle; the result is
handed to the job's ``arrived`` callback (in this module's thread) before anyone waiting for it
wakes up. :func:`wait_for` is what a request does: a job still queued is taken back (the caller
does the work itself, which is sooner than waiting for a worker still importing torch), a running
one is waited for (never done twice), a failed one leaves the work to the caller.

The worker is a plain ``python -c`` child (not ``multiprocessing``: that would run the user's
script again in it, where it has no ``__main__`` guard), at a lower priority (``nice`` 10), in a
session of its own (a terminal's Ctrl-C is this process's, not its worker's), talking over its
stdin and stdout (pickles, each after its length; what the traced code prints goes to its
stderr, discarded). It never outlives this process: it is killed at exit (and no worker starts
after that), and it ends by itself when its stdin closes. Only the process that started it
touches it: a forked child starts afresh, with no jobs and no worker.

Nothing is started (:func:`enabled`) with ``MEMFIT_NO_BACKGROUND=1`` (which the CLI sets for
every command: a command exits after answering), inside :func:`off`, in a process started by
``multiprocessing`` (a plan's trace workers), or on a machine with one core or with every core
busy (:func:`_spare_core`).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import importlib
import multiprocessing
import os
import pickle
import signal
import site
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from memfit import progress

OFF_VARIABLE = "MEMFIT_NO_BACKGROUND"
# a worker with nothing to do for this long exits (its torch import is paid again by the next)
IDLE_SECONDS = 120.0

_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("background_off", default=False)


def enabled() -> bool:
    """Whether work may be started in the background from here (see the module)."""
    if _OFF.get() or os.environ.get(OFF_VARIABLE, "") not in ("", "0"):
        return False
    if multiprocessing.parent_process() is not None:
        return False  # a worker of someone's pool already shares the cores
    return _spare_core()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _spare_core() -> bool:
    """Whether a core may be idle now. This process's is busy; on a machine with more tasks
    running than cores (a test suite, other jobs) a worker would only slow them all down, this
    process included. Linux says how many tasks run now (``/proc/loadavg``, this process's
    thread among them; one other is let pass: a moment's task, or what a core of its own runs);
    elsewhere a second core is taken to be idle."""
    cores = _cores()
    if cores < 2:
        return False
    running = _running_tasks()
    return running is None or running <= cores


def _running_tasks() -> int | None:
    """How many tasks the machine runs now (None where it does not say)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Inside it, nothing is started in the background (jobs already started go on)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


@dataclass(eq=False)
class Job:
    """A function to run in the worker, and what became of it."""

    key: Hashable
    label: str  # what is traced, for the status line of whoever waits for it
    function: tuple[str, str]  # (module, name)
    args: tuple[Any, ...]
    arrived: Callable[[Any], None]
    # modules the worker imports before it takes up its first job (seconds it would otherwise
    # spend in a job someone may be waiting for)
    preload: tuple[str, ...] = ()
    state: str = "queued"  # queued | running | done | failed | taken (by the caller)
    error: str | None = None
    started: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


_COND = threading.Condition()
_QUEUE: list[Job] = []
_JOBS: dict[Hashable, Job] = {}
_THREAD: threading.Thread | None = None
_WORKER: subprocess.Popen[bytes] | None = None
_STOP = False  # set by shutdown(): the thread ends at once
_EXITING = False  # set at exit: no worker starts after it
_OWNER = os.getpid()  # the process whose jobs and worker these are (not a forked child)
# a request's or reply's length, before its pickle: a pickle the worker cannot load (a class it
# cannot import) is one failed job, not a stream out of step
_LENGTH = struct.Struct("<Q")


def _after_fork_in_child() -> None:
    """A forked child starts afresh: the parent's jobs, thread and worker are the parent's (its
    lock may have been held by the thread, which the child has not)."""
    global _COND, _QUEUE, _JOBS, _THREAD, _WORKER, _STOP, _EXITING, _OWNER
    _COND = threading.Condition()
    _QUEUE, _JOBS = [], {}
    _THREAD = _WORKER = None
    _STOP = _EXITING = False
    _OWNER = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def submit(
    key: Hashable,
    label: str,
    function: tuple[str, str],
    args: tuple[Any, ...],
    arrived: Callable[[Any], None],
    preload: tuple[str, ...] = (),
) -> Job | None:
    """Queue ``function(*args)`` for the worker (None when a job of ``key`` is already known)."""
    global _THREAD
    with _COND:
        if _EXITING or os.getpid() != _OWNER:
            return None
        if key in _JOBS and _JOBS[key].state in ("queued", "running", "done"):
            return None
        job = Job(key, label, function, args, arrived, preload)
        _JOBS[key] = job
        _QUEUE.append(job)
        if _THREAD is None:
            _THREAD = threading.Thread(target=_manage, name="memfit-background", daemon=True)
            _THREAD.start()
        _COND.notify_all()
    return job


def wait_for(key: Hashable) -> bool:
    """What a request for the work of ``key`` does: True when the worker did it (its result has
    arrived), False when the caller must do it itself (no such job, taken back from the queue,
    or failed). A running job is waited for, saying so on the status line."""
    with _COND:
        job = _JOBS.get(key)
        if job is None:
            return False
        if job.state == "queued":
            # the caller is sooner than a worker that has not begun it (it may still be starting)
            _QUEUE.remove(job)
            job.state = "taken"
            job.done.set()
            return False
    if job.state == "running":
        progress.report(f"waiting for {job.label}, being traced in the background")
    job.done.wait()
    return job.state == "done"


def wait_all(timeout: float | None = None) -> bool:
    """Wait until every job queued or running has ended; False when ``timeout`` ran out first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _COND:
            pending = [j for j in _JOBS.values() if not j.done.is_set()]
        if not pending:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        pending[0].done.wait(left)


def drop(keys: Any) -> None:
    """Take back the jobs of ``keys`` not begun (a running one's result is still taken in)."""
    with _COND:
        for key in keys:
            job = _JOBS.get(key)
            if job is not None and job.state == "queued":
                _QUEUE.remove(job)
                job.state = "taken"
                job.done.set()


def _drop_queued() -> None:
    """Every job not begun, taken back (under ``_COND``)."""
    for job in _QUEUE:
        job.state = "taken"
        job.done.set()
    _QUEUE.clear()


def forget() -> None:
    """Drop the jobs not begun and what is known of the others (tests start afresh with it)."""
    with _COND:
        _drop_queued()
        for key in [k for k, j in _JOBS.items() if j.done.is_set()]:
            del _JOBS[key]


def shutdown(timeout: float = 10.0) -> None:
    """End the worker and its thread now: the jobs not begun are dropped, a running one fails
    (its caller traces itself). Tests start afresh with it."""
    global _STOP
    if os.getpid() != _OWNER:
        return
    with _COND:
        thread, _STOP = _THREAD, True
        _drop_queued()
        _COND.notify_all()
        worker = _WORKER
    if worker is not None:
        _stop_worker(worker)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)
    with _COND:
        _STOP = False


def _finish(job: Job, state: str, error: str | None = None) -> None:
    with _COND:
        job.state, job.error = state, error
        job.done.set()


def _manage() -> None:
    """The thread that feeds the worker, one job at a time, and hands on what it returns."""
    global _THREAD
    worker = None
    try:
        while True:
            with _COND:
                if not _QUEUE and not _STOP and not _EXITING:
                    _COND.wait(IDLE_SECONDS)
                if not _QUEUE or _STOP or _EXITING:
                    _THREAD = None
                    return
            if worker is None:
                worker = _start_worker()
                if worker is None:  # it cannot start here: the callers do their work themselves
                    with _COND:
                        for job in _QUEUE:
                            job.state, job.error = "failed", "the worker did not start"
                            job.done.set()
                        _QUEUE.clear()
                        _THREAD = None
                    return
            with _COND:
                if not _QUEUE:
                    continue  # taken back while the worker started
                job = _QUEUE.pop(0)
                job.state, job.started = "running", time.monotonic()
            reply = _ask(worker, job)
            if reply is None:  # the worker died (killed, out of memory): a new one for the next
                _stop_worker(worker)
                worker = None
                _finish(job, "failed", "the worker ended")
                continue
            status, value = reply
            if status != "ok":
                _finish(job, "failed", str(value))
                continue
            try:
                job.arrived(value)
            except Exception as exc:  # a result that cannot be taken in: the caller traces
                _finish(job, "failed", f"{type(exc).__name__}: {exc}")
                continue
            _finish(job, "done")
    finally:
        if worker is not None:
            _stop_worker(worker)


def _ask(worker: subprocess.Popen[bytes], job: Job) -> tuple[str, Any] | None:
    """The worker's reply to ``job`` (None when the worker has died)."""
    assert worker.stdin is not None and worker.stdout is not None
    try:
        request = pickle.dumps((job.function, job.args))
    except Exception as exc:  # arguments that do not pickle (a config holding a function)
        return ("error", f"{type(exc).__name__}: {exc}")
    try:
        _write_frame(worker.stdin, request)
        frame = _read_frame(worker.stdout)
    except (OSError, ValueError):
        return None
    if frame is None:
        return None
    try:
        reply = pickle.loads(frame)
    except Exception as exc:  # a result this process cannot load: the caller traces itself
        return ("error", f"the reply did not load: {type(exc).__name__}: {exc}")
    if not (isinstance(reply, tuple) and len(reply) == 2):
        return ("error", "the reply is no (status, value)")
    return reply


def _write_frame(stream: IO[bytes], data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """The next request or reply on ``stream`` (None at its end: the other side has gone)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    return data if len(data) == length else None


def _on_default_path(folder: str) -> bool:
    """Whether ``folder`` is on the path of any Python this interpreter starts (the standard
    library's, site-packages): an installed memfit."""
    default = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(AttributeError):  # a virtualenv's old site module has neither
        default.update(site.getsitepackages())
        default.add(site.getusersitepackages())
    return folder in {str(Path(p).resolve()) for p in default if p}


def _start_worker() -> subprocess.Popen[bytes] | None:
    """A worker process, once it has imported what its jobs need (None when it cannot start)."""
    global _WORKER
    env = dict(os.environ)
    env[OFF_VARIABLE] = "1"  # the worker starts no worker of its own
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[variable] = "1"  # tracing is Python-bound: one core is all it takes
    # memfit as this process imports it, wherever that is (a checkout on sys.path, say); not an
    # installed one's site-packages, which the worker has anyway: first, it would shadow the
    # standard library with whatever else is installed there
    here = str(Path(__file__).resolve().parents[2])
    if not _on_default_path(here):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    with _COND:
        if _EXITING:
            return None
        preload = sorted({m for job in _QUEUE for m in (job.function[0], *job.preload)})
    code = "from memfit.estimate.background import _serve; _serve()"
    try:
        worker = subprocess.Popen(
            [sys.executable, "-c", code, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            # a terminal's Ctrl-C (sent to its foreground process group) is not the worker's
            start_new_session=os.name == "posix",
        )
    except OSError:
        return None
    with _COND:
        # at exit meanwhile: _at_exit saw no worker to kill, so it is killed here
        exiting = _EXITING
        if not exiting:
            _WORKER = worker
    if exiting:
        _stop_worker(worker)
        return None
    assert worker.stdout is not None
    try:
        frame = _read_frame(worker.stdout)
        ready = None if frame is None else pickle.loads(frame)
    except Exception:
        ready = None
    if ready != "ready":
        _stop_worker(worker)
        return None
    return worker


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    global _WORKER
    with contextlib.suppress(OSError):
        worker.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.wait(timeout=5)
    for stream in (worker.stdin, worker.stdout):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()
    if _WORKER is worker:
        _WORKER = None


@atexit.register
def _at_exit() -> None:
    # no worker outlives this process, nor burns a core after it: its half-done trace is lost
    # (nothing is half-written: the disk cache is written by this process, atomically). The jobs
    # not begun are dropped first, and no worker starts after this: the thread, seeing its worker
    # killed, would start another for them (an orphan importing torch for seconds)
    global _EXITING
    if os.getpid() != _OWNER:
        return  # a forked child's: the worker is its parent's
    with _COND:
        _EXITING = True
        _drop_queued()
        _COND.notify_all()
        worker = _WORKER
    if worker is not None:
        _stop_worker(worker)


def _serve() -> None:
    """The worker's loop: run each job read from stdin, and write its result to stdout."""
    # work ahead of time yields to the work asked now (this process's parent's, anyone's)
    with contextlib.suppress(AttributeError, OSError):
        os.nice(10)
    with contextlib.suppress(ValueError):  # Ctrl-C is the parent's (where it shares a session)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel: IO[bytes] = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the traced code prints must not mix with the replies
    sys.stdout = sys.stderr
    for module in sys.argv[1:]:
        with contextlib.suppress(Exception):  # a job that needs it fails in its turn
            importlib.import_module(module)
    requests = sys.stdin.buffer
    try:
        _write_frame(channel, pickle.dumps("ready"))
        while (request := _read_frame(requests)) is not None:
            try:
                # a request that does not load (a class from a model's remote code, not
                # importable here) fails alone: its caller traces itself
                (module, name), args = pickle.loads(request)
                result = getattr(importlib.import_module(module), name)(*args)
                reply = pickle.dumps(("ok", result))
            except Exception as exc:
                reply = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
            _write_frame(channel, reply)
    except OSError:
        pass  # the parent has gone: so does its worker
