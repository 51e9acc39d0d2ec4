"""GuardedTrainer.training_step: any split of a Trainer micro-batch gives the stock gradient, and
an OOM half-way through a step is re-run to the same gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import Trainer

from memfit.errors import NothingFitsError, UsageError
from memfit.integrations import GuardedTrainer


def record_rows(model: torch.nn.Module) -> list[int]:
    """The rows of every forward the model runs, in order."""
    seen: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(int(kwargs["input_ids"].shape[0]))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


class FakeOom:
    """Raises a CUDA-style OOM from the backward of BERT's pooler output when the chunk has
    more than ``above`` rows: after the classifier's gradients were written, like a real OOM
    half-way through a backward. ``armed`` switches it on and off."""

    def __init__(self, model: Any, above: int, *, error: Exception | None = None) -> None:
        self.above = above
        self.armed = True
        self.error = error
        self.raised = 0
        model.bert.pooler.register_forward_hook(self._forward)

    def _forward(self, module: Any, args: Any, output: torch.Tensor) -> None:
        if self.armed and output.requires_grad and output.shape[0] > self.above:
            output.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.raised += 1
        raise self.error or torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 1 GiB"
        )


def stock_gradients(make_trainer: Callable, model: Any, calls: list[tuple[dict, Any]]) -> tuple:
    stock = make_trainer(Trainer, model)
    losses = [float(stock.training_step(stock.model, dict(b), n)) for b, n in calls]
    return stock, losses


def test_uneven_chunks_give_the_stock_gradient_when_the_model_ignores_num_items(
    make_trainer: Callable,
    bert_classifier: Callable,
    padded_batch: Callable,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    batch = padded_batch(8)
    items = torch.tensor(16)  # the step's labels over its two micro-batches, as the Trainer counts
    stock, [expected_loss] = stock_gradients(make_trainer, bert_classifier(), [(batch, items)])
    guarded = make_trainer(GuardedTrainer, bert_classifier())
    rows = record_rows(guarded.model)
    guarded.guard_micro_batch_size = 3
    loss = guarded.training_step(guarded.model, dict(batch), items)
    # BERT's classification head takes num_items_in_batch and ignores it: a mean per call
    assert guarded._guard_items_normalised is False
    assert rows[-3:] == [3, 3, 2]  # the chunks ran (after the probe's two one-row forwards)
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
    assert "compute_loss" not in vars(guarded)  # the weighting is undone after the call


def test_uneven_chunks_give_the_stock_gradient_for_a_per_token_loss_over_the_step(
    make_trainer: Callable,
    gpt2_lm: Callable,
    padded_batch: Callable,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    batch = padded_batch(8, causal=True)
    # the step's target tokens: this micro-batch's and 23 more in the step's other one
    items = torch.tensor(int(batch["labels"][:, 1:].ne(-100).sum()) + 23)
    stock, [expected_loss] = stock_gradients(make_trainer, gpt2_lm(), [(batch, items)])
    guarded = make_trainer(GuardedTrainer, gpt2_lm())
    guarded.guard_micro_batch_size = 3
    loss = guarded.training_step(guarded.model, dict(batch), items)
    # GPT-2's loss is Σ token losses ÷ num_items_in_batch: chunks add up unweighted
    assert guarded._guard_items_normalised is True
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)


def test_uneven_chunks_give_the_stock_gradient_for_a_token_mean_without_num_items(
    make_trainer: Callable,
    gpt2_lm: Callable,
    padded_batch: Callable,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    batch = padded_batch(8, causal=True, seed=4)
    stock, [expected_loss] = stock_gradients(make_trainer, gpt2_lm(), [(batch, None)])
    guarded = make_trainer(GuardedTrainer, gpt2_lm())
    guarded.guard_micro_batch_size = 5
    loss = guarded.training_step(guarded.model, dict(batch), None)
    # the model's own mean over target tokens: chunks weigh their share of the tokens
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)


class SmoothedTrainer(GuardedTrainer):
    """A user's compute_loss override: label-smoothed cross-entropy, a mean over the rows."""

    def compute_loss(
        self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = torch.nn.functional.cross_entropy(outputs.logits, labels, label_smoothing=0.1)
        return (loss, outputs) if return_outputs else loss


def test_a_compute_loss_override_is_split_exactly(
    make_trainer: Callable,
    bert_classifier: Callable,
    padded_batch: Callable,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    batch = padded_batch(8, seed=5)
    items = torch.tensor(16)
    stock = make_trainer(SmoothedTrainer, bert_classifier())
    expected = float(stock.training_step(stock.model, dict(batch), items))
    guarded = make_trainer(SmoothedTrainer, bert_classifier())
    guarded.guard_micro_batch_size = 3
    loss = guarded.training_step(guarded.model, dict(batch), items)
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert float(loss) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_oom_in_a_later_micro_batch_reruns_the_step_to_the_same_gradient(
    make_trainer: Callable,
    bert_classifier: Callable,
    padded_batch: Callable,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    first, second = padded_batch(8, seed=1), padded_batch(8, seed=2)
    items = torch.tensor(16)
    stock, losses = stock_gradients(
        make_trainer, bert_classifier(), [(first, items), (second, items)]
    )
    guarded = make_trainer(GuardedTrainer, bert_classifier())
    rows = record_rows(guarded.model)
    oom = FakeOom(guarded.model, above=4)
    oom.armed = False
    loss_first = guarded.training_step(guarded.model, dict(first), items)
    oom.armed = True  # the step's second micro-batch runs out of memory half-way through backward
    loss_second = guarded.training_step(guarded.model, dict(second), items)
    assert oom.raised == 1
    assert [e["type"] for e in guarded.guard_events] == ["oom", "backoff"]
    assert guarded.guard_events[1] | {"time": 0} == {
        "time": 0,
        "type": "backoff",
        "step": 1,
        "from": 8,
        "to": 4,
    }
    assert guarded.guard_micro_batch_size == 4
    # the first micro-batch is re-run (its gradient went with the failed attempt's), then the
    # second, both in chunks of 4 (the probe's one-row forwards come first)
    assert rows[:2] == [8, 8] and rows[-4:] == [4, 4, 4, 4]
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert [float(loss_first), float(loss_second)] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_the_events_file_has_the_shape_of_memfit_events(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    import json
    from pathlib import Path

    guarded = make_trainer(GuardedTrainer, bert_classifier())
    FakeOom(guarded.model, above=2)
    guarded.training_step(guarded.model, dict(padded_batch(8)), torch.tensor(8))
    path = Path(guarded.args.output_dir) / "memfit_events.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["type"], e.get("from"), e.get("to")) for e in lines] == [
        ("oom", None, None),
        ("backoff", 8, 4),
        ("oom", None, None),
        ("backoff", 4, 2),
    ]
    assert lines[0]["error"].startswith("CUDA out of memory. Tried to allocate 20.00 MiB")
    assert all(e["step"] == 1 and isinstance(e["time"], float) for e in lines)


@pytest.mark.slow
def test_the_guard_grows_back_after_clean_steps_and_waits_longer_when_that_fails(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    guarded = make_trainer(GuardedTrainer, bert_classifier(), trainer_kwargs={"grow_after": 2})
    oom = FakeOom(guarded.model, above=4)
    batch, items = padded_batch(8), torch.tensor(8)

    def step() -> None:
        guarded.training_step(guarded.model, dict(batch), items)
        guarded.state.global_step += 1  # the optimizer step the Trainer would take

    step()  # OOM at 8 → 4
    step()
    step()  # two clean steps at 4
    assert guarded.guard_micro_batch_size == 4
    oom.armed = False
    step()  # grows to the whole micro-batch (the stock path) and fits
    assert guarded.guard_micro_batch_size is None
    assert guarded.guard_events[-1] | {"time": 0} == {
        "time": 0,
        "type": "grow",
        "step": 4,
        "from": 4,
        "to": 8,
    }
    oom.armed = True
    step()  # OOM at 8 → 4 again
    step()
    step()
    step()  # grows, OOMs: the next try waits twice as long
    assert [e["type"] for e in guarded.guard_events[-3:]] == ["grow", "oom", "backoff"]
    assert guarded.guard_grow_after == 4
    assert guarded.guard_micro_batch_size == 4


def test_one_row_that_does_not_fit_stops_with_the_cures(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    guarded = make_trainer(GuardedTrainer, bert_classifier())
    FakeOom(guarded.model, above=0)
    with pytest.raises(NothingFitsError, match=r"step 1: one row per forward pass does not fit"):
        guarded.training_step(guarded.model, dict(padded_batch(4)), torch.tensor(4))
    assert [e["type"] for e in guarded.guard_events] == [
        "oom",
        "backoff",
        "oom",
        "backoff",
        "oom",
        "stop",
    ]


def test_errors_that_are_not_oom_pass_through(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    guarded = make_trainer(GuardedTrainer, bert_classifier())
    FakeOom(guarded.model, above=0, error=ValueError("a bug in the user's hook"))
    with pytest.raises(ValueError, match="a bug in the user's hook"):
        guarded.training_step(guarded.model, dict(padded_batch(4)), torch.tensor(4))
    assert guarded.guard_events == []


def test_prediction_step_splits_on_oom_and_joins_the_outputs(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    batch = padded_batch(7, seed=3)
    stock = make_trainer(Trainer, bert_classifier())
    expected = stock.prediction_step(stock.model, dict(batch), prediction_loss_only=False)
    guarded = make_trainer(GuardedTrainer, bert_classifier())

    def refuse_big(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    guarded.model.register_forward_pre_hook(refuse_big, with_kwargs=True)
    loss, logits, labels = guarded.prediction_step(
        guarded.model, dict(batch), prediction_loss_only=False
    )
    assert guarded.guard_eval_batch_size == 3
    assert [(e["type"], e["phase"]) for e in guarded.guard_events] == [
        ("oom", "eval"),
        ("backoff", "eval"),
    ]
    assert float(loss) == pytest.approx(float(expected[0]), rel=1e-5)
    torch.testing.assert_close(logits, expected[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(labels, expected[2])


def test_bad_guard_keywords_name_the_keyword(
    make_trainer: Callable, bert_classifier: Callable
) -> None:
    with pytest.raises(UsageError, match=r"memory_cap: cannot read 'lots' as a size"):
        make_trainer(GuardedTrainer, bert_classifier(), trainer_kwargs={"memory_cap": "lots"})
    with pytest.raises(ValueError, match=r"grow_after: must be a whole number ≥ 1, got 0"):
        make_trainer(GuardedTrainer, bert_classifier(), trainer_kwargs={"grow_after": 0})


def test_a_restarted_training_loop_forgets_the_aborted_step(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    """auto_find_batch_size restarts the loop from step 0: the aborted loop's inputs of step 0
    must not be re-run with the new loop's step 0."""
    from memfit.integrations._guard import _StepReset

    guarded = make_trainer(GuardedTrainer, bert_classifier())
    guarded.training_step(guarded.model, dict(padded_batch(8)), torch.tensor(16))
    assert len(guarded._guard_step_calls) == 1
    reset = _StepReset(guarded)
    reset.on_train_begin(guarded.args, guarded.state, guarded.control)
    assert guarded._guard_step_calls == [] and guarded._guard_step_key is None
