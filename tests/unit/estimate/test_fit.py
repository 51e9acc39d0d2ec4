"""The bilinear fit must reproduce a direct trace of the requested shape, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.estimate.fit import fit_trace, grid_shapes
from memfit.estimate.trace import trace_steps
from memfit.estimate.workload import StepSpec
from memfit.models import resolve_model


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fixture", "spec"),
    [
        ("tiny_bert", StepSpec(task="classification", device="cpu")),
        ("tiny_bert", StepSpec(task="classification", device="cpu", attn_implementation="eager")),
        ("tiny_bert", StepSpec(task="sentence-embedding", device="cpu", loss="mnrl")),
        ("tiny_gpt2", StepSpec(task="causal-lm", device="cpu", gradient_checkpointing=True)),
        ("tiny_gpt2", StepSpec(task="causal-lm", device="cpu", mode="eval")),
    ],
)
def test_fit_matches_a_direct_trace(
    request: pytest.FixtureRequest, fixture: str, spec: StepSpec
) -> None:
    model = resolve_model(request.getfixturevalue(fixture))
    check, grid, second = grid_shapes(model.max_positions)
    fitted = fit_trace(trace_steps(model.config, spec, [check, *grid, second]))
    assert fitted is not None
    # shapes far outside the grid: the polynomial must extrapolate exactly
    for shape in [(13, 96), (64, 128)]:
        direct = trace_steps(model.config, spec, [shape], optimizer_steps=0).steps[0][1]
        assert direct.signature() == fitted.template.signature()
        np.testing.assert_array_equal(fitted.sizes(*shape), np.array(direct.sizes))
    # a batch of one has its own fit over the sequence length
    check, grid, second = grid_shapes(model.max_positions, batch_size=1)
    single = fit_trace(trace_steps(model.config, spec, [check, *grid, second]))
    assert single is not None
    for shape in [(1, 8), (1, 128)]:
        direct = trace_steps(model.config, spec, [shape], optimizer_steps=0).steps[0][1]
        assert direct.signature() == single.template.signature()
        np.testing.assert_array_equal(single.sizes(*shape), np.array(direct.sizes))


@pytest.mark.slow
def test_in_batch_negatives_grow_quadratically_in_batch(tiny_bert: str) -> None:
    model = resolve_model(tiny_bert)
    spec = StepSpec(task="sentence-embedding", device="cpu", loss="mnrl")
    check, grid, second = grid_shapes(model.max_positions)
    fitted = fit_trace(trace_steps(model.config, spec, [check, *grid, second]))
    assert fitted is not None
    sizes = fitted.sizes(100, 8)
    # the B×B similarity matrix of MultipleNegativesRankingLoss is there, in fp32
    assert 100 * 100 * 4 in set(sizes.tolist())
