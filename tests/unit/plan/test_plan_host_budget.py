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


def _stub_search(monkeypatch: pytest.MonkeyPatch, host: dict[str, Any], world_size: int) -> Any:
    """A :class:`~memfit.plan.search.Search` whose estimates are a stub: 1 GiB on the GPU and
    ``host`` as ``details["host"]`` (only the host bookkeeping is under test)."""
    from types import SimpleNamespace

    def stub(model: str, **kwargs: Any) -> Any:
        details = {"model_state": {"total_bytes": 0}, "host": dict(host)}
        breakdown = {"parameters": 0, "buffers": 0}  # no weights: no floor to skip by
        return SimpleNamespace(total_bytes=1 << 30, details=details, breakdown=breakdown)

    monkeypatch.setattr(search, "estimate", stub)
    monkeypatch.setattr(search.Search, "estimate_kwargs", lambda self, knobs, micro: {})
    monkeypatch.setattr(search.Search, "weights_key", lambda self, knobs: None)  # no floor
    job = object.__new__(search.Search)
    for name, value in {
        "model": "stub", "usable": 2 << 30, "host_budget": 300 * MiB, "world_size": world_size,
        "_estimates": {}, "_hosts": {}, "_model_states": {},
    }.items():  # fmt: skip
        setattr(job, name, value)
    return job


def test_the_host_budget_holds_every_rank_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from memfit.plan import explain, planner

    # 100 MiB a rank, four ranks on the node: 400 MiB of the 300 MiB host budget
    job = _stub_search(monkeypatch, {"total_bytes": 100 * MiB, "ranks_per_node": 4}, 4)
    assert job.host("k", 1) == 100 * MiB and job.host_ranks("k", 1) == 4
    assert not job.fits("k", 1) and not job.host_fits("k", 1)
    assert not planner._host_fits(job, "k")
    chosen = SimpleNamespace(knobs="k", mini_batch_size=None, micro_batch_size=1)
    result = SimpleNamespace(predicted_host_bytes=100 * MiB, chosen=chosen)
    [line] = explain._host_lines(job, result)
    assert line.startswith(
        "Host memory: 100.00 MiB per rank (400.00 MiB for the node's 4 ranks) of the 300.00 MiB"
    )
    # without ranks_per_node the estimate's figure is the node's: one rank
    job = _stub_search(monkeypatch, {"total_bytes": 100 * MiB}, 1)
    assert job.fits("k", 1) and planner._host_fits(job, "k")
    [line] = explain._host_lines(job, result)
    assert line.startswith("Host memory: 100.00 MiB of the 300.00 MiB host budget")
