"""The back-off policy: how much smaller after an OOM, when to grow back, agreed across ranks.

One policy for every guarded loop: :class:`memfit.guard.Guard` (``memfit train``, and
``memfit predict``/``embed`` through its eval path) and the Trainer integrations
(:mod:`memfit.integrations`).

* **Halve** (:meth:`BackOff.halve`): after an OOM the next size is half of what really ran (a size
  above the rows there were ran them all at once); nothing is smaller than one row. A token
  budget halves to half the padded tokens of the chunk that failed (:meth:`BackOff.halve_tokens`).
* **Report** (:func:`back_off`): an ``oom`` event, then a ``backoff`` event ``from``/``to``; one
  row that does not fit stops the caller's way (its exception). An OOM in the optimizer update
  stops the run (:func:`optimizer_stop`): no smaller micro-batch changes what the update holds.
* **Grow back** (:meth:`BackOff.grow`): after ``grow_after`` clean optimizer steps, twice the size
  (up to its ceiling, the planned one); a grown size that runs out of memory doubles the wait
  before the next try (:meth:`BackOff.after_oom`).
* **Agree** (:func:`agree`): with several ranks each proposes a size (half of what failed on the
  ranks that failed, its own on the others) and all adopt the smallest.

The schedule (clean steps, the wait) is one per run, but a run may have several sizes that grow
on it (rows or a token budget; the chunk rows or a GradCache mini-batch in the Trainer
integrations): the sizes stay with their owners, who ask the policy for the next one.
Inference never grows (a later block may hold rows as long as the one that failed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from memfit.errors import NothingFitsError

EventSink = Callable[[dict[str, Any]], None]

# a budget no rank proposes: "keep mine" in the agreement on the smallest one
NO_LIMIT = 1 << 62


class BackOff:
    """The grow-back schedule of one guarded run, and the sizes it chooses.

    ``grow_after`` is the clean optimizer steps to wait before trying a larger size; it doubles
    each time a grown size runs out of memory. ``clean_steps`` counts the clean steps since the
    last OOM or grow; ``growing`` says the step in flight tries a grown size.
    """

    def __init__(self, grow_after: int = 50) -> None:
        self.grow_after = int(grow_after)
        self.clean_steps = 0
        self.growing = False

    @staticmethod
    def halve(size: int, ran: int) -> int:
        """The size after an OOM at ``size`` where ``ran`` rows were there to run: half of what
        really ran; 0 when that was one row (nothing smaller exists)."""
        effective = min(size, ran)
        return 0 if effective <= 1 else effective // 2

    @staticmethod
    def halve_tokens(budget: int, padded: int) -> int:
        """The token budget after an OOM of a chunk of ``padded`` tokens (padding included):
        half of what failed, and always below the budget before, so that the retries end."""
        return max(1, min(budget, padded) // 2)

    def due(self) -> bool:
        """Whether enough clean steps have passed to try a larger size."""
        return self.clean_steps >= self.grow_after

    def grew(self) -> None:
        """A larger size is being tried from this step on: count clean steps afresh, and let an
        OOM of this step double the wait (:meth:`after_oom`)."""
        self.clean_steps = 0
        self.growing = True

    @staticmethod
    def doubled(size: int, ceiling: int) -> int | None:
        """Twice ``size``, at most ``ceiling``; None where ``size`` is at the ceiling already."""
        return None if size >= ceiling else min(ceiling, size * 2)

    def grow(self, size: int, ceiling: int) -> int | None:
        """The size to try from this step on when it is due (:meth:`due`) and ``size`` is below
        ``ceiling``: twice ``size``, at most ``ceiling``; None: keep ``size``."""
        new = self.doubled(size, ceiling) if self.due() else None
        if new is not None:
            self.grew()
        return new

    def after_oom(self) -> None:
        """An attempt ran out of memory: if it tried a grown size, that size does not fit; wait
        twice as long before the next try."""
        if self.growing:
            self.growing = False
            self.grow_after *= 2

    def after_step(self, clean: bool) -> None:
        """An optimizer step finished; ``clean``: without an OOM (the clean steps count on)."""
        self.growing = False
        self.clean_steps = self.clean_steps + 1 if clean else 0


def back_off(
    size: int,
    ran: int,
    error: str,
    *,
    emit: EventSink,
    stop: Callable[[str], NoReturn],
    step: int | None,
    phase: str | None = None,
    oom: dict[str, Any] | None = None,
    backoff: dict[str, Any] | None = None,
) -> int:
    """Report an OOM at ``size`` (``ran``: the rows there were) and return the next size.

    Emits ``{"type": "oom", "step", "micro_batch_size": size, "phase"?, "error"}`` (``oom``:
    other keys in place of ``micro_batch_size``), then ``stop(error)`` when one row did not fit,
    else ``{"type": "backoff", "step", "from": size, "to": next, "phase"?}`` (``backoff``: extra
    keys). ``phase`` is left out for training.
    """
    event: dict[str, Any] = {"type": "oom", "step": step}
    event.update(oom if oom is not None else {"micro_batch_size": size})
    if phase is not None:
        event["phase"] = phase
    emit({**event, "error": error})
    new = BackOff.halve(size, ran)
    if new < 1:
        stop(error)
    event = {"type": "backoff", "step": step, "from": size, "to": new, **(backoff or {})}
    if phase is not None:
        event["phase"] = phase
    emit(event)
    return new


def optimizer_stop(
    step: int, error: str, *, emit: EventSink, cures: str, stop_step: int | None = None
) -> NothingFitsError:
    """An OOM in the optimizer update (clipping, the step): the end of the run, as no smaller
    micro-batch changes what the update holds. Emits ``{"type": "oom", "step", "phase":
    "optimizer", "error"}`` and ``{"type": "stop", "step": stop_step (default step), "reason"}``,
    and returns the error to raise: one line with ``cures`` (the caller's spelling of what helps:
    CLI flags, ``TrainingArguments``)."""
    emit({"type": "oom", "step": step, "phase": "optimizer", "error": error})
    emit(
        {
            "type": "stop",
            "step": step if stop_step is None else stop_step,
            "reason": "the optimizer step does not fit",
        }
    )
    return NothingFitsError(
        f"step {step}: the optimizer step runs out of memory ({error}). It holds the weights, "
        f"their gradients and the optimizer state whatever the micro-batch: try {cures}"
    )


class Least(Protocol):
    """What the agreement uses of the process group (:class:`memfit.train.distributed.Ranks`)."""

    def least(self, *values: int) -> tuple[int, ...]: ...


def agree(ranks: Least, rows: int, tokens: int | None) -> tuple[int, int]:
    """The rows (token budget) every rank adopts: the smallest proposed. A rank proposes half of
    what failed where it ran out of memory (0: even one row failed), its own size elsewhere;
    ``tokens`` None: no budget (it never wins the agreement)."""
    agreed_rows, agreed_tokens = ranks.least(rows, NO_LIMIT if tokens is None else tokens)
    return agreed_rows, agreed_tokens
