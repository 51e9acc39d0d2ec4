"""memfit plan and host memory: what an offloading lever keeps there must fit --host-memory,
and the offloading levers enter a plan only when nothing fits without them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.plan import plan, search

JOB: dict[str, Any] = {"task": "causal-lm", "precision": "bf16", "cross_entropy": "fused-linear"}


MiB = 1 << 20


def _offloading(model: str, **kwargs: Any) -> Any:
    """The estimate, with an offloaded optimizer's 100 MiB off the GPU and 200 MiB in host memory
    (a stand-in: the planner's bookkeeping, not the lever's figures, is under test)."""
    result = estimate(model, **kwargs)
    if kwargs.get("optimizer_offload") != "cpu":
        return result
    host = {"total_bytes": 200 * MiB, "parts": {"optimizer_state": 200 * MiB}}
    return dataclasses.replace(
        result, total_bytes=result.total_bytes - 100 * MiB, details={**result.details, "host": host}
    )


@pytest.mark.slow
def test_offloaded_state_must_fit_the_host_budget(
    monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    monkeypatch.setattr(search, "estimate", _offloading)
    least = estimate(tiny_gpt2, batch_size=1, seq_len=64, gradient_checkpointing=True, **JOB)
    # a GPU budget only the offloaded optimizer fits (no margin: the budget is the usable memory)
    budget = least.total_bytes - 50 * MiB
    kwargs = {**JOB, "seq_len": 64, "effective_batch_size": 1, "safety_margin": 0}
    fits = plan(tiny_gpt2, gpu_memory=budget, host_memory=200 * MiB, **kwargs)
    assert fits.fits and fits.plan is not None
    assert fits.plan["optimizer_offload"] == "cpu"
    assert fits.predicted_host_bytes == 200 * MiB == fits.host_budget_bytes
    assert any(line.startswith("Host memory: 200.00 MiB of ") for line in fits.explanation)
    # one byte less of host memory: nothing fits any more
    short = plan(tiny_gpt2, gpu_memory=budget, host_memory=200 * MiB - 1, **kwargs)
    assert not short.fits and short.plan is None


@pytest.mark.slow
def test_a_plan_that_fits_without_offloading_never_prices_it(
    monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    asked: list[dict[str, Any]] = []

    def counted(model: str, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return estimate(model, **kwargs)

    monkeypatch.setattr(search, "estimate", counted)
    roomy = plan(tiny_gpt2, gpu_memory="8GiB", seq_len=64, effective_batch_size=4, **JOB)
    assert roomy.fits and roomy.plan is not None and roomy.predicted_host_bytes is None
    assert asked, "the plan estimates through memfit.plan.search.estimate"
    # neither the search nor the least configuration traced an offloading step: they cost time
    # and host memory, and are searched only when nothing fits without them
    assert not [k for k in asked if k.get("optimizer_offload") or k.get("activation_offloading")]


def test_a_bad_host_budget_is_one_clear_error(tiny_gpt2: str) -> None:
    with pytest.raises(UsageError, match="--host-memory"):
        plan(
            tiny_gpt2, seq_len=64, effective_batch_size=1, gpu_memory="8GiB", host_memory="x", **JOB
        )
