"""``GuardedSentenceTransformerTrainer``: sentence-transformers' trainer under memfit's guard.

The one-line change::

    from sentence_transformers import SentenceTransformerTrainer                            # before
    from memfit.integrations import GuardedSentenceTransformerTrainer as SentenceTransformerTrainer  # after

What the guard may do on out-of-memory depends on the loss, because a smaller piece of a batch
must not change what the step learns:

* **Per-sample losses** (``CosineSimilarityLoss``, ``SoftmaxLoss``, ``ContrastiveLoss``,
  ``TripletLoss``, ``MarginMSELoss``): a batch's loss is the mean (or sum) of its rows' losses, so
  the guard splits the micro-batch into row chunks weighted by their share, as
  :class:`~memfit.integrations.GuardedTrainer` does.
* **In-batch negatives** (``MultipleNegativesRankingLoss``, ``MultipleNegativesSymmetricRankingLoss``):
  every other positive of the batch is a negative for an anchor, so splitting the batch would
  change the objective. The guard switches the loss to its GradCache variant
  (``CachedMultipleNegativesRankingLoss`` …, same hyper-parameters) with a ``mini_batch_size`` of
  half the rows, lowered again on a further OOM: all embeddings are computed without a graph, the
  loss and its gradient at the embeddings are taken over the whole batch, then each mini-batch is
  re-embedded with a graph; the gradient is the whole batch's. A loss that is already cached gets
  its ``mini_batch_size`` lowered. The user's loss object itself is never changed: the cached
  variant stands in for it during the Trainer's call only.
* **Other losses that couple a batch's samples** (``CoSENTLoss``, ``AnglELoss``, the batch-hard
  triplet losses, ``OnlineContrastiveLoss``, …, and any loss class the guard does not know):
  no split keeps their objective, so an OOM stops training with what would help. Subclass and
  override :meth:`GuardedSentenceTransformerTrainer.loss_reduction` to declare a loss of your
  own as a per-sample mean or sum.

Eval: ``prediction_step`` is guarded for per-sample losses only; evaluators are not guarded.

Several ranks (``torchrun``): the ranks agree an OOM as with ``GuardedTrainer`` (the pieces run
without communication, a sync point after each, the gradients reduced after the step). A loss
that gathers embeddings across ranks inside its forward (``gather_across_devices=True``) cannot
be met at a sync point: with it the guard steps aside, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from sentence_transformers import SentenceTransformerTrainer
from torch import nn

from memfit import quiet
from memfit.guard.policy import BackOff, back_off
from memfit.integrations._batch import batch_rows
from memfit.integrations._guard import MEAN, SUM, TrainerGuardMixin
from memfit.integrations._ranks import ranks_problem
from memfit.integrations.plan import PlannedArguments
from memfit.integrations.trainer import plan_trainer_arguments

logger = logging.getLogger("memfit.integrations")

# in-batch-negative losses → their GradCache variants (same objective, same gradient)
CACHED_VARIANTS = {
    "MultipleNegativesRankingLoss": "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss": "CachedMultipleNegativesSymmetricRankingLoss",
}
# losses that are means over the rows of a batch
_ROW_MEANS = ("TripletLoss", "MarginMSELoss")
# losses whose reduction is their loss_fct's (nn.MSELoss, nn.CrossEntropyLoss)
_LOSS_FCT_REDUCED = ("CosineSimilarityLoss", "SoftmaxLoss")
# the keyword arguments of a cached loss that are not hyper-parameters of the objective
_CACHE_KNOBS = ("self", "model", "mini_batch_size", "mini_batch_num_tokens", "show_progress_bar")

CACHED = "cached"  # a GradCache loss: lower its mini-batch
COUPLED = "coupled"  # the samples of a batch interact and there is no cached variant: no split


def losses_module() -> Any:
    """``sentence_transformers.losses`` (v3-5), moved under ``sentence_transformer`` in v6."""
    try:
        return importlib.import_module("sentence_transformers.sentence_transformer.losses")
    except ImportError:
        return importlib.import_module("sentence_transformers.losses")


def cached_variant(loss: nn.Module, mini_batch_size: int) -> nn.Module:
    """The GradCache variant of an in-batch-negative ``loss``, with its hyper-parameters."""
    cached_cls = getattr(losses_module(), CACHED_VARIANTS[type(loss).__name__])
    options = {
        name: getattr(loss, name)
        for name in inspect.signature(cached_cls.__init__).parameters
        if name not in _CACHE_KNOBS and hasattr(loss, name)
    }
    return cached_cls(loss.model, mini_batch_size=mini_batch_size, **options)


class GuardedSentenceTransformerTrainer(TrainerGuardMixin, SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` whose steps survive OOM without changing what they learn.

    Per-sample losses are split into weighted row chunks; in-batch-negative losses switch to
    their GradCache variant with a smaller ``mini_batch_size`` (see the module docstring).
    ``guard_mini_batch_size`` is that mini-batch (``None``: the loss as given). The keywords
    ``memory_cap``, ``grow_after`` and ``memfit_plan`` are those of
    :class:`~memfit.integrations.GuardedTrainer`; with ``memfit_plan`` a plan that chooses
    the cached loss starts training with it at the planned mini-batch.
    """

    guard_mini_batch_size: int | None

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
        self.guard_mini_batch_size = None
        # original loss (by id) → its cached stand-in, made once
        self._guard_cached_losses: dict[int, nn.Module] = {}
        self.memfit_plan: PlannedArguments | None = None
        if memfit_plan:
            loss = kwargs.get("loss", args[4] if len(args) > 4 else None)
            name = {
                "MultipleNegativesRankingLoss": "mnrl",
                "CachedMultipleNegativesRankingLoss": "mnrl",
                "CoSENTLoss": "cosent",
                "CosineSimilarityLoss": "cosine",
                "SoftmaxLoss": "softmax",
            }.get(type(loss).__name__)
            defaults: dict[str, Any] = {"task": "sentence-embedding"}
            if name is not None:
                defaults["loss"] = name
            args, kwargs, self.memfit_plan = plan_trainer_arguments(
                args, kwargs, memfit_plan, **defaults
            )
        super().__init__(*args, **kwargs)
        self._guard_check_arguments()
        if self.memfit_plan is not None and self.memfit_plan.mini_batch_size:
            self.guard_mini_batch_size = int(self.memfit_plan.mini_batch_size)

    # -- which loss, and what it allows ---------------------------------------------------------
    def loss_reduction(self, loss: nn.Module) -> str:
        """How ``loss`` reduces a batch: ``"mean"`` or ``"sum"`` over its rows (split into
        weighted chunks), ``"cached"`` (GradCache: lower the mini-batch; in-batch-negative
        losses that have a cached variant count too) or ``"coupled"`` (no split)."""
        name = type(loss).__name__
        if name in CACHED_VARIANTS:
            return CACHED
        if getattr(loss, "uses_gradient_cache", False) and hasattr(loss, "mini_batch_size"):
            return CACHED
        if name in _ROW_MEANS:
            return MEAN
        if name in _LOSS_FCT_REDUCED:
            reduction = getattr(getattr(loss, "loss_fct", None), "reduction", None)
            return {"mean": MEAN, "sum": SUM}.get(str(reduction), COUPLED)
        if name == "ContrastiveLoss":
            return MEAN if getattr(loss, "size_average", True) else SUM
        return COUPLED

    def _guard_loss(self, inputs: Mapping[str, Any]) -> tuple[Any, nn.Module]:
        """The loss this batch uses, and its key in a dict of losses (per dataset)."""
        loss: Any = self.loss
        if isinstance(loss, Mapping):
            name = inputs.get("dataset_name")
            return name, loss[name]
        return None, loss

    def _guard_modules(self) -> list[nn.Module]:
        losses = self.loss.values() if isinstance(self.loss, Mapping) else [self.loss]
        # a loss may own weights (SoftmaxLoss's classifier): the cap counts them too
        return [self.model, *(loss for loss in losses if isinstance(loss, nn.Module))]

    def _guard_reduction(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> str:
        return self.loss_reduction(self._guard_loss(inputs)[1])

    def _guard_eval_splittable(self, inputs: Mapping[str, Any]) -> bool:
        return self.loss_reduction(self._guard_loss(inputs)[1]) in (MEAN, SUM)

    # -- training -------------------------------------------------------------------------------
    def _guard_run_call(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        key, loss = self._guard_loss(inputs)
        kind = self.loss_reduction(loss)
        if kind in (CACHED, COUPLED):
            # one piece, then a sync point (several ranks): asked before anything is allocated
            slots = self._guard_sync_slots(1)
            with self._guard_cached(key, loss) if kind == CACHED else contextlib.nullcontext():
                # the whole call at once: the GradCache loss splits it without changing it
                value = SentenceTransformerTrainer.training_step(
                    self, model, dict(inputs), num_items_in_batch
                )
            for _ in range(slots):
                self._guard_sync()
            return value
        return super()._guard_run_call(model, inputs, num_items_in_batch)

    # -- several ranks --------------------------------------------------------------------------
    def _guard_ranks_problem(self) -> str | None:
        problem = ranks_problem(self)
        if problem is not None:
            return problem
        if self.args.world_size <= 1:
            return None
        losses = self.loss.values() if isinstance(self.loss, Mapping) else [self.loss]
        for loss in losses:
            if getattr(loss, "gather_across_devices", False):
                return (
                    f"{type(loss).__name__}(gather_across_devices=True) (it gathers embeddings "
                    "across ranks inside its forward; without it each rank's in-batch negatives "
                    "are its own rows and the guard covers it)"
                )
        return None

    def _guard_current_size(self, inputs: Mapping[str, Any]) -> int:
        _, loss = self._guard_loss(inputs)
        kind = self.loss_reduction(loss)
        if kind in (MEAN, SUM):
            return super()._guard_current_size(inputs)
        rows = batch_rows(inputs)
        if kind == COUPLED:
            return rows
        own = getattr(loss, "mini_batch_size", None)
        if type(loss).__name__ in CACHED_VARIANTS:
            own = None
        return int(min(self.guard_mini_batch_size or own or rows, rows))

    def _guard_propose(self, inputs: Mapping[str, Any], error: str, step: int) -> int:
        _, loss = self._guard_loss(inputs)
        kind = self.loss_reduction(loss)
        if kind in (MEAN, SUM):
            return super()._guard_propose(inputs, error, step)
        rows = batch_rows(inputs)
        if kind == COUPLED:
            self._guard_emit(
                {"type": "oom", "step": step, "micro_batch_size": rows, "error": error}
            )
            return 0
        size = self._guard_current_size(inputs)
        self._guard_emit(
            {
                "type": "oom",
                "step": step,
                "micro_batch_size": rows,
                "mini_batch_size": size,
                "error": error,
            }
        )
        return BackOff.halve(size, rows)

    def _guard_stop_reason(self, inputs: Mapping[str, Any]) -> str:
        _, loss = self._guard_loss(inputs)
        kind = self.loss_reduction(loss)
        name = type(loss).__name__
        if kind == COUPLED:
            return (
                f"{name} compares the samples of a batch with each other, so no smaller piece "
                "of the batch keeps its objective (and it has no GradCache variant); a smaller "
                "per_device_train_batch_size changes what it learns"
            )
        if kind == CACHED:
            return f"{name} with mini-batches of one row does not fit"
        return super()._guard_stop_reason(inputs)

    def _guard_backoff_keys(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        _, loss = self._guard_loss(inputs)
        if self.loss_reduction(loss) == CACHED:
            return {"loss": f"cached {type(loss).__name__}"}
        return {}

    def _guard_adopt(self, inputs: Mapping[str, Any], size: int) -> None:
        _, loss = self._guard_loss(inputs)
        if self.loss_reduction(loss) in (MEAN, SUM):
            super()._guard_adopt(inputs, size)
        else:
            self.guard_mini_batch_size = size

    @contextlib.contextmanager
    def _guard_cached(self, key: Any, loss: nn.Module) -> Iterator[None]:
        """The loss for one call: as given while the guard has not backed off, else its cached
        variant (or itself, for a cached loss) at ``guard_mini_batch_size``."""
        size = self.guard_mini_batch_size
        if size is None:
            yield
            return
        if type(loss).__name__ not in CACHED_VARIANTS:
            # a GradCache loss of the user's: its own mini-batch, lowered for this call
            before = loss.mini_batch_size
            setattr(loss, "mini_batch_size", size)  # noqa: B010
            try:
                yield
            finally:
                setattr(loss, "mini_batch_size", before)  # noqa: B010
            return
        stand_in = self._guard_cached_losses.get(id(loss))
        if stand_in is None:
            stand_in = cached_variant(loss, size).to(self.model.device)
            self._guard_cached_losses[id(loss)] = stand_in
        setattr(stand_in, "mini_batch_size", size)  # noqa: B010
        original = self.loss
        if isinstance(original, Mapping):
            self.loss = {**original, key: stand_in}
        else:
            self.loss = stand_in
        try:
            yield
        finally:
            self.loss = original

    def _guard_back_off(self, inputs: Mapping[str, Any], error: str) -> None:
        _, loss = self._guard_loss(inputs)
        kind = self.loss_reduction(loss)
        if kind in (MEAN, SUM):
            super()._guard_back_off(inputs, error)
            return
        rows = batch_rows(inputs)
        step = self._guard_step_number()
        name = type(loss).__name__
        if kind == COUPLED:
            self._guard_emit(
                {"type": "oom", "step": step, "micro_batch_size": rows, "error": error}
            )
            self._guard_stop(
                step,
                f"{name} compares the samples of a batch with each other, so no smaller piece "
                "of the batch keeps its objective (and it has no GradCache variant); a smaller "
                "per_device_train_batch_size changes what it learns",
                error,
            )
        own = getattr(loss, "mini_batch_size", None) if name not in CACHED_VARIANTS else None
        size = min(self.guard_mini_batch_size or own or rows, rows)
        reason = f"{name} with mini-batches of one row does not fit"
        self.guard_mini_batch_size = back_off(
            size,
            rows,
            error,
            emit=self._guard_emit,
            stop=functools.partial(self._guard_stop, step, reason),
            step=step,
            oom={"micro_batch_size": rows, "mini_batch_size": size},
            backoff={"loss": f"cached {name}"},
        )

    def _guard_grow(self) -> bool:
        size = self.guard_mini_batch_size
        if size is None:
            return super()._guard_grow()
        # the ceiling: the plan's mini-batch, a cached loss's own, else the whole batch
        ceiling = int(self.args.per_device_train_batch_size)
        planned = self.memfit_plan.mini_batch_size if self.memfit_plan is not None else None
        own = getattr(self.loss, "mini_batch_size", None)
        if planned:
            ceiling = int(planned)
        elif isinstance(own, int) and type(self.loss).__name__ not in CACHED_VARIANTS:
            ceiling = own
        new = BackOff.doubled(size, ceiling)
        if new is None:
            return False
        self._guard_emit(
            {"type": "grow", "step": self._guard_step_number(), "from": size, "to": new}
        )
        # back at the ceiling without a plan: the loss as given runs again
        self.guard_mini_batch_size = None if new >= ceiling and not planned else new
        return True
