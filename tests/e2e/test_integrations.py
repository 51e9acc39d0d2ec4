"""Ordinary Trainer and SentenceTransformerTrainer scripts under a real (simulated) memory cap.

Each script is run three ways: the stock trainer without a cap (the reference), the stock trainer
under the cap (it must run out of memory: the cap bites), and the guarded trainer under the same
cap, which must back off and end with the reference's weights (dropout off, SGD). The cap sits
halfway between the live tensor bytes of the script at its micro-batch and at half of it,
measured first by running the guarded trainer with a cap too large to be reached.
"""

from __future__ import annotations

import json
import random
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(60)]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UNREACHABLE = "64GiB"


class CountSteps:
    """A TrainerCallback counting optimizer steps (all of them, across restarts)."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class _Count(TrainerCallback):
            steps = 0

            def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.steps += 1

        return _Count()


def texts(n: int, seed: int, *, long_row: int | None = None) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = 120 if i == long_row else rng.randint(6, 14)
        out.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return out


def classification_script(
    trainer_cls: type,
    model_dir: str,
    out: Path,
    *,
    rows: int = 48,
    long_row: int | None = None,
    per_device: int = 8,
    accumulation: int = 2,
    **trainer_kwargs: Any,
) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """An ordinary Trainer script: tokenize with datasets, pad per batch, train, save."""
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainingArguments,
        set_seed,
    )

    set_seed(0)  # the classification head is initialised when the model loads
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    sentences = texts(rows, seed=1, long_row=long_row)
    labels = [int("w7" in s.split() or "w13" in s.split()) for s in sentences]
    data = Dataset.from_dict({"text": sentences, "label": labels}).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=128), batched=True
    )
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    steps = CountSteps()
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[steps],
        **trainer_kwargs,
    )
    # the rows of every forward the model runs, failed and re-run ones included
    trainer.forwarded_rows = forwarded = []
    model.register_forward_pre_hook(
        lambda module, a, k: forwarded.append(int(k["input_ids"].shape[0])), with_kwargs=True
    )
    trainer.train()
    trainer.save_model(str(out / "model"))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, weights, steps


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def capped_stock_run_fails(script: Callable[..., Any], cap: int, *args: Any) -> None:
    """The stock trainer under the cap: it must run out of memory, or the test proves nothing."""
    from memfit.guard import memory_cap

    class CappedStock:
        def __new__(cls, *a: Any, **k: Any) -> Any:
            from transformers import Trainer

            trainer = Trainer(*a, **k)
            original = trainer.train

            def train(*ta: Any, **tk: Any) -> Any:
                with memory_cap(cap, torch.device("cpu")) as live:
                    assert live is not None
                    live.track(trainer.model)
                    return original(*ta, **tk)

            trainer.train = train
            return trainer

    with pytest.raises(torch.OutOfMemoryError, match=r"memfit memory cap: tried to hold"):
        script(CappedStock, *args)


def test_guarded_trainer_ends_with_the_uncapped_weights(
    tiny_classifier: str, tmp_path: Path
) -> None:
    from transformers import Trainer

    from memfit.integrations import GuardedTrainer

    _, reference, reference_steps = classification_script(Trainer, tiny_classifier, tmp_path / "a")
    # live tensor bytes at the script's micro-batch of 8, and at 4 (same samples per step)
    whole, *_ = classification_script(
        GuardedTrainer, tiny_classifier, tmp_path / "b", memory_cap=UNREACHABLE
    )
    half, *_ = classification_script(
        GuardedTrainer,
        tiny_classifier,
        tmp_path / "c",
        per_device=4,
        accumulation=4,
        memory_cap=UNREACHABLE,
    )
    assert whole.guard_events == [] and half.guard_events == []
    assert half.guard_cap.peak_bytes < whole.guard_cap.peak_bytes
    cap = (half.guard_cap.peak_bytes + whole.guard_cap.peak_bytes) // 2
    capped_stock_run_fails(classification_script, cap, tiny_classifier, tmp_path / "d")

    guarded, weights, steps = classification_script(
        GuardedTrainer, tiny_classifier, tmp_path / "e", memory_cap=cap
    )
    kinds = [e["type"] for e in guarded.guard_events]
    assert "oom" in kinds and "backoff" in kinds
    assert guarded.guard_micro_batch_size == 4
    # same optimizer steps, same effective batch, same weights
    assert steps.steps == reference_steps.steps == 3
    assert guarded.args.per_device_train_batch_size * guarded.args.gradient_accumulation_steps == 16
    assert max_difference(reference, weights) <= 1e-5
    events = (tmp_path / "e" / "memfit_events.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in events] == kinds
    # the saved model loads as it is
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "e" / "model"))


def test_an_oom_in_the_second_micro_batch_of_a_later_step_is_rerun(
    tiny_classifier: str, tmp_path: Path
) -> None:
    """One long row: only its micro-batch runs out of memory at 8, half-way through a run."""
    from transformers import Trainer

    from memfit.integrations import GuardedTrainer

    # row 37 lands in the second micro-batch of step 2 with this data order (seed 3): the
    # re-run must redo the step's first micro-batch too
    long_row = 37
    _, reference, _ = classification_script(
        Trainer, tiny_classifier, tmp_path / "a", long_row=long_row
    )
    short, *_ = classification_script(
        GuardedTrainer, tiny_classifier, tmp_path / "b", memory_cap=UNREACHABLE
    )
    long, *_ = classification_script(
        GuardedTrainer, tiny_classifier, tmp_path / "c", long_row=long_row, memory_cap=UNREACHABLE
    )
    assert long.guard_cap.peak_bytes > short.guard_cap.peak_bytes
    cap = (short.guard_cap.peak_bytes + long.guard_cap.peak_bytes) // 2
    guarded, weights, steps = classification_script(
        GuardedTrainer, tiny_classifier, tmp_path / "d", long_row=long_row, memory_cap=cap
    )
    ooms = [e for e in guarded.guard_events if e["type"] == "oom"]
    assert [e["step"] for e in ooms] == [2]
    # step 1 at 8 + 8; step 2: 8, then 8 that fails; the probe of the loss's reduction (two
    # one-row forwards without a graph); step 2 again from its start at 4 + 4, 4 + 4; step 3
    assert guarded.forwarded_rows == [8, 8, 8, 8, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4]
    assert steps.steps == 3
    assert max_difference(reference, weights) <= 1e-5


def st_script(
    trainer_cls: type,
    model_dir: str,
    out: Path,
    *,
    per_device: int = 8,
    **trainer_kwargs: Any,
) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """An ordinary sentence-transformers script: (anchor, positive) pairs, in-batch negatives."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    from memfit.integrations.sentence_transformers import losses_module

    torch.manual_seed(0)
    model = SentenceTransformer(model_dir, device="cpu")
    anchors = texts(32, seed=4)
    positives = [
        " ".join(a.split()[:5] + texts(1, seed=i)[0].split()[:4]) for i, a in enumerate(anchors)
    ]
    data = Dataset.from_dict({"anchor": anchors, "positive": positives})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    loss = losses_module().MultipleNegativesRankingLoss(model)
    steps = CountSteps()
    trainer = trainer_cls(
        model=model, args=args, train_dataset=data, loss=loss, callbacks=[steps], **trainer_kwargs
    )
    trainer.train()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, weights, steps


def test_guarded_sentence_transformer_trainer_switches_to_gradcache(
    tiny_classifier: str, tmp_path: Path
) -> None:
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformerTrainer

    from memfit.integrations import GuardedSentenceTransformerTrainer as Guarded

    _, reference, reference_steps = st_script(
        SentenceTransformerTrainer, tiny_classifier, tmp_path / "a"
    )
    whole, *_ = st_script(Guarded, tiny_classifier, tmp_path / "b", memory_cap=UNREACHABLE)

    class HalfCached(Guarded):  # type: ignore[misc,valid-type]
        """Measures the peak of the cached loss at a mini-batch of 4 from the first step."""

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.guard_mini_batch_size = 4

    half, *_ = st_script(HalfCached, tiny_classifier, tmp_path / "c", memory_cap=UNREACHABLE)
    assert half.guard_cap.peak_bytes < whole.guard_cap.peak_bytes
    cap = (half.guard_cap.peak_bytes + whole.guard_cap.peak_bytes) // 2

    guarded, weights, steps = st_script(Guarded, tiny_classifier, tmp_path / "d", memory_cap=cap)
    backoffs = [e for e in guarded.guard_events if e["type"] == "backoff"]
    assert backoffs and backoffs[0]["loss"] == "cached MultipleNegativesRankingLoss"
    assert guarded.guard_mini_batch_size == 4
    assert steps.steps == reference_steps.steps == 2
    # GradCache embeds mini-batches trimmed to their own padding: float32 rounding differs
    assert max_difference(reference, weights) <= 1e-5


def test_the_after_examples_run_under_a_cap_and_match_the_before_examples(
    tiny_classifier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each example pair: the before script without a cap, the after script (the same but for
    one import) under MEMFIT_MEMORY_CAP set below its peak: it backs off, same weights."""
    pytest.importorskip("sentence_transformers")
    for name in ("trainer", "sentence_transformers"):
        before = runpy.run_path(str(EXAMPLES / f"{name}_before.py"), run_name="example")["main"]
        after = runpy.run_path(str(EXAMPLES / f"{name}_after.py"), run_name="example")["main"]
        argv = ["--model", tiny_classifier, "--epochs", "1", "--output-dir"]
        monkeypatch.delenv("MEMFIT_MEMORY_CAP", raising=False)
        plain = before([*argv, str(tmp_path / f"{name}-before")])
        monkeypatch.setenv("MEMFIT_MEMORY_CAP", UNREACHABLE)
        measured = after([*argv, str(tmp_path / f"{name}-measured")])
        assert measured.guard_events == []
        # below the peak of the whole micro-batch: the guard must back off at least once
        monkeypatch.setenv("MEMFIT_MEMORY_CAP", str(int(measured.guard_cap.peak_bytes * 0.9)))
        guarded = after([*argv, str(tmp_path / f"{name}-after")])
        assert [e["type"] for e in guarded.guard_events][:2] == ["oom", "backoff"]
        assert (tmp_path / f"{name}-after" / "model").is_dir()
        weights = {k: v.detach() for k, v in guarded.model.state_dict().items()}
        expected = {k: v.detach() for k, v in plain.model.state_dict().items()}
        assert max_difference(expected, weights) <= 1e-5
