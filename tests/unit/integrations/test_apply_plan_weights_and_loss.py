"""apply_plan carries the weights' dtype and the causal-LM loss: Liger's fused linear
cross-entropy through ``use_liger_kernel`` (only the loss patched) where it runs (liger-kernel
installed, a CUDA GPU, a model type Liger patches), pure bf16 through TRL's ``model_init_kwargs``
for a named model, said for a loaded one. The planner is a stand-in that answers one
configuration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainingArguments

import memfit.plan
from memfit.errors import UsageError
from memfit.integrations import apply_plan
from memfit.integrations import plan as integration
from memfit.plan.planner import Candidate, Levers, Plan


@dataclass
class SFTLikeArguments(TrainingArguments):
    """TRL's configs' field for from_pretrained's keywords (their trainer loads a named model)."""

    model_init_kwargs: dict[str, Any] | None = None


def arguments(tmp_path: Path, cls: type = TrainingArguments, **overrides: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        use_cpu=True,
        report_to="none",
    )
    return cls(**(options | overrides))


def answer(monkeypatch: pytest.MonkeyPatch, **levers: Any) -> list[dict[str, Any]]:
    """The planner answers fp32 at micro-batch 8 with these other lever values; returns the
    calls it got."""
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
        chosen = Candidate(Levers.of(values), 8, 1, 1, "cross-entropy", None, 1 << 30, 10.0)
        return Plan(True, 8 << 30, 1 << 30, 1 << 30, chosen, [], [], [])

    monkeypatch.setattr(memfit.plan, "plan", plan)
    return calls


def llama_lm() -> Any:
    """A tiny Llama (a model type Liger Kernel patches), built in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """liger-kernel installed and the arguments on a CUDA GPU: where Liger's loss runs."""
    monkeypatch.setattr(integration, "_liger_installed", lambda: True)
    monkeypatch.setattr(integration, "_on_cuda", lambda args: True)


def test_fused_linear_turns_on_liger_for_the_loss_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_a_gpu(monkeypatch)
    calls = answer(monkeypatch, cross_entropy="fused-linear")
    planned = apply_plan(arguments(tmp_path), llama_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] is None  # the plan chooses
    assert planned.args.use_liger_kernel is True
    config = planned.args.liger_kernel_config
    assert config["fused_linear_cross_entropy"] is True and not config["cross_entropy"]
    assert not any(config[k] for k in ("rope", "rms_norm", "swiglu"))
    assert "use_liger_kernel False → True" in planned.changes
    assert any("fused linear cross-entropy only" in c for c in planned.changes)


def test_without_liger_kernel_the_plan_keeps_the_standard_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2_lm: Callable
) -> None:
    monkeypatch.setattr(integration, "_liger_installed", lambda: False)
    calls = answer(monkeypatch)
    apply_plan(arguments(tmp_path), gpt2_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] == "standard"


def test_arguments_with_liger_keep_their_own_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = answer(monkeypatch, cross_entropy="fused-linear")
    args = arguments(tmp_path, use_liger_kernel=True)
    planned = apply_plan(args, llama_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] == "fused-linear"
    assert planned.args.liger_kernel_config is None  # Liger's defaults, as the user set them
    assert not any("liger" in c for c in planned.changes)


def test_a_classifier_has_no_loss_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    calls = answer(monkeypatch)
    apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] is None


def test_a_model_objects_dtype_is_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bert_classifier: Callable
) -> None:
    calls = answer(monkeypatch)
    apply_plan(arguments(tmp_path), bert_classifier().to(torch.bfloat16), seq_len=32,
               gpu_memory="8GiB")  # fmt: skip
    apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32, gpu_memory="8GiB")
    apply_plan(arguments(tmp_path), bert_classifier(), seq_len=32, gpu_memory="8GiB",
               weights_dtype="auto")  # fmt: skip
    # every weight trained in fp32: fp32 master weights, as auto trains them
    assert [c["weights_dtype"] for c in calls] == ["bf16", "auto", "auto"]


def test_pure_bf16_of_a_named_model_needs_arguments_that_load_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"allow: pure-16bit change the model .*dtype=torch"):
        apply_plan(arguments(tmp_path), "gpt2", task="causal-lm", seq_len=32,
                   allow=["pure-16bit"])  # fmt: skip


def test_pure_bf16_goes_into_model_init_kwargs_for_a_named_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integration, "_liger_installed", lambda: False)
    answer(monkeypatch, weights_dtype="bf16")
    args = arguments(tmp_path, SFTLikeArguments, model_init_kwargs={"revision": "main"})
    planned = apply_plan(args, "gpt2", task="causal-lm", seq_len=32, gpu_memory="8GiB",
                         allow=["pure-16bit"])  # fmt: skip
    assert planned.args.model_init_kwargs == {"revision": "main", "dtype": "bfloat16"}
    assert args.model_init_kwargs == {"revision": "main"}  # the original is untouched
    assert any("model_init_kwargs dtype bfloat16 loads them so" in c for c in planned.changes)


@pytest.mark.parametrize("cls", [TrainingArguments, SFTLikeArguments])
def test_pure_bf16_of_a_loaded_model_is_said_not_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2_lm: Callable, cls: type
) -> None:
    """A loaded model's dtype is the caller's whatever the arguments: said in the changes (plain
    TrainingArguments are not refused for a loaded model, as they are for a name)."""
    monkeypatch.setattr(integration, "_liger_installed", lambda: False)
    answer(monkeypatch, weights_dtype="bf16")
    args = arguments(tmp_path, cls)
    planned = apply_plan(args, gpt2_lm(), seq_len=32, gpu_memory="8GiB", allow=["pure-16bit"])
    # TRL refuses model_init_kwargs for a model it did not load
    assert getattr(planned.args, "model_init_kwargs", None) is None
    assert any(
        c.startswith("load the model in bf16 yourself") and "dtype=torch.bfloat16" in c
        for c in planned.changes
    )


def test_the_plan_keeps_the_standard_loss_on_cpu_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # liger-kernel installed, but the arguments train on the CPU: Liger's kernels need CUDA
    monkeypatch.setattr(integration, "_liger_installed", lambda: True)
    calls = answer(monkeypatch)
    args = arguments(tmp_path)
    assert args.use_cpu and not integration._on_cuda(args)
    planned = apply_plan(args, llama_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] == "standard"
    assert not planned.args.use_liger_kernel


def test_the_plan_keeps_the_standard_loss_for_a_model_liger_does_not_patch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2_lm: Callable
) -> None:
    # GPT-2: the Trainer's use_liger_kernel patches nothing, the standard loss runs
    on_a_gpu(monkeypatch)
    calls = answer(monkeypatch)
    apply_plan(arguments(tmp_path), gpt2_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[0]["cross_entropy"] == "standard"
    # a model given by name: its config's type decides the same
    apply_plan(arguments(tmp_path), "gpt2", task="causal-lm", seq_len=32, gpu_memory="8GiB")
    assert calls[1]["cross_entropy"] == "standard"
    # and arguments that turn Liger on for it run the standard loss too
    args = arguments(tmp_path, use_liger_kernel=True)
    apply_plan(args, gpt2_lm(), seq_len=32, gpu_memory="8GiB")
    assert calls[2]["cross_entropy"] == "standard"


def test_liger_patches_the_types_of_its_table() -> None:
    from types import SimpleNamespace

    args = SimpleNamespace(use_liger_kernel=True, liger_kernel_config=None)
    for model_type in ("llama", "mistral", "qwen2", "gemma2", "phi3", "granite"):
        config = SimpleNamespace(model_type=model_type)
        assert integration.own_cross_entropy(args, config) == "fused-linear", model_type
    for model_type in ("gpt2", "bert", None):
        config = SimpleNamespace(model_type=model_type)
        assert integration.own_cross_entropy(args, config) == "standard", model_type


def test_the_trainers_step_knobs_say_no_fused_loss_for_a_model_liger_does_not_patch(
    tmp_path: Path, gpt2_lm: Callable
) -> None:
    from memfit.integrations.trainer import step_knobs

    args = arguments(tmp_path, use_liger_kernel=True)
    assert step_knobs(llama_lm(), args)["cross_entropy"] == "fused-linear"
    assert "cross_entropy" not in step_knobs(gpt2_lm(), args)


def test_apply_plan_and_the_trainer_read_a_models_dtype_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader: a frozen body over a trained fp32 head is ``auto`` when the body is held in
    the checkpoint's bf16, ``fp32`` when held in fp32; a model all in bf16 is ``bf16``."""
    from memfit.integrations.trainer import step_knobs

    calls = answer(monkeypatch)
    args = arguments(tmp_path)
    model = llama_lm()
    model.config.dtype = torch.bfloat16  # a bf16 checkpoint
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lm_head" in name)
    apply_plan(args, model, seq_len=32, gpu_memory="8GiB")
    assert calls[-1]["weights_dtype"] == step_knobs(model, args)["weights_dtype"] == "fp32"
    for name, parameter in model.named_parameters():
        if "lm_head" not in name:
            parameter.data = parameter.data.to(torch.bfloat16)
    apply_plan(args, model, seq_len=32, gpu_memory="8GiB")
    assert calls[-1]["weights_dtype"] == step_knobs(model, args)["weights_dtype"] == "auto"
    model.to(torch.bfloat16).requires_grad_(True)
    apply_plan(args, model, seq_len=32, gpu_memory="8GiB")
    assert calls[-1]["weights_dtype"] == step_knobs(model, args)["weights_dtype"] == "bf16"
