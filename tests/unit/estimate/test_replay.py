"""The replay's first step: it walks the forward and backward the first optimizer step follows.

A model that builds state lazily on its first forward (Phi-3.5's LongRoPE computes its long
frequencies then, and keeps them) records a first step with allocations the later ones do not
make. The first optimizer step frees the gradients of that first step by their place in it; the
CUDA replay walked the steady step's events instead: ``IndexError`` where the first step has
more allocations (issue 30, item 13), wrong frees where it merely differs.
"""

from __future__ import annotations

import pytest

from memfit.devices.profiles import cuda_profile
from memfit.estimate.replay import replay_step
from memfit.estimate.step_trace import ALLOC, CAT, FREE, FREE_PREV, MARK, PHASE, Segment, StepTrace
from memfit.estimate.workload import StepSpec

PARAM, LAZY, ACTIVATION = 1 << 20, 1 << 16, 3 << 20
FORWARD, BACKWARD, STEP = (MARK, PHASE["forward"]), (MARK, PHASE["backward"]), (MARK, PHASE["optimizer_step"])  # fmt: skip


def _segment(events: list[tuple[int, int]], allocations: list[tuple[int, str]]) -> Segment:
    n = len(allocations)
    return Segment(
        events=events,
        sizes=[size for size, _ in allocations],
        categories=[CAT[category] for _, category in allocations],
        ops=["empty"] * n,
        shapes=[(size,) for size, _ in allocations],
        itemsizes=[1] * n,
        formulas=[None] * n,
        params=[0 if category == "gradients" else -1 for _, category in allocations],
        origins=[-1] * n,
    )


def _trace() -> StepTrace:
    """One parameter; a first step that also builds a lazy tensor and keeps it, then the steady
    step; SGD without momentum (no optimizer state): each optimizer step frees the gradient."""
    first = _segment(
        [FORWARD, (ALLOC, 0), (ALLOC, 1), BACKWARD, (ALLOC, 2), (FREE, 1)],
        [(LAZY, "activations"), (ACTIVATION, "activations"), (PARAM, "gradients")],
    )
    steady = _segment(
        [FORWARD, (ALLOC, 0), BACKWARD, (ALLOC, 1), (FREE, 0)],
        [(ACTIVATION, "activations"), (PARAM, "gradients")],
    )
    first_opt = _segment([STEP, (FREE_PREV, 2)], [])
    steady_opt = _segment([STEP, (FREE_PREV, 1)], [])
    sizes = [PARAM, LAZY, ACTIVATION, PARAM, ACTIVATION, PARAM]
    categories = [CAT[c] for c in ("parameters", "activations", "activations", "gradients")]
    categories += [CAT["activations"], CAT["gradients"]]
    return StepTrace(
        resident_sizes=sizes,
        resident_categories=categories,
        steps=[((1, 64), first, first_opt), ((1, 64), steady, steady_opt)],
        num_parameters=PARAM // 4,
        parameter_bytes=PARAM,
        trainable_parameters=PARAM // 4,
        trainable_gradient_bytes=PARAM,
        initial=[0],
        steady=[0, 1],  # the lazy tensor outlives the first step
        first_optimizer_globals=[],
    )


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_first_step_unlike_the_steady_one_is_replayed_as_traced(device: str) -> None:
    trace = _trace()
    steady = trace.steps[1][1]
    spec = StepSpec(task="causal-lm", optimizer="sgd", device=device)
    peak = replay_step(trace, steady, list(steady.sizes), spec, cuda_profile())
    # the steady step's peak: the weight, its gradient, the activation and the lazy tensor the
    # first step left (the first step's gradient was freed by the first optimizer step)
    assert peak.breakdown["parameters"] == PARAM
    assert peak.breakdown["gradients"] == PARAM
    assert peak.breakdown["activations"] == ACTIVATION + LAZY
    assert peak.breakdown["optimizer_state"] == 0
    if device == "cuda":
        assert peak.allocated_peak_bytes >= 2 * PARAM + ACTIVATION + LAZY


def test_eval_warms_the_cache_with_the_first_step() -> None:
    trace = _trace()
    trace.steps = [(shape, fb, None) for shape, fb, _ in trace.steps]
    steady = trace.steps[1][1]
    spec = StepSpec(task="causal-lm", mode="eval", device="cuda")
    peak = replay_step(trace, steady, list(steady.sizes), spec, cuda_profile())
    # the lazy tensor the first batch built is alive through the second
    assert peak.breakdown["activations"] == ACTIVATION + LAZY
