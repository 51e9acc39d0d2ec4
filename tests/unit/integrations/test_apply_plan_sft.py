"""apply_plan onto TRL's SFTConfig: the job it prices (``max_length`` as the sequence length,
``packing``/``padding_free``) and the fields it writes (micro-batch, accumulation, checkpointing,
``activation_offloading``, ``model_init_kwargs``; never Liger's fused loss, which SFTTrainer refuses:
the loss priced is TRL's own chunked head).
GuardedSFTTrainer's ``memfit_plan`` applies it before SFTTrainer reads the config. The planner
is a stand-in that answers one configuration and records what it was asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import memfit.plan
from memfit.errors import UsageError
from memfit.integrations import apply_plan
from memfit.integrations import plan as integration
from memfit.plan.planner import Candidate, Levers, Plan


def sft_config(tmp_path: Path, **overrides: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
    )
    return SFTConfig(**(options | overrides))


def answer(monkeypatch: pytest.MonkeyPatch, **levers: Any) -> list[dict[str, Any]]:
    """The planner answers micro-batch 4 × 4 with these lever values; returns its calls."""
    calls: list[dict[str, Any]] = []

    def plan(model: str, **kwargs: Any) -> Plan:
        calls.append({"model": model, **kwargs})
        values = {
            "precision": "fp32",
            "gradient_checkpointing": False,
            "optimizer": "adamw",
            "max_seq_len": kwargs["seq_len"],
            "lora_rank": 0,
            **levers,
        }
        chosen = Candidate(Levers.of(values), 4, 4, 1, "cross-entropy", None, 1 << 30, 10.0)
        return Plan(True, 8 << 30, 1 << 30, 1 << 30, chosen, [], [], [])

    monkeypatch.setattr(memfit.plan, "plan", plan)
    return calls


@pytest.fixture(autouse=True)
def no_liger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integration, "_liger_installed", lambda: False)


def test_the_plan_writes_sft_configs_own_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = answer(
        monkeypatch, gradient_checkpointing=True, activation_offloading=True, weights_dtype="bf16"
    )
    args = sft_config(tmp_path, model_init_kwargs={"revision": "main"})
    # no task: an SFTConfig trains a causal LM
    planned = apply_plan(args, "gpt2", gpu_memory="8GiB", allow=["pure-16bit"])
    new = planned.args
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (4, 4)
    assert new.activation_checkpointing is True
    assert new.activation_offloading is True
    assert new.model_init_kwargs == {"revision": "main", "dtype": "bfloat16"}
    assert type(new).__name__ == "SFTConfig" and new.max_length == args.max_length
    # the sequence length the plan priced is the config's max_length (1024 by default)
    assert calls[0]["seq_len"] == 1024
    assert calls[0]["task"] == "causal-lm"
    # the config's activation offloading off leaves the plan free to choose it
    assert calls[0]["activation_offloading"] is None
    assert "activation_offloading False → True" in planned.changes


@pytest.mark.parametrize(
    ("settings", "priced"),
    [
        ({}, {}),
        ({"packing": True}, {"packing": True, "packing_strategy": "bfd"}),
        (
            {"packing": True, "packing_strategy": "wrapped"},
            {"packing": True, "packing_strategy": "wrapped"},
        ),
        ({"padding_free": True, "max_length": 256}, {"packing": True, "packing_strategy": "bfd"}),
    ],
)
def test_packing_and_padding_free_are_priced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict, priced: dict
) -> None:
    calls = answer(monkeypatch)
    apply_plan(sft_config(tmp_path, **settings), "gpt2", task="causal-lm", seq_len=128,
               gpu_memory="8GiB")  # fmt: skip
    asked = {k: calls[0][k] for k in ("packing", "packing_strategy") if k in calls[0]}
    assert asked == priced
    assert calls[0]["seq_len"] == 128  # what the call names wins over max_length


def test_an_sft_config_never_gets_ligers_fused_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(integration, "_liger_installed", lambda: True)
    monkeypatch.setattr(integration, "_on_cuda", lambda args: True)
    calls = answer(monkeypatch, cross_entropy="fused-linear")  # a planner that would choose it
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    planned = apply_plan(sft_config(tmp_path), LlamaForCausalLM(config), gpu_memory="8GiB")
    # SFTTrainer raises on Liger's fused loss: never written; the plan prices TRL's own head
    assert planned.args.use_liger_kernel is False
    assert calls[0]["cross_entropy"] == "trl-chunked"


def test_an_sft_config_without_max_length_asks_for_seq_len(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer(monkeypatch)
    args = sft_config(tmp_path, padding_free=True, max_length=None)
    with pytest.raises(UsageError, match=r"^apply_plan: seq_len: .*max_length is None.*seq_len="):
        apply_plan(args, "gpt2", task="causal-lm", gpu_memory="8GiB")


def test_training_arguments_still_need_seq_len(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import TrainingArguments

    answer(monkeypatch)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(UsageError, match=r"TrainingArguments says no sequence length"):
        apply_plan(args, "gpt2", task="causal-lm", gpu_memory="8GiB")


def test_the_guarded_sft_trainer_plans_with_its_configs_max_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.integrations import GuardedSFTTrainer

    calls = answer(monkeypatch, gradient_checkpointing=True)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    trainer = GuardedSFTTrainer(
        model=LlamaForCausalLM(config),
        args=sft_config(tmp_path, max_length=48),
        train_dataset=_dataset(),
        processing_class=_tokenizer(tmp_path),
        memfit_plan={"gpu_memory": "8GiB"},
    )
    assert calls[0]["seq_len"] == 48
    assert trainer.args.per_device_train_batch_size == 4
    assert trainer.args.activation_checkpointing is True
    assert trainer.memfit_plan is not None and trainer.memfit_plan.args is trainer.args


def _dataset() -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "a b", "completion": " c"}] * 4)


def _tokenizer(tmp_path: Path) -> Any:
    from tiny_models import SENTENCES, save_tiny_llama

    return save_tiny_llama(tmp_path / "llama", [*SENTENCES, "a b c"])
