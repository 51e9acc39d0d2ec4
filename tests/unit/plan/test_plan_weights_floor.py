"""The search's floor: the weights a configuration holds through its whole step, known from an
estimated configuration with the same weights, rule out the configurations whose weights alone are
over the budget without estimating (tracing) them — and never change the plan."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from memfit.plan import plan, planner
from memfit.plan.search import Search

JOB = {"task": "causal-lm", "seq_len": 64, "effective_batch_size": 4}
GIB = 2**30


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama whose matmul weights outweigh its embeddings, as in a real LLM."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("tiny-llama-floor")
    config.save_pretrained(folder)
    return str(folder)


def _fake_estimate(calls: list[dict[str, Any]]) -> Any:
    """An estimator whose weights follow the base weights' form (16-bit: 10 GiB; 4-bit: 3 GiB)
    and whose activations follow the batch and checkpointing: a model too large for the card
    unless quantized."""

    def estimate(model: str, **kwargs: Any) -> Any:
        calls.append(kwargs)
        quantized = kwargs.get("quantization") not in (None, "none")
        weights = (3 if quantized else 10) * GIB
        activations = (
            kwargs["batch_size"] * GIB // (4 if kwargs.get("gradient_checkpointing") else 1)
        )
        total = weights + activations
        return SimpleNamespace(
            total_bytes=total,
            breakdown={"parameters": weights, "buffers": 0},
            details={"model_state": {"total_bytes": weights}},
        )

    return estimate


def _summary(result: Any) -> Any:
    fields = ("fits", "predicted_peak_bytes", "min_required_bytes", "chosen", "alternatives")
    return tuple(repr(getattr(result, name)) for name in fields)


def test_the_floor_skips_what_cannot_fit_and_the_plan_is_the_same(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")  # no worker processes: every estimate is here
    with_floor: list[dict[str, Any]] = []
    monkeypatch.setattr("memfit.plan.search.estimate", _fake_estimate(with_floor))
    kwargs = dict(JOB, gpu_memory="8GiB", allow=["lora", "quantization"])
    result = plan(tiny_llama, **kwargs)
    assert result.fits and result.chosen is not None
    assert result.chosen.knobs.quantization != "none"

    without_floor: list[dict[str, Any]] = []
    monkeypatch.setattr("memfit.plan.search.estimate", _fake_estimate(without_floor))
    monkeypatch.setattr(Search, "floor", lambda self, knobs: None)
    again = plan(tiny_llama, **kwargs)
    assert _summary(again) == _summary(result)
    # 16-bit weights (10 GiB) are over the 8 GiB card whatever else the configuration does:
    # with the floor, one estimate per weights' form says so
    unquantized = [c for c in with_floor if c.get("quantization") in (None, "none")]
    assert len(with_floor) < len(without_floor)
    assert len(unquantized) < len(
        [c for c in without_floor if c.get("quantization") in (None, "none")]
    )


def test_the_floor_is_unknown_under_a_sharding_scheme(tiny_llama: str) -> None:
    """ZeRO-3 and FSDP divide the weights by phase: what one configuration holds says nothing
    sure about another's, so no floor."""
    captured: dict[str, Search] = {}
    original = planner._search

    def capture(search: Search, *args: Any) -> Any:
        captured["search"] = search
        return original(search, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "_search", capture)
        plan(tiny_llama, **JOB, gpu_memory="80GiB")
    search = captured["search"]
    knobs = next(iter(search._estimates))[0]
    assert search.floor(knobs) is not None
    sharded = dataclasses.replace(search, sharding="zero3")
    assert sharded.floor(knobs) is None


@pytest.mark.slow
def test_configurations_with_the_same_weights_key_hold_the_same_weights(tiny_llama: str) -> None:
    """On real estimates: configurations that differ only in the levers the floor calls
    weight-neutral hold the same parameters and buffers, at a batch of one and at the whole
    batch, and the floor is at most each one's peak (what makes the skip safe). Every weights'
    form, each with a sample of the weight-neutral levers' values."""
    from memfit.estimate import estimate

    captured: dict[str, Search] = {}
    original = planner._search

    def capture(search: Search, *args: Any) -> Any:
        captured["search"] = search
        return original(search, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "_search", capture)
        plan(tiny_llama, **JOB, gpu_memory="80GiB", allow=["lora", "quantization", "optimizer"])
    search = captured["search"]
    groups: dict[Any, list[Any]] = {}
    for knobs in search.combos():
        groups.setdefault(search.weights_key(knobs), []).append(knobs)
    assert len(groups) >= 3  # plain, adapters, quantized base (at least)
    checked = 0
    for members in groups.values():
        # the first, the last and one in between: they differ in several weight-neutral levers
        sample = list(dict.fromkeys([members[0], members[len(members) // 2], members[-1]]))
        held = set()
        for knobs, micro in itertools.product(sample, (1, search.per_rank)):
            result = estimate(tiny_llama, **search.estimate_kwargs(knobs, micro))
            held.add(result.breakdown["parameters"] + result.breakdown["buffers"])
            search.peak(knobs, micro)
            floor = search.floor(knobs)
            assert floor is not None and floor <= result.total_bytes, (knobs, micro)
            checked += 1
        assert len(held) == 1, sample
    assert checked >= 12
