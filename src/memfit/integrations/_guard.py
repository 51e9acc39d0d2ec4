"""The guard inside a ``transformers.Trainer``: out of memory → the same gradient, smaller pieces.

How the Trainer runs an optimizer step (transformers ≥ 4.46): it draws the step's
``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` rows, counts
``num_items_in_batch`` over all of them (label entries that are not -100, where the model
takes loss kwargs or a ``compute_loss_func`` is given), then calls
``training_step(model, inputs, num_items_in_batch)`` once per micro-batch. Each call is a
forward and a backward whose gradient adds into ``.grad``; ``training_step`` divides the loss by
the accumulation steps unless the loss was normalised by ``num_items_in_batch`` already. Then it
clips, steps the optimizer and zeroes the gradients. A callback cannot catch an OOM raised inside
that call, so the guard overrides ``training_step`` itself:

* Without an OOM a call is the stock ``training_step``, unchanged (no copy, no extra work).
* A call whose micro-batch is larger than the guard's ``guard_micro_batch_size`` runs as
  consecutive row chunks (views of the collated tensors), each through the stock
  ``training_step`` with ``compute_loss``'s loss multiplied by the chunk's weight, so that the
  chunks' losses, and so their gradients, add up to the call's. The weight depends on how the
  loss is reduced, which the guard finds out once (see :meth:`TrainerGuardMixin._guard_weights`):
  a loss normalised by ``num_items_in_batch`` (sum over the step ÷ the step's items) adds up as
  it is (weight 1); a mean over the call's own items (samples, or tokens that are not -100) gets
  the chunk's share of the call's items. The Trainer's own scaling (÷ accumulation steps, the
  ``num_items_in_batch`` it passes) applies to every chunk exactly as to the whole call.
* On OOM (:func:`memfit.guard.is_oom`) the failed attempt has written part of a gradient into
  ``.grad``, on top of what the step's earlier calls accumulated. The guard drops every
  gradient, frees the failed graph, halves the chunk size and re-runs the step's calls so far
  (their inputs are the ones the Trainer still holds for this step) and then this one. The
  step's gradient is again the sum over its samples, each counted once: the same gradient as a
  run without OOM, up to float summation order. Wasted work is bounded by one optimizer step.
  Re-running the earlier calls instead of setting their gradients aside costs no memory: a
  set-aside copy would hold a second gradient at the end of every later call's backward.
* The chunk size is kept for later steps; after ``grow_after`` clean optimizer steps it doubles
  (up to the whole micro-batch) at a step boundary, and a grow that runs out of memory doubles
  the wait before the next try: :class:`memfit.guard.Guard`'s policy
  (:class:`memfit.guard.policy.BackOff`).

Dropout: with dropout off a guarded run ends with the same weights as an unguarded one (up to
float summation order). With dropout on, the re-run draws new masks: equal in distribution.

Several ranks (``torchrun``, DDP): an OOM on one rank becomes every rank's decision, as in
``memfit train``: the chunks run without communication, the ranks meet at a sync point after each
one, all adopt the smallest proposed size and re-run the step, and the guard all-reduces the
gradients itself after the step's last call (:mod:`memfit.integrations._ranks`).

The optimizer update (clipping, ``optimizer.step``) holds the weights, their gradients and the
optimizer state (AdamW allocates its two moments in the first step) whatever the micro-batch: an
OOM there is not guarded but ends ``train()`` with a ``NothingFitsError`` naming what helps, as
``memfit train`` does (:func:`memfit.guard.policy.optimizer_stop`). That error, and the one when
one row does not fit, leave ``train``/``evaluate``/``predict`` with their traceback cut there and,
uncaught, end a script with their one line and exit code 3 (:mod:`memfit.integrations._exit`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from memfit import quiet
from memfit.errors import NothingFitsError
from memfit.guard.cap import CpuMemoryCap, memory_cap
from memfit.guard.guard import PeerOutOfMemory
from memfit.guard.oom import CatchOom, drop_gradients, free_memory
from memfit.guard.policy import BackOff, agree, back_off, optimizer_stop
from memfit.integrations._batch import batch_rows, concat_outputs, count_items, split_batch
from memfit.integrations._exit import Surfaced
from memfit.integrations._ranks import (
    broadcasts_buffers,
    inner_module,
    join_ranks,
    ranks_problem,
    reduce_gradients,
)
from memfit.units import parse_size

if TYPE_CHECKING:
    from transformers import Trainer as _TrainerBase

    from memfit.integrations._ranks import SyncPoints
else:
    _TrainerBase = object

logger = logging.getLogger("memfit.integrations")

EVENTS_FILE = "memfit_events.jsonl"
# the memory cap when the constructor gives none
CAP_VARIABLE = "MEMFIT_MEMORY_CAP"

# how a call's loss is reduced, for the chunks' weights
SUM_OVER_STEP = "sum-over-step"  # Σ item losses ÷ num_items_in_batch: chunks add up as they are
MEAN = "mean"  # mean over the call's items: a chunk weighs its share of them
SUM = "sum"  # a plain sum over the call's rows: chunks add up as they are

# what helps when the optimizer update does not fit, in TrainingArguments' words
UPDATE_CURES = (
    "optim='adafactor' (or optim='adamw_bnb_8bit' on CUDA with bitsandbytes), LoRA adapters "
    "(peft's get_peft_model), or more memory"
)


class _StepReset(TrainerCallback):
    """Resets the guard's step bookkeeping whenever a training loop begins, and marks the
    optimizer step (an OOM inside it is the end of the run, see ``TrainerGuardMixin.train``)."""

    def __init__(self, trainer: TrainerGuardMixin) -> None:
        # a weak reference: the trainer holds this callback, not the other way round
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._guard_reset_steps()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._guard_updating = True

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._guard_updating = False


class TrainerGuardMixin(_TrainerBase):
    """The guard's state and ``training_step`` / ``prediction_step``; mixed into a Trainer.

    Public state (read it after ``train()``): ``guard_micro_batch_size`` (rows per forward and
    backward inside a Trainer micro-batch; ``None``: the whole micro-batch, the stock path),
    ``guard_eval_batch_size`` (the same for eval), ``guard_events`` (what was logged to
    ``OUTPUT_DIR/memfit_events.jsonl``), ``guard_cap`` (the CPU memory cap of the last capped
    ``train``/``evaluate``/``predict``, with its ``peak_bytes``).
    """

    guard_micro_batch_size: int | None
    guard_eval_batch_size: int | None
    guard_events: list[dict[str, Any]]
    guard_cap: CpuMemoryCap | None
    guard_memory_cap_bytes: int | None

    # -- set-up -------------------------------------------------------------------------------
    def _guard_init(self, *, memory_cap: int | str | None, grow_after: int) -> None:
        if isinstance(grow_after, bool) or not isinstance(grow_after, int) or grow_after < 1:
            raise ValueError(f"grow_after: must be a whole number ≥ 1, got {grow_after!r}")
        name = "memory_cap"
        if memory_cap is None and os.environ.get(CAP_VARIABLE):
            # a script runs under a cap without an edit: MEMFIT_MEMORY_CAP=300MiB python train.py
            memory_cap, name = os.environ[CAP_VARIABLE], CAP_VARIABLE
        self.guard_memory_cap_bytes = (
            None if memory_cap is None else parse_size(memory_cap, name=name)
        )
        # when to grow back: the schedule memfit's Guard follows, counted in optimizer steps
        self._guard_policy = BackOff(grow_after)
        self.guard_micro_batch_size = None
        self.guard_eval_batch_size = None
        self.guard_events = []
        self.guard_cap = None
        self._guard_capping = False
        # between a step's last training_step and the end of its optimizer step: the update
        self._guard_updating = False
        # the optimizer step in flight: its Trainer step number, its calls so far (inputs and
        # num_items_in_batch, which a re-run after OOM needs), whether it ran clean
        self._guard_step_key: int | None = None
        self._guard_step_calls: list[tuple[Mapping[str, Any], Any]] = []
        self._guard_step_clean = True
        # how compute_loss reduces, found on first need (see _guard_reduction)
        self._guard_items_normalised: bool | None = None
        # several ranks: the process group's sync points and the parameters whose gradients
        # they average (None: one process, or a setup the guard steps aside from)
        self._guard_ranks: SyncPoints | None = None
        # DDP's wrapper while a step runs on the module it holds (its buffers follow rank 0)
        self._guard_wrapper: nn.Module | None = None
        # why the guard steps aside from this run's ranks (None: it does not)
        self._guard_aside: str | None = None

    @property
    def guard_grow_after(self) -> int:
        """Clean optimizer steps before the next try of a larger chunk (doubles after a failed
        one)."""
        return self._guard_policy.grow_after

    @guard_grow_after.setter
    def guard_grow_after(self, value: int) -> None:
        self._guard_policy.grow_after = int(value)

    def _guard_check_arguments(self) -> None:
        """Say where the arguments limit what the guard does (after the Trainer's __init__)."""
        problem = self._guard_aside = self._guard_ranks_problem()
        if problem is not None:
            logger.warning(
                "memfit: the guard cannot agree an out-of-memory error across %d processes "
                "under %s, so it steps aside and the Trainer runs as stock (an OOM ends the "
                "run); plain DDP (torchrun without it) is guarded",
                self.args.world_size,
                problem,
            )
        if getattr(self.args, "auto_find_batch_size", False):
            logger.warning(
                "memfit: auto_find_batch_size restarts training with a smaller batch (and a "
                "smaller effective batch); the guard already handles OOM inside the step, so "
                "it only sees what the guard cannot cure. Consider auto_find_batch_size=False"
            )

    def _guard_ranks_problem(self) -> str | None:
        """Why the guard cannot cover this run's ranks (None: one process, or plain DDP)."""
        return ranks_problem(self)

    def _guard_join_ranks(self) -> None:
        """With several ranks the guard can cover: the sync points, set up once before training
        (and before any memory cap) on every rank alike."""
        if self._guard_ranks is not None or self.args.world_size <= 1:
            return
        if self._guard_ranks_problem() is not None:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        self._guard_ranks = join_ranks(self._guard_parameters())

    # -- the memory cap -----------------------------------------------------------------------
    def _guard_modules(self) -> list[nn.Module]:
        """Modules whose weights exist before training starts (the cap counts them)."""
        return [cast(nn.Module, self.model)]

    def _guard_parameters(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for module in self._guard_modules():
            for param in module.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    @contextlib.contextmanager
    def _guard_capped(self) -> Iterator[None]:
        """Run under ``memory_cap`` (once: ``train`` may call ``evaluate`` inside)."""
        if self.guard_memory_cap_bytes is None or self._guard_capping:
            yield
            return
        self._guard_capping = True
        try:
            with memory_cap(self.guard_memory_cap_bytes, self.args.device) as cap:
                if cap is not None:
                    # weights (and gradients or optimizer state left from before) exist already;
                    # what the run allocates from here on the cap sees by itself
                    cap.track(*self._guard_modules())
                    if self.optimizer is not None:
                        cap.track(self.optimizer)
                    if self._guard_ranks is not None:
                        cap.track(*self._guard_ranks.buffers())
                self.guard_cap = cap
                yield
        finally:
            self._guard_capping = False

    def _guard_reset_steps(self) -> None:
        """A training loop starts (again, after auto_find_batch_size's restart): no step in
        flight, none of an aborted loop's inputs to re-run."""
        self._guard_step_key = None
        self._guard_step_calls = []
        self._guard_step_clean = True

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; an OOM in the optimizer update ends it with a
        ``NothingFitsError`` that names what helps (no micro-batch changes what it holds)."""
        self._guard_reset_steps()
        if not any(isinstance(c, _StepReset) for c in self.callback_handler.callbacks):
            self.add_callback(_StepReset(self))
        self._guard_join_ranks()
        try:
            # quiet.calls: the Trainer's own dataloader pins memory where there is no GPU
            with Surfaced(), self._guard_capped(), quiet.calls():
                # an OOM anywhere else goes on up as it is (training_step catches its own)
                with CatchOom(when=lambda: self._guard_updating) as caught:
                    return super().train(*args, **kwargs)
                raise optimizer_stop(
                    self._guard_step_number(),
                    str(caught.error),
                    emit=self._guard_emit,
                    cures=UPDATE_CURES,
                )
        finally:
            # the last step's inputs are the Trainer's to free, not ours to keep
            self._guard_step_calls = []
            self._guard_updating = False

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with Surfaced(), self._guard_capped():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with Surfaced(), self._guard_capped():
            return super().predict(*args, **kwargs)

    # -- training -----------------------------------------------------------------------------
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The stock ``training_step`` over ``inputs``, in chunks when the guard has backed off,
        re-run with the step's earlier calls after an OOM (see the module docstring)."""
        ranks = self._guard_ranks
        if self.args.world_size > 1 and ranks is None:
            # a setup the guard cannot cover (said once, when the trainer was made)
            return super().training_step(model, inputs, num_items_in_batch)
        if ranks is not None:
            # the module DDP wraps: no reducer, no collective inside forward or backward; the
            # gradients are reduced after the step's last call, once every rank is known fine
            self._guard_wrapper = model if broadcasts_buffers(model) else None
            model = inner_module(model)
        self._guard_updating = False
        self._guard_begin_call()
        call: tuple[Mapping[str, Any], Any] = (inputs, num_items_in_batch)
        self._guard_step_calls.append(call)
        pending = [call]
        while True:
            # an OOM's traceback frames hold the failed graph: CatchOom lets it go
            with CatchOom() as caught:
                for past_inputs, past_items in pending[:-1]:
                    # the step's earlier calls: their gradients went with the failed attempt's
                    self._guard_run_call(model, past_inputs, past_items)
                loss = self._guard_run_call(model, inputs, num_items_in_batch)
                if ranks is not None and self._guard_last_call():
                    reduce_gradients(ranks, self._guard_buffers_of())
            error = caught.error
            if error is None:
                # the step's last call (the Trainer syncs gradients on it): clipping and the
                # optimizer step come next, until on_optimizer_step
                self._guard_updating = self._guard_last_call()
                return loss
            # out of the with block: the exception and its frames are gone now
            own = not (
                caught.exception_type is not None
                and issubclass(caught.exception_type, PeerOutOfMemory)
            )
            self._guard_step_clean = False
            self._guard_drop_gradients()
            free_memory(self.args.device)
            if ranks is not None and own:
                # the sync point the other ranks are waiting at: they learn of it there
                ranks.anyone(True)
            self._guard_policy.after_oom()
            if ranks is None:
                self._guard_back_off(inputs, error)
            else:
                self._guard_agree(ranks, inputs, error, own=own)
            pending = list(self._guard_step_calls)

    def _guard_buffers_of(self) -> nn.Module | None:
        """The module whose buffers follow rank 0's after each step (DDP's broadcast_buffers)."""
        wrapper = self._guard_wrapper
        return inner_module(wrapper) if wrapper is not None else None

    # -- several ranks --------------------------------------------------------------------------
    def _guard_sync_slots(self, pieces: int) -> int:
        """How many pieces (sync points) this call runs: the most any rank runs, so that every
        rank meets the others the same number of times. Asked before anything is allocated."""
        ranks = self._guard_ranks
        return ranks.most(pieces) if ranks is not None else pieces

    def _guard_sync(self) -> None:
        """A sync point after a piece: PeerOutOfMemory if another rank ran out of memory."""
        if self._guard_ranks is not None:
            self._guard_ranks.check()

    def _guard_agree(
        self, ranks: SyncPoints, inputs: Mapping[str, Any], error: str, *, own: bool
    ) -> None:
        """The chunk size every rank adopts after an OOM: a rank that ran out proposes half of
        what failed (0: one row failed), the others their own; all take the smallest."""
        step = self._guard_step_number()
        current = self._guard_current_size(inputs)
        proposal = self._guard_propose(inputs, error, step) if own else current
        agreed, _ = agree(ranks, proposal, None)
        if agreed < 1:
            if own:
                self._guard_stop(step, self._guard_stop_reason(inputs), error)
            self._guard_stop(
                step, "another rank ran out of memory with the smallest piece there is", error
            )
        event: dict[str, Any] = {"type": "backoff", "step": step, "from": current, "to": agreed}
        event.update(self._guard_backoff_keys(inputs))
        if not own:
            event["cause"] = "another rank"
        self._guard_emit(event)
        self._guard_adopt(inputs, agreed)

    # -- what a piece of a call is ------------------------------------------------------------
    def _guard_rows(self, inputs: Mapping[str, Any]) -> int:
        """The pieces a call's ``inputs`` can be cut into (the rows of a padded batch)."""
        return batch_rows(inputs)

    def _guard_split(self, inputs: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
        """``inputs`` as consecutive chunks of at most ``size`` pieces, in order."""
        return split_batch(inputs, size)

    def _guard_current_size(self, inputs: Mapping[str, Any]) -> int:
        """The rows this rank runs at once in a call of ``inputs``."""
        rows = self._guard_rows(inputs)
        return min(self.guard_micro_batch_size or rows, rows)

    def _guard_propose(self, inputs: Mapping[str, Any], error: str, step: int) -> int:
        """This rank's own OOM: its ``oom`` event, and the size it proposes (0: none)."""
        size = self._guard_current_size(inputs)
        self._guard_emit({"type": "oom", "step": step, "micro_batch_size": size, "error": error})
        return BackOff.halve(size, self._guard_rows(inputs))

    def _guard_stop_reason(self, inputs: Mapping[str, Any]) -> str:
        return "one row per forward pass does not fit"

    def _guard_backoff_keys(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _guard_adopt(self, inputs: Mapping[str, Any], size: int) -> None:
        self.guard_micro_batch_size = size

    def _guard_last_call(self) -> bool:
        """Whether the call that just ran was its optimizer step's last (transformers sets
        accelerate's ``sync_gradients`` before it; older ones only mark the update by
        ``on_pre_optimizer_step``, which covers the optimizer step but not the clipping)."""
        state = getattr(getattr(self, "accelerator", None), "gradient_state", None)
        return bool(getattr(state, "sync_gradients", False))

    def _guard_begin_call(self) -> None:
        """Step bookkeeping: a call with a new Trainer step number starts a new optimizer step
        (the Trainer counts ``global_step`` up after each optimizer step; a training loop that
        starts again from step 0 resets the bookkeeping through :class:`_StepReset`)."""
        key = int(self.state.global_step)
        if key == self._guard_step_key:
            return
        policy = self._guard_policy
        if self._guard_step_key is not None:
            policy.after_step(self._guard_step_clean)
        policy.growing = False
        self._guard_step_key = key
        self._guard_step_calls = []
        self._guard_step_clean = True
        if policy.due() and self._guard_grow():
            policy.grew()

    def _guard_run_call(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        """One Trainer call: whole, or in chunks of ``guard_micro_batch_size`` rows (with
        several ranks, a sync point after each, see :mod:`memfit.integrations._ranks`)."""
        size = self.guard_micro_batch_size
        rows = self._guard_rows(inputs)
        whole = size is None or size >= rows
        # agreed before the split and the weights allocate anything (the probe runs a forward)
        slots = self._guard_sync_slots(1 if whole else -(-rows // int(size or rows)))
        if whole:
            loss = super().training_step(model, dict(inputs), num_items_in_batch)
            for _ in range(slots):
                self._guard_sync()
            return loss
        chunks = self._guard_split(inputs, int(size or rows))
        weights = self._guard_weights(model, inputs, chunks, num_items_in_batch)
        total: torch.Tensor | None = None
        for index in range(slots):
            if index < len(chunks) and weights[index] != 0.0:
                # a chunk without an item to learn from is skipped: a mean over the call gives
                # it no gradient
                with self._guard_weighted_loss(weights[index]):
                    loss = super().training_step(model, chunks[index], num_items_in_batch)
                total = loss if total is None else total + loss
            if total is None and index == slots - 1:
                # allocated before the sync point: a collective follows it
                total = torch.zeros((), device=self.args.device)
            self._guard_sync()
        assert total is not None
        return total

    # -- how the chunks are weighed ---------------------------------------------------------
    def _guard_reduction(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> str:
        """How ``compute_loss`` reduces a call's loss: :data:`SUM_OVER_STEP` or :data:`MEAN`.

        Without ``num_items_in_batch`` a transformers model's loss is its own mean (over the
        samples, or the tokens that are not -100). With it, the Trainer assumes the loss was
        normalised by it, but many models take the keyword and ignore it (BERT's sequence
        classification head computes a plain mean). The guard asks the model once: the loss of
        one row with ``num_items_in_batch`` = N and = 2N, in eval mode under ``no_grad`` (no
        dropout masks drawn, no graph kept). Halved: normalised by it; equal: a mean.
        """
        if num_items_in_batch is None:
            return MEAN
        normalised = self._guard_items_normalised
        if normalised is None:
            normalised = self._guard_probe_items(model, inputs, num_items_in_batch)
            # None: this call has no item to ask with (its chunks all weigh 0); ask the next one
            self._guard_items_normalised = normalised
        return SUM_OVER_STEP if normalised else MEAN

    def _guard_probe_items(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> bool | None:
        shifted = self._guard_shifted_labels()
        row = next(
            (c for c in self._guard_split(inputs, 1) if count_items(c, shifted_labels=shifted) > 0),
            None,
        )
        if row is None:
            return None  # nothing to weigh: every chunk is skipped either way
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                prepared = self._prepare_inputs(dict(row))
                with self.compute_loss_context_manager():
                    once = self.compute_loss(
                        model, dict(prepared), num_items_in_batch=num_items_in_batch
                    )
                    twice = self.compute_loss(
                        model, dict(prepared), num_items_in_batch=num_items_in_batch * 2
                    )
                # two floats: the probe keeps no tensor alive
                first, second = (
                    float((out[0] if isinstance(out, tuple) else out).mean())
                    for out in (once, twice)
                )
        finally:
            model.train(was_training)
        if first != 0 and math.isclose(second * 2, first, rel_tol=1e-3):
            return True
        if not math.isclose(second, first, rel_tol=1e-3, abs_tol=1e-12):
            logger.warning(
                "memfit: the loss changed with num_items_in_batch but was not halved by doubling "
                "it (%.6g vs %.6g); weighing chunks as a mean over their items",
                first,
                second,
            )
        return False

    def _guard_shifted_labels(self) -> bool:
        """Whether the loss shifts its labels (causal LMs: position 0 of a row is never a
        target). The Trainer's own flag reads the model's ``loss_type``, which many causal LMs
        leave unset (GPT-2 in transformers 5), so the model class is asked too."""
        if getattr(self, "_loss_shifts_labels", False):
            return True
        model: Any = self.model
        for _ in range(3):  # the model, or the one a peft wrapper holds
            name = type(model).__name__
            if name.endswith(("ForCausalLM", "LMHeadModel")):
                return not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
            model = getattr(getattr(model, "base_model", None), "model", None)
            if model is None:
                break
        return False

    def _guard_weights(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        chunks: list[dict[str, Any]],
        num_items_in_batch: Any,
    ) -> list[float]:
        """Each chunk's loss multiplier, so that the chunks' losses add up to the call's."""
        reduction = self._guard_reduction(model, inputs, num_items_in_batch)
        shifted = self._guard_shifted_labels()
        items = [count_items(c, shifted_labels=shifted) for c in chunks]
        if reduction in (SUM_OVER_STEP, SUM):
            # the loss is a sum (÷ a constant): chunks add up as they are
            return [1.0 if n else 0.0 for n in items]
        total = sum(items)
        if total == 0:
            return [0.0] * len(chunks)
        return [n / total for n in items]

    @contextlib.contextmanager
    def _guard_weighted_loss(self, weight: float) -> Iterator[None]:
        """``compute_loss`` (the subclass's override included) with its loss times ``weight``,
        for the stock ``training_step`` to scale and back-propagate as usual."""
        if weight == 1.0:
            yield
            return
        compute_loss = self.compute_loss

        def weighted(*args: Any, **kwargs: Any) -> Any:
            out = compute_loss(*args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * weight, *out[1:])
            return out * weight

        had_own = "compute_loss" in vars(self)
        object.__setattr__(self, "compute_loss", weighted)
        try:
            yield
        finally:
            if had_own:
                object.__setattr__(self, "compute_loss", compute_loss)
            else:
                del self.__dict__["compute_loss"]

    # -- recovery -----------------------------------------------------------------------------
    def _guard_drop_gradients(self) -> None:
        # the failed attempt's gradients are partial (earlier calls, a backward that died
        # half-way): drop them all, the re-run accumulates the whole step again
        drop_gradients(self._guard_parameters())
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                drop_gradients(group["params"])

    def _guard_step_number(self) -> int:
        return int(self.state.global_step) + 1

    def _guard_back_off(self, inputs: Mapping[str, Any], error: str) -> None:
        """Halve the chunk size after an OOM in a call of ``inputs``' size; NothingFitsError
        (with a ``stop`` event) when one row did not fit."""
        rows = self._guard_rows(inputs)
        size = min(self.guard_micro_batch_size or rows, rows)
        step = self._guard_step_number()
        self.guard_micro_batch_size = back_off(
            size,
            rows,
            error,
            emit=self._guard_emit,
            stop=functools.partial(self._guard_stop, step, "one row per forward pass does not fit"),
            step=step,
        )

    def _guard_grow(self) -> bool:
        """Try twice the chunk size from the next step on; False when there is nothing to grow."""
        size = self.guard_micro_batch_size
        if size is None:
            return False
        new = size * 2
        whole = int(self.args.per_device_train_batch_size)
        self._guard_emit(
            {"type": "grow", "step": self._guard_step_number(), "from": size, "to": min(new, whole)}
        )
        # at the whole micro-batch the stock path runs again
        self.guard_micro_batch_size = None if new >= whole else new
        return True

    def _guard_stop(self, step: int, reason: str, error: str) -> NoReturn:
        self._guard_emit({"type": "stop", "step": step, "reason": reason})
        raise NothingFitsError(
            f"step {step}: {reason} ({error}). What helps without changing the batch: "
            "activation_checkpointing=True (gradient_checkpointing in older transformers), bf16=True "
            "(or fp16=True) on a GPU, shorter sequences "
            "(max_length), a lighter optimizer (optim='adafactor'), or more memory; "
            "`memfit plan` finds a configuration that fits"
        )

    def _guard_emit(self, event: dict[str, Any]) -> None:
        """Record an event (``OUTPUT_DIR/memfit_events.jsonl``, the shape of memfit's
        events.jsonl) and say it on the log."""
        record = {"time": round(time.time(), 3), **event}
        self.guard_events.append(record)
        kind = event["type"]
        if kind in ("oom", "backoff", "stop"):  # what changed the run, or ended it: said
            logger.warning("memfit guard: %s", json.dumps(event))
        else:
            logger.info("memfit guard: %s", json.dumps(event))
        if not self.args.output_dir or not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir) / EVENTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    # -- evaluation ---------------------------------------------------------------------------
    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """The stock ``prediction_step``; on OOM the batch runs in chunks of half the rows
        (kept for later batches) and their outputs are joined in order. Eval holds no
        gradients, so a chunk that fails is simply run again smaller. With several ranks each
        rank chunks its own batch (eval runs the unwrapped model: no collective inside), except
        where the guard steps aside (FSDP, DeepSpeed: their forward communicates)."""
        if self._guard_aside is not None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        rows = self._guard_rows(inputs)
        while True:
            size = self.guard_eval_batch_size
            # an OOM of a batch that may be split is caught (see _guard_eval_splittable)
            with CatchOom(when=lambda: self._guard_eval_splittable(inputs)) as caught:
                if size is None or size >= rows:
                    return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
                return self._guard_predict_chunks(
                    model, inputs, size, prediction_loss_only, ignore_keys
                )
            free_memory(self.args.device)
            step = self._guard_step_number()
            self.guard_eval_batch_size = back_off(
                min(size or rows, rows),
                rows,
                str(caught.error),
                emit=self._guard_emit,
                stop=functools.partial(self._guard_stop, step, "one row of eval does not fit"),
                step=step,
                phase="eval",
            )

    def _guard_eval_splittable(self, inputs: Mapping[str, Any]) -> bool:
        """Whether an eval batch may be split (a loss over in-batch negatives may not)."""
        return True

    def _guard_predict_chunks(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        size: int,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        shifted = self._guard_shifted_labels()
        losses: list[tuple[torch.Tensor, int]] = []
        logits: list[Any] = []
        labels: list[Any] = []
        for chunk in self._guard_split(inputs, size):
            loss, chunk_logits, chunk_labels = super().prediction_step(
                model, chunk, prediction_loss_only, ignore_keys
            )
            if loss is not None:
                # the stock eval loss of a chunk is a mean over its items (num_items_in_batch
                # is counted per batch in eval): weigh it by them
                losses.append((loss, count_items(chunk, shifted_labels=shifted)))
            logits.append(chunk_logits)
            labels.append(chunk_labels)
        loss_out: torch.Tensor | None = None
        total = sum(n for _, n in losses)
        for value, n in losses:
            if n:
                part = value * (n / total)
                loss_out = part if loss_out is None else loss_out + part
        if prediction_loss_only:
            return (loss_out, None, None)
        return (loss_out, concat_outputs(logits), concat_outputs(labels))
