"""When the guard cannot help, ``train()`` stops in one line: an OOM in the optimizer update (under
a real memory cap, between what the forward/backward and the update hold), one row that does
not fit; the error leaves ``train()`` with its traceback cut there and, uncaught, ends a script
with its line and exit code 3."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from memfit.errors import NothingFitsError, UsageError
from memfit.integrations import GuardedSentenceTransformerTrainer, GuardedTrainer
from memfit.integrations._exit import exit_if_uncaught


class PhasePeaks(TrainerCallback):
    """The capped run's peak in each phase of an optimizer step: ``passes`` (the forward and
    backward of its micro-batches) and ``update`` (the optimizer step)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.passes: list[int] = []
        self.update: list[int] = []

    def _mark(self, into: list[int] | None) -> None:
        cap = self.trainer.guard_cap
        if into is not None:
            into.append(cap.peak_bytes)
        cap.reset_peak()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark(None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark(self.passes)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark(self.update)


def rows(padded_batch: Callable, n: int) -> list[dict[str, torch.Tensor]]:
    batch = padded_batch(n)
    return [{key: value[i] for key, value in batch.items()} for i in range(n)]


def trainer_with(
    make_trainer: Callable,
    bert_classifier: Callable,
    data: list[dict[str, torch.Tensor]],
    cap: int | str,
    *callbacks: TrainerCallback,
) -> Any:
    # one row per micro-batch: the guard has nothing to halve, and AdamW's two moments (twice
    # the weights, allocated in the first optimizer step) outweigh a row's activations
    return make_trainer(
        GuardedTrainer,
        bert_classifier(),
        trainer_kwargs={"train_dataset": data, "memory_cap": cap, "callbacks": list(callbacks)},
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        optim="adamw_torch",
        max_steps=1,
    )


def test_an_optimizer_step_that_does_not_fit_stops_in_one_line_with_the_cures(
    make_trainer: Callable,
    bert_classifier: Callable,
    padded_batch: Callable,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the stop chains a hook: undo it
    data = rows(padded_batch, 2)
    peaks = PhasePeaks()
    free = trainer_with(make_trainer, bert_classifier, data, "64GiB", peaks)
    peaks.trainer = free
    free.train()
    # step 1: AdamW allocates its moments in the update
    passes, update = peaks.passes[0], peaks.update[0]
    assert update > passes, (passes, update)  # the update holds more than one row's passes
    # a cap that every micro-batch's forward and backward fit under, but not the update
    capped = trainer_with(make_trainer, bert_classifier, data, (passes + update) // 2)
    with pytest.raises(NothingFitsError) as info:
        capped.train()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("step 1: the optimizer step runs out of memory (memfit memory cap:")
    assert "whatever the micro-batch: try optim='adafactor'" in message
    assert [(e["type"], e["step"], e.get("phase")) for e in capped.guard_events] == [
        ("oom", 1, "optimizer"),
        ("stop", 1, None),
    ]
    # raised from train() itself: no frame of the Trainer's loop, no chained OOM traceback
    frames = traceback.extract_tb(info.tb)
    assert not [f for f in frames if "transformers" in Path(f.filename).parts]
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_oom_after_the_optimizer_step_goes_on_up_as_it_is(
    make_trainer: Callable, bert_classifier: Callable, padded_batch: Callable
) -> None:
    """Only the update is the update: an OOM elsewhere outside training_step is not relabelled."""

    class OomAtStepEnd(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer = trainer_with(
        make_trainer, bert_classifier, rows(padded_batch, 2), "64GiB", OomAtStepEnd()
    )
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        trainer.train()
    assert trainer.guard_events == []


def test_one_row_that_does_not_fit_stops_train_in_one_line(
    make_trainer: Callable,
    bert_classifier: Callable,
    padded_batch: Callable,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    trainer = trainer_with(make_trainer, bert_classifier, rows(padded_batch, 2), "64GiB")

    def out_of_memory(module: Any, args: Any, output: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    trainer.model.bert.pooler.register_forward_hook(out_of_memory)
    with pytest.raises(
        NothingFitsError, match=r"^step 1: one row per forward pass does not fit"
    ) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert not [
        f for f in traceback.extract_tb(info.tb) if "transformers" in Path(f.filename).parts
    ]
    # uncaught, it ends the script in its line with exit code 3
    with pytest.raises(SystemExit) as exited:
        sys.excepthook(type(info.value), info.value, info.tb)
    assert exited.value.code == 3


def test_the_sentence_transformers_trainer_stops_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments
    from sentence_transformers.losses import CosineSimilarityLoss

    from tiny_models import save_bert

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    (tmp_path / "model").mkdir()
    save_bert(tmp_path / "model", [f"w{i}" for i in range(40)])
    data = Dataset.from_dict(
        {"a": ["w1 w2 w3", "w4 w5"], "b": ["w6 w7", "w8 w9 w10 w11"], "score": [0.2, 0.9]}
    )

    def trainer(name: str, cap: int | str, *callbacks: TrainerCallback) -> Any:
        model = SentenceTransformer(str(tmp_path / "model"), device="cpu")
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=1,
            optim="adamw_torch",
            max_steps=1,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
        )
        return GuardedSentenceTransformerTrainer(
            model=model,
            args=args,
            train_dataset=data,
            loss=CosineSimilarityLoss(model),
            memory_cap=cap,
            callbacks=list(callbacks),
        )

    peaks = PhasePeaks()
    peaks.trainer = trainer("free", "64GiB", peaks)
    peaks.trainer.train()
    # step 1: AdamW allocates its moments in the update
    passes, update = peaks.passes[0], peaks.update[0]
    assert update > passes, (passes, update)
    capped = trainer("capped", (passes + update) // 2)
    with pytest.raises(NothingFitsError, match=r"^step 1: the optimizer step runs out of memory"):
        capped.train()
    assert [e["type"] for e in capped.guard_events] == ["oom", "stop"]


def test_an_uncaught_stop_ends_the_script_with_its_line_and_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    error = exit_if_uncaught(NothingFitsError("step 2: the optimizer step runs out of memory"))
    with pytest.raises(SystemExit) as exited:
        sys.excepthook(type(error), error, None)
    assert exited.value.code == 3
    assert capsys.readouterr().err == (
        "memfit: error: step 2: the optimizer step runs out of memory\n"
    )
    # anything else, a memfit error that was not stopped by the guard included, goes to the
    # hook there was before
    other = UsageError("not the guard's")
    sys.excepthook(UsageError, other, None)
    exit_if_uncaught(NothingFitsError("again"))  # the hook is chained once
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert seen == [other, seen[1]] and isinstance(seen[1], ValueError)
