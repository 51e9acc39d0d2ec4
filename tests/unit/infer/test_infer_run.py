"""The shared inference loop: order restored after a longest-first, backed-off run; every row once;
the planned starting batch; every flag problem at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.errors import NothingFitsError, UsageError
from memfit.infer.run import (
    DEFAULT_BATCH_SIZE,
    SAFETY_MARGIN,
    GuardedInference,
    InferConfig,
    Item,
    config_problems,
    plan_batch_size,
)

CPU = torch.device("cpu")


def items(lengths: list[int]) -> list[Item]:
    return [
        Item(index, length, (f"text {index}",), f"--file: data.csv line {index + 2}")
        for index, length in enumerate(lengths)
    ]


@dataclass
class FakeModel:
    """Runs a chunk: its output is ``index * 10``; a chunk of more than ``fits`` rows raises a real
    ``torch.OutOfMemoryError`` from a tensor made inside the chunk (as the cap would)."""

    fits: int
    chunks: list[list[int]] = field(default_factory=list)

    def __call__(self, chunk: list[Item]) -> list[Any]:
        self.chunks.append([item.index for item in chunk])
        held = torch.zeros(len(chunk), 8)
        if len(chunk) > self.fits:
            raise torch.OutOfMemoryError(f"out of memory: {held.numel()} floats")
        return [item.index * 10 for item in chunk]


def test_outputs_come_back_in_input_order_after_back_offs() -> None:
    lengths = [5, 40, 12, 40, 3, 27, 9, 33, 18, 1]
    events: list[dict[str, Any]] = []
    model = FakeModel(fits=2)
    guarded = GuardedInference(model, batch_size=8, device=CPU, on_event=events.append)

    outputs = guarded.run(items(lengths))

    assert outputs == [i * 10 for i in range(len(lengths))]
    # the first chunk is the 8 longest rows, longest first (ties keep input order)
    assert model.chunks[0] == [1, 3, 7, 5, 8, 2, 6, 0]
    # 8 fails, 4 fails, then chunks of 2: each row finishes exactly once
    finished = [c for c in model.chunks if len(c) <= 2]
    assert sorted(i for c in finished for i in c) == list(range(len(lengths)))
    assert [(e["type"], e.get("from"), e.get("to")) for e in events] == [
        ("oom", None, None),
        ("backoff", 8, 4),
        ("oom", None, None),
        ("backoff", 4, 2),
    ]
    assert all(e["phase"] == "predict" and "step" not in e for e in events)
    assert events[0]["micro_batch_size"] == 8 and events[0]["longest_tokens"] == 40
    assert (guarded.ooms, guarded.backoffs, guarded.batch_size) == (2, 2, 2)


def test_the_backed_off_batch_holds_for_the_next_block() -> None:
    model = FakeModel(fits=3)
    guarded = GuardedInference(model, batch_size=8, device=CPU)
    assert guarded.run(items([4] * 8)) == [i * 10 for i in range(8)]
    assert guarded.batch_size == 2  # 8 -> 4 -> 2
    model.chunks.clear()
    second = [Item(8 + k, 4, ("t",), "x") for k in range(5)]
    assert guarded.run(second) == [(8 + k) * 10 for k in range(5)]
    assert [len(c) for c in model.chunks] == [2, 2, 1]  # no retry at 8: the size stayed down


def test_a_row_that_does_not_fit_alone_is_exit_3_naming_its_line() -> None:
    guarded = GuardedInference(FakeModel(fits=0), batch_size=4, device=CPU)
    with pytest.raises(NothingFitsError, match=r"data\.csv line 3: this row \(40 tokens\)") as info:
        guarded.run(items([5, 40, 7]))
    assert info.value.exit_code == 3


def test_an_oom_a_library_wrapped_is_quoted_by_its_own_words() -> None:
    """transformers' tokenizer words an OOM while it makes its tensors as a truncation problem
    (a ValueError whose cause is the OOM): the message quotes the OOM, not the wrapper."""

    def tokenizer_like(chunk: list[Item]) -> list[Any]:
        try:
            raise torch.OutOfMemoryError("memfit memory cap: tried to hold 2 KiB, the cap is 1 KiB")
        except torch.OutOfMemoryError as exc:
            raise ValueError(
                "Unable to create tensor, you should probably activate truncation and/or padding "
                "with 'padding=True' 'truncation=True' to have batched tensors with the same length."
            ) from exc

    events: list[dict[str, Any]] = []
    guarded = GuardedInference(tokenizer_like, batch_size=2, device=CPU, on_event=events.append)
    with pytest.raises(NothingFitsError) as info:
        guarded.run(items([5, 4]))
    message = str(info.value)
    assert "tried to hold 2 KiB, the cap is 1 KiB" in message
    assert "truncation" not in message and "Unable to create tensor" not in message
    assert all("truncation" not in str(e.get("error", "")) for e in events)


def test_an_error_that_is_not_oom_is_not_retried() -> None:
    def broken(chunk: list[Item]) -> list[Any]:
        raise ValueError("a bug")

    guarded = GuardedInference(broken, batch_size=4, device=CPU)
    with pytest.raises(ValueError, match="a bug"):
        guarded.run(items([3, 2]))
    assert guarded.ooms == 0


@dataclass
class FakeEstimate:
    total_bytes: int
    breakdown: dict[str, int]


def linear_estimate(base: int, per_row: int, context: int = 0) -> Any:
    calls: list[int] = []

    def estimate(model: str, **knobs: Any) -> FakeEstimate:
        assert knobs["mode"] == "eval"
        calls.append(knobs["batch_size"])
        total = base + per_row * knobs["batch_size"] + context
        return FakeEstimate(total, {"runtime_overhead": context})

    estimate.calls = calls  # type: ignore[attr-defined]
    return estimate


def plan(**knobs: Any) -> Any:
    """plan_batch_size for a classifier of 500 rows, the longest 30 tokens, on the CPU."""
    settings: dict[str, Any] = {"rows": 500, "longest": 30, "device": CPU, "budget": None}
    return plan_batch_size(Path("m"), "classification", **(settings | knobs))


def test_the_plan_is_the_largest_batch_whose_estimate_fits() -> None:
    # budget 2000, usable 1900: 1000 + 100·9 = 1900 fits, 10 rows do not
    result = plan(budget=2000, estimate=linear_estimate(1000, 100))
    assert result.batch_size == 9
    assert result.predicted_peak_bytes == 1900 and result.seq_len == 30
    assert "memfit estimate" in result.source


def test_the_plan_counts_the_cuda_context_once_on_free_memory() -> None:
    estimate = linear_estimate(1000, 100, context=500)
    free = plan(budget=2000, counts_context=True, estimate=estimate)
    whole = plan(budget=2000, estimate=estimate)
    assert (free.batch_size, whole.batch_size) == (9, 4)


def test_the_plan_never_exceeds_the_rows_and_given_and_default_win() -> None:
    roomy = linear_estimate(10, 1)
    assert plan(rows=7, budget=10**9, estimate=roomy).batch_size == 7
    assert roomy.calls == [1, 7]  # all rows fit: no bisection
    assert plan(rows=7, budget=10**9, given=3, estimate=roomy).batch_size == 3
    default = plan()
    assert default.batch_size == DEFAULT_BATCH_SIZE and "no --gpu-memory" in default.source
    assert plan(rows=3).batch_size == 3


def test_nothing_fits_when_one_row_exceeds_the_budget() -> None:
    with pytest.raises(NothingFitsError, match=r"one row of 30 tokens needs .* --max-seq-len"):
        plan(rows=5, budget=1000, estimate=linear_estimate(1000, 100))


def test_a_model_the_estimator_refuses_runs_from_the_default() -> None:
    def refuses(model: str, **knobs: Any) -> Any:
        raise UsageError("--task: cannot trace this architecture")

    result = plan(rows=100, budget=10**9, estimate=refuses)
    assert result.batch_size == DEFAULT_BATCH_SIZE
    assert "not planned (--task: cannot trace this architecture)" in result.source


def test_the_plan_with_the_real_estimate(tiny_bert: str) -> None:
    import memfit

    def need(batch: int) -> int:
        return memfit.estimate(
            tiny_bert,
            task="classification",
            batch_size=batch,
            seq_len=64,
            mode="eval",
            device="cpu",
        ).total_bytes

    budget = int(need(37) / (1 - SAFETY_MARGIN)) + 1
    result = plan_batch_size(
        Path(tiny_bert), "classification", rows=1000, longest=64, device=CPU, budget=budget
    )
    assert result.batch_size == 37
    assert need(37) <= budget * (1 - SAFETY_MARGIN) < need(38)
    assert result.predicted_peak_bytes == need(37)


def test_every_flag_problem_is_reported_at_once(tmp_path: Path) -> None:
    problems = config_problems(
        InferConfig(
            model="m",
            file="f",
            output="o",
            batch_size=0,
            max_seq_len=-1,
            gpu_memory="lots",
            memory_cap="0",
            precision="fp8",
            device="tpu",
            events=str(tmp_path / "no" / "e.jsonl"),
            id_column="text",
        )
    )
    flags = [p.split(":")[0].split(" ")[0] for p in problems]
    assert flags == [
        "--batch-size",
        "--max-seq-len",
        "--gpu-memory",
        "--memory-cap",
        "--precision",
        "--device",
        "--events",
        "--id-column",
    ]
