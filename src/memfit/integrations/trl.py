"""``GuardedSFTTrainer``: TRL's ``SFTTrainer`` that survives out-of-memory with the same gradient.

The one-line change to an existing TRL script::

    from trl import SFTTrainer                                      # before
    from memfit.integrations import GuardedSFTTrainer as SFTTrainer  # after

Everything else stays: ``SFTConfig``, the dataset (prompt/completion, conversational, plain text),
``peft_config``, packing, ``padding_free``, ``activation_offloading``, ``use_liger_kernel``.
Extra keywords as :class:`~memfit.integrations.GuardedTrainer`'s: ``memory_cap``, ``grow_after``,
``memfit_plan`` (its ``seq_len`` defaults to ``SFTConfig.max_length``).

How the gradient stays exact under TRL (trl 1.16's ``SFTTrainer.compute_loss``):

* The loss of a call is Σ token losses ÷ ``num_items_in_batch``, the target tokens (labels that
  are not -100, shifted) of the whole optimizer step, which the Trainer counts before the step's
  first call. Completion-only loss (``completion_mask``) and assistant-only loss
  (``assistant_masks``) are -100 labels in the collated batch, so they are counted the same way.
  Chunks of a call therefore add up unweighted (the guard's ``sum-over-step`` reduction, found by
  its probe), and a chunk without a target token (only prompt tokens) is skipped: its gradient is
  zero either way.
* Padding-free batches (``padding_free=True``, and ``packing=True`` with its default ``bfd``
  strategy, which implies it) are one row of sequences laid end to end, told apart by
  ``position_ids`` (no attention mask). The guard cuts them at sequence boundaries, not by rows
  (:func:`memfit.integrations._batch.split_sequences`): a chunk is whole sequences with their
  own ``cu_seq_lens``; the label of each sequence's first token is -100, so no target crosses a
  cut. ``packing_strategy='wrapped'`` batches are padded rows and are cut by rows. In a
  padding-free batch the guard's sizes (``guard_micro_batch_size``, the events' ``from``/``to``)
  count sequences.
* Eval (``prediction_step`` after an OOM): a padding-free batch's chunks join their logits and
  labels along the tokens; the loss is the chunks' token means weighed by their target tokens.
* TRL's activation offloading context is entered by TRL's own ``training_step`` once around each
  chunk (and each re-run after an OOM), never nested: the guard sits above it.
* TRL's logged metrics stay those of a run without OOM: the token count and the per-call entropy
  and token accuracy of a failed attempt are dropped before the re-run, a chunked call logs one
  entry weighed over its chunks' target tokens, and the guard's probe leaves no eval entry.

Not exact: a MoE model's router auxiliary loss (``router_aux_loss_coef``), a mean over each
forward's tokens: under the guard it is each chunk's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from trl import SFTTrainer

from memfit import quiet
from memfit.integrations._batch import count_items, sequence_starts, split_sequences
from memfit.integrations._guard import TrainerGuardMixin
from memfit.integrations.plan import PlannedArguments
from memfit.integrations.trainer import plan_trainer_arguments

# the per-call metrics TRL's compute_loss appends (a mean over the call's target tokens)
_TOKEN_MEANS = ("entropy", "mean_token_accuracy")


class GuardedSFTTrainer(TrainerGuardMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose ``training_step`` survives OOM with the same gradient.

    As :class:`~memfit.integrations.GuardedTrainer`: on an out-of-memory error in a micro-batch's
    forward or backward the guard drops the step's gradients, halves the rows (padding-free:
    the sequences) it runs at once and re-runs the step's micro-batches so far in chunks whose
    gradients add up to the micro-batch's. Events go to ``OUTPUT_DIR/memfit_events.jsonl``.

    Args (besides SFTTrainer's):
        memory_cap: a size (``"300MiB"``, bytes as int) the run behaves as if the device had
            (default: the environment variable ``MEMFIT_MEMORY_CAP``).
        grow_after: clean optimizer steps before the guard tries twice the chunk size again.
        memfit_plan: keywords for :func:`~memfit.integrations.apply_plan` (``gpu_memory``/``gpu``
            the budget; ``seq_len`` defaults to the config's ``max_length``), or True: the plan's
            micro-batch, accumulation, precision, checkpointing and SFTConfig's own
            ``activation_offloading`` and ``model_init_kwargs`` are written into ``args`` before
            SFTTrainer reads them (never Liger's fused loss, which SFTTrainer refuses: the plan
            prices SFTTrainer's own chunked LM head, ``cross_entropy="trl-chunked"``). The
            result is ``self.memfit_plan``.
    """

    def __init__(
        self,
        *args: Any,
        memory_cap: int | str | None = None,
        grow_after: int = 50,
        memfit_plan: dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> None:
        quiet.install()  # the library lines that say nothing (memfit.quiet)
        self._guard_init(memory_cap=memory_cap, grow_after=grow_after)
        self.memfit_plan: PlannedArguments | None = None
        # TRL's metrics as they were when the optimizer step in flight began (see module)
        self._memfit_metrics_mark: tuple[int, dict[str, int]] | None = None
        if memfit_plan:
            arguments = args[1] if len(args) > 1 else kwargs.get("args")
            length = getattr(arguments, "max_length", None)
            defaults = {} if length is None else {"seq_len": int(length)}
            args, kwargs, self.memfit_plan = plan_trainer_arguments(
                args, kwargs, memfit_plan, **defaults
            )
        super().__init__(*args, **kwargs)
        self._guard_check_arguments()

    # -- what a piece of a call is: a row, or a sequence of a padding-free batch ----------------
    def _guard_rows(self, inputs: Mapping[str, Any]) -> int:
        starts = sequence_starts(inputs)
        return super()._guard_rows(inputs) if starts is None else len(starts)

    def _guard_split(self, inputs: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
        starts = sequence_starts(inputs)
        if starts is None:
            return super()._guard_split(inputs, size)
        return split_sequences(inputs, starts, size)

    # -- TRL's metrics, as a run without OOM logs them -------------------------------------------
    def _memfit_metrics_now(self) -> tuple[int, dict[str, int]]:
        train = self._metrics["train"]
        return int(self._total_train_tokens), {key: len(values) for key, values in train.items()}

    def _memfit_metrics_back(self, mark: tuple[int, dict[str, int]]) -> None:
        tokens, lengths = mark
        self._total_train_tokens = tokens
        for key, values in self._metrics["train"].items():
            del values[lengths.get(key, 0) :]

    def _guard_begin_call(self) -> None:
        new_step = int(self.state.global_step) != self._guard_step_key
        super()._guard_begin_call()
        if new_step:
            self._memfit_metrics_mark = self._memfit_metrics_now()

    def _guard_drop_gradients(self) -> None:
        super()._guard_drop_gradients()
        if self._memfit_metrics_mark is not None:
            # the failed attempt's tokens and means: the re-run logs the step's calls again
            self._memfit_metrics_back(self._memfit_metrics_mark)

    def _guard_run_call(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        _, before = self._memfit_metrics_now()
        size = self.guard_micro_batch_size
        loss = super()._guard_run_call(model, inputs, num_items_in_batch)
        if size is not None and size < self._guard_rows(inputs):
            self._memfit_merge_means(inputs, size, before)
        return loss

    def _memfit_merge_means(
        self, inputs: Mapping[str, Any], size: int, before: dict[str, int]
    ) -> None:
        """The chunks' entropy and token accuracy as the one entry the call would have logged:
        their means weighed by their target tokens (a chunk without any was not run)."""
        shifted = self._guard_shifted_labels()
        counts = [count_items(c, shifted_labels=shifted) for c in self._guard_split(inputs, size)]
        counts = [n for n in counts if n]
        total = sum(counts)
        for key in _TOKEN_MEANS:
            values = self._metrics["train"].get(key)
            if values is None:
                continue
            added = values[before.get(key, 0) :]
            if len(added) != len(counts) or total == 0:
                continue  # not one entry per chunk run (a compute_loss of the user's): left
            del values[before.get(key, 0) :]
            values.append(sum(v * n for v, n in zip(added, counts, strict=True)) / total)

    def _guard_predict_chunks(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        size: int,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        if prediction_loss_only or sequence_starts(inputs) is None:
            return super()._guard_predict_chunks(
                model, inputs, size, prediction_loss_only, ignore_keys
            )
        # a padding-free batch's chunks are pieces of its one row: their logits and labels are
        # joined along the tokens, not the rows; each chunk's loss is a mean over its target
        # tokens (num_items_in_batch is not passed in eval), weighed by them
        shifted = self._guard_shifted_labels()
        losses: list[tuple[torch.Tensor, int]] = []
        outputs: list[tuple[Any, Any]] = []
        for chunk in self._guard_split(inputs, size):
            loss, logits, labels = SFTTrainer.prediction_step(
                self, model, chunk, False, ignore_keys
            )
            if loss is not None:
                losses.append((loss, count_items(chunk, shifted_labels=shifted)))
            outputs.append((logits, labels))
        total = sum(n for _, n in losses)
        loss_out: torch.Tensor | None = None
        for value, n in losses:
            if n:
                part = value * (n / total)
                loss_out = part if loss_out is None else loss_out + part
        joined = [
            None
            if any(out[i] is None for out in outputs)
            else torch.cat([out[i] for out in outputs], dim=1)
            for i in (0, 1)
        ]
        return loss_out, joined[0], joined[1]

    def _guard_probe_items(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> bool | None:
        # the probe runs compute_loss in eval mode: TRL files its metrics under eval, dropped here
        saved = {key: list(values) for key, values in self._metrics["eval"].items()}
        try:
            return super()._guard_probe_items(model, inputs, num_items_in_batch)
        finally:
            self._metrics["eval"].clear()
            self._metrics["eval"].update(saved)
