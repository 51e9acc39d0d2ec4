"""Depth extrapolation: the trace written out from two shallow traces is the full-depth trace.

Every case traces a small model twice — every layer, and ``auto`` (two shallow copies, then
written out) — and requires the two traces to be the same, list for list and byte for byte, and
the estimates replayed from them to be the same (total, breakdown, phase peaks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from memfit.estimate import api, depth, depth_streams, traces, workload
from memfit.estimate.fit import grid_shapes
from memfit.estimate.replay import replay_step
from memfit.estimate.sharding import layout as sharding_layout
from memfit.models import resolve_model

# small widths, enough layers for two shallow traces (3p + r and 4p + r layers) and a few more
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
_DECODER = dict(
    _SMALL,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=512,
    num_hidden_layers=7,
)


def _config(family: str) -> Any:
    registry = {
        "bert": "bert-base-uncased",
        "roberta": "roberta-base",
        "distilbert": "distilbert-base-uncased",
        "mpnet": "sentence-transformers/all-mpnet-base-v2",
        "gpt2": "gpt2",
    }
    if family in registry:
        base = resolve_model(registry[family]).config
        values = base.to_dict()
        if family == "gpt2":
            values.update(n_embd=64, n_head=4, n_layer=7)
        elif family == "distilbert":
            values.update(dim=64, hidden_dim=128, n_heads=4, n_layers=7)
        else:
            values.update(_SMALL, num_hidden_layers=7)
        return base.__class__.from_dict(values)
    if family == "gemma2":  # sliding and global attention alternate: a period of two layers
        return transformers.Gemma2Config(**{**_DECODER, "head_dim": 16, "num_hidden_layers": 11})
    if family == "modernbert":  # global attention every third layer: a period of three
        values = {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        return transformers.ModernBertConfig(
            **{**values, "num_hidden_layers": 16, "global_attn_every_n_layers": 3},
            local_attention=32,
            **ids,
        )
    if family == "phi3":
        return transformers.Phi3Config(**_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
    }
    return classes[family](**_DECODER)


def _task(family: str) -> str:
    decoders = ("gpt2", "llama", "qwen2", "mistral", "gemma2", "phi3")
    return "causal-lm" if family in decoders else "classification"


def _shapes(config: Any) -> list[tuple[int, int]]:
    from memfit.models.registry import usable_positions

    check, grid, second = grid_shapes(usable_positions(config))
    return [check, *grid, second]


def _compare(family: str, **knobs: Any) -> dict[str, Any]:
    config = _config(family)
    spec = workload.StepSpec(**{"task": _task(family), **knobs})
    shapes = _shapes(config)
    extrapolated, info = traces.trace_model(config, spec, shapes, "auto")
    full, full_info = traces.trace_model(config, spec, shapes, "full")
    assert full_info["mode"] == "full"
    assert info["mode"] == "extrapolated", info
    assert depth.same_trace(extrapolated, full)
    # and what the estimator makes of them: the shape fit, then a replay per scheme
    from memfit.estimate.fit import fit_trace

    fitted_a, fitted_b = fit_trace(extrapolated), fit_trace(full)
    assert (fitted_a is None) == (fitted_b is None)
    if fitted_a is not None and fitted_b is not None:
        from memfit.devices.profiles import cuda_profile

        schemes = ["none"] if spec.mode == "eval" else ["none", "zero2", "fsdp"]
        for batch, seq in ((3, 48), (6, 136)):
            for sharding in schemes:
                peaks = [
                    replay_step(
                        trace,
                        fitted.template,
                        fitted.sizes(batch, seq).tolist(),
                        spec,
                        cuda_profile(),
                        world_size=2,
                        shard=None
                        if sharding == "none"
                        else sharding_layout(trace, spec, sharding, 2, hidden_size=64),
                    )
                    for trace, fitted in ((extrapolated, fitted_a), (full, fitted_b))
                ]
                assert peaks[0] == peaks[1]
    return info


FAMILIES = [
    "bert",
    "roberta",
    "distilbert",
    "mpnet",
    "gpt2",
    "llama",
    "qwen2",
    "mistral",
    "phi3",
    "gemma2",
    "modernbert",
]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_extrapolates_exactly(family: str) -> None:
    # MPNet and Gemma-2 have no SDPA attention in transformers
    eager = family in ("mpnet", "gemma2")
    info = _compare(family, **({"attn_implementation": "eager"} if eager else {}))
    assert info["depth"] == _config(family).num_hidden_layers
    period = {"gemma2": 2, "modernbert": 3}.get(family, 1)
    assert info["period"] == period


KNOBS = [
    {"mode": "eval"},
    {"precision": "bf16"},
    {"precision": "fp16", "gradient_checkpointing": True},
    {"attn_implementation": "eager"},
    {"lora_rank": 4},
    {"device": "cpu"},
    {"optimizer": "adafactor"},
    {"optimizer": "adamw-8bit"},
    {"optimizer": "sgd"},
]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_every_knob_extrapolates_exactly(family: str, knobs: dict[str, Any]) -> None:
    _compare(family, **knobs)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["mnrl", "cached-mnrl", "cosent"])
def test_sentence_embedding_losses_extrapolate_exactly(loss: str) -> None:
    _compare("bert", task="sentence-embedding", loss=loss)


@pytest.mark.slow
def test_estimates_agree_through_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``estimate(trace_depth=auto)`` equals ``full`` at batch sizes of one, odd lengths, with
    accumulation and sharding, and says how it traced."""
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config("llama").to_dict()))
    for shape in ((4, 64), (1, 40), (3, 45)):
        for extra in (
            {},
            {"gradient_accumulation_steps": 2},
            {"world_size": 2, "sharding": "zero3"},
        ):
            knobs: dict[str, Any] = dict(task="causal-lm", batch_size=shape[0], seq_len=shape[1])
            knobs |= extra
            auto = api.estimate(str(folder), **knobs)
            full = api.estimate(str(folder), trace_depth="full", **knobs)
            assert auto.total_bytes == full.total_bytes
            assert auto.breakdown == full.breakdown
            assert auto.details["phase_peak_bytes"] == full.details["phase_peak_bytes"]
            assert auto.details["trace_depth"]["mode"] == "extrapolated"
            assert auto.details["trace_depth"]["traced_depths"] == [3, 4]
            assert full.details["trace_depth"] == {
                "mode": "full",
                "depth": 7,
                "reason": "--trace-depth full",
            }


def test_layers_that_do_not_repeat_are_traced_whole() -> None:
    # sliding-window attention in the upper layers only: no period shorter than the stack
    config = transformers.Qwen2Config(
        **{**_DECODER, "num_hidden_layers": 9, "use_sliding_window": True, "max_window_layers": 4}
    )
    plan, reason = depth.plan_depth(config)
    assert plan is None
    assert reason == "the layers differ: layer_types repeat only every 9 of 9 layers"


def test_a_plan_keeps_the_period_and_the_remainder() -> None:
    plan, _ = depth.plan_depth(_config("gemma2"))
    assert plan is not None
    assert (plan.period, plan.traced, plan.suffix) == (2, (7, 9), 2)
    shallow = depth.shallow_config(_config("gemma2"), plan, 7)
    assert shallow.num_hidden_layers == 7
    assert shallow.layer_types == _config("gemma2").layer_types[:7]
    plan, _ = depth.plan_depth(_config("modernbert"))
    assert plan is not None and (plan.period, plan.traced) == (3, (10, 13))
    plan, reason = depth.plan_depth(_config("bert").__class__(num_hidden_layers=4))
    assert plan is None and "4 layers" in reason


def _items(contexts: list[int | None]) -> list[depth_streams.Item]:
    return [(c, ("event", "x" if c is None else "layer")) for c in contexts]


def test_compress_and_expand_sweeps() -> None:
    # a forward up the layers, the head, a backward down, then an optimizer op up: 4 groups
    contexts = [None, 0, 1, 2, 3, None, 3, 2, 1, 0, None, 0, 1, 2, 3]
    form = depth._compress(_items(contexts), 4, 1)
    assert form == depth._compress(_items([None, 0, 1, 2, None, 2, 1, 0, None, 0, 1, 2]), 3, 1)
    expanded = depth._expand(form, 6, 1)
    assert [c for c, _ in expanded] == [None, *range(6), None, *range(5, -1, -1), None, *range(6)]


def test_a_sweep_that_turns_back_shares_its_last_run() -> None:
    # frees of every layer in reverse, then the next op's allocations: group 0 runs on
    items = [(2, ("f",)), (1, ("f",)), (0, ("f",)), (0, ("a",)), (1, ("a",)), (2, ("a",))]
    form = depth._compress(items, 3, 1)
    assert [c for c, _ in depth._expand(form, 3, 1)] == [2, 1, 0, 0, 1, 2]
    assert [c for c, _ in depth._expand(form, 5, 1)] == [4, 3, 2, 1, 0, 0, 1, 2, 3, 4]


def test_irregular_streams_are_refused() -> None:
    with pytest.raises(depth.NotRepeating, match="starts in the middle"):
        depth._compress(_items([None, 1, 2]), 4, 1)
    with pytest.raises(depth.NotRepeating, match="skips"):
        depth._compress(_items([0, 1, 3]), 4, 1)
    middle = [(0, ("a",)), (1, ("b",)), (2, ("c",)), (3, ("d",))]
    with pytest.raises(depth.NotRepeating, match="do not repeat"):
        depth._compress(middle, 4, 1)


def _llama_traces() -> tuple[Any, Any, depth.DepthPlan, workload.StepSpec]:
    config = _config("llama")
    spec = workload.StepSpec(task="causal-lm")
    trace, info = traces.trace_model(config, spec, _shapes(config), "auto")
    assert info["mode"] == "extrapolated"
    plan, _ = depth.plan_depth(config)
    assert plan is not None
    return config, trace, plan, spec


@pytest.mark.slow
def test_a_layer_unlike_the_traced_ones_is_caught() -> None:
    """A layer that differs by its absolute index, past the shallow depths, is never traced:
    the model built with every layer (on meta) must match the extrapolated trace."""
    import torch

    config, trace, plan, spec = _llama_traces()

    def model() -> Any:
        with torch.device("meta"):
            return workload.build_model(config, spec)

    depth.check_model(trace, model(), plan)  # the model as it is: no complaint
    wider = model()
    layer = wider.model.layers[5]
    layer.mlp.up_proj = torch.nn.Linear(64, 256, bias=False, device="meta")
    with pytest.raises(depth.NotRepeating, match="parameters"):
        depth.check_model(trace, wider, plan)
    sliding = model()
    sliding.model.layers[5].self_attn.sliding_window = 16
    with pytest.raises(depth.NotRepeating, match="layer 5 is built unlike layer 4"):
        depth.check_model(trace, sliding, plan)


def test_a_failing_shallow_copy_falls_back_to_the_whole_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _config("bert")
    spec = workload.StepSpec(task="classification", mode="eval")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("per_layer_config keys must be in range")

    monkeypatch.setattr(depth, "shallow_config", broken)
    trace, info = traces.trace_model(config, spec, [(2, 16), (2, 16)], "auto")
    assert info["mode"] == "full"
    assert info["reason"] == (
        "a shallow copy could not be traced (ValueError: per_layer_config keys must be in range)"
    )
    assert len(trace.steps) == 2


def test_settings_keyed_by_layer_are_not_cut_short() -> None:
    config = transformers.LlamaConfig(**_DECODER, per_layer_config={"5": {"rms_norm_eps": 1e-5}})
    plan, reason = depth.plan_depth(config)
    assert plan is None
    assert reason == "the config sets per_layer_config layer by layer"
