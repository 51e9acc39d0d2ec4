"""The measured side of :mod:`memfit.measure`: one real CPU step per ``go`` from the parent.

Run as ``python -m memfit._measure_child '<request json>'``; never imported by memfit itself. The
parent measures this process from outside (``/proc/<pid>``); this side only has to make every
repeat allocate the same thing and hold nothing in between.

Protocol, one line each way (the protocol channel is the original stdout; everything else the
process prints, including library chatter, is redirected to stderr)::

    child:  ready <i>            model, optimizer and warm-up done; nothing of step i exists yet
    parent: go                   (after resetting VmHWM and reading the baseline VmRSS)
    child:  done <i> <seconds>   step i ran, its tensors are freed
    ...
    parent: quit (or EOF)        the child exits 0

Requests (JSON object):

* ``{"kind": "step", "model": ..., "task": ..., "batch_size": ..., ...}``: one training or eval
  step of :mod:`memfit.estimate.workload`. The input batch is created *inside* the measured window
  (the estimator counts it as activations).
* ``{"kind": "probe", "bytes": N, "fail": false}``: allocate and fill an N-byte tensor inside the
  window (tests of the method itself); ``"fail": true`` raises inside the window instead.

Any exception goes to stderr as a traceback and the process exits 1 without another protocol
line; the parent turns that into an error carrying the stderr tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from memfit.job import DEFAULT_MINI_BATCH_SIZE, STEP_FIELDS

WARMUP_STEPS = 2
SEED = 0


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0): give freed heap pages (not only the top of the heap) back to the OS."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def run() -> None:
        trim(0)

    return run


def _settle(trim: Callable[[], None]) -> None:
    """Free everything the last step left to the cyclic GC, then return free heap pages."""
    gc.collect()
    trim()


def _resolve_config(model: str) -> Any:
    """The architecture config of ``model``, resolved exactly as the estimator resolves it."""
    # start-up: memfit.models.registry loads transformers, after main() redirected stdout
    from memfit.models import resolve_model

    return resolve_model(model).config


class _Step:
    """A real training or eval step, with everything that must persist built up front."""

    def __init__(self, request: dict[str, Any]) -> None:
        # torch loads once main() has pointed stdout at stderr, its chatter off the protocol
        # channel (start-up)
        import torch

        # start-up: the estimator imports torch and transformers (after the redirect too)
        from memfit.estimate import workload
        from memfit.estimate.api import step_job, step_spec

        self.workload = workload
        # the step the estimator prices for the same knobs (the request's job fields), on the CPU
        knobs = {k: v for k, v in request.items() if k in STEP_FIELDS and k != "micro_batch_size"}
        job = step_job(request["model"], batch_size=int(request["batch_size"]), **knobs)
        self.spec = dataclasses.replace(step_spec(job, request.get("mode", "train")), device="cpu")
        self.batch_size = int(request["batch_size"])
        if self.spec.loss == "cached-mnrl":
            # the workload's batch is ``cached_chunks`` mini-batches of ``batch_size`` rows
            mini = min(job.mini_batch_size or DEFAULT_MINI_BATCH_SIZE, self.batch_size)
            if self.batch_size % mini:
                raise ValueError("the measured cached loss needs whole mini-batches")
            self.spec = dataclasses.replace(self.spec, cached_chunks=self.batch_size // mini)
            self.batch_size = mini
        self.seq_len = int(request["seq_len"])
        torch.manual_seed(SEED)
        self.config = _resolve_config(request["model"])
        self.model = workload.build_model(self.config, self.spec)
        self.train = self.spec.mode == "train"
        self.optimizer = (
            workload.make_optimizer(self.spec.optimizer, self.model, device_type="cpu")
            if self.train
            else None
        )
        self.autocast = workload.default_autocast(self.spec, "cpu")
        self.scaler = workload.make_scaler(self.spec, "cpu", fake=False)

    def __call__(self) -> None:
        workload = self.workload
        # the input batch is part of what the step allocates (the estimator counts it as activations)
        batch = workload.make_batch(
            self.config, self.spec, self.batch_size, self.seq_len, device="cpu"
        )
        if self.train:
            assert self.optimizer is not None
            workload.training_step(
                self.model,
                batch,
                self.spec,
                self.optimizer,
                scaler=self.scaler,
                autocast=self.autocast,
            )
        else:
            workload.eval_step(self.model, batch, self.spec, autocast=self.autocast)
        del batch


class _Probe:
    """Allocate and touch a known number of bytes: the method's own calibration."""

    def __init__(self, request: dict[str, Any]) -> None:
        # start-up: imported by main() already, after stdout was pointed at stderr
        import torch

        self.torch = torch
        self.nbytes = int(request["bytes"])
        self.fail = bool(request.get("fail", False))

    def __call__(self) -> None:
        if self.fail:
            raise RuntimeError("probe failure requested")
        tensor = self.torch.empty(self.nbytes, dtype=self.torch.uint8)
        tensor.fill_(1)
        del tensor


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so an interrupted benchmark leaves no child behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        parent = os.environ.get("MEMFIT_MEASURE_PARENT")
        if parent and os.getppid() != int(parent):  # the parent died before prctl
            os._exit(1)


def _send(channel: TextIO, line: str) -> None:
    channel.write(line + "\n")
    channel.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m memfit._measure_child '<request json>'", file=sys.stderr)
        return 2
    _die_with_parent()
    request = json.loads(args[0])
    # the protocol gets the original stdout; anything printed from here on goes to stderr
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    # start-up: torch loads only now, its chatter going to stderr, not to the protocol channel
    import torch

    threads = request.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel work
            torch.set_num_interop_threads(1)

    kind = request.get("kind", "step")
    step: Callable[[], None]
    if kind == "step":
        step = _Step(request)
    elif kind == "probe":
        step = _Probe(request)
    else:
        raise ValueError(f"unknown request kind {kind!r}")

    trim = _malloc_trim()
    # steady state: optimizer state exists, lazy caches (oneDNN primitives, autograd, Python code
    # paths) are warm, so every measured step allocates the same thing
    if not (kind == "probe" and request.get("fail")):
        for _ in range(int(request.get("warmup", WARMUP_STEPS))):
            step()
            _settle(trim)

    repeats = int(request.get("repeats", 3))
    for i in range(repeats):
        _settle(trim)
        _send(channel, f"ready {i}")
        command = sys.stdin.readline().strip()
        if command != "go":
            return 0
        start = time.perf_counter()
        step()
        gc.collect()
        _send(channel, f"done {i} {time.perf_counter() - start:.6f}")
    sys.stdin.readline()  # wait for "quit" (or EOF) so the parent can read /proc/<pid> last
    return 0


if __name__ == "__main__":
    sys.exit(main())
