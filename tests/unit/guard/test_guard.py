"""The guard: any split gives the full-batch gradient, and OOM recovery keeps it exact."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.guard import CpuMemoryCap, Guard, StepTooLarge, is_oom

Row = dict[str, Any]


def make_model(width: int = 16, inputs: int = 6, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, classes))


def sample_rows(n: int, inputs: int = 6, classes: int = 3) -> list[Row]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, inputs, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return [{"id": i, "x": x[i], "y": y[i]} for i in range(n)]


def token_rows(lengths: list[int], inputs: int = 6, classes: int = 3) -> list[Row]:
    g = torch.Generator().manual_seed(2)
    return [
        {
            "id": i,
            "x": torch.randn(n, inputs, generator=g),
            "y": torch.randint(0, classes, (n,), generator=g),
        }
        for i, n in enumerate(lengths)
    ]


class SampleRecipe:
    """Classification: one unit per row. Records the row ids each attempt of a step saw."""

    splittable = True

    def __init__(self, model: nn.Module, oom_above: int | None = None) -> None:
        self.model = model
        # a chunk with more rows than this raises OOM (for the schedule tests; the exactness
        # tests under OOM use the real CpuMemoryCap)
        self.oom_above = oom_above
        self.attempts: list[list[int]] = []
        self.eval_calls: list[list[int]] = []

    def units(self, rows: list[Row]) -> int:
        self.attempts.append([])  # the guard computes the units once per attempt
        return len(rows)

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        if self.oom_above is not None and len(rows) > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(rows)} MiB")
        self.attempts[-1].extend(row["id"] for row in rows)
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        return F.cross_entropy(self.model(x), y, reduction="sum") / total_units

    def eval_partial(self, rows: list[Row]) -> torch.Tensor:
        if self.oom_above is not None and len(rows) > self.oom_above:
            raise RuntimeError("CUDA error: out of memory")
        self.eval_calls.append([row["id"] for row in rows])
        assert not torch.is_grad_enabled()
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        return F.cross_entropy(self.model(x), y, reduction="none")

    def eval_reduce(self, partials: list[torch.Tensor]) -> dict[str, float]:
        losses = torch.cat(partials)
        return {"loss": float(losses.mean()), "rows": float(losses.numel())}


class TokenRecipe(SampleRecipe):
    """Causal-LM-like: rows of different lengths, weighted by their tokens."""

    def units(self, rows: list[Row]) -> int:
        super().units(rows)
        return sum(len(row["y"]) for row in rows)

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        self.attempts[-1].extend(row["id"] for row in rows)
        x = torch.cat([row["x"] for row in rows])
        y = torch.cat([row["y"] for row in rows])
        return F.cross_entropy(self.model(x), y, reduction="sum") / total_units


class CoupledRecipe(SampleRecipe):
    """A loss that couples its samples (in-batch negatives): the guard must not split it."""

    splittable = False

    def __init__(self, model: nn.Module, oom_above: int | None = None) -> None:
        super().__init__(model, oom_above)
        self.mini_batch_sizes: list[int | None] = []

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        self.mini_batch_sizes.append(mini_batch_size)
        if self.oom_above is not None and (mini_batch_size or len(rows)) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory (mini-batch too large)")
        self.attempts[-1].extend(row["id"] for row in rows)
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        logits = self.model(x)
        return (F.cross_entropy(logits, y, reduction="sum") + logits.logsumexp(0).sum()) / (
            total_units
        )


def full_batch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_gradient(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


# -- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [1, 3, 4, 7])
def test_any_split_gives_the_full_batch_gradient(micro: int) -> None:
    model = make_model()
    rows = sample_rows(7)
    x = torch.stack([r["x"] for r in rows])
    y = torch.stack([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)
    expected_loss = float(F.cross_entropy(model(x), y).detach())

    recipe = SampleRecipe(model)
    loss = Guard(micro).step(rows, recipe, params=list(model.parameters()))

    assert_same_gradient(grads_of(model), expected)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert recipe.attempts == [list(range(7))]


@pytest.mark.parametrize("micro", [1, 2, 4, 5])
def test_token_weighted_split_gives_the_per_token_mean_gradient(micro: int) -> None:
    model = make_model()
    rows = token_rows([3, 11, 1, 7, 2])
    x = torch.cat([r["x"] for r in rows])
    y = torch.cat([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)  # mean over all 24 tokens, not over rows

    recipe = TokenRecipe(model)
    loss = Guard(micro).step(rows, recipe, params=list(model.parameters()))

    assert_same_gradient(grads_of(model), expected)
    assert loss == pytest.approx(float(F.cross_entropy(model(x), y).detach()), abs=1e-6)


def test_autocast_and_scale_are_applied_per_chunk() -> None:
    model = make_model()
    rows = sample_rows(6)
    entered: list[int] = []

    class Autocast:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    x = torch.stack([r["x"] for r in rows])
    y = torch.stack([r["y"] for r in rows])
    expected = [2 * g for g in full_batch_gradient(model, x, y)]
    Guard(2).step(
        rows,
        SampleRecipe(model),
        params=list(model.parameters()),
        autocast=Autocast,
        scale=lambda t: 2 * t,
    )
    assert len(entered) == 3
    assert_same_gradient(grads_of(model), expected)


def test_unsplittable_recipe_gets_the_whole_step_and_a_mini_batch_size() -> None:
    model = make_model()
    rows = sample_rows(8)
    reference = CoupledRecipe(model)
    reference.units(rows)
    reference.loss(rows, 8).backward()
    expected = grads_of(model)
    model.zero_grad(set_to_none=True)

    recipe = CoupledRecipe(model, oom_above=2)
    events: list[dict[str, Any]] = []
    guard = Guard(8, on_event=events.append)
    guard.step(rows, recipe, params=list(model.parameters()), step=1)

    assert recipe.mini_batch_sizes == [8, 4, 2]
    assert [e["type"] for e in events] == ["oom", "backoff", "oom", "backoff"]
    assert recipe.attempts[-1] == list(range(8))
    assert guard.micro_batch_size == 2
    assert_same_gradient(grads_of(model), expected)


# -- OOM recovery under a real memory cap ----------------------------------------------------
def wide_model() -> nn.Module:
    # activations (4096 floats per row per layer) dominate the parameters
    return make_model(width=4096, inputs=8, classes=4)


def peak_of_step(model: nn.Module, rows: list[Row], micro: int) -> int:
    """The bytes a guarded step at ``micro`` needs, measured uncapped."""
    with CpuMemoryCap(2**40) as probe:
        probe.track(model)
        Guard(micro).step(rows, SampleRecipe(model), params=list(model.parameters()))
        peak = probe.peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.slow
def test_oom_backs_off_and_keeps_the_gradient_exact() -> None:
    model = wide_model()
    params = list(model.parameters())
    rows = sample_rows(16, inputs=8, classes=4)
    x = torch.stack([r["x"] for r in rows])
    y = torch.stack([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)
    fits, too_big = peak_of_step(model, rows, 2), peak_of_step(model, rows, 8)
    assert fits < too_big

    recipe = SampleRecipe(model)
    events: list[dict[str, Any]] = []
    guard = Guard(8, on_event=events.append)
    with CpuMemoryCap((fits + too_big) // 2) as cap:
        cap.track(model)
        loss = guard.step(rows, recipe, params=params, step=7)
        gc.collect()
        # nothing of the failed attempts is left: parameters and their gradients only
        assert cap.live_bytes == 2 * sum(p.numel() * 4 for p in params)

    assert events[0]["type"] == "oom"
    assert events[0]["step"] == 7 and events[0]["micro_batch_size"] == 8
    assert "memfit memory cap" in events[0]["error"]
    assert events[1] == {"type": "backoff", "step": 7, "from": 8, "to": 4}
    assert 2 <= guard.micro_batch_size <= 4
    assert_same_gradient(grads_of(model), expected)
    assert loss == pytest.approx(float(F.cross_entropy(model(x), y).detach()), abs=1e-6)
    # the successful attempt saw every row exactly once, in order
    assert recipe.attempts[-1] == list(range(16))
    assert len(recipe.attempts) == 1 + sum(e["type"] == "backoff" for e in events)


def test_a_backward_that_dies_half_way_leaks_nothing_into_grad() -> None:
    model = make_model()
    params = list(model.parameters())
    rows = sample_rows(8)
    x = torch.stack([r["x"] for r in rows])
    y = torch.stack([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)

    class DiesInSecondBackward(SampleRecipe):
        """At micro-batch 4 the second chunk's backward fails after the first chunk's
        gradients were accumulated and after the last layer's gradient was written."""

        def loss(self, rows: list[Row], total_units: int, **kw: Any) -> torch.Tensor:
            loss = super().loss(rows, total_units, **kw)
            if len(rows) == 4 and rows[0]["id"] == 4:

                def fail(grad: torch.Tensor) -> torch.Tensor:
                    raise torch.OutOfMemoryError("CUDA out of memory in backward")

                x = torch.stack([r["x"] for r in rows]).requires_grad_()
                loss = loss + 0 * self.model(x).sum()
                x.register_hook(fail)
            return loss

    recipe = DiesInSecondBackward(model)
    guard = Guard(4)
    guard.step(rows, recipe, params=params)
    assert recipe.attempts == [list(range(8)), list(range(8))]
    assert guard.micro_batch_size == 2
    assert_same_gradient(grads_of(model), expected)


def test_step_too_large_when_even_one_row_does_not_fit() -> None:
    model = wide_model()
    params = list(model.parameters())
    rows = sample_rows(6, inputs=8, classes=4)
    events: list[dict[str, Any]] = []
    guard = Guard(8, on_event=events.append)
    param_bytes = sum(p.numel() * 4 for p in params)
    with CpuMemoryCap(param_bytes + 1024) as cap:
        cap.track(model)
        with pytest.raises(StepTooLarge, match="memfit memory cap: tried to hold") as info:
            guard.step(rows, SampleRecipe(model), params=params, step=3)
        gc.collect()
        assert cap.live_bytes == param_bytes
    assert info.value.micro_batch_size == 1
    assert all(p.grad is None for p in params)
    # 8 ran all 6 rows at once: the next tries are 3, 1
    backoffs = [(e["from"], e["to"]) for e in events if e["type"] == "backoff"]
    assert backoffs == [(8, 3), (3, 1)]
    assert [e["micro_batch_size"] for e in events if e["type"] == "oom"] == [8, 3, 1]


def test_other_errors_are_not_swallowed() -> None:
    class Broken(SampleRecipe):
        def loss(self, rows: list[Row], total_units: int, **kw: Any) -> torch.Tensor:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    model = make_model()
    guard = Guard(4)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        guard.step(sample_rows(4), Broken(model), params=list(model.parameters()))
    assert guard.micro_batch_size == 4


# -- growing back ----------------------------------------------------------------------------
@pytest.mark.slow
def test_grows_back_after_clean_steps_and_waits_longer_after_a_failed_grow() -> None:
    model = make_model()
    params = list(model.parameters())
    rows = sample_rows(8)
    recipe = SampleRecipe(model, oom_above=2)
    events: list[dict[str, Any]] = []
    guard = Guard(8, grow_after=3, on_event=events.append)

    def run(step: int) -> None:
        guard.step(rows, recipe, params=params, step=step)
        model.zero_grad(set_to_none=True)

    run(1)
    assert guard.micro_batch_size == 2
    for step in (2, 3, 4):  # three clean steps
        run(step)
    assert guard.micro_batch_size == 2
    recipe.oom_above = 4  # more memory now: the grow succeeds
    events.clear()
    run(5)
    assert events == [{"type": "grow", "step": 5, "from": 2, "to": 4}]
    assert guard.micro_batch_size == 4

    for step in (6, 7):
        run(step)
    events.clear()
    run(8)  # after 3 clean steps at 4 (5, 6, 7) it tries 8, which does not fit
    assert [e["type"] for e in events] == ["grow", "oom", "backoff"]
    assert events[0]["to"] == 8 and events[2] == {"type": "backoff", "step": 8, "from": 8, "to": 4}
    assert guard.micro_batch_size == 4
    assert guard.grow_after == 6

    events.clear()
    for step in range(9, 15):  # six clean steps at 4: no grow yet
        run(step)
    assert events == []
    run(15)
    assert events[0] == {"type": "grow", "step": 15, "from": 4, "to": 8}


def test_never_grows_above_the_target() -> None:
    model = make_model()
    guard = Guard(2, target_micro_batch_size=3, grow_after=1)
    rows = sample_rows(6)
    for _ in range(3):
        guard.step(rows, SampleRecipe(model), params=list(model.parameters()))
    assert guard.micro_batch_size == 3


def test_state_dict_round_trip() -> None:
    guard = Guard(8, grow_after=5)
    guard.micro_batch_size, guard.clean_steps, guard.grow_after = 2, 4, 10
    other = Guard(8)
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == {
        "micro_batch_size": 2,
        "target_micro_batch_size": 8,
        "clean_steps": 4,
        "grow_after": 10,
        "max_tokens": None,
        "target_max_tokens": None,
    }


# -- evaluation ------------------------------------------------------------------------------
def test_evaluate_in_chunks_equals_unsplit() -> None:
    model = make_model()
    rows = sample_rows(10)
    whole = Guard(10).evaluate(rows, SampleRecipe(model))
    recipe = SampleRecipe(model)
    split = Guard(3).evaluate(rows, recipe)
    assert recipe.eval_calls == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert split["rows"] == whole["rows"] == 10
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert Guard(8).evaluate(rows, recipe, micro_batch_size=5)["loss"] == pytest.approx(
        whole["loss"], abs=1e-6
    )


def test_evaluate_recovers_from_oom_keeping_finished_chunks() -> None:
    model = make_model()
    rows = sample_rows(10)
    whole = Guard(10).evaluate(rows, SampleRecipe(model))

    class RunsShort(SampleRecipe):
        def eval_partial(self, rows: list[Row]) -> torch.Tensor:
            if self.eval_calls:  # memory runs short after the first chunk
                self.oom_above = 2
            return super().eval_partial(rows)

    recipe = RunsShort(model)
    events: list[dict[str, Any]] = []
    guard = Guard(4, on_event=events.append)
    result = guard.evaluate(rows, recipe, step=12)

    assert recipe.eval_calls == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
    assert result["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert events == [
        {
            "type": "oom",
            "step": 12,
            "micro_batch_size": 4,
            "phase": "eval",
            "error": "CUDA error: out of memory",
        },
        {"type": "backoff", "step": 12, "from": 4, "to": 2, "phase": "eval"},
    ]
    assert guard.micro_batch_size == 4  # training keeps its size

    with pytest.raises(StepTooLarge) as info:
        Guard(4).evaluate(rows, SampleRecipe(model, oom_above=0))
    assert info.value.phase == "eval"


# -- is_oom ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("whatever"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"),
        RuntimeError("memfit memory cap: tried to hold 2 GiB, the cap is 1 GiB"),
        MemoryError(),
    ],
)
def test_is_oom_recognizes_out_of_memory(exc: BaseException) -> None:
    assert is_oom(exc)


def test_is_oom_sees_through_wrapping_and_rejects_other_errors() -> None:
    wrapped = RuntimeError("error in the backward of a custom function")
    wrapped.__cause__ = torch.OutOfMemoryError("x")
    assert is_oom(wrapped)
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))  # only runtime errors carry OOM messages
    assert not is_oom(KeyboardInterrupt())


# -- token budgets ------------------------------------------------------------------------------
class LengthRecipe(TokenRecipe):
    """A token recipe that tells the guard its rows' lengths (as the real recipes do)."""

    pad_multiple = 1

    def __init__(self, model: nn.Module, oom_above_tokens: int | None = None) -> None:
        super().__init__(model)
        self.oom_above_tokens = oom_above_tokens
        self.chunks: list[list[int]] = []

    def lengths(self, rows: list[Row]) -> list[int]:
        return [len(row["y"]) for row in rows]

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        padded = len(rows) * max(len(row["y"]) for row in rows)
        if self.oom_above_tokens is not None and padded > self.oom_above_tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({padded} padded tokens)")
        self.chunks.append([row["id"] for row in rows])
        return super().loss(rows, total_units)


def test_token_budget_split_keeps_the_per_token_gradient_and_reports_padding() -> None:
    model = make_model()
    lengths = [3, 11, 1, 7, 2, 9, 4]
    rows = token_rows(lengths)
    x = torch.cat([r["x"] for r in rows])
    y = torch.cat([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)

    recipe = LengthRecipe(model)
    guard = Guard(7, max_tokens=22)
    guard.step(rows, recipe, params=list(model.parameters()))

    assert_same_gradient(grads_of(model), expected)
    # longest first, the fewest micro-batches within 22 tokens (3), then the least padding (45)
    assert recipe.chunks[0][0] == 1 and len(recipe.chunks) == 3
    assert all(len(c) * max(lengths[i] for i in c) <= 22 for c in recipe.chunks)
    assert sum(len(c) * max(lengths[i] for i in c) for c in recipe.chunks) == 45
    assert guard.last_step["tokens"] == sum(lengths)
    assert guard.last_step["chunks"] == len(recipe.chunks)
    assert guard.last_step["padded_tokens"] == sum(
        len(c) * max(lengths[i] for i in c) for c in recipe.chunks
    )


def test_oom_under_a_token_budget_halves_the_budget_not_the_rows() -> None:
    model = make_model()
    rows = token_rows([10, 10, 10, 10, 2, 2, 2, 2])
    x = torch.cat([r["x"] for r in rows])
    y = torch.cat([r["y"] for r in rows])
    expected = full_batch_gradient(model, x, y)
    events: list[dict[str, Any]] = []
    recipe = LengthRecipe(model, oom_above_tokens=20)
    guard = Guard(8, max_tokens=40, on_event=events.append)
    guard.step(rows, recipe, params=list(model.parameters()), step=3)

    assert_same_gradient(grads_of(model), expected)
    backoffs = [e for e in events if e["type"] == "backoff"]
    assert backoffs[0]["max_tokens_from"] == 40 and backoffs[0]["max_tokens_to"] == 20
    assert guard.max_tokens == 20 and guard.micro_batch_size == 8  # rows cap untouched
    # the final attempt: two long rows per chunk, and the four short rows together (8 tokens)
    assert recipe.chunks[-3:] == [[0, 1], [2, 3], [4, 5, 6, 7]]


def test_token_budget_step_too_large_for_a_single_row_and_grows_back() -> None:
    model = make_model()
    recipe = LengthRecipe(model, oom_above_tokens=5)
    with pytest.raises(StepTooLarge):
        Guard(4, max_tokens=64).step(token_rows([9, 2]), recipe, params=list(model.parameters()))
    events: list[dict[str, Any]] = []
    guard = Guard(4, max_tokens=8, target_max_tokens=32, grow_after=1, on_event=events.append)
    recipe = LengthRecipe(model)
    guard.step(token_rows([4, 4]), recipe, params=list(model.parameters()), step=1)
    guard.step(token_rows([4, 4]), recipe, params=list(model.parameters()), step=2)
    assert events[0] == {"type": "grow", "step": 2, "max_tokens_from": 8, "max_tokens_to": 16}
    assert guard.state_dict()["max_tokens"] == 16


class FixedWidthRecipe(LengthRecipe):
    """--padding max_length: every row is fed at max_seq_len, whatever its length."""

    max_seq_len = 16

    def padded_width(self, longest: int) -> int:
        return self.max_seq_len

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        fed = len(rows) * self.max_seq_len
        if self.oom_above_tokens is not None and fed > self.oom_above_tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({fed} fed tokens)")
        self.chunks.append([row["id"] for row in rows])
        return TokenRecipe.loss(self, rows, total_units)


def test_the_budget_counts_the_width_really_fed_and_back_off_always_shrinks() -> None:
    model = make_model()
    recipe = FixedWidthRecipe(model, oom_above_tokens=32)
    events: list[dict[str, Any]] = []
    guard = Guard(8, max_tokens=64, on_event=events.append)
    guard.step(token_rows([3] * 8), recipe, params=list(model.parameters()), step=1)
    # 64 tokens at width 16 is 4 rows (not 21 rows of 3); after the OOM at 64, 2 rows (32)
    assert [len(c) for c in recipe.chunks[-4:]] == [2, 2, 2, 2]
    budgets = [e["max_tokens_to"] for e in events if e["type"] == "backoff"]
    assert budgets == [32]
    # a budget the recipe can never meet ends in StepTooLarge, not in endless retries
    with pytest.raises(StepTooLarge):
        Guard(8, max_tokens=64).step(
            token_rows([3] * 4),
            FixedWidthRecipe(model, oom_above_tokens=8),
            params=list(model.parameters()),
        )


def test_the_step_loss_is_read_from_the_device_once_however_many_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a read (float, item) waits for the device: one per micro-batch would stall the host
    # before every next forward on a GPU; the step's loss is read once, after the last backward
    model = make_model()
    rows = sample_rows(8)
    reads: list[str] = []
    real_float, real_item, real_tolist = (
        torch.Tensor.__float__,
        torch.Tensor.item,
        torch.Tensor.tolist,
    )

    def counting_float(self: torch.Tensor) -> float:
        reads.append("float")
        return real_float(self)

    def counting_item(self: torch.Tensor) -> Any:
        reads.append("item")
        return real_item(self)

    def counting_tolist(self: torch.Tensor) -> Any:
        reads.append("tolist")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "__float__", counting_float)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    loss = Guard(2).step(rows, SampleRecipe(model), params=list(model.parameters()))
    monkeypatch.undo()

    x = torch.stack([r["x"] for r in rows])
    y = torch.stack([r["y"] for r in rows])
    assert loss == pytest.approx(float(F.cross_entropy(model(x), y)), abs=1e-6)
    assert len(reads) == 1, reads  # four micro-batches, one read
