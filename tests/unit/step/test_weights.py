"""memfit.step.weights: the dtype each weight of the step is held in, for the estimator's step
and memfit train alike."""

from __future__ import annotations

import pytest
import torch
import transformers

from memfit.step import weights


def _llama(dtype: str | None = "bfloat16", **extra: object) -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        **extra,
    )
    config.dtype = dtype
    return config


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (None, torch.float32),
    ],
)
def test_the_checkpoint_dtype_is_the_configs_and_fp32_when_it_names_none(
    stored: object, expected: torch.dtype
) -> None:
    config = _llama()
    config.dtype = stored
    assert weights.checkpoint_dtype(config) == expected


@pytest.mark.parametrize(
    ("knob", "frozen", "trainable"),
    [
        (None, torch.bfloat16, torch.float32),
        ("auto", torch.bfloat16, torch.float32),
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16, torch.float16),
    ],
)
def test_frozen_weights_take_the_checkpoints_dtype_and_trained_ones_fp32_unless_pure(
    knob: str | None, frozen: torch.dtype, trainable: torch.dtype
) -> None:
    assert weights.weight_dtypes(_llama(), knob) == (frozen, trainable)
    assert weights.load_dtype(_llama(), knob, frozen_base=True) == frozen
    assert weights.load_dtype(_llama(), knob, frozen_base=False) == trainable


def test_a_trained_head_over_a_bf16_body_runs_without_autocast_and_keeps_fp32() -> None:
    """A LoRA classifier over a bf16 base: the adapters and the head are trained in fp32, the
    body is held in bf16; with no autocast (fp32 runs) the head's input is cast to its dtype."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = _llama()
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, dtype=torch.bfloat16
    )
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj", "v_proj"]),
    )
    frozen, trainable = weights.weight_dtypes(config, "auto")
    weights.place_weights(model, frozen, trainable, cast_inputs=True)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    ids = torch.randint(1, 64, (2, 8))
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_without_the_input_cast_the_same_head_meets_two_dtypes() -> None:
    """What the pre-hook is for: the same model with cast_inputs=False fails without autocast."""
    peft = pytest.importorskip("peft")
    config = _llama()
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, dtype=torch.bfloat16
    )
    model = peft.get_peft_model(
        model, peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"])
    )
    weights.place_weights(model, torch.bfloat16, torch.float32, cast_inputs=False)
    with pytest.raises(RuntimeError, match="dtype"):
        model(input_ids=torch.randint(1, 64, (2, 8)))


def test_full_fine_tuning_is_one_dtype_and_gets_no_hooks() -> None:
    model = transformers.AutoModelForCausalLM.from_config(_llama(), dtype=torch.bfloat16)
    weights.place_weights(model, torch.bfloat16, torch.float32, cast_inputs=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(m._forward_pre_hooks for m in model.modules())
