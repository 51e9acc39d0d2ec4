"""A recipe that takes the whole step (in-batch negatives) backs off its GradCache mini-batch,
not a micro-batch: its guard events say so ("what": "mini_batch", the other keys unchanged) and
so does the line memfit train prints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.guard import Guard
from memfit.train.console import describe

Row = dict[str, Any]


class _Recipe:
    """One unit per row; a chunk (or mini-batch) over ``oom_above`` rows runs out of memory."""

    def __init__(self, *, splittable: bool, oom_above: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.splittable = splittable
        self.oom_above = oom_above

    def units(self, rows: list[Row]) -> int:
        return len(rows)

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        if (mini_batch_size or len(rows)) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        return F.cross_entropy(self.model(x), y, reduction="sum") / total_units

    def eval_partial(self, rows: list[Row]) -> torch.Tensor:
        if len(rows) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return torch.zeros(len(rows))

    def eval_reduce(self, partials: list[torch.Tensor]) -> dict[str, float]:
        return {"rows": float(torch.cat(partials).numel())}


def _rows(n: int) -> list[Row]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4, generator=g), "y": torch.tensor(i % 3)} for i in range(n)]


def _train_events(*, splittable: bool) -> list[dict[str, Any]]:
    recipe = _Recipe(splittable=splittable, oom_above=3)
    events: list[dict[str, Any]] = []
    guard = Guard(8, grow_after=1, on_event=events.append)
    params = list(recipe.model.parameters())
    guard.step(_rows(8), recipe, params=params, step=1)  # 8 → 4 → 2
    for p in params:
        p.grad = None
    recipe.oom_above = 100
    for step in (2, 3):  # a clean step, then the guard grows back 2 → 4
        for p in params:
            p.grad = None
        guard.step(_rows(8), recipe, params=params, step=step)
    return events


def test_a_whole_step_recipe_reports_its_mini_batch() -> None:
    events = _train_events(splittable=False)
    assert [e["type"] for e in events] == ["oom", "backoff", "oom", "backoff", "grow"]
    assert all(e["what"] == "mini_batch" for e in events)
    # the contract's keys are kept: extended, not renamed
    backoffs = [(e["from"], e["to"]) for e in events if e["type"] == "backoff"]
    assert backoffs == [(8, 4), (4, 2)]
    assert [e["micro_batch_size"] for e in events if e["type"] == "oom"] == [8, 4]
    lines = [describe(e) for e in events]
    assert lines[1] == "step 1: GradCache mini-batch 8 → 4, step re-run from its start"
    assert lines[0] == "out of memory at step 1 with GradCache mini-batch 8"
    assert lines[4] == "step 3: trying GradCache mini-batch 4"
    assert not any("micro-batch" in line for line in lines)


def test_a_split_recipe_reports_its_micro_batch() -> None:
    events = _train_events(splittable=True)
    assert [e["type"] for e in events] == ["oom", "backoff", "oom", "backoff", "grow"]
    assert not any("what" in e for e in events)
    assert describe(events[1]) == "step 1: micro-batch 8 → 4, step re-run from its start"
    assert not any("mini-batch" in describe(e) for e in events)


@pytest.mark.parametrize("splittable", [False, True])
def test_eval_batches_are_not_mini_batches(splittable: bool) -> None:
    recipe = _Recipe(splittable=splittable, oom_above=100)
    events: list[dict[str, Any]] = []
    guard = Guard(8, on_event=events.append)
    guard.step(_rows(8), recipe, params=list(recipe.model.parameters()), step=1)
    recipe.oom_above = 2
    assert guard.evaluate(_rows(6), recipe, micro_batch_size=8, step=1) == {"rows": 6.0}
    assert events and all(e["phase"] == "eval" and "what" not in e for e in events)
