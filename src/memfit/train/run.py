"""``memfit train``: a fine-tuning run under the guard, with checkpoints, logs and resume.

The loop is plain PyTorch on purpose: each optimizer step is a fixed set of samples drawn from a
seeded permutation before any split; the guard runs them as micro-batches (and survives OOM with
the same gradient); the loop then clips the whole step's gradient, steps the optimizer and the
scheduler, logs one line, and checkpoints at step boundaries. The run folder is a contract:

    DIR/model/            the final model (loads with Auto* classes or SentenceTransformer)
    DIR/best/             the best model by the eval metric (with --eval-file)
    DIR/metrics.jsonl     one line per optimizer step, plus eval lines (``eval_`` keys)
    DIR/events.jsonl      oom, backoff, grow, checkpoint, resume, eval, stop
    DIR/checkpoints/step-N/  atomic: weights, optimizer, scheduler, RNG, sampler, micro-batch
    DIR/run.json          resolved config, plan, versions
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time
from pathlib import Path
from typing import Any

from transformers.utils import logging as hf_logging

from memfit.errors import NothingFitsError, UsageError
from memfit.guard import memory_cap
from memfit.guard.oom import first_line, is_oom, oom_in
from memfit.levers.optimizer import OPTIMIZER_TABLE
from memfit.runtime import quiet_deepspeed
from memfit.train import checkpoint as ck
from memfit.train.config import TrainConfig, TrainResult
from memfit.train.console import say
from memfit.train.loop import StopSignal, TrainingRun
from memfit.train.peers import check_shared_folder, lost_contact
from memfit.train.resume import finished_model, finished_run, refuse_another_finished
from memfit.train.runfolder import RunLock
from memfit.train.setup import checked_inputs, take


def train(config: TrainConfig | None = None, /, **knobs: Any) -> TrainResult:
    """Fine-tune under the guard. ``memfit.train(task=..., model=..., train_file=..., output_dir=...)``."""
    quiet_deepspeed()
    cfg = config or TrainConfig(**knobs)
    if config is not None and knobs:
        cfg = dataclasses.replace(config, **knobs)
    # the output folder's lock, taken once the model is loaded, held until the run ends
    lock = RunLock(Path(cfg.output_dir))
    # the phase the run is in, for an out-of-memory error outside a step to say where it was
    phase: dict[str, str] = {}
    try:
        with contextlib.ExitStack() as closers:
            return _train(cfg, lock, closers, phase)
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS or not _in_run_folders(cfg, exc):
            raise
        raise UsageError(_disk_message(cfg, exc)) from None
    except (RuntimeError, MemoryError) as exc:
        # another rank died, was killed or hangs: one line and --resume, not a traceback
        lost = lost_contact(exc, Path(cfg.output_dir)) if isinstance(exc, RuntimeError) else None
        if lost is not None:
            raise lost from None
        if not is_oom(exc):
            raise
        # the guard survives an OOM inside a step; one anywhere else is the end (exit 3)
        raise NothingFitsError(_oom_message(cfg, exc, phase)) from None
    finally:
        lock.release()


# what a user's disk or folder can do to a run: full, over quota, read-only, taken away, failing
# (EIO: also torch.save's short write, whose error carries no errno: runfolder.as_os_error)
_DISK_ERRNOS = frozenset(
    {
        errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
        errno.ENOTDIR, errno.EISDIR, errno.EIO,
    }
)  # fmt: skip


def _in_run_folders(cfg: TrainConfig, exc: OSError) -> bool:
    """A full, over-quota or read-only disk is the user's wherever it is; a missing file or a
    permission only where the run writes (elsewhere it may be a bug: a traceback)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or not exc.filename:
        return True
    where = Path(str(exc.filename))
    return _inside(where, Path(cfg.output_dir)) or bool(
        cfg.cache_dir and _inside(where, Path(cfg.cache_dir))
    )


def _disk_message(cfg: TrainConfig, exc: OSError) -> str:
    """One line for a write the disk refused: which flag's folder, why, and what is kept."""
    out = Path(cfg.output_dir)
    where = Path(str(exc.filename)) if exc.filename else out
    flag = "--output-dir"
    if cfg.cache_dir and _inside(where, Path(cfg.cache_dir)):
        flag = "--cache-dir"
    elif not _inside(where, out):
        flag = ""
    steps = ck.completed_steps(out / "checkpoints")
    kept = (
        f"; the newest checkpoint, {out / 'checkpoints' / f'step-{steps[-1]}'}, is whole: make "
        "room and run again with --resume"
        if steps
        else "; no checkpoint was written"
        + ("" if cfg.save_every else " (--save-every N keeps one every N steps)")
        if (out / "run.json").exists()
        else ""  # before the first step: nothing of the run was lost
    )
    return f"{flag + ': ' if flag else ''}{where}: {exc.strerror or exc}{kept}"


# the phases before the run holds its weights: holding less of them (LoRA, a smaller optimizer
# state) cures nothing there
_BEFORE_WEIGHTS = frozenset({"reading the data", "loading the model"})


def _oom_message(cfg: TrainConfig, exc: BaseException, phase: dict[str, str]) -> str:
    """One line for an out-of-memory error outside a guarded step (reading the data, loading
    the model, ordering the data, writing a checkpoint): where it was (``phase["now"]``), which
    memory ran out (the host's RAM: Python's MemoryError; else the device's, or --memory-cap once
    it counts: ``phase["capped"]``), the cures this run does not use already, and what is
    kept."""
    out = Path(cfg.output_dir)
    steps = ck.completed_steps(out / "checkpoints")
    kept = (
        f"; the newest checkpoint, {out / 'checkpoints' / f'step-{steps[-1]}'}, is whole: with "
        "more memory, run again with --resume"
        if steps
        else ""
    )
    host = isinstance(oom_in(exc) or exc, MemoryError)
    if host:
        what, more = "the machine's memory (RAM) ran out", "give it more memory"
    elif cfg.memory_cap and phase.get("capped"):
        what, more = "it does not fit under --memory-cap", "give it a larger --memory-cap"
    else:
        what, more = "the device's memory ran out", "give it more memory"
    cures = []
    where = phase.get("now")
    if not host and where not in _BEFORE_WEIGHTS:
        # what the run holds between steps: the weights, their gradients, the optimizer state
        if not cfg.lora_rank:
            cures.append("--lora-rank 8")
        own, small = OPTIMIZER_TABLE.get(cfg.optimizer), OPTIMIZER_TABLE["adafactor"]
        if own is not None and own.bytes_per_parameter > small.bytes_per_parameter:
            cures.append("--optimizer adafactor")
    cure = f"{more} or hold less ({', '.join(cures)})" if cures else more
    said = f", while {where}" if where else ""
    return f"out of memory outside a training step ({first_line(exc)}){said}: {what}; {cure}{kept}"


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(folder))
    except ValueError:
        return False
    return True


def _train(
    cfg: TrainConfig, lock: Any, closers: contextlib.ExitStack, phase: dict[str, str]
) -> TrainResult:
    """The run, phase by phase (each one a method of :class:`~memfit.train.loop.TrainingRun`)."""
    hf_logging.disable_progress_bar()  # the run has its own progress line

    # every problem with the flags and every bad row of both files, at once, before anything is
    # loaded or written
    phase["now"] = "reading the data"
    recipe, train_rows, eval_rows = checked_inputs(cfg)
    done = finished_run(cfg)
    # a finished run's --model spelled otherwise: the same model is told once it is loaded
    model_check = finished_model(cfg)
    if done is not None and model_check is None:
        # nothing to redo: retraining would replace the finished model/ with the same steps
        return _already_finished(cfg, done)

    run = TrainingRun(cfg, recipe, lock)
    run.join_ranks()
    # the model loads before anything is written: a model that cannot be had leaves no folder
    phase["now"] = "loading the model"
    run.load_model(train_rows, eval_rows)
    if model_check is not None:
        refuse_another_finished(cfg, model_check, run.model_signature)
        if done is not None:
            run.close()
            return _already_finished(cfg, done)
    phase["now"] = "planning the run"
    run.plan()
    phase["now"] = "placing the model"
    run.open_folder()
    # several hosts: every rank must see rank 0's folder (it reads the checkpoints back)
    check_shared_folder(run.ranks, run.out)
    phase["now"] = "building the optimizer"
    run.build_optimizer()
    run.open_logs(closers)
    run.make_guard()
    phase["now"] = "resuming from a checkpoint"
    run.resume()
    run.write_run_json()
    phase["now"] = "starting the steps"

    snapshot = run.weights_snapshot()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        run.watch_memory(stack.enter_context(memory_cap(cfg.memory_cap, run.device)))
        phase["capped"] = "yes"  # from here on --memory-cap counts
        stop = stack.enter_context(StopSignal())
        if snapshot is not None:
            phase["now"] = "probing the longest rows"
            run.probe(snapshot)
            snapshot = None  # the copy of the weights goes before step 1
        phase["now"] = "ordering the data"
        perm = run.permutation(run.epoch)
        progress = run.progress()
        while run.step < run.total_steps:
            phase["now"] = f"preparing step {run.step + 1}"
            if run.position >= run.rows_n:
                run.epoch, run.position = run.epoch + 1, 0
                perm = run.permutation(run.epoch)
            indices = perm[run.position : run.position + run.per_step]
            # the whole step's rows on every rank; the guarded step keeps this rank's share
            record = run.train_step(take(run.train_rows, indices))
            run.metrics.write(record)
            progress.update(record)
            phase["now"] = f"evaluating or checkpointing after step {run.step}"
            if run.after_step(stop):
                break
        progress.close()
        if run.stopped == "done":
            phase["now"] = "writing the model"
            run.finish(started)
    return run.close()


def _already_finished(cfg: TrainConfig, done: dict[str, Any]) -> TrainResult:
    """A --resume of a run that finished: said, and its result returned."""
    steps_done = int(done.get("steps", 0))
    if not cfg.quiet:
        say(
            f"memfit: the run in {cfg.output_dir} already finished ({steps_done} steps; its "
            f"model is in {Path(cfg.output_dir) / 'model'}): nothing to resume. To train it "
            "further, start a new run with --model on that folder"
        )
    return TrainResult(
        Path(cfg.output_dir),
        steps_done,
        int(done.get("samples_seen", 0)),
        done.get("final_loss"),
        dict(done.get("eval_metrics") or {}),
        "finished",
    )
