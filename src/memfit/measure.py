"""Measure the real memory of one CPU training (or eval) step, from outside the process.

This is the *truth* side of memfit's CPU benchmark: the estimator traces the step of
:mod:`memfit.estimate.workload` on fake tensors; here the same step runs for real, with random
weights, in a child process (:mod:`memfit._measure_child`), and the parent reads the child's
resident set size from ``/proc/<pid>``.

How one sample is taken:

1. The child builds the model and optimizer, runs :data:`~memfit._measure_child.WARMUP_STEPS`
   warm-up steps (optimizer state exists: steady state), runs ``gc.collect()`` and
   ``malloc_trim(0)``, and prints ``ready``. Gradients are ``None`` (``zero_grad(set_to_none=True)``).
2. The parent writes ``5`` to ``/proc/<pid>/clear_refs`` (resets the peak, VmHWM, to the current
   RSS), reads VmRSS (the *baseline*: weights, buffers, optimizer state, libraries, interpreter)
   and sends ``go``.
3. The child creates the input batch (inside the window: the estimator counts the batch as
   activations), runs exactly one step, runs ``gc.collect()`` and prints ``done``.
4. The parent reads VmHWM. ``above_baseline = VmHWM - baseline``: gradients, activations,
   temporaries and the batch at the step's worst moment, i.e. the estimate's
   ``total - parameters - buffers - optimizer_state - runtime_overhead``.

RSS only equals "bytes of live tensors" if freed memory leaves the process at once and nothing
freed is silently reused, so the child runs with (see :func:`child_environment`):

* ``MALLOC_MMAP_THRESHOLD_=65536``: every allocation of 64 KiB or more (every tensor that matters)
  is its own ``mmap`` and goes back to the kernel on free. Setting it also switches off glibc's
  *dynamic* threshold, which otherwise rises to the size of the last freed mmapped chunk (up to
  32 MiB) and from then on serves such tensors from the heap, where freed memory stays resident,
  so that each step's peak would depend on the previous ones. 64 KiB rather than lower: mmap
  rounds each chunk up to whole 4 KiB pages (≤ 6 % waste at 64 KiB, ≪ 1 % for activation-sized
  tensors) and each one costs two syscalls; below 64 KiB, tensors share the heap, where they are
  packed without rounding and are a negligible part of a step.
* ``MALLOC_TRIM_THRESHOLD_=0``: the top of the heap is returned as soon as it is free; the child
  also calls ``malloc_trim(0)`` before every ``ready`` to return free pages inside the heap.
* ``MALLOC_ARENA_MAX=1``: OpenMP worker threads allocate from the main arena too, instead of
  per-thread arenas with their own heaps and trim rules.
* ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``/... fixed to ``threads``; ``LD_PRELOAD`` is dropped (a
  preloaded jemalloc or tcmalloc would ignore all of the above and cache freed memory).

Limits of the method (all small next to a real step):

* Linux keeps RSS in per-CPU counters and records the peak from an approximate read, so VmHWM can
  read a little low: a 100 MiB probe measures 99.7–99.95 MiB (40–300 KiB short, 2 CPUs). Keep
  what is measured above ~30 MiB for 1 % precision.
* Tensors under 64 KiB share glibc's heap: a step leaves freed chunks between live ones there, and
  that fragmentation is resident (a few MiB at most, and only where most of a step's tensors are
  that small, e.g. bf16 at a batch of 32 tokens).
* Pages of a tensor that are allocated but never written are not resident and not counted (a GPU
  caching allocator would count them).
* Library-internal caches (MKL packing buffers, oneDNN primitive caches) warm up in the warm-up
  steps and sit in the baseline; kernel scratch memory that bypasses PyTorch's allocator is
  counted (it is real), though the estimator cannot see it.

Checked against PyTorch's own CPU allocator totals (``torch.profiler`` with ``profile_memory``):
the RSS peak and the allocator's peak of the same step agreed within 0.3 MiB (0.15 %) on the
BERT-like cases tried.

The estimator models the same allocator (``memfit.estimate.device.cpu_allocation_bytes``: 64 KiB
mmap threshold, whole pages above it).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from memfit.errors import MemfitError
from memfit.job import STEP_FIELDS

# see the module docstring for why each of these is set
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_ARENA_MAX": "1",
}
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
DEFAULT_TIMEOUT_S = 1800.0
STDERR_TAIL_CHARS = 4000


class MeasurementError(MemfitError):
    """The measured child process failed, hung or could not be observed."""


@dataclass(frozen=True)
class CpuSample:
    """One measured step, as seen from ``/proc/<pid>/status``."""

    baseline_rss_bytes: int  # VmRSS right before "go"
    peak_rss_bytes: int  # VmHWM after "done" (reset to the baseline before "go")
    after_rss_bytes: int  # VmRSS after "done": what the step left behind
    seconds: float  # the step's wall time, measured in the child

    @property
    def above_baseline_bytes(self) -> int:
        return self.peak_rss_bytes - self.baseline_rss_bytes

    @property
    def residual_bytes(self) -> int:
        return self.after_rss_bytes - self.baseline_rss_bytes


@dataclass(frozen=True)
class CpuMeasurement:
    """The peak memory of one real CPU step above what stays resident between steps."""

    above_baseline_bytes: int  # median over the repeats
    samples: list[int]  # above-baseline bytes of each repeat, in order
    baseline_rss_bytes: int  # median baseline VmRSS (model, buffers, optimizer state, runtime)
    details: list[CpuSample] = field(default_factory=list)
    threads: int = 1
    startup_seconds: float = 0.0  # child start to the first "ready": imports, build, warm-up
    request: dict[str, Any] = field(default_factory=dict)

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: 0.0 when every repeat measured the same."""
        if not self.samples or self.above_baseline_bytes <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.above_baseline_bytes

    @property
    def max_residual_bytes(self) -> int:
        """The most any step left resident after it ended (≈ 0 when nothing leaks)."""
        return max((s.residual_bytes for s in self.details), default=0)

    @property
    def step_seconds(self) -> float:
        return statistics.median(s.seconds for s in self.details) if self.details else 0.0


def default_threads() -> int:
    """All the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def child_environment(threads: int) -> dict[str, str]:
    """The child's environment: glibc malloc that returns freed memory, fixed thread counts."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(MALLOC_ENV)
    for var in THREAD_ENV_VARS:
        env[var] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["MEMFIT_MEASURE_PARENT"] = str(os.getpid())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the child imports the same memfit as this process, installed or not
    package_root = str(Path(__file__).resolve().parent.parent)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = package_root if not path else package_root + os.pathsep + path
    return env


def measure_cpu_step(
    model: str,
    *,
    batch_size: int,
    mode: str = "train",
    repeats: int = 3,
    threads: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    **knobs: Any,
) -> CpuMeasurement:
    """Run one real CPU step ``repeats`` times in a fresh child and measure its peak above baseline.

    ``model`` is anything :func:`memfit.models.resolve_model` accepts (a registry name, a folder
    with ``config.json`` or a ``config.json`` path); the weights are random. ``batch_size``,
    ``mode`` and ``knobs`` (the job's fields: ``task``, ``seq_len``, ``precision``, ...) are
    :func:`memfit.estimate`'s: the child runs the step the estimator prices for them. Raises
    :class:`MeasurementError` (with the child's stderr tail) if the child fails.
    """
    for name in knobs:
        if name not in STEP_FIELDS or name == "micro_batch_size":
            raise TypeError(f"measure_cpu_step() got an unexpected keyword argument {name!r}")
    request: dict[str, Any] = {
        "kind": "step",
        "model": str(model),
        "batch_size": int(batch_size),
        "mode": mode,
        **knobs,
    }
    return run_measurement(request, repeats=repeats, threads=threads, timeout=timeout)


def run_measurement(
    request: dict[str, Any],
    *,
    repeats: int = 3,
    threads: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> CpuMeasurement:
    """Start the child with ``request`` (see :mod:`memfit._measure_child`) and measure each repeat."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if not Path("/proc/self/clear_refs").exists():
        raise MeasurementError("measuring a CPU step needs Linux /proc/<pid>/clear_refs")
    threads = default_threads() if threads is None else int(threads)
    request = {**request, "repeats": repeats, "threads": threads}
    command = [sys.executable, "-m", "memfit._measure_child", json.dumps(request)]
    with tempfile.TemporaryFile(mode="w+b") as stderr:
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=child_environment(threads),
            text=True,
            bufsize=1,
        )
        assert proc.stdin is not None and proc.stdout is not None
        lines = _line_reader(proc.stdout)
        deadline = start + timeout
        details: list[CpuSample] = []
        startup = 0.0
        try:
            for i in range(repeats):
                _expect(lines, proc, stderr, deadline, f"ready {i}")
                if i == 0:
                    startup = time.monotonic() - start
                _clear_peak(proc.pid)
                baseline = _status_bytes(proc.pid, "VmRSS")
                _send(proc, stderr, "go")
                done = _expect(lines, proc, stderr, deadline, f"done {i}")
                peak = _status_bytes(proc.pid, "VmHWM")
                after = _status_bytes(proc.pid, "VmRSS")
                details.append(CpuSample(baseline, peak, after, float(done.split()[2])))
            _send(proc, stderr, "quit")
            proc.stdin.close()
            returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if returncode != 0:
                raise MeasurementError(_failure(f"exited with code {returncode}", proc, stderr))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    samples = [s.above_baseline_bytes for s in details]
    return CpuMeasurement(
        above_baseline_bytes=int(statistics.median(samples)),
        samples=samples,
        baseline_rss_bytes=int(statistics.median(s.baseline_rss_bytes for s in details)),
        details=details,
        threads=threads,
        startup_seconds=startup,
        request=request,
    )


def _line_reader(stream: IO[str]) -> queue.Queue[str | None]:
    """Lines of the child's protocol channel, read on a thread so waits can time out."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _expect(
    lines: queue.Queue[str | None],
    proc: subprocess.Popen[str],
    stderr: IO[bytes],
    deadline: float,
    prefix: str,
) -> str:
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        proc.kill()
        proc.wait()
        raise MeasurementError(
            _failure(f"timed out waiting for {prefix!r}", proc, stderr)
        ) from None
    if line is None:
        proc.wait()
        raise MeasurementError(_failure(f"exited with code {proc.returncode}", proc, stderr))
    if not line.startswith(prefix):
        raise MeasurementError(
            _failure(f"sent {line!r} where {prefix!r} was expected", proc, stderr)
        )
    return line


def _send(proc: subprocess.Popen[str], stderr: IO[bytes], line: str) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        proc.wait()
        raise MeasurementError(
            _failure(f"exited with code {proc.returncode}", proc, stderr)
        ) from None


def _failure(what: str, proc: subprocess.Popen[str], stderr: IO[bytes]) -> str:
    # pread: the child shares this file's offset, so leave it where it is
    fd = stderr.fileno()
    size = os.fstat(fd).st_size
    start = max(0, size - 4 * STDERR_TAIL_CHARS)
    data = os.pread(fd, size - start, start)
    tail = data.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:].rstrip()
    return (
        f"measurement child (pid {proc.pid}) {what}; its stderr ends with:\n{tail or '(nothing)'}"
    )


def _clear_peak(pid: int) -> None:
    """Reset the child's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        raise MeasurementError(f"cannot reset the peak RSS of pid {pid}: {exc}") from exc


def _status_bytes(pid: int, key: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM), in bytes."""
    prefix = key + ":"
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(prefix):
                return int(line.split()[1]) * 1024
    raise MeasurementError(f"/proc/{pid}/status has no {key}")
