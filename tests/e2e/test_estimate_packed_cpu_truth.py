"""The CPU estimate of a padding-free packed step (``--packing``, bfd) against the same step run
for real and measured from outside the process (within 5 %), as ``test_estimate_cpu_truth``
does for the other knobs: the batch holds packed rows (their own position ids, no padding mask),
so transformers builds the block-diagonal mask from the positions in both."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from estimate_cpu_truth import CUSTOM_CONFIGS

MiB = 2**20
TOLERANCE = 0.05
RESIDENT_KEYS = ("parameters", "buffers", "optimizer_state", "runtime_overhead")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not os.path.exists("/proc/self/clear_refs"),
        reason="the measurement reads /proc/<pid>/clear_refs (Linux)",
    ),
]


@pytest.fixture(scope="module")
def llama_mini(tmp_path_factory: pytest.TempPathFactory) -> str:
    import transformers

    model_type, kwargs = CUSTOM_CONFIGS["llama-mini"]
    path = Path(tmp_path_factory.mktemp("packed-truth")) / "llama-mini"
    transformers.AutoConfig.for_model(model_type, **kwargs).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "knobs"),
    [
        pytest.param(4, 256, {}, id="sdpa"),
        pytest.param(2, 256, {"attn_implementation": "eager"}, id="eager"),
        pytest.param(
            2, 256, {"packing_strategy": "wrapped"}, id="wrapped-blocks-are-plain-sequences"
        ),
    ],
)
def test_the_estimate_of_a_packed_step_matches_the_measured_step(
    llama_mini: str, batch_size: int, seq_len: int, knobs: dict[str, Any]
) -> None:
    from memfit.estimate import estimate
    from memfit.estimate.api import step_job, step_spec
    from memfit.measure import measure_cpu_step

    kwargs = dict(knobs, task="causal-lm", batch_size=batch_size, seq_len=seq_len, packing=True)
    spec = step_spec(step_job(llama_mini, **kwargs))
    assert spec.packed == (knobs.get("packing_strategy") != "wrapped")
    est = estimate(llama_mini, device="cpu", **kwargs)
    estimated = est.total_bytes - sum(est.breakdown.get(k, 0) for k in RESIDENT_KEYS)
    measured = measure_cpu_step(llama_mini, repeats=3, threads=1, **kwargs)
    real = measured.above_baseline_bytes
    summary = f"estimated {estimated / MiB:.2f} MiB, measured {real / MiB:.2f} MiB"
    print(summary)
    assert abs(estimated - real) <= TOLERANCE * real, summary
