"""apply_plan: memfit's plan written into TrainingArguments, effective batch kept; the errors
name the keyword to change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainingArguments

import memfit.plan
from memfit.errors import NothingFitsError, UsageError
from memfit.integrations import GuardedTrainer, apply_plan
from memfit.plan.planner import Candidate, Levers, Plan


def arguments(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        use_cpu=True,
        report_to="none",
    )
    return TrainingArguments(**(options | overrides))


def fake_plan(
    monkeypatch: pytest.MonkeyPatch,
    *,
    micro_batch_size: int = 8,
    accumulation: int = 4,
    precision: str = "bf16",
    checkpointing: bool = True,
    optimizer: str = "adamw",
    loss: str = "cross-entropy",
    mini_batch_size: int | None = None,
    fits: bool = True,
) -> list[dict[str, Any]]:
    """Replace the planner by one that answers this plan; returns the calls it got."""
    calls: list[dict[str, Any]] = []

    def plan(model: str, **kwargs: Any) -> Plan:
        calls.append({"model": model, **kwargs})
        assert (Path(model) / "config.json").is_file() or not Path(model).exists()
        chosen = Candidate(
            knobs=Levers(precision, checkpointing, optimizer, kwargs["seq_len"], 0),
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=accumulation,
            world_size=1,
            loss=loss,
            mini_batch_size=mini_batch_size,
            predicted_peak_bytes=7 << 30,
            predicted_samples_per_second=10.0,
        )
        return Plan(
            fits=fits,
            budget_bytes=8 << 30 if fits else 3 << 20,
            predicted_peak_bytes=7 << 30 if fits else None,
            min_required_bytes=1 << 30,
            chosen=chosen if fits else None,
            alternatives=[],
            explanation=[],
            suggestions=["A GPU with more memory (--gpu t4)."],
        )

    monkeypatch.setattr(memfit.plan, "plan", plan)
    return calls


def test_the_plan_is_written_into_a_copy_of_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    calls = fake_plan(monkeypatch)
    args = arguments(tmp_path)
    planned = apply_plan(args, bert_classifier(), seq_len=32, gpu_memory="8GiB", precision="bf16")
    new = planned.args
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (8, 4)
    assert new.bf16 and not new.fp16 and new.activation_checkpointing
    # what TrainingArguments derives from bf16 is derived again (accelerate reads it)
    assert new.mixed_precision == "bf16"
    assert args.per_device_train_batch_size == 32 and not args.bf16  # the original is untouched
    assert planned.changes == [
        "per_device_train_batch_size 32 → 8",
        "gradient_accumulation_steps 1 → 4",
        "bf16 False → True",
        "activation_checkpointing False → True",
    ]
    assert str(planned).startswith("memfit plan applied: per_device_train_batch_size 32 → 8")
    # the model object: its task and labels read from it, its config written for the planner
    [call] = calls
    assert call["task"] == "classification" and call["num_labels"] == 3
    assert call["effective_batch_size"] == 32 and call["optimizer"] == "adamw"
    assert call["precision"] == "bf16" and call["gpu_memory"] == "8GiB"


def test_on_the_cpu_the_plan_is_pinned_to_fp32_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    calls = fake_plan(monkeypatch, precision="fp32", checkpointing=False, optimizer="sgd")
    planned = apply_plan(
        arguments(tmp_path, optim="sgd"), bert_classifier(), seq_len=64, gpu_memory="1GiB"
    )
    assert calls[0]["precision"] == "fp32" and calls[0]["optimizer"] == "sgd"
    assert not planned.args.bf16 and not planned.args.fp16


def test_a_cached_loss_plan_takes_the_whole_batch_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_plan(
        monkeypatch, micro_batch_size=32, accumulation=1, loss="cached-mnrl", mini_batch_size=4
    )
    planned = apply_plan(
        arguments(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2),
        "all-MiniLM-L6-v2",
        task="sentence-embedding",
        seq_len=128,
        gpu_memory="1GiB",
    )
    assert planned.args.per_device_train_batch_size == 32
    assert planned.args.gradient_accumulation_steps == 1
    assert (planned.loss, planned.mini_batch_size) == ("cached-mnrl", 4)


def test_nothing_fits_says_what_would_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    fake_plan(monkeypatch, fits=False)
    with pytest.raises(NothingFitsError, match=r"nothing fits in 3\.00 MiB .* \(gpu t4\)"):
        apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32, gpu_memory="3MiB")


def test_lora_and_truncation_are_not_training_arguments(
    tmp_path: Path, bert_classifier: Callable
) -> None:
    with pytest.raises(UsageError, match=r"allow: lora change the model or the tokenizer"):
        apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32, allow=["lora"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for this machine's GPU")
def test_no_budget_on_a_machine_without_a_gpu_names_the_keywords(
    tmp_path: Path, bert_classifier: Callable
) -> None:
    with pytest.raises(UsageError, match=r"no GPU on this machine .* pass gpu_memory='16GiB'"):
        apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32)


def test_planner_errors_name_keywords_not_flags(tmp_path: Path, bert_classifier: Callable) -> None:
    with pytest.raises(UsageError, match=r"apply_plan: seq_len: must be a whole number ≥ 1, got 0"):
        apply_plan(arguments(tmp_path), bert_classifier(), seq_len=0, gpu_memory="1GiB")


def test_messages_about_an_in_memory_model_name_its_class(
    tmp_path: Path, bert_classifier: Callable
) -> None:
    with pytest.raises(
        UsageError,
        match=r"seq_len: 100 is beyond the 64 positions the BertForSequenceClassification can use",
    ):
        apply_plan(arguments(tmp_path), bert_classifier(), seq_len=100, gpu_memory="1GiB")


def test_a_model_whose_task_cannot_be_told_asks_for_it(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UsageError, match=r"task: cannot tell the task of BertModel; pass task="):
        apply_plan(arguments(tmp_path), model, seq_len=16, gpu_memory="1GiB")


def test_the_trainer_applies_the_plan_before_it_reads_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    fake_plan(monkeypatch, precision="fp32", checkpointing=False)
    trainer = GuardedTrainer(
        model=bert_classifier(),
        args=arguments(tmp_path),
        memfit_plan={"seq_len": 64, "gpu_memory": "1GiB"},
    )
    assert trainer.args.per_device_train_batch_size == 8
    assert trainer.args.gradient_accumulation_steps == 4
    assert trainer.memfit_plan is not None and trainer.memfit_plan.args is trainer.args
    with pytest.raises(UsageError, match=r"memfit_plan: seq_len: the plan needs"):
        GuardedTrainer(model=bert_classifier(), args=arguments(tmp_path), memfit_plan=True)


@pytest.mark.slow
def test_a_real_plan_keeps_the_effective_batch(tmp_path: Path, bert_classifier: Callable) -> None:
    """The planner itself (traces the tiny model): its answer lands in the arguments."""
    args = arguments(tmp_path, per_device_train_batch_size=16, optim="sgd")
    planned = apply_plan(args, bert_classifier(), seq_len=32, gpu_memory="2GiB")
    settings = planned.plan.plan
    assert planned.plan.fits and settings["precision"] == "fp32"
    assert planned.args.per_device_train_batch_size == settings["micro_batch_size"]
    assert planned.args.gradient_accumulation_steps == settings["gradient_accumulation_steps"]
    effective = planned.args.per_device_train_batch_size * planned.args.gradient_accumulation_steps
    assert effective == 16
