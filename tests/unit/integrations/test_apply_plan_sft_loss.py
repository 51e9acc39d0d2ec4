"""apply_plan onto TRL's SFTConfig never writes Liger's fused loss: trl 1.16's SFTTrainer raises
ValueError on ``liger_kernel_config={"fused_linear_cross_entropy": True}`` and computes its own
chunked loss (``add_fused_lm_head``), so the plan prices TRL's loss (``trl-chunked``), never Liger's, even where
Liger's would run (liger-kernel installed, a CUDA GPU, a Llama). The real planner runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from memfit.errors import UsageError
from memfit.integrations import apply_plan
from memfit.integrations import plan as integration


def llama_lm() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # a 32k vocabulary over a 16-wide body: the loss is most of the step, so a plan chooses
    # Liger's fused loss where it may
    config = LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def sft_config(tmp_path: Path, **overrides: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        use_cpu=True,
        bf16=False,
        max_length=512,
        report_to="none",
    )
    return SFTConfig(**(options | overrides))


# where a plan for a Trainer chooses Liger's fused loss (the standard one fits at micro-batch 1)
BUDGET = "1200MiB"


@pytest.fixture
def liger_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """liger-kernel installed and the arguments on a CUDA GPU: where a Trainer runs Liger's loss."""
    monkeypatch.setattr(integration, "_liger_installed", lambda: True)
    monkeypatch.setattr(integration, "_on_cuda", lambda args: True)


@pytest.mark.slow  # the real planner traces the 32k-vocabulary Llama (about 6 s)
@pytest.mark.usefixtures("liger_on_a_gpu")
def test_an_sft_config_never_gets_ligers_fused_loss(tmp_path: Path) -> None:
    planned = apply_plan(sft_config(tmp_path), llama_lm(), gpu_memory=BUDGET)
    liger = planned.args.liger_kernel_config or {}
    assert not liger.get("fused_linear_cross_entropy")
    assert planned.args.use_liger_kernel is False
    # priced with the loss SFTTrainer computes: its fused LM head
    assert planned.plan.chosen.settings().get("cross_entropy") == "trl-chunked"


@pytest.mark.slow  # the real planner traces the 32k-vocabulary Llama (about 6 s)
@pytest.mark.usefixtures("liger_on_a_gpu")
def test_an_sft_config_with_liger_on_is_not_priced_with_ligers_loss(tmp_path: Path) -> None:
    # SFTTrainer turns Liger's fused loss off (and applies only its layer kernels)
    args = sft_config(tmp_path, use_liger_kernel=True)
    planned = apply_plan(args, llama_lm(), gpu_memory=BUDGET)
    assert planned.plan.chosen.settings().get("cross_entropy") != "fused-linear"
    assert not (planned.args.liger_kernel_config or {}).get("fused_linear_cross_entropy")


def test_fused_linear_pinned_on_an_sft_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^apply_plan: cross_entropy: fused-linear .*SFTTrainer"):
        apply_plan(
            sft_config(tmp_path), llama_lm(), gpu_memory=BUDGET, cross_entropy="fused-linear"
        )


@pytest.mark.slow  # the real planner traces the 32k-vocabulary Llama (about 6 s)
@pytest.mark.usefixtures("liger_on_a_gpu")
def test_sft_trainer_accepts_the_planned_config(tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from tiny_models import save_tiny_llama

    save_tiny_llama(tmp_path / "llama", ["a b c d e", "b c d e f"])
    model = llama_lm()
    planned = apply_plan(sft_config(tmp_path), model, gpu_memory=BUDGET)
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5]] * 4})
    # SFTTrainer.__init__ raises ValueError on Liger's fused loss; here it builds
    trainer = SFTTrainer(
        model=model,
        args=planned.args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(tmp_path / "llama"),
    )
    assert trainer.args.liger_kernel_config is None or not trainer.args.liger_kernel_config.get(
        "fused_linear_cross_entropy"
    )
