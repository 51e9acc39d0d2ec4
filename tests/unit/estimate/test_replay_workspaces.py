"""Where the CUDA replay's cuBLAS workspaces are allocated, and the cache TRL's offloading empties.

Both come from one H200 run's caching-allocator histories
(``bench/results/gpu_truth_20261128_H200/allocator_history``): the autograd thread's workspace is
allocated by the first backward matmul, inside a freed logits-sized block; TRL's activation
offloading empties the cache as each micro-batch starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from memfit.estimate import device as dev
from memfit.estimate.replay import WORKSPACE, uses_bitsandbytes, with_workspaces
from memfit.estimate.step_spec import StepSpec
from memfit.estimate.step_trace import ALLOC, FREE, MARK, PHASE, Segment
from memfit.step import offload

MiB = 2**20
CUBLAS, LT = 32 * MiB, 1 * MiB


def _segment(ops: list[str], events: list[tuple[int, int]]) -> Segment:
    n = len(ops)
    return Segment(events=events, sizes=[MiB] * n, categories=[4] * n, ops=ops)


def _lm_step() -> Segment:
    """Forward: embedding, a linear with a bias, a matmul, the logits; backward: the loss's
    gradient, then the head's matmul."""
    ops = ["embedding.default", "addmm.default", "mm.default", "mm.default"]
    ops += ["nll_loss_backward.default", "mm.default", "addmm.default"]
    events = [(MARK, PHASE["forward"])] + [(ALLOC, j) for j in range(4)]
    events += [(MARK, PHASE["backward"])] + [(ALLOC, j) for j in range(4, 7)]
    return _segment(ops, events)


def test_each_thread_allocates_its_workspaces_after_its_first_matmul() -> None:
    events = with_workspaces(_lm_step(), CUBLAS, LT, backward_thread=True)
    forward = [(MARK, PHASE["forward"]), (ALLOC, 0), (ALLOC, 1), (WORKSPACE, CUBLAS)]
    forward += [(WORKSPACE, LT), (ALLOC, 2), (ALLOC, 3)]
    # the backward thread: its first matmul (after the loss's gradient) makes its cuBLAS
    # workspace; its first gemm-and-bias its cuBLASLt one
    backward = [(MARK, PHASE["backward"]), (ALLOC, 4), (ALLOC, 5), (WORKSPACE, CUBLAS)]
    backward += [(ALLOC, 6), (WORKSPACE, LT)]
    assert events == forward + backward


def test_an_eval_step_has_one_thread_and_a_torch_without_cublaslt_workspace_none() -> None:
    events = with_workspaces(_lm_step(), CUBLAS, 0, backward_thread=False)
    assert [e for e in events if e[0] == WORKSPACE] == [(WORKSPACE, CUBLAS)]
    assert events.index((WORKSPACE, CUBLAS)) == 3  # right after the first addmm's output


def test_no_matmul_no_workspace() -> None:
    seg = _segment(["empty.default"], [(MARK, PHASE["forward"]), (ALLOC, 0), (FREE, 0)])
    assert with_workspaces(seg, CUBLAS, LT, backward_thread=True) == seg.events


def test_the_backward_workspace_splits_a_freed_logits_block_as_on_the_gpu() -> None:
    """The H200 history's sequence, in miniature: two logits-sized blocks freed when the
    backward's first matmul takes its workspace; the next step's logits need a new segment."""

    def step(allocator: dev.CachingAllocator, workspace_now: bool) -> None:
        logits = allocator.malloc(1188 * MiB)
        grad = allocator.malloc(1188 * MiB)
        allocator.free(logits)
        allocator.free(grad)
        if workspace_now:
            allocator.malloc(CUBLAS)

    up_front, at_first_use = dev.CachingAllocator(), dev.CachingAllocator()
    up_front.malloc(CUBLAS)
    step(up_front, False)
    step(up_front, False)
    step(at_first_use, True)
    step(at_first_use, False)
    assert up_front.max_reserved == 2 * 1188 * MiB + CUBLAS
    assert at_first_use.max_reserved == 3 * 1188 * MiB


def test_empty_cache_returns_only_segments_with_nothing_in_use() -> None:
    allocator = dev.CachingAllocator()
    kept = allocator.malloc(30 * MiB)
    freed = allocator.malloc(40 * MiB)
    small = allocator.malloc(4096)
    allocator.free(freed)
    allocator.free(small)
    assert allocator.reserved == 30 * MiB + 40 * MiB + dev.K_SMALL_BUFFER
    allocator.empty_cache()
    assert allocator.reserved == 30 * MiB
    assert [s["total"] for s in allocator.segments()] == [30 * MiB]
    assert allocator.max_reserved == 30 * MiB + 40 * MiB + dev.K_SMALL_BUFFER
    # the allocator goes on: a new request gets a new segment, the kept block can be freed
    again = allocator.malloc(40 * MiB)
    assert allocator.reserved == 70 * MiB
    allocator.free(kept)
    allocator.free(again)
    allocator.empty_cache()
    assert allocator.reserved == 0 and allocator.allocated == 0


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({}, False),
        ({"optimizer": "adamw-8bit"}, True),
        ({"optimizer": "paged-adamw-32bit"}, True),
        ({"lora_rank": 8, "quantization": "nf4"}, True),
    ],
)
def test_which_steps_use_bitsandbytes(knobs: dict[str, object], expected: bool) -> None:
    assert uses_bitsandbytes(StepSpec(task="causal-lm", **knobs)) is expected  # type: ignore[arg-type]


def test_trl_empties_the_cache_where_bitsandbytes_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state: dict[str, object] = {"bitsandbytes": True, "trl": "1.16.0"}
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name == "bitsandbytes":
            return object() if state["bitsandbytes"] else None
        return real_find_spec(name, *args)  # type: ignore[arg-type]

    def version(name: str) -> str:
        if name == "trl" and state["trl"] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return str(state["trl"]) if name == "trl" else real_version(name)

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert offload.empties_cuda_cache(imports_bitsandbytes=True)
    # a run that imports neither bitsandbytes nor peft (a full fine-tune, AdamW)
    assert not offload.empties_cuda_cache(imports_bitsandbytes=False)
    # a TRL from before the emptying (1.5); none here: its current rules
    state["trl"] = "1.4.2"
    assert not offload.empties_cuda_cache(imports_bitsandbytes=True)
    state["trl"] = None
    assert offload.empties_cuda_cache(imports_bitsandbytes=True)
    state["bitsandbytes"] = False
    assert not offload.empties_cuda_cache(imports_bitsandbytes=True)


def test_workspaces_of_one_size_are_each_made_and_the_answer_is_kept() -> None:
    seg = _lm_step()
    events = with_workspaces(seg, LT, LT, backward_thread=True)
    # cuBLAS' and cuBLASLt's workspaces of one size are still two allocations per thread
    assert [e for e in events if e[0] == WORKSPACE] == [(WORKSPACE, LT)] * 4
    assert with_workspaces(seg, LT, LT, backward_thread=True) is events
    assert with_workspaces(seg, CUBLAS, LT, backward_thread=True) is not events
