"""On the emulated CUDA device too, every shape is predicted by a fit, never a fallback trace.

CUDA kernels round some buffers up (flash attention's sequence to 128, memory-efficient
attention's logsumexp to 32, a misaligned mask to 8): the fitted prediction must still equal a
direct trace of the requested shape, byte for byte, for aligned and misaligned lengths alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from memfit.estimate import traces
from memfit.estimate.workload import StepSpec
from memfit.models import resolve_model

SHAPES = [(13, 96), (3, 7), (1, 100), (1, 9), (6, 45)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fixture", "spec"),
    [
        ("tiny_bert", StepSpec(task="classification")),
        ("tiny_bert", StepSpec(task="classification", gradient_checkpointing=True)),
        ("tiny_bert", StepSpec(task="classification", precision="bf16")),
        ("tiny_bert", StepSpec(task="sentence-embedding", precision="fp16", loss="mnrl")),
        ("tiny_gpt2", StepSpec(task="causal-lm", precision="bf16", gradient_checkpointing=True)),
    ],
)
def test_cuda_fit_matches_a_direct_trace(
    request: pytest.FixtureRequest, fixture: str, spec: StepSpec
) -> None:
    model = resolve_model(request.getfixturevalue(fixture))
    traced = traces.traced(model, spec)
    for batch_size, seq_len in SHAPES:
        variant = traced._variant(batch_size, seq_len)
        assert variant.method == "fitted", (batch_size, seq_len)
        assert variant.fitted is not None
        direct = traced._exact_trace(batch_size, seq_len).trace.steps[1][1]
        assert direct.signature() == variant.fitted.template.signature()
        np.testing.assert_array_equal(
            variant.fitted.sizes(batch_size, seq_len), np.array(direct.sizes)
        )
