"""Activation offloading's trace has the same structure at every shape (issue 34): it fits, it is
extrapolated in depth, and a fitted replay is what an exact trace of that shape says.

- The emulation takes a storage to be in flight (TRL keeps a storage saved again while its copy
  is in flight) only while that storage lives: a cloned save tracks its original's key, and once
  the original is freed its address may be any other storage's (fake storages' addresses are the
  host allocator's), which made the saves kept, and the events, vary from shape to shape and from
  run to run.
- A broadcast save brought back is sized as its host copy was (a padded mask's storage fits by
  its formula, not as a flat byte count).
- Memory-efficient attention's logsumexp, (B, H, round_up(S, 32)), is a token-sized tensor: with
  few heads it falls under TRL's 1 KiB at some lengths of a batch of one, and its offloading may
  not change with the shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from memfit.devices.profiles import cuda_profile
from memfit.estimate import fit, traces
from memfit.estimate.step_spec import StepSpec
from memfit.step.offload import OffloadEmulation


def _emulation() -> tuple[OffloadEmulation, list[tuple[int, ...]]]:
    copies: list[tuple[int, ...]] = []

    def host_copy(tensor: torch.Tensor, whole_storage: bool) -> torch.Tensor:
        copies.append(tuple(tensor.shape))
        return torch.empty(tuple(tensor.shape), dtype=tensor.dtype)

    emulation = OffloadEmulation(torch.nn.Linear(2, 2), "trl", host_copy)
    # every storage at one address, as a freed address taken again by the next storage
    emulation._storage_key = lambda tensor: (1, 0, tensor.dtype)  # type: ignore[method-assign]
    return emulation, copies


def test_a_storage_saved_again_while_in_flight_stays_but_a_freed_ones_address_tracks_nothing() -> (
    None
):
    emulation, copies = _emulation()
    original = torch.zeros(64, 64).t()  # not contiguous: TRL clones it, and keys the original
    emulation._pack(original)
    emulation._pack(original)  # the same storage again, its copy in flight: kept
    assert copies == [(64, 64)]
    del original  # freed: the clone alone is stashed, the key's storage is gone
    emulation._pack(torch.zeros(64, 64))  # a new storage at the freed address: offloaded
    assert copies == [(64, 64), (64, 64)]


def _llama(layers: int) -> Any:
    from transformers import LlamaConfig

    # four heads: memory-efficient attention's logsumexp of a short batch of one is under 1 KiB
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


def _fitted(config: Any, spec: StepSpec, kind: tuple[bool, bool]) -> traces.Traced:
    check, grid, second = fit.grid_shapes(512, batch_size=1 if kind[0] else None, aligned=kind[1])
    trace, depth = traces.trace_model(config, spec, [check, *grid, second])
    return traces.Traced(
        config,
        spec,
        trace,
        fit.fit_trace(trace),
        cuda_profile(),
        0.0,
        variant_key=kind,
        depth=depth,
    )


def _exact(config: Any, spec: StepSpec, shape: tuple[int, int]) -> dict[str, Any]:
    trace, _ = traces.trace_model(config, spec, [shape, shape], "full")
    kind = (shape[0] == 1, shape[1] % 8 == 0)
    exact = traces.Traced(config, spec, trace, None, cuda_profile(), 0.0, variant_key=kind)
    exact.fitted = traces._identity_fit(trace)
    return dataclasses.asdict(exact.replay(*shape))


# (1, 8) and (1, 13): the logsumexp (1, 4, 32) under 1 KiB; (1, 37) at 1 KiB; (3, 13) above
_SHAPES = [(1, 8), (1, 37), (1, 13), (3, 13)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        dict(sdpa_sm=75, lora_rank=8),
        pytest.param(
            dict(gradient_checkpointing=True, cross_entropy="fused-linear"),
            marks=pytest.mark.xfail(
                strict=True,
                reason="known: with checkpointing, the fused loss's declared chunk slots trace "
                "another rank of dims at a batch of one of odd lengths (1 x 132 and 1 x 260 "
                "differ), so that kind does not fit and each such shape is an exact trace (the "
                "figures are right, the speed-up is missed); without offloading too",
            ),
        ),
    ],
    ids=["lora-sm75", "checkpointing-fused"],
)
def test_offloading_fits_and_extrapolates_and_replays_what_an_exact_trace_says(
    knobs: dict[str, Any],
) -> None:
    # deep enough for two shallow copies with the checkpointed forward stash's literal prefix
    config = _llama(12)
    spec = StepSpec(task="causal-lm", activation_offloading=True, **knobs)
    fits: dict[tuple[bool, bool], traces.Traced] = {}
    for shape in _SHAPES:
        kind = (shape[0] == 1, shape[1] % 8 == 0)
        if kind not in fits:
            fits[kind] = _fitted(config, spec, kind)
            assert fits[kind].depth["mode"] == "extrapolated", fits[kind].depth
            assert fits[kind].fitted is not None, kind
        fitted = dataclasses.asdict(fits[kind].replay(*shape))
        assert fitted["host_peak_bytes"] > 0
        assert fitted == _exact(config, spec, shape), shape


@pytest.mark.slow
def test_the_8b_lora_step_with_offloading_is_fitted_and_extrapolated() -> None:
    from memfit.models import resolve_model

    model = resolve_model("meta-llama/Llama-3.1-8B")
    spec = StepSpec(task="causal-lm", sdpa_sm=75, lora_rank=8, activation_offloading=True)
    check, grid, second = fit.grid_shapes(model.max_positions)
    trace, depth = traces.trace_model(model.config, spec, [check, *grid, second])
    assert depth["mode"] == "extrapolated", depth
    assert fit.fit_trace(trace) is not None
