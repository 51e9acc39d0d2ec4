"""The training run: its state, and its phases as the methods of :class:`TrainingRun`.

:func:`memfit.train.run.train` calls the phases in order: join the ranks, load the model and the
data, plan the knobs left open, open the run folder, build the optimizer, open the logs, make the
guard, resume, write run.json, probe, then step after step (:meth:`TrainingRun.train_step`) with
evals and checkpoints between them (:meth:`TrainingRun.after_step`), and finish. Each optimizer
step is a fixed set of samples; the guard runs them as micro-batches (and survives OOM with the
same gradient); :meth:`TrainingRun.update` clips the whole step's gradient and steps the optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.batching import length_grouped_order
from memfit.data.rows import Row
from memfit.errors import NothingFitsError, TrainingStoppedError, UsageError
from memfit.guard import StepTooLarge
from memfit.guard.guard import PeerOutOfMemory
from memfit.guard.oom import CatchOom
from memfit.guard.policy import optimizer_stop
from memfit.train import checkpoint as ck
from memfit.train import runfolder
from memfit.train.config import TrainResult
from memfit.train.console import Progress, say
from memfit.train.distributed import shard_rows
from memfit.train.memory import PeakMemory, snapshot_writer
from memfit.train.optim import offload_implementation, rescale_lr, state_format
from memfit.train.resume import (
    changed_settings,
    misfit,
    other_model,
    pick_checkpoint,
    refuse_changed,
    refuse_other_model,
    truncate_metrics,
)
from memfit.train.runfolder import save_model_folder
from memfit.train.setup import RunSetup, next_cure, take, versions
from memfit.train.zero import optimizer_offload_of
from memfit.units import format_bytes


class TrainingRun(RunSetup):
    """One run of ``memfit train``: what it holds (the model, optimizer, guard, logs, where it
    is in the data; set up by :class:`~memfit.train.setup.RunSetup`) and the phases that change
    it. Every rank holds its own."""

    # --- resume ---------------------------------------------------------------------------------
    def resume(self) -> None:
        """With --resume: on from the newest checkpoint that loads (the damaged ones set aside),
        or from the start; the killed run's metrics after it are dropped."""
        cfg, ranks = self.cfg, self.ranks
        picked: tuple[Path, dict[str, Any]] | None = None
        # a finished run resumed to write its missing model/ again: its result, for finish()
        self.previous_result = runfolder.finished(self.out) if cfg.resume else None
        if cfg.resume and ranks is None:
            picked = pick_checkpoint(self.ckpt_dir, self.load, self.skip, self.check)
        elif cfg.resume and ranks is not None:
            # rank 0 verifies the checkpoints; every rank loads the one it picked
            found = (
                pick_checkpoint(self.ckpt_dir, None, self.skip, self.check) if self.main else None
            )
            chosen = ranks.broadcast_object(found[0] if found is not None else None)
            picked = (chosen, self.load(chosen)) if chosen is not None else None
        if picked is not None:
            resume_from, state = picked
            self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
            self.samples_seen, self.best = state["samples_seen"], ck.saved_best(state)
            self.resumed_at = self.step
            self.on_event(
                {
                    "type": "resume",
                    "step": self.step,
                    "checkpoint": str(resume_from),
                    "micro_batch_size": self.guard.micro_batch_size,
                }
            )
        elif cfg.resume:
            self.on_event(
                {
                    "type": "resume",
                    "step": 0,
                    "checkpoint": None,
                    "note": "no checkpoint yet: from the start"
                    if not ck.completed_steps(self.ckpt_dir)
                    else "no checkpoint could be read: from the start",
                }
            )
        if cfg.resume and self.main:
            # the killed run's lines after its checkpoint are redone: drop them before appending
            truncate_metrics(self.out / "metrics.jsonl", self.step)

    def check(self, path: Path, state: dict[str, Any]) -> str | None:
        """What is wrong with a checkpoint that verifies (passed over, set aside), or None: a
        trainer state memfit did not write (counts out of range or at odds with each other), or
        weights that are not finite (resumed from, the next step's loss is NaN again, whatever
        --lr). One of other settings or another model is not damaged: :meth:`load` refuses it."""
        if isinstance(state, dict) and (
            changed_settings(state.get("settings"), self.settings)
            or other_model(state.get("model"), self.model_signature)
        ):
            return None
        number = int(path.name.removeprefix("step-"))
        problem = ck.state_problem(state, number, self.rows_n, self.per_step)
        return problem if problem is not None else ck.weights_problem(path)

    def load(self, path: Path) -> dict[str, Any]:
        """Check the checkpoint's settings and model against this run's, then load it. Weights
        (or an optimizer state) that do not fit the model are another --model, refused: never a
        damaged checkpoint (set aside, the run would start over and replace its model)."""
        saved = ck.read_state(path)
        refuse_changed(path, saved.get("settings"), self.settings)
        other = other_model(saved.get("model"), self.model_signature)
        if other is not None:
            raise refuse_other_model(path, self.cfg, saved.get("model"), other)
        optimizer = saved.get("optimizer")
        if optimizer is None:
            # a checkpoint of a memfit that recorded no optimizer: run.json has the run's (it is
            # written again only after this resume), else its state would not load (KeyError)
            optimizer = (runfolder.run_config(self.out) or {}).get("optimizer")
        if isinstance(optimizer, str) and optimizer != self.cfg.optimizer:
            raise UsageError(
                f"--resume: {path} holds the state of --optimizer {optimizer}, not of "
                f"--optimizer {self.cfg.optimizer}: resume with --optimizer {optimizer}, or "
                "start a new run in another folder"
            )
        layout = saved.get("optimizer_format", "torch")
        if self.zero_stage is None and layout != state_format(self.optimizer):
            offload = "cpu" if layout != "torch" else "none"
            raise UsageError(
                f"--resume: {path} holds an optimizer state of --optimizer-offload {offload} "
                f"({layout}), which this run's optimizer does not load: resume with "
                f"--optimizer-offload {offload}, or start a new run in another folder"
            )
        try:
            state = ck.read_checkpoint(
                path,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                device=self.device,
                rank=self.rank,
                world_size=self.world,
                sharded=self.sharded,
            )
        except (RuntimeError, ValueError) as exc:
            # a checkpoint of a memfit that recorded no model: its loading says it
            detail = misfit(exc)
            if detail is None:
                raise
            raise refuse_other_model(path, self.cfg, saved.get("model"), detail) from None
        self.guard.load_state_dict(state["guard"])
        old_lr = rescale_lr(self.optimizer, self.scheduler, self.cfg.lr)
        if old_lr is not None:
            # --lr of this resume (a run stopped at a NaN, lower it): the schedule, scaled
            self.on_event({"type": "lr", "step": state["step"], "from": old_lr, "to": self.cfg.lr})
        return state

    def skip(self, path: Path, problem: str) -> None:
        """A checkpoint that does not load: moved out of the checkpoints a resume or
        --save-total-limit counts (kept to look at)."""
        aside = ck.set_aside(path)
        self.on_event(
            {
                "type": "checkpoint_skipped",
                "checkpoint": str(path),
                "reason": problem,
                "moved_to": str(aside),
            }
        )
        if self.main and not self.cfg.quiet:
            say(
                f"memfit: checkpoint {path} skipped: {problem} (moved to {aside.name}); trying "
                "the one before it"
            )

    def write_run_json(self) -> None:
        """run.json: the config, what was resolved, the plan, the versions (rank 0)."""
        ranks = self.ranks
        self.run_json = {
            "config": dataclasses.asdict(self.cfg),
            "resolved": {
                "device": str(self.device),
                "micro_batch_size": self.micro,
                "precision": self.precision,
                "gradient_checkpointing": self.checkpointing,
                "steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch,
                "train_rows": self.rows_n,
                "eval_rows": len(self.eval_rows) if self.eval_rows is not None else 0,
                "skipped_rows": len(self.skipped),
                "max_tokens_per_micro_batch": self.max_tokens,
                # the data's longest row in tokens (truncated, special tokens in) and the width
                # of the micro-batch that holds it: the shapes the run feeds at its largest
                "longest_tokens": max(self.lengths) if self.lengths else None,
                "seq_len": (self.recipe.padded_width(max(self.lengths)) if self.lengths else None),
                # an epoch's last step: short when the rows are not a multiple of the step
                "last_step_rows": self.rows_n % self.per_step or self.per_step,
                "pad_to_multiple_of": self.recipe.pad_multiple,
                "group_by_length": self.cfg.group_by_length,
                "world_size": self.world,
                "sharding": f"zero{self.zero_stage}" if self.zero_stage else self.cfg.sharding,
                "backend": ranks.backend if ranks is not None else None,
                # a fine-tuned classifier's head: kept (same labels) or replaced (said on stderr)
                "classifier_head": getattr(self.recipe, "head_note", None),
                # a classifier's label names in id order: a LoRA adapter folder keeps no
                # config.json, and memfit predict names its outputs from these
                "labels": [str(x) for x in getattr(self.recipe, "labels", None) or []] or None,
                # which model: a --resume spelling --model otherwise is checked against them
                "model_path": os.path.abspath(self.cfg.model)
                if os.path.isdir(self.cfg.model)
                else None,
                "model_signature": self.model_signature,
                # what the weights were held in and which token loss ran (--weights-dtype,
                # --cross-entropy): read from the model and the recipe, not from the flags
                "weights": self.held_weights(),
                "cross_entropy": self.cross_entropy_ran(),
                # which implementation moved the saved activations to host memory (None: off)
                "activation_offloading": self.activation_offloading_ran(),
                # what ran --optimizer-offload (None: not asked for)
                "optimizer_offload": offload_implementation(
                    optimizer_offload_of(self.cfg),
                    zero=self.zero_stage is not None,
                    device=self.device,
                ),
            },
            "plan": self.planned,
            "versions": versions(),
        }
        if self.main:
            runfolder.write_json(self.out / "run.json", self.run_json)
        self.note_short_last_step()

    def note_short_last_step(self) -> None:
        """One line when the run has short epoch ends that weaken its loss (in-batch negatives:
        the recipe says what they do); the pairs are still trained on, never dropped."""
        note_of = getattr(self.recipe, "short_step_note", None)
        if note_of is None or not self.main or self.cfg.quiet:
            return
        if self.total_steps < self.steps_per_epoch:
            return  # the run ends before any epoch does
        note = note_of(self.rows_n, self.per_step)
        if note:
            say(f"memfit: {note}")

    # --- the steps ------------------------------------------------------------------------------
    def permutation(self, epoch: int) -> list[int]:
        """The order of the rows in ``epoch``: a pure function of (seed, epoch), so that a
        resumed run recomputes it and goes on at its position."""
        cfg = self.cfg
        if cfg.group_by_length and self.lengths is not None:
            return length_grouped_order(self.lengths, self.per_step, seed=cfg.seed, epoch=epoch)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        return torch.randperm(self.rows_n, generator=g).tolist()

    def watch_memory(self, cap: Any) -> None:
        """Under ``cap`` (--memory-cap, or None): what it counts from the start, the step's peak
        memory by phase, and with --memory-snapshot a snapshot at each caught OOM."""
        if cap is not None:
            optimizer = self.optimizer
            if state_format(optimizer) == "torchao-cpu-offload":
                # torchao's offloaded state is host memory: its on-device optimizer's is counted
                optimizer = optimizer.d_opt
            cap.track(self.model, *([optimizer] if optimizer is not None else []))
            if self.ranks is not None:
                # written in place at every sync point: held already, never a new allocation
                cap.track(*self.ranks.buffers())
            if self.zero_stage is not None:
                # DeepSpeed's partitions, master weights and flat buffers
                cap.track(*self.sharded.held_tensors())
        self.refuse_cap_below_held(cap)
        self.peak = PeakMemory(self.device, cap)
        self.guard.on_phase = self.peak.phase
        if self.cfg.memory_snapshot and self.device.type == "cuda":
            self.guard.on_oom = snapshot_writer(self.out / "memory-snapshots", self.on_event)

    def refuse_cap_below_held(self, cap: Any) -> None:
        """A --memory-cap below what the run holds already (its weights, at least): no step can
        fit, and the first allocation outside one (the data's order) would fail. Exit 3 now."""
        limit = self.cfg.memory_cap
        if limit is None:
            return
        held: int | None = None
        if cap is not None:
            held = int(cap.live_bytes)
        elif self.device.type == "cuda":
            held = int(torch.cuda.memory_allocated(self.device))
        if held is None or held < limit:
            return
        self.on_event(
            {"type": "stop", "step": self.step, "reason": "the memory cap is below what is held"}
        )
        raise NothingFitsError(
            f"--memory-cap {format_bytes(limit)}: the run holds {format_bytes(held)} before its "
            f"first step (the model's weights{', the optimizer state' if self.optimizer.state else ''}"
            "), so no step fits; give a --memory-cap above that, with room for a step"
        )

    def train_step(self, rows: list[Row]) -> dict[str, Any]:
        """One optimizer step on ``rows`` (the whole step's, on every rank): forward and backward
        under the guard, the update, the schedule; returns its metrics line."""
        guard, peak = self.guard, self.peak
        peak.reset()
        t0 = time.perf_counter()
        loss: float | None = self.guarded_step(rows, self.step + 1)
        peak.phase("optimizer")  # clipping, the update and zero_grad
        grad_norm = self.update(self.step + 1, loss=loss)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        # the step's gradients are spent: free them before the next step's forward
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += len(rows)
        self.samples_seen += len(rows)
        step_peak, phase_peaks = peak.read(), peak.record()
        tokens = guard.last_step.get("tokens") if self.recipe.splittable else None
        padded = guard.last_step.get("padded_tokens") if self.recipe.splittable else None
        rank_peaks: list[int | None] | None = None
        if self.ranks is not None:
            loss, tokens, padded, step_peak, phase_peaks, rank_peaks = self._gather(
                loss, tokens, padded, step_peak, phase_peaks
            )
        self.loss_value = loss
        seconds = time.perf_counter() - t0
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "loss": loss,
            "samples_seen": self.samples_seen,
            "micro_batch_size": guard.micro_batch_size,
            "gradient_accumulation_steps": guard.last_step.get("chunks", 1)
            if self.recipe.splittable
            else 1,
            "max_tokens_per_micro_batch": guard.max_tokens,
            "tokens": tokens,
            "padded_tokens": padded,
            "peak_bytes": step_peak,
            **phase_peaks,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds": round(seconds, 4),
            "samples_per_second": round(len(rows) / seconds, 2) if seconds > 0 else None,
        }
        if not self.recipe.splittable:
            # the loss takes the whole step; micro_batch_size is its GradCache mini-batch (as in
            # the guard's events)
            record["what"] = "mini_batch"
        if self.ranks is not None:
            record["world_size"] = self.world
            record["rank_peak_bytes"] = rank_peaks
        return record

    def _gather(
        self,
        loss: float | None,
        tokens: int | None,
        padded: int | None,
        step_peak: int | None,
        phase_peaks: dict[str, int],
    ) -> tuple[float | None, int | None, int | None, int | None, dict[str, int], list[int | None]]:
        """The step's figures over the ranks: the loss and tokens are sums, the peaks the
        largest (and each rank's peak)."""
        keys = ["loss", "tokens", "padded", "peak", *PeakMemory.RECORD_KEYS]
        local = [loss, tokens, padded, step_peak, *(phase_peaks.get(k) for k in keys[4:])]
        gathered = self.ranks.gather_floats(local)
        columns = list(zip(*gathered, strict=True))
        rank_peaks = [_int_or_none(x) for x in columns[3]]
        peaks = {
            key: int(value)
            for key, column in zip(keys[4:], columns[4:], strict=True)
            if (value := _max_or_none(column)) is not None
        }
        return (
            _sum_or_none(columns[0]),
            _int_or_none(_sum_or_none(columns[1])),
            _int_or_none(_sum_or_none(columns[2])),
            _int_or_none(_max_or_none(columns[3])),
            peaks,
            rank_peaks,
        )

    def after_step(self, stop: StopSignal) -> bool:
        """Eval and checkpoint on their schedule; True when a signal ends the run (with a
        checkpoint)."""
        cfg, step = self.cfg, self.step
        if (
            self.eval_rows is not None
            and cfg.eval_every
            and step % cfg.eval_every == 0
            and step < self.total_steps
        ):
            self.last_eval = self.evaluate()
        if cfg.save_every and step % cfg.save_every == 0 and step < self.total_steps:
            self.save("every")
        # a signal reaches every rank (the launcher forwards it), but maybe not between the same
        # two steps: the ranks agree to stop after the same one
        signalled = stop.signal is not None
        if self.ranks is not None:
            signalled = self.ranks.anyone(signalled)
        if not signalled:
            return False
        reason = f"signal {stop.signal}" if stop.signal is not None else "signal"
        self.save(reason)
        self.on_event({"type": "stop", "step": step, "reason": reason})
        self.stopped = "signal"
        return True

    def guarded_step(self, rows: list[Row], number: int) -> float:
        """One step's forward and backward under the guard (this rank's share of ``rows``); after
        micro-batch 1 fails, the next cure (gradient checkpointing), else stop with a checkpoint
        (exit 3). Returns the step's loss (this rank's part of it with several ranks)."""
        recipe, guard, ranks = self.recipe, self.guard, self.ranks
        total_units = recipe.units(rows) if recipe.splittable else len(rows)
        if ranks is not None:
            rows = shard_rows(rows, recipe.lengths(rows) if rows else None, self.rank, self.world)
        while True:
            try:
                # --activation-offloading: entered as each micro-batch's forward starts (the
                # autocast factory) and exited when its backward ends or fails (the guard's
                # backward, make_guard): each attempt its own entry, as TRL's SFTTrainer enters it
                # around each training step
                offloading = self.offload
                try:
                    loss: float = guard.step(
                        rows,
                        recipe,
                        params=self.params,
                        autocast=(
                            offloading.autocast(self.autocast)
                            if offloading is not None
                            else self.autocast
                        ),
                        scale=(self.scaler.scale if self.scaler is not None else _identity),
                        step=number,
                        total_units=total_units,
                    )
                finally:
                    if offloading is not None:
                        offloading.close()
                return loss
            except StepTooLarge as exc:
                # every rank gets here together (the guard agreed on it) and decides alike
                cure = next_cure(self.model, self.checkpointing)
                if cure is None:
                    self.save("nothing fits")
                    self.on_event(
                        {
                            "type": "stop",
                            "step": self.step,
                            "reason": "even micro-batch 1 does not fit",
                            "error": str(exc),
                        }
                    )
                    raise NothingFitsError(
                        f"step {number}: even micro-batch 1 runs out of memory "
                        f"({exc}); a checkpoint is in {self.ckpt_dir}. Try "
                        "--gradient-checkpointing, --precision bf16 on a GPU, --max-seq-len, or a "
                        "larger --memory-cap/GPU"
                    ) from None
                self.checkpointing = True
                self.on_event({"type": "backoff", "step": number, "cure": cure})
                # one row per micro-batch (a budget of one token leaves each row alone)
                guard.micro_batch_size = 1
                if guard.max_tokens is not None:
                    guard.max_tokens = 1

    def update(
        self, number: int, *, loss: float | None = None, probe: bool = False
    ) -> float | None:
        """Clip the whole step's gradient and step the optimizer; the returned gradient norm is
        None without clipping. No micro-batch changes what this phase holds (weights, gradients,
        optimizer state), so an OOM here is the end: exit 3 with what would help (on every rank:
        they agree on it). A loss or gradient that is not finite stops the run before the update
        (exit 4), unless the fp16 loss scaler is on: it skips such a step itself (and says so)."""
        if self.zero_stage is not None:
            return None if probe else self.zero_update(number, loss)
        cfg, scaler, optimizer, params = self.cfg, self.scaler, self.optimizer, self.params
        grad_norm, norm = None, None
        with CatchOom() as caught:
            if scaler is not None and not probe:
                scaler.unscale_(optimizer)
            if cfg.max_grad_norm:
                grad_norm = norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            elif scaler is None and not probe:
                # the norm alone (a factor of 1 on every gradient), for the finite check
                norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
        self.agree_oom(number, caught.error)
        if scaler is None and not probe:
            values = {"loss": loss, "gradient norm": norm}
            bad = [
                f"the {k} is {v}"
                for k, v in values.items()
                if v is not None and not math.isfinite(v)
            ]
            if self.ranks is not None and self.ranks.anyone(bool(bad)) and not bad:
                bad = ["another rank's loss or gradient is not finite"]
            if bad:
                self.stop_not_finite(number, bad)
        with CatchOom() as caught:
            if scaler is not None and not probe:
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < scale:
                    self.on_event(
                        {
                            "type": "skip",
                            "step": number,
                            "reason": "fp16 loss scaler: the gradient is not finite; the update "
                            f"is skipped and the scale lowered from {scale:g} to "
                            f"{scaler.get_scale():g}",
                        }
                    )
            else:
                optimizer.step()
        self.agree_oom(number, caught.error)
        return grad_norm

    def zero_update(self, number: int, loss: float | None) -> float | None:
        """The update of a DeepSpeed ZeRO run: the loss checked on every rank, then
        ``engine.step()`` (ZeRO-1's reduction, DeepSpeed's clipping and update). A gradient that
        is not finite makes DeepSpeed skip the update: the run stops there, as without ZeRO,
        except under fp16, whose loss scaler skips such steps (and lowers its scale) by design."""
        fp16 = self.precision == "fp16"
        finite = loss is None or math.isfinite(loss) or fp16
        bad = [] if finite else [f"the loss is {loss}"]
        if self.ranks is not None and self.ranks.anyone(bool(bad)) and not bad:
            bad = ["another rank's loss is not finite"]
        if bad:
            self.sharded.reset()
            self.stop_not_finite(number, bad)
        with CatchOom() as caught:
            norm = self.sharded.step()
        self.agree_oom(number, caught.error, peer=_peer_oom(caught))
        if self.sharded.skipped() and fp16:
            self.on_event(
                {
                    "type": "skip",
                    "step": number,
                    "reason": "DeepSpeed's fp16 loss scaler: the gradient is not finite; the "
                    "update is skipped and the scale lowered",
                }
            )
        elif self.sharded.skipped():
            self.stop_not_finite(number, [f"the gradient norm is {norm}"])
        return norm if self.cfg.max_grad_norm else None

    def agree_oom(self, number: int, error: str | None, *, peer: bool = False) -> None:
        """Every rank learns whether any ran out of memory in the update: then all stop. An
        OOM another rank's raised inside a collective (``peer``) was that agreement already."""
        ranks = self.ranks
        # (a peer's OOM: no second sync point, the others are past it)
        if peer or (ranks is not None and ranks.anyone(error is not None) and error is None):
            error = "another rank ran out of memory in its optimizer step"
        if error is None:
            return
        raise optimizer_stop(
            number,
            error,
            emit=self.on_event,
            stop_step=self.step,
            cures="--optimizer adafactor (or adamw-8bit), --lora-rank 8, "
            + ("--sharding fsdp, " if ranks is not None and self.sharded is None else "")
            + "or more memory",
        )

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (on every rank): each rank looks at its own
        part (an FSDP shard, a ZeRO-3 partition), and they agree."""
        finite = all(ck.finite(_local(p).detach()) for p in self.params)
        if self.ranks is not None:
            finite = not self.ranks.anyone(not finite)
        return finite

    def stop_not_finite(self, number: int, bad: list[str], *, updated: bool = False) -> None:
        """Stop before an update that would write NaN or inf into the weights (``updated``:
        before the checkpoint of weights an update made so), with advice that holds.

        Resumed from the weights of the step before, step ``number`` computes the same loss and
        gradient (the same rows and random draws), whatever --lr: those weights are not a resume
        point (a checkpoint of them is set aside, ``.not-finite-step-N``, kept to look at), so
        that --resume goes on from an earlier checkpoint, where a lower --lr changes the updates
        that led here."""
        step, ckpt_dir = self.step, self.ckpt_dir
        self.optimizer.zero_grad(set_to_none=True)
        self.on_event({"type": "not_finite", "step": number, "problems": bad})
        if updated:
            how = "stopped before its checkpoint"
        elif self.weights_finite():
            how = (
                f"stopped before the update. Resumed from the weights of step {step}, step "
                f"{number} computes the same, so they are no resume point"
            )
            if self.main and (ckpt_dir / f"step-{step}").is_dir():
                aside = ck.set_aside(ckpt_dir / f"step-{step}", "not-finite")
                self.on_event(
                    {
                        "type": "checkpoint_skipped",
                        "checkpoint": str(ckpt_dir / f"step-{step}"),
                        "reason": f"step {number} after it is not finite",
                        "moved_to": str(aside),
                    }
                )
                how += f" (their checkpoint is set aside as {aside})"
        else:
            how = "stopped before the update; the weights were already not finite"
        if self.ranks is not None:
            self.ranks.barrier()  # every rank sees the checkpoints as rank 0 left them
        steps_kept = ck.completed_steps(ckpt_dir)
        resume_from = (
            f"a resume goes on from {ckpt_dir / f'step-{steps_kept[-1]}'}"
            if steps_kept
            else "with no checkpoint before it, a resume starts from step 0"
        )
        self.on_event({"type": "stop", "step": step, "reason": "loss or gradient not finite"})
        raise TrainingStoppedError(
            f"step {number}: {' and '.join(bad)}; {how}; {resume_from}. Lower --lr"
            f"{'' if self.cfg.max_grad_norm else ' (or set --max-grad-norm)'} and run again with "
            "--resume, or fix the data and start a new run"
        )

    # --- the probe ------------------------------------------------------------------------------
    def weights_snapshot(self) -> list[torch.Tensor] | None:
        """With --probe (and steps left): a copy of the trained weights, on the CPU, made before
        the memory cap (outside it), that the probe puts back; frozen ones (LoRA's base model)
        are never changed by an optimizer step."""
        if self.cfg.probe and self.lengths is not None and self.step < self.total_steps:
            if self.zero_stage is not None:
                return []  # the probe makes no update under DeepSpeed: nothing to put back
            return [p.detach().to("cpu", copy=True) for p in self.params]
        return None

    def probe(self, snapshot: list[torch.Tensor]) -> None:
        """Step 0: the longest rows of the data as one step, so that an OOM the data holds for
        later comes now and the micro-batch (token budget) is corrected before step 1. Then
        everything it changed is put back: weights, optimizer state, gradients, RNG."""
        guard, optimizer, lengths = self.guard, self.optimizer, self.lengths
        assert lengths is not None
        longest = sorted(range(self.rows_n), key=lambda i: -lengths[i])[: self.per_step]
        rows = take(self.train_rows, longest)
        rng = _rng_state(self.device)
        fresh = not optimizer.state
        before = (guard.micro_batch_size, guard.max_tokens)
        ooms = [0]

        def count(event: dict[str, Any]) -> None:
            ooms[0] += event["type"] == "oom"
            self.on_event(event)

        guard.on_event = count
        try:
            self.guarded_step(rows, 0)
            if fresh:
                # a fresh optimizer allocates its state in its first step: part of the peak
                self.update(0, probe=True)
        finally:
            guard.on_event = self.on_event
            optimizer.zero_grad(set_to_none=True)
            if self.zero_stage is not None:
                # the probe's gradients, in DeepSpeed's partitions too
                self.sharded.reset()
            elif fresh:
                # the state the probe created goes; step 1 creates it anew, as without a probe
                optimizer.state.clear()
            if self.zero_stage is None:
                with torch.no_grad():
                    for param, saved in zip(self.params, snapshot, strict=True):
                        param.copy_(saved)
                # torchao's CPUOffloadOptimizer steps host copies: they get the weights back too
                sync = getattr(optimizer, "sync_host_weights", None)
                if sync is not None:
                    sync()
            _set_rng_state(self.device, rng)
        # the plan is corrected: a later grow never goes past what the longest rows allowed
        guard.target_micro_batch_size = guard.micro_batch_size
        guard.target_max_tokens = guard.max_tokens
        guard.clean_steps = 0
        self.on_event(
            {
                "type": "probe",
                "step": 0,
                "rows": len(rows),
                "longest_tokens": lengths[longest[0]] if longest else 0,
                "ooms": ooms[0],
                "micro_batch_size": guard.micro_batch_size,
                "max_tokens_per_micro_batch": guard.max_tokens,
                "changed": (guard.micro_batch_size, guard.max_tokens) != before,
            }
        )

    # --- eval, checkpoints, the end -------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The eval metrics of the eval rows (guarded, as the steps); a new best saves DIR/best."""
        assert self.local_eval is not None
        recipe = self.recipe
        self.model.eval()
        try:
            result: dict[str, float] = self.guard.evaluate(
                self.local_eval, recipe, autocast=self.autocast
            )
        finally:
            self.model.train()
        metrics = {f"eval_{k}": v for k, v in result.items()}
        self.metrics.write({"step": self.step, "samples_seen": self.samples_seen, **metrics})
        if self.main:
            self.on_event({"type": "eval", "step": self.step, **metrics})
        value = result.get(recipe.metric)
        if better(value, self.best, greater=recipe.greater_is_better):
            self.best = value
            self.save_model(self.out / "best")
        return result

    def save(self, reason: str) -> None:
        """A checkpoint of this step (every rank writes its part). Weights that an update made
        not finite are never written: a resume would take them (and --save-total-limit push
        good checkpoints out for them); the run stops instead (exit 4)."""
        if not self.weights_finite():
            self.stop_not_finite(
                self.step, ["its update made the weights not finite"], updated=True
            )
        state = {
            "epoch": self.epoch,
            "position": self.position,
            "samples_seen": self.samples_seen,
            "best": self.best,
            "guard": self.guard.state_dict(),
            "reason": reason,
            "settings": self.settings,
            # what its weights fit: a resume with another --model is refused before loading
            "model": self.model_signature,
            "optimizer": self.cfg.optimizer,
            # its optimizer.pt's layout (--optimizer-offload cpu on CUDA: torchao's)
            "optimizer_format": state_format(self.optimizer),
        }
        path = ck.write_checkpoint(
            self.ckpt_dir,
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            state=state,
            keep=self.cfg.save_total_limit,
            ranks=self.ranks,
            sharded=self.sharded,
        )
        if self.main:
            self.on_event(
                {"type": "checkpoint", "step": self.step, "path": str(path), "reason": reason}
            )

    def save_model(self, folder: Path) -> None:
        """The model folder (rank 0 writes it; under FSDP every rank gathers the weights)."""
        weights = self.sharded.full_state_dict() if self.sharded is not None else None
        if self.main:
            save_model_folder(
                self.recipe, folder, state_dict=weights, merge_lora=self.cfg.merge_lora
            )

    def finish(self, started: float) -> None:
        """The end of a run that did every step: the last eval, the model, the result."""
        # resumed at the last step (the model's save was cut short, or a finished run's model/
        # is gone): its checkpoint is there, and a finished run's eval line too
        at_end = self.resumed_at == self.step
        previous = (self.previous_result or {}).get("eval_metrics") if at_end else None
        if self.eval_rows is not None and isinstance(previous, dict) and previous:
            self.last_eval = dict(previous)
        elif self.eval_rows is not None:
            self.last_eval = self.evaluate()
        if self.cfg.save_every and not at_end:
            # first: a disk that fills up at the model's save loses no step (--resume then finds
            # the last step done and only writes the model)
            self.save("end")
        self.save_model(self.out / "model")
        if not self.main:
            return
        self.on_event(
            {
                "type": "stop",
                "step": self.step,
                "reason": "done",
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        # a --resume of this folder now has nothing to do (and says so)
        self.run_json["result"] = {
            "stopped": "done",
            "steps": self.step,
            "samples_seen": self.samples_seen,
            "final_loss": self.loss_value,
            "eval_metrics": self.last_eval,
        }
        runfolder.write_json(self.out / "run.json", self.run_json)

    def close(self) -> TrainResult:
        """Leave the other ranks (once every rank is done writing) and return the result."""
        if self.ranks is not None:
            # every rank is done writing before any leaves (rank 0's model folder included)
            self.ranks.barrier()
            self.ranks.close()
        return TrainResult(
            self.out, self.step, self.samples_seen, self.loss_value, self.last_eval, self.stopped
        )

    def progress(self) -> Progress:
        """The progress line or bar (rank 0, unless --quiet)."""
        return Progress(self.total_steps, self.step, quiet=self.cfg.quiet or not self.main)


class StopSignal:
    """SIGTERM/SIGINT: finish the step in hand, write a checkpoint, exit 0 (spot instances)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def better(value: float | None, best: float | None, *, greater: bool) -> bool:
    """Whether the eval metric ``value`` is a new best. One that is not finite never is: kept
    as the best, NaN would beat no later eval (every comparison with it is false) and make the
    checkpoints' ``best`` NaN."""
    if value is None or not math.isfinite(value):
        return False
    return best is None or (value > best if greater else value < best)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(device: torch.device, state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _peer_oom(caught: CatchOom) -> bool:
    """Whether ``caught`` is another rank's OOM, raised at a sync point inside a collective."""
    kind = caught.exception_type
    return kind is not None and issubclass(kind, PeerOutOfMemory)


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _max_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP shard is a DTensor (its local tensor); a DeepSpeed
    ZeRO-3 parameter is an empty placeholder outside a forward, its values in ``ds_tensor``
    (this rank's partition)."""
    partition = getattr(tensor, "ds_tensor", None)
    if isinstance(partition, torch.Tensor):
        return partition
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
