"""Every rank of one torchrun launch that runs several ``memfit train`` jobs, one after another.

A 2-rank launch spends most of its seconds starting: the agent and both ranks import torch,
transformers, memfit (and DeepSpeed, for ZeRO). The end-to-end tests therefore run the jobs that
share a sharding scheme in one launch: this script joins the ranks (gloo) once, then runs each job
as ``memfit ARGV`` in this process (``memfit.cli.main``, with its exit codes), which leaves a
process group it did not start to its owner. Each job's output (file descriptors 1 and 2, so
DeepSpeed's and C++ lines too) goes to ``NAME.rankR.log`` in the jobs' folder.

argv: JOBS_JSON. The file holds ``{"folder": ..., "jobs": [...]}``; a job is
``{"name", "argv", "cap"?, "stop_after"?}``:

- ``cap``: a ``--memory-cap`` computed from earlier jobs' runs, ``{"function": "MODULE:NAME",
  "kwargs": {...}}``: ``NAME(folder, **kwargs)`` of the test module that wrote the jobs (it sets
  its caps from the peaks it measured, and checks them with the same function);
- ``stop_after``: rank 0 sends SIGTERM to both ranks once that many steps are logged (a spot
  instance's notice); the job must stop after the same step on both and leave a checkpoint.

Rank 0 writes ``results.json``: each job's exit codes, by rank, and its seconds (the slower
rank's). The tests' side: :func:`launch_jobs` starts the launch, :class:`Launched` reads it.

Each job after the first runs in a process where torch, transformers and DeepSpeed are imported
and the first job's state (DeepSpeed's communication backend, warnings already shown) is set up:
memfit's start from a fresh process is what the first job of each launch, and the tests that
launch ``python -m memfit`` themselves, exercise.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def rank_peaks(out: Path) -> list[list[int]]:
    """Each logged step's peak on every rank (live tensor bytes under a memory cap)."""
    return [m["rank_peak_bytes"] for m in jsonl(out / "metrics.jsonl") if "loss" in m]


def cap_for(spec: dict[str, Any], folder: Path) -> int:
    """The memory cap ``spec`` names (see the module docstring)."""
    module, name = spec["function"].split(":")
    # the test module imports its helpers as pytest lets it (tests/, bench/: pyproject.toml)
    here = Path(__file__).resolve().parent
    for path in (here, here.parent, here.parent.parent / "bench"):
        if str(path) not in sys.path:
            sys.path.append(str(path))
    return int(getattr(importlib.import_module(module), name)(folder, **spec.get("kwargs", {})))


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (Python's streams and everything else's) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def stop_later(
    metrics: Path, steps: int, pids: list[int], done: threading.Event
) -> threading.Thread:
    """SIGTERM to every rank once ``metrics`` logs ``steps`` steps (nothing once ``done``)."""

    def watch() -> None:
        while not done.is_set():
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_job(job: dict[str, Any], folder: Path, rank: int, pids: list[int]) -> int:
    """``memfit ARGV`` of ``job`` in this process: its exit code (1 for an exception, whose
    traceback goes to the job's log like everything else it prints)."""
    from memfit.cli import main

    argv = list(job["argv"])
    done = threading.Event()
    watcher = None
    code = 0
    with output_to(folder / f"{job['name']}.rank{rank}.log"):
        try:
            if job.get("cap"):
                argv += ["--memory-cap", str(cap_for(job["cap"], folder))]
            if job.get("stop_after"):
                # the signal is memfit's to handle while it trains; one arriving after memfit
                # restored the handler it found (the run ended first) must not kill the launch:
                # the test then sees a run that was not stopped
                signal.signal(signal.SIGTERM, lambda *_: None)
                if rank == 0:
                    out = Path(argv[argv.index("--output-dir") + 1])
                    watcher = stop_later(out / "metrics.jsonl", int(job["stop_after"]), pids, done)
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return code


def main() -> None:
    import datetime

    import torch.distributed as dist

    spec = json.loads(Path(sys.argv[1]).read_text())
    folder = Path(spec["folder"])
    # memfit's collectives run on this group, with this timeout: a job whose ranks disagree
    # fails after it instead of hanging the launch
    timeout = datetime.timedelta(seconds=float(spec["job_timeout"]))
    dist.init_process_group("gloo", timeout=timeout)
    # the launch's own bookkeeping, on a group of its own: never mixed with a job's collectives
    books = dist.new_group(backend="gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=books)
    results: dict[str, dict[str, Any]] = {}
    for job in spec["jobs"]:
        started = time.monotonic()
        code = run_job(job, folder, rank, pids)
        done: list[Any] = [None] * world
        # also: every rank is done before the next job starts
        dist.all_gather_object(done, (code, time.monotonic() - started), group=books)
        results[job["name"]] = {
            "codes": [c for c, _ in done],
            "seconds": max(seconds for _, seconds in done),
        }
        if rank == 0:
            (folder / "results.json").write_text(json.dumps(results))
    dist.barrier(group=books)
    dist.destroy_process_group()


# --- the tests' side ----------------------------------------------------------------------------
class Launched:
    """One launch's jobs: each job's folder (``out``), exit codes, seconds and output by rank."""

    def __init__(self, folder: Path, outs: dict[str, Path]) -> None:
        self.folder, self.outs = folder, outs
        self.results = json.loads((folder / "results.json").read_text())

    def out(self, job: str) -> Path:
        """The job's run folder, once both ranks ended it with exit code 0."""
        assert self.results[job]["codes"] == [0, 0], (job, self.output(job)[-3000:])
        return self.outs[job]

    def output(self, job: str) -> str:
        """What both ranks printed during the job."""
        return "\n".join((self.folder / f"{job}.rank{r}.log").read_text() for r in (0, 1))


def launch_jobs(
    folder: Path, jobs: list[dict[str, Any]], env: dict[str, str], *, job_timeout: float
) -> Launched:
    """Run ``jobs`` in one 2-rank torchrun launch (in ``folder``). A collective waits at most
    ``job_timeout`` seconds, the launch at most that per job: past it the launch and its ranks
    are killed and the test fails, naming the job that ran and what its ranks printed."""
    import pytest

    spec = folder / "jobs.json"
    spec.write_text(json.dumps({"folder": str(folder), "jobs": jobs, "job_timeout": job_timeout}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(Path(__file__).resolve()), str(spec)]
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timeout = job_timeout * len(jobs)
    try:
        _out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its ranks
        _out, err = process.communicate()
        pytest.fail(f"the launch ran past {timeout:.0f} s: {_running(folder, jobs)}\n{err[-2000:]}")
    if process.returncode != 0:
        pytest.fail(f"the launch failed: {_running(folder, jobs)}\n{err[-2000:]}")
    outs = {job["name"]: Path(job["argv"][job["argv"].index("--output-dir") + 1]) for job in jobs}
    return Launched(folder, outs)


def _running(folder: Path, jobs: list[dict[str, Any]]) -> str:
    """The first job the launch did not finish, and the end of what its ranks printed."""
    results = folder / "results.json"
    finished = json.loads(results.read_text()) if results.is_file() else {}
    for job in jobs:
        if job["name"] not in finished:
            logs = [folder / f"{job['name']}.rank{rank}.log" for rank in (0, 1)]
            tails = [f"{log.name}: {log.read_text()[-1500:]}" for log in logs if log.is_file()]
            return f"in job {job['name']!r}\n" + "\n".join(tails)
    return "after its last job"


if __name__ == "__main__":
    main()
    import torch.distributed  # start-up: only the rank side needs torch

    # the rank ends without the interpreter's teardown, as memfit train's ranks do: in it, gloo's
    # threads can end a finished rank with SIGABRT (a CI run saw it)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
