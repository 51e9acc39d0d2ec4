"""Run one optimizer step as micro-batches, and survive out-of-memory with the same gradient.

The caller picks a step's rows before any split; the guard runs them in consecutive chunks of
``micro_batch_size`` and accumulates their gradients. A recipe's ``loss(chunk, total_units)`` is
the chunk's summed loss over the whole step's units (see :mod:`memfit.train.recipes.base`), so the
chunks' gradients add up to the step's mean-loss gradient for any split, uneven ones included.

When the recipe knows its rows' token lengths (``lengths``), the step's rows are sorted longest
first before the split (chunks of similar lengths pad least), and with a token budget
(``max_tokens``) a chunk also holds at most that many tokens including padding
(:func:`memfit.data.batching.split_into_chunks`): short rows go many to a chunk, long rows few.

On OOM the guard throws away everything the failed attempt produced (the graph the traceback
holds, the gradients the earlier chunks and the half-finished backward wrote), halves the
micro-batch (with a token budget: the budget, to half the padded tokens of the chunk that failed)
and re-runs the whole step from its start: the same rows, each exactly once, the same gradient.
After ``grow_after`` clean steps it tries twice the micro-batch (budget) again, up to the planned
one; a grow that fails doubles the wait before the next try (the policy, shared with the Trainer
integrations and guarded inference: :mod:`memfit.guard.policy`).

With several ranks (``ranks``, see :mod:`memfit.train.distributed`) each rank runs its share of the
step's rows and the ranks meet at a sync point after every micro-batch (a rank with fewer
micro-batches meets the others without work, or with a zero-weighted pass where the model itself
communicates, FSDP) and before the gradient reduction. A rank that runs out of memory joins the
next sync point with its flag up, the others raise :class:`PeerOutOfMemory` there, and all adopt
the smallest proposed micro-batch (token budget): every rank re-runs the step with the same size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import torch

from memfit.data.batching import padded_tokens, split_into_chunks
from memfit.guard.oom import CatchOom, drop_gradients, free_memory
from memfit.guard.policy import BackOff, EventSink, agree, back_off

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


class GuardedRecipe(Protocol):
    """What the guard uses of a recipe (:class:`memfit.train.recipes.base.Recipe` has it)."""

    @property
    def splittable(self) -> bool: ...

    def units(self, rows: list[Any]) -> int: ...

    def loss(
        self, rows: list[Any], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor: ...

    def eval_partial(self, rows: list[Any]) -> Any: ...

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]: ...


def _lengths(recipe: Any, rows: list[Any]) -> list[int] | None:
    """The rows' token lengths, where the recipe knows them (``Recipe.lengths``)."""
    lengths = getattr(recipe, "lengths", None)
    return None if lengths is None else lengths(rows)


def _no_phase(name: str) -> None:
    return None


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory: this rank drops the step and backs off with it."""


class RankAgreement(Protocol):
    """What the guard uses of the process group (:class:`memfit.train.distributed.Ranks`)."""

    def anyone(self, failed: bool) -> bool: ...

    def check(self) -> None: ...

    def most(self, value: int) -> int: ...

    def least(self, *values: int) -> tuple[int, ...]: ...

    def finish_gradients(self, params: Sequence[torch.Tensor]) -> None: ...

    def gather_object(self, obj: Any) -> list[Any]: ...


class StepTooLarge(Exception):
    """Even micro-batch 1 runs out of memory; the gradients are cleared already.

    The message is the original out-of-memory error's first line; the caller decides the cure
    (gradient checkpointing, lower precision, shorter sequences, more memory).
    """

    def __init__(self, error: str, *, micro_batch_size: int = 1, phase: str = "train") -> None:
        super().__init__(error)
        self.error = error
        self.micro_batch_size = micro_batch_size
        self.phase = phase


def _too_large(phase: str) -> Callable[[str], NoReturn]:
    """What the policy calls when one row does not fit: :class:`StepTooLarge` for ``phase``."""

    def stop(error: str) -> NoReturn:
        raise StepTooLarge(error, micro_batch_size=1, phase=phase)

    return stop


def _from_peer(caught: CatchOom) -> bool:
    """Whether the OOM ``caught`` was another rank's (:class:`PeerOutOfMemory` raised here)."""
    kind = caught.exception_type
    return kind is not None and issubclass(kind, PeerOutOfMemory)


class Guard:
    """Splits optimizer steps into micro-batches and adapts their size to the memory there is.

    ``micro_batch_size`` is the size the next step uses (public: a caller may set it, e.g. to 1
    after it turned gradient checkpointing on). It never grows above ``target_micro_batch_size``,
    the planned size (by default the initial one).
    """

    def __init__(
        self,
        micro_batch_size: int,
        *,
        target_micro_batch_size: int | None = None,
        grow_after: int = 50,
        on_event: EventSink | None = None,
        device: torch.device | None = None,
        max_tokens: int | None = None,
        target_max_tokens: int | None = None,
        on_phase: Callable[[str], None] | None = None,
        on_oom: Callable[[BaseException], None] | None = None,
        ranks: RankAgreement | None = None,
        pad_pass: Callable[[bool], None] | None = None,
        on_recover: Callable[[], None] | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if grow_after < 1:
            raise ValueError(f"grow_after must be at least 1, got {grow_after}")
        self.micro_batch_size = int(micro_batch_size)
        self.target_micro_batch_size = int(target_micro_batch_size or micro_batch_size)
        # when to grow back (the micro-batch, or the token budget where there is one)
        self.policy = BackOff(grow_after)
        self.on_event = on_event
        self.device = device
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        # the token budget of a chunk, padding included (None: rows only)
        self.max_tokens = int(max_tokens) if max_tokens else None
        self.target_max_tokens = int(target_max_tokens or max_tokens or 0) or None
        # called as each phase starts ("forward", "backward"): per-phase memory peaks
        self.on_phase = on_phase
        # called with a caught OOM before its graph is released (a CUDA memory snapshot)
        self.on_oom = on_oom
        # the chunk in flight (rows, padded tokens): what an OOM backs off from
        self._chunk: tuple[int, int | None] = (0, None)
        # what the last finished step ran: chunks, real tokens, padded tokens (None: unknown)
        self.last_step: dict[str, int | None] = {}
        # several ranks: the sync points, and (FSDP) a zero-weighted forward and backward that a
        # rank with fewer micro-batches runs so that the model's collectives line up
        self.ranks = ranks
        self.pad_pass = pad_pass
        # called after a failed attempt, before the re-run (FSDP resets its iteration state)
        self.on_recover = on_recover
        # a micro-batch's backward (DeepSpeed's engine runs its own); None: ``loss.backward()``
        self._backward = backward or _plain_backward
        # the training step's size is a GradCache mini-batch (a recipe that takes the whole step:
        # in-batch negatives), not a micro-batch: its events say so ("what": "mini_batch")
        self._mini_batches = False

    @property
    def grow_after(self) -> int:
        """Clean steps before the next try of a larger micro-batch (doubles after a failed one)."""
        return self.policy.grow_after

    @grow_after.setter
    def grow_after(self, value: int) -> None:
        self.policy.grow_after = int(value)

    @property
    def clean_steps(self) -> int:
        """Clean steps since the last OOM or grow (a caller may restart the count)."""
        return self.policy.clean_steps

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        self.policy.clean_steps = int(value)

    # -- training ----------------------------------------------------------------------------
    def step(
        self,
        rows: list[Any],
        recipe: GuardedRecipe,
        *,
        params: Sequence[torch.Tensor],
        autocast: AutocastFactory = contextlib.nullcontext,
        scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        step: int | None = None,
        total_units: int | None = None,
    ) -> float:
        """Forward and backward of one optimizer step over exactly ``rows``; returns its loss.

        The gradients are accumulated into ``params``' ``.grad``, which must be ``None`` (or
        zero) when the step starts: a re-run after OOM starts again from ``None``. With several
        ranks ``rows`` is this rank's share, ``total_units`` the whole step's units (on every
        rank), the returned loss this rank's part of it, and the gradients leave reduced.
        """
        if not rows and self.ranks is None:
            raise ValueError("a step needs at least one row")
        self._mini_batches = not recipe.splittable
        self._maybe_grow(step)
        clean = True
        while True:
            size = self.micro_batch_size
            units = int(total_units) if total_units is not None else recipe.units(rows)
            with CatchOom(self._own_oom) as caught:
                loss = self._forward_backward(rows, recipe, size, autocast, scale, units, params)
            error = caught.error
            if error is None:
                break
            # out of the with block: the exception and its frames are gone now
            own = not _from_peer(caught)
            clean = False
            if self.on_recover is not None:
                self.on_recover()
            # the failed attempt's gradients are partial: the re-run accumulates the whole step
            drop_gradients(params)
            free_memory(self.device)
            if own and self.ranks is not None:
                # the sync point the others are waiting at: they learn of it there
                self.ranks.anyone(True)
            self.policy.after_oom()
            self._adopt_back_off(error, own=own, rows=len(rows), size=size, step=step)
        self.policy.after_step(clean)
        return loss

    def _own_oom(self, exc: BaseException) -> None:
        """``on_oom`` for this rank's own OOMs (not for another rank's, raised here)."""
        if self.on_oom is not None and not isinstance(exc, PeerOutOfMemory):
            self.on_oom(exc)

    def _adopt_back_off(
        self, error: str, *, own: bool, rows: int, size: int, step: int | None
    ) -> None:
        """The next micro-batch (token budget) after an OOM; every rank adopts the same one."""
        tokens = self.max_tokens is not None and self._chunk[1] is not None
        if self.ranks is None:
            if tokens:
                self.max_tokens = self._back_off_tokens(error, step=step)
            else:
                self.micro_batch_size = self._back_off(size, rows, error, step=step, phase="train")
            return
        # several ranks: the ranks that failed propose half of what failed (0: even one row
        # fails), the others keep theirs; all take the smallest
        proposal_rows, proposal_tokens = self.micro_batch_size, self.max_tokens
        if own:
            rows_failed, padded = self._chunk
            event: dict[str, Any] = {"type": "oom", "step": step, "micro_batch_size": size}
            if tokens:
                event.update(padded_tokens=padded, max_tokens=self.max_tokens)
                proposal_tokens = (
                    0
                    if rows_failed <= 1 or not padded or (self.max_tokens or 0) <= 1
                    else BackOff.halve_tokens(self.max_tokens or padded, padded)
                )
            else:
                proposal_rows = BackOff.halve(size, rows_failed or rows or size)
            self._emit({**event, "error": error})
        agreed_rows, agreed_tokens = agree(self.ranks, proposal_rows, proposal_tokens)
        if agreed_rows < 1 or agreed_tokens < 1:
            raise StepTooLarge(
                error if own else "another rank ran out of memory with one row per micro-batch",
                micro_batch_size=1,
                phase="train",
            )
        backoff: dict[str, Any] = {"type": "backoff", "step": step}
        backoff.update({"from": self.micro_batch_size, "to": agreed_rows})
        if tokens:
            backoff.update(max_tokens_from=self.max_tokens, max_tokens_to=agreed_tokens)
            self.max_tokens = agreed_tokens
        self.micro_batch_size = agreed_rows
        if not own:
            backoff["cause"] = "another rank"
        self._emit(backoff)

    def _forward_backward(
        self,
        rows: list[Any],
        recipe: GuardedRecipe,
        size: int,
        autocast: AutocastFactory,
        scale: Callable[[torch.Tensor], torch.Tensor],
        total_units: int,
        params: Sequence[torch.Tensor] = (),
    ) -> float:
        self._chunk = (0, None)
        phase = self.on_phase or _no_phase
        ranks = self.ranks
        if not recipe.splittable:
            # the recipe splits internally (GradCache) without changing the gradient
            phase("forward")
            with autocast():
                loss = recipe.loss(rows, total_units, mini_batch_size=size)
            phase("backward")
            self._backward(scale(loss))
            value = float(loss.detach())
            del loss
            if ranks is not None:
                ranks.finish_gradients(params)
            return value
        # the micro-batches' losses are added on the device and read once, after the last
        # backward: a read per micro-batch would make the host wait for each backward to finish
        # before it queues the next micro-batch's forward (on a GPU the one read left still
        # waits for the step's backward: bench/guard_overhead.py measures what that costs)
        losses: list[torch.Tensor] = []
        chunks = self.chunks(rows, recipe, size, self.max_tokens) if rows else []
        # several ranks meet after every micro-batch: the same number of times on each
        count = ranks.most(len(chunks)) if ranks is not None else len(chunks)
        for index in range(count):
            if index < len(chunks):
                chunk = chunks[index]
                self._chunk = (len(chunk), self._padded(recipe, chunk))
                phase("forward")
                with autocast():
                    loss = recipe.loss(chunk, total_units)
                phase("backward")
                self._backward(scale(loss))
                losses.append(loss.detach())
                # the graph is freed by backward; drop the last reference before the next forward
                del loss
            elif self.pad_pass is not None:
                # the model communicates in its forward and backward (FSDP): join with no weight
                self.pad_pass(True)
            if ranks is not None:
                ranks.check()
        if ranks is not None:
            ranks.finish_gradients(params)
        lengths = _lengths(recipe, rows)
        self.last_step = {
            "chunks": count,
            "tokens": sum(lengths) if lengths is not None else None,
            "padded_tokens": sum(self._padded(recipe, c) or 0 for c in chunks)
            if lengths is not None
            else None,
        }
        # one read of every micro-batch's loss, summed as Python floats in their order (as a
        # read per micro-batch did; float32 on the device, as MPS has no float64)
        step_loss = 0.0
        if losses:
            for value in torch.stack(losses).float().cpu().tolist():
                step_loss += value
        return step_loss

    @staticmethod
    def chunks(
        rows: list[Any], recipe: Any, max_rows: int, max_tokens: int | None
    ) -> list[list[Any]]:
        """``rows`` cut into micro-batches: longest first under the token budget where the
        recipe knows lengths, else consecutive runs of ``max_rows``."""
        lengths = _lengths(recipe, rows)
        if lengths is None:
            return [rows[start : start + max_rows] for start in range(0, len(rows), max_rows)]
        groups = split_into_chunks(
            lengths,
            max_rows=max_rows,
            max_tokens=max_tokens,
            pad_multiple=getattr(recipe, "pad_multiple", 1),
            # the width the recipe really feeds (max_seq_len under --padding max_length)
            width_of=getattr(recipe, "padded_width", None),
        )
        return [[rows[i] for i in group] for group in groups]

    @staticmethod
    def _padded(recipe: Any, chunk: list[Any]) -> int | None:
        lengths = _lengths(recipe, chunk)
        if lengths is None:
            return None
        width = getattr(recipe, "padded_width", None)
        if width is not None:
            return len(chunk) * int(width(max(lengths)))
        return padded_tokens(lengths, getattr(recipe, "pad_multiple", 1))

    def _maybe_grow(self, step: int | None) -> None:
        """Twice the token budget (where there is one) or micro-batch, when the policy says so."""
        if self.max_tokens is not None and self.target_max_tokens is not None:
            old = self.max_tokens
            new = self.policy.grow(old, self.target_max_tokens)
            if new is None:
                return
            self._emit({"type": "grow", "step": step, "max_tokens_from": old, "max_tokens_to": new})
            self.max_tokens = new
        else:
            old = self.micro_batch_size
            new = self.policy.grow(old, self.target_micro_batch_size)
            if new is None:
                return
            self._emit({"type": "grow", "step": step, "from": old, "to": new})
            self.micro_batch_size = new

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(
        self,
        rows: Sequence[Any],
        recipe: GuardedRecipe,
        *,
        autocast: AutocastFactory = contextlib.nullcontext,
        micro_batch_size: int | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """The recipe's eval metrics over ``rows`` in chunks, under ``torch.no_grad``.

        Where the recipe knows its rows' lengths the rows go longest first, in chunks under the
        token budget too (the metrics do not depend on the order). On OOM only the failed chunk
        is re-run, smaller; finished chunks are kept. The training micro-batch is left as it is
        (eval holds no gradients, so its sizes differ). With several ranks ``rows`` is this
        rank's share: the ranks meet after every chunk (until all are done), back off together,
        and the metrics are reduced over every rank's chunks.
        """
        size = int(micro_batch_size or self.micro_batch_size)
        budget = self.max_tokens
        lengths = _lengths(recipe, list(rows))
        if lengths is not None:
            order = sorted(range(len(rows)), key=lambda i: -lengths[i])
            rows = [rows[i] for i in order]
        ranks = self.ranks
        partials: list[Any] = []
        start = 0
        with torch.no_grad():
            while True:
                done = start >= len(rows)
                # several ranks go on while any has rows left (the same number of rounds each)
                if done and (ranks is None or ranks.most(0) == 0):
                    break
                if not done and ranks is not None:
                    ranks.most(1)
                chunk = (
                    []
                    if done
                    else self.chunks(list(rows[start : start + size]), recipe, size, budget)[0]
                )
                partial: Any = None
                with CatchOom() as caught:
                    if chunk:
                        with autocast():
                            partial = recipe.eval_partial(chunk)
                    elif self.pad_pass is not None:
                        self.pad_pass(False)
                error = caught.error
                if error is None and chunk:
                    partials.append(partial)
                    start += len(chunk)
                if error is not None and _from_peer(caught):
                    # another rank's OOM, raised at a sync point inside the model's collectives
                    # (FSDP, ZeRO-3 gather in the eval forward): that was this round's sync
                    # point; the back-off is the other rank's
                    failed, error = True, None
                else:
                    # one sync point a round; a rank that failed raises its flag here
                    failed = (
                        ranks.anyone(error is not None) if ranks is not None else error is not None
                    )
                if not failed:
                    continue
                if self.on_recover is not None:
                    self.on_recover()
                free_memory(self.device)
                if ranks is None:
                    assert error is not None
                    size = self._back_off(size, len(chunk), error, step=step, phase="eval")
                    if budget is not None:
                        budget = BackOff.halve_tokens(budget, self._padded(recipe, chunk) or budget)
                    continue
                size, budget = self._agree_eval_back_off(recipe, chunk, error, size, budget, step)
        if ranks is not None:
            partials = [p for share in ranks.gather_object(partials) for p in share]
        return recipe.eval_reduce(partials)

    def _agree_eval_back_off(
        self,
        recipe: GuardedRecipe,
        chunk: list[Any],
        error: str | None,
        size: int,
        budget: int | None,
        step: int | None,
    ) -> tuple[int, int | None]:
        """Several ranks: the eval chunk size (token budget) every rank adopts after an OOM."""
        assert self.ranks is not None
        proposal_rows, proposal_tokens = size, budget
        if error is not None:
            self._emit(
                {
                    "type": "oom",
                    "step": step,
                    "micro_batch_size": size,
                    "phase": "eval",
                    "error": error,
                }
            )
            proposal_rows = BackOff.halve(size, len(chunk))
            if budget is not None:
                proposal_tokens = BackOff.halve_tokens(
                    budget, self._padded(recipe, chunk) or budget
                )
        rows, tokens = agree(self.ranks, proposal_rows, proposal_tokens)
        if rows < 1:
            raise StepTooLarge(
                error or "another rank ran out of memory evaluating one row",
                micro_batch_size=1,
                phase="eval",
            )
        event: dict[str, Any] = {"type": "backoff", "step": step, "from": size, "to": rows}
        event["phase"] = "eval"
        if error is None:
            event["cause"] = "another rank"
        self._emit(event)
        return rows, (tokens if budget is not None else None)

    # -- recovery ----------------------------------------------------------------------------
    def _back_off(self, size: int, rows: int, error: str, *, step: int | None, phase: str) -> int:
        """Report the OOM and return the next smaller size; StepTooLarge below 1."""
        return back_off(
            size,
            rows,
            error,
            emit=self._emit,
            stop=_too_large(phase),
            step=step,
            phase=None if phase == "train" else phase,
        )

    def _back_off_tokens(self, error: str, *, step: int | None) -> int:
        """Report the OOM of a token-budget chunk and return the next budget: half the padded
        tokens of the chunk that failed (so it splits); StepTooLarge for a chunk of one row."""
        rows, padded = self._chunk
        event = {"type": "oom", "step": step, "micro_batch_size": rows, "padded_tokens": padded}
        self._emit({**event, "max_tokens": self.max_tokens, "error": error})
        if rows <= 1 or not padded or self.max_tokens is None or self.max_tokens <= 1:
            raise StepTooLarge(error, micro_batch_size=1, phase="train")
        new = BackOff.halve_tokens(self.max_tokens, padded)
        self._emit(
            {
                "type": "backoff",
                "step": step,
                "from": self.micro_batch_size,
                "to": self.micro_batch_size,
                "max_tokens_from": self.max_tokens,
                "max_tokens_to": new,
            }
        )
        return new

    def _emit(self, event: dict[str, Any]) -> None:
        if self.on_event is None:
            return
        if self._mini_batches and "phase" not in event:
            # a training step's events (oom, backoff, grow; eval's name their phase): their
            # sizes are the GradCache mini-batch's
            event = {**event, "what": "mini_batch"}
        self.on_event(event)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int | None]:
        """What a resumed run needs to continue with the same micro-batch and grow schedule."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "target_micro_batch_size": self.target_micro_batch_size,
            "clean_steps": self.clean_steps,
            "grow_after": self.grow_after,
            "max_tokens": self.max_tokens,
            "target_max_tokens": self.target_max_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = int(state["micro_batch_size"])
        self.target_micro_batch_size = int(
            state.get("target_micro_batch_size", self.target_micro_batch_size)
        )
        self.clean_steps = int(state.get("clean_steps", 0))
        self.grow_after = int(state.get("grow_after", self.grow_after))
        if "max_tokens" in state:
            self.max_tokens = state["max_tokens"]
            self.target_max_tokens = state.get("target_max_tokens")
        self.policy.growing = False
