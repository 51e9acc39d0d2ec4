"""The estimate prices ``--weights-dtype`` (the dtype frozen and trained weights are held in) and
``--cross-entropy fused-linear`` (the loss computed chunk by chunk, never the whole logits)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memfit.estimate import estimate, workload
from memfit.estimate.workload import StepSpec

VOCAB = 32000
LM = {"task": "causal-lm", "device": "cpu"}


def llama_config(*, dtype: str | None = "bfloat16", vocab: int = 2048) -> Any:
    from transformers import LlamaConfig

    extra = {"dtype": dtype} if dtype else {}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama whose checkpoint is bf16 (config.dtype), as today's decoders ship."""
    folder = tmp_path_factory.mktemp("bf16-llama")
    llama_config().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def wide_vocab_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An fp32 Llama with a 32000-token head: its logits are the step's largest tensors."""
    folder = tmp_path_factory.mktemp("wide-vocab-llama")
    llama_config(dtype=None, vocab=VOCAB).save_pretrained(folder)
    return str(folder)


def lora(model: str, **knobs: Any) -> Any:
    return estimate(model, batch_size=2, seq_len=64, lora_rank=8, **LM, **knobs)


@pytest.mark.slow  # traces a model (seconds)
def test_a_lora_base_of_a_bf16_checkpoint_is_held_in_two_bytes_per_weight(bf16_llama: str) -> None:
    e = lora(bf16_llama)
    total, trainable = e.details["num_parameters"], e.details["trainable_parameters"]
    frozen = total - trainable
    assert frozen > 10 * trainable
    # the frozen base in bf16, the adapters in fp32 (peft's, over a 16-bit base)
    assert e.breakdown["parameters"] == 2 * frozen + 4 * trainable
    assert e.details["weights"] == {"frozen": "bf16", "trainable": "fp32", "checkpoint": "bf16"}


@pytest.mark.slow  # traces a model (seconds)
def test_weights_dtype_fp32_holds_every_weight_in_four_bytes_as_before(bf16_llama: str) -> None:
    auto, fp32 = lora(bf16_llama), lora(bf16_llama, weights_dtype="fp32")
    assert fp32.breakdown["parameters"] == 4 * fp32.details["num_parameters"]
    assert fp32.details["weights"]["frozen"] == "fp32"
    # a trace of its own (the knob is part of the trace's key), and a larger step
    assert fp32.total_bytes > auto.total_bytes


@pytest.mark.slow  # traces a model (seconds)
def test_pure_bf16_holds_weights_gradients_and_adamw_state_in_bf16(bf16_llama: str) -> None:
    kw: dict[str, Any] = {"batch_size": 2, "seq_len": 64, "precision": "bf16", **LM}
    mixed = estimate(bf16_llama, **kw)
    pure = estimate(bf16_llama, weights_dtype="bf16", **kw)
    n = pure.details["num_parameters"]
    # full fine-tuning under auto: fp32 master weights whatever the checkpoint's dtype
    assert mixed.breakdown["parameters"] == 4 * n
    assert mixed.details["weights"] == {"frozen": None, "trainable": "fp32", "checkpoint": "bf16"}
    assert pure.breakdown["parameters"] == 2 * n
    assert pure.details["weights"] == {"frozen": None, "trainable": "bf16", "checkpoint": "bf16"}
    # AdamW's two moments in bf16 (beside a few bytes of step counters per tensor)
    assert 4 * n <= pure.breakdown["optimizer_state"] < 4 * n + 4096
    assert mixed.breakdown["optimizer_state"] >= 8 * n
    model = workload.build_model(
        llama_config(), StepSpec(task="causal-lm", precision="bf16", weights_dtype="bf16")
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.slow  # traces a model (seconds)
def test_fused_linear_never_holds_the_logits(wide_vocab_llama: str) -> None:
    batch, seq = 4, 128
    # LoRA: no gradient of the embeddings or the head among the step's tensors
    kw: dict[str, Any] = {"batch_size": batch, "seq_len": seq, "lora_rank": 8, **LM}
    standard = estimate(wide_vocab_llama, **kw)
    fused = estimate(wide_vocab_llama, cross_entropy="fused-linear", **kw)
    logits = batch * seq * VOCAB * 4

    def forward_backward(e: Any) -> int:  # their peak above the weights and optimizer state
        resident = e.breakdown["parameters"] + e.breakdown["optimizer_state"]
        peaks = e.details["phase_peak_bytes"]
        return int(max(peaks["forward"], peaks["backward"]) - resident)

    assert forward_backward(standard) > logits
    # one chunk of logits at a time, the head's gradient computed in the forward
    assert forward_backward(fused) < logits / 10
    ce = fused.details["cross_entropy"]
    # Liger's rule: rows / ceil(V / H) rounded up to a power of two
    assert ce["chunk_rows"] == 2 and ce["chunks"] == batch * seq // 2
    assert ce["kind"] == "fused-linear" and "memfit's torch implementation" in ce["implementation"]
    assert "cross_entropy" not in standard.details


def test_the_step_builds_a_lora_base_in_the_checkpoint_dtype_and_adapters_in_fp32() -> None:
    pytest.importorskip("peft")
    for weights_dtype, frozen, trained in (
        ("auto", torch.bfloat16, torch.float32),
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ):
        spec = StepSpec(task="causal-lm", lora_rank=8, weights_dtype=weights_dtype)
        with torch.device("meta"):
            model = workload.build_model(llama_config(), spec)
        dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
        assert dtypes == {(False, frozen), (True, trained)}


def test_qlora_keeps_its_unquantized_layers_in_the_checkpoint_dtype() -> None:
    pytest.importorskip("peft")
    spec = StepSpec(task="causal-lm", precision="bf16", lora_rank=8, quantization="nf4")
    for weights_dtype, frozen in (("auto", torch.bfloat16), ("fp32", torch.float32)):
        with torch.device("meta"):
            model = workload.build_model(
                llama_config(), StepSpec(**{**spec.__dict__, "weights_dtype": weights_dtype})
            )
        named = dict(model.named_parameters())
        embeddings = next(p for n, p in named.items() if n.endswith("embed_tokens.weight"))
        head = next(p for n, p in named.items() if n.endswith("lm_head.weight"))
        norm = next(p for n, p in named.items() if n.endswith("model.norm.weight"))
        assert embeddings.dtype == head.dtype == norm.dtype == frozen
        adapters = {p.dtype for n, p in named.items() if "lora_" in n}
        assert adapters == {torch.float32}


@pytest.mark.slow  # traces a model (seconds)
def test_fsdp_shards_keep_a_bf16_base_in_two_bytes(bf16_llama: str) -> None:
    e = lora(bf16_llama, world_size=2, sharding="fsdp")
    total, trainable = e.details["num_parameters"], e.details["trainable_parameters"]
    held = e.details["model_state"]["parameters_bytes"]
    # each rank holds half of every tensor (rows padded): 2 bytes per frozen weight
    assert held < 2 * (total - trainable) / 2 + 4 * trainable + 4096
    assert held >= (2 * (total - trainable) + 4 * trainable) / 2


def test_cuda_autocast_casts_an_fp32_weight_but_not_a_bf16_one() -> None:
    from memfit.estimate.autocast_emulation import CudaAutocast

    fp32 = torch.nn.Parameter(torch.ones(4, 4))
    bf16 = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    with CudaAutocast(torch.bfloat16) as autocast:
        # a weight already in the autocast dtype is used as it is: no copy, nothing cached
        assert autocast.cached_cast(torch.bfloat16, bf16) is bf16
        assert autocast.cache_size == 0
        copy = autocast.cached_cast(torch.bfloat16, fp32)
        assert copy is not fp32 and copy.dtype == torch.bfloat16
        assert autocast.cached_copy(fp32) is copy
