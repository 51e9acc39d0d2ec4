"""Every host copy an offloading trace makes is recorded as host memory, a formula-sized save's
(attention's logsumexp, a padded mask) included: the recorder marked those "declared", a device
allocation, so the GPU total counted them and the host total missed them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from memfit.estimate import step_trace, trace, traces
from memfit.estimate.step_spec import StepSpec


def test_each_host_copy_is_recorded_as_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    made = 0
    formula_sized = 0

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        nonlocal made
        made += 1
        with step_trace.host_allocation():
            yield

    original = trace.sized_allocation

    @contextlib.contextmanager
    def sized(dims, formula):  # type: ignore[no-untyped-def]
        nonlocal formula_sized
        formula_sized += bool(step_trace._host_marks)
        with original(dims, formula):
            yield

    monkeypatch.setattr(trace, "host_allocation", counted)
    monkeypatch.setattr(trace, "sized_allocation", sized)
    spec = StepSpec(task="causal-lm", activation_offloading=True, sdpa_sm=75)
    result, _ = traces.trace_model(config, spec, [(2, 100), (2, 100)], "full")
    assert formula_sized > 0  # the case of the bug: a formula-sized save was offloaded
    host_ops = sum(op == step_trace.HOST_OP for _, seg, _ in result.steps for op in seg.ops)
    assert host_ops == made
