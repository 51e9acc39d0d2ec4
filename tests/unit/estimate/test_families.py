"""Today's architectures through every estimate knob.

Llama (GQA, RoPE, SwiGLU, RMSNorm, tied head), Qwen2 (sliding-window layers, untied), Mistral
(sliding window), Gemma-2 (alternating sliding/global layers, soft-capping), Phi-3 (fused
projections), ModernBERT (alternating local/global bidirectional attention), DeBERTa-v2
(disentangled attention): every task the family has a head for, with sdpa, eager and
flash_attention_2 (memfit's stand-in for the flash-attn package), as tiny random configs.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.cli import main
from memfit.errors import UsageError
from memfit.estimate import estimate, workload
from memfit.estimate import flash_attention_emulation as fa2
from memfit.estimate.attention import attention_run
from memfit.estimate.autocast_emulation import CudaAutocast
from memfit.estimate.fake_model import build_fake_model
from memfit.estimate.sdpa_emulation import CudaSdpa, SdpaBackend
from memfit.job import DEFAULT_LOSS

BF16 = torch.bfloat16
FP32 = torch.float32
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DECODER = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    intermediate_size=128,
    max_position_embeddings=256,
)
DECODERS = ("llama", "qwen2", "mistral", "gemma2", "phi3")
ENCODERS = ("modernbert", "deberta-v2")
FAMILIES = DECODERS + ENCODERS
TASKS = ("classification", "causal-lm", "sentence-embedding")


def family_config(family: str) -> Any:
    """A tiny config of the family, with the features its real checkpoints have."""
    import transformers as t

    if family == "llama":  # no pad token (the classifier takes eos), tied head
        return t.LlamaConfig(**_DECODER, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    if family == "qwen2":  # the layers from max_window_layers on use a sliding window
        return t.Qwen2Config(
            **_DECODER, use_sliding_window=True, sliding_window=32, max_window_layers=1
        )
    if family == "mistral":  # every layer slides
        return t.MistralConfig(**_DECODER, sliding_window=32, tie_word_embeddings=False)
    if family == "gemma2":  # sliding and global layers alternate; logits soft-capped
        return t.Gemma2Config(
            **_DECODER,
            head_dim=16,
            sliding_window=32,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return t.Phi3Config(**_DECODER, sliding_window=32, **_IDS)
    if family == "modernbert":  # local attention, global every third layer
        return t.ModernBertConfig(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=256,
            local_attention=32,
            global_attn_every_n_layers=3,
            cls_token_id=1,
            sep_token_id=2,
            **_IDS,
        )
    if family == "deberta-v2":  # DeBERTa-v3's relative positions
        return t.DebertaV2Config(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=256,
            relative_attention=True,
            position_buckets=64,
            pos_att_type=["p2c", "c2p"],
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            position_biased_input=False,
        )
    raise ValueError(family)


def tasks_of(family: str) -> tuple[str, ...]:
    """The tasks the family has a head for (encoders have no causal-LM head)."""
    return TASKS if family in DECODERS else ("classification", "sentence-embedding")


def attentions_of(family: str, device: str) -> tuple[str, ...]:
    """DeBERTa-v2 has no FlashAttention in transformers; FlashAttention never runs on the CPU."""
    if device == "cpu" or family == "deberta-v2":
        return ("sdpa", "eager")
    return ("sdpa", "eager", fa2.FLASH_ATTENTION_2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        family_config(family).save_pretrained(root / family)
        out[family] = str(root / family)
    return out


# ---------------------------------------------------------------------------------------------------
# LoRA targets, heads, attention choice
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["phi3", "modernbert", "llama", "gemma2", "deberta-v2"])
def test_lora_groups_find_every_layers_projections(family: str) -> None:
    config = family_config(family)
    with torch.device("meta"):
        model = workload.build_model(config, workload.StepSpec(task="classification"))
    layers = int(config.num_hidden_layers)
    paths = workload._adaptable_modules(model, workload.lora_head_modules(model))
    for group, names in workload.LORA_TARGETS[family].items():
        assert workload.lora_target_modules(model, "classification", [group]) == list(names)
        for name in names:
            found = sum(workload._lora_name_matches(p, name) for p in paths)
            # BERT-style output.dense is both the attention's and the MLP's output
            assert found == layers or (group == "mlp" and found == 2 * layers), (name, found)


def test_a_decoder_classifier_takes_eos_as_its_pad_token() -> None:
    spec = workload.StepSpec(task="classification")
    llama = family_config("llama")
    assert llama.pad_token_id is None
    assert workload._task_config(llama, spec).pad_token_id == 2
    llama.eos_token_id = [7, 8]  # Llama-3.1 lists several end tokens: the tokenizer's is the first
    assert workload._task_config(llama, spec).pad_token_id == 7
    assert workload._task_config(family_config("phi3"), spec).pad_token_id == 0


@pytest.mark.parametrize(
    ("family", "task", "requested", "runs"),
    [
        ("llama", "causal-lm", "sdpa", "sdpa"),
        # transformers has no SDPA for these: its default (no attention named) is eager
        ("gemma2", "causal-lm", "sdpa", "eager"),
        ("deberta-v2", "classification", "sdpa", "eager"),
        ("gemma2", "classification", "flash_attention_2", "flash_attention_2"),
        ("modernbert", "sentence-embedding", "flash_attention_2", "flash_attention_2"),
    ],
)
def test_the_attention_transformers_runs(family: str, task: str, requested: str, runs: str) -> None:
    spec = workload.StepSpec(task=task, attn_implementation=requested)
    config = family_config(family)
    assert attention_run(config, spec) == runs
    built = workload._task_config(config, spec)._attn_implementation
    assert built == (fa2.TRACE_NAME if runs == fa2.FLASH_ATTENTION_2 else runs)


def test_sdpa_where_transformers_has_none_is_estimated_as_eager(folders: dict[str, str]) -> None:
    knobs: dict[str, Any] = dict(task="causal-lm", batch_size=2, seq_len=32, precision="bf16")
    asked = estimate(folders["gemma2"], attn_implementation="sdpa", **knobs)
    eager = estimate(folders["gemma2"], attn_implementation="eager", **knobs)
    assert asked.spec.attn_implementation == "eager"
    assert asked.details["attn_implementation_run"] == "eager"
    assert "attn_implementation_run" not in eager.details
    assert asked.total_bytes == eager.total_bytes


def test_flash_attention_where_transformers_has_none_is_a_usage_error() -> None:
    spec = workload.StepSpec(task="classification", attn_implementation="flash_attention_2")
    with pytest.raises(UsageError, match=r"--attn-implementation flash_attention_2: .*deberta-v2"):
        attention_run(family_config("deberta-v2"), spec)


def test_a_task_without_a_head_is_a_usage_error() -> None:
    spec = workload.StepSpec(task="causal-lm")
    with pytest.raises(UsageError, match=r"--task causal-lm: .*modernbert"):
        workload._task_config(family_config("modernbert"), spec)


# ---------------------------------------------------------------------------------------------------
# flash_attention_2: where it cannot run
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"device": "cpu"}, "FlashAttention runs on CUDA GPUs only, not --device cpu"),
        ({"precision": "fp32"}, "FlashAttention computes in fp16 or bf16 only"),
        ({"gpu": "t4"}, "--gpu t4 is sm75"),
        ({"gpu": "v100"}, "--gpu v100 is sm70"),
    ],
)
def test_flash_attention_2_where_it_cannot_run(
    folders: dict[str, str], knobs: dict[str, Any], message: str
) -> None:
    knobs = {"precision": "bf16", "device": "cuda", **knobs}
    with pytest.raises(UsageError, match=message):
        estimate(
            folders["llama"],
            task="causal-lm",
            batch_size=2,
            seq_len=16,
            attn_implementation="flash_attention_2",
            **knobs,
        )


def test_cli_flash_attention_2_on_the_cpu_exits_2_in_one_line(
    folders: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["estimate", folders["llama"], "--task", "causal-lm", "--batch-size", "2"]
    args += ["--seq-len", "16", "--device", "cpu", "--attn-implementation", "flash_attention_2"]
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert "--attn-implementation flash_attention_2" in err and "--device cpu" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# flash_attention_2: the stand-in's allocations (flash-attn's flash_api.cpp, transformers' unpad)
# ---------------------------------------------------------------------------------------------------


class _Allocations(TorchDispatchMode):
    """(shape, dtype) of every new storage an op returns (not one of its inputs')."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in seen:
                seen.add(_key(t))
                self.made.append((tuple(t.shape), t.dtype))
        return out

    def bytes(self) -> list[int]:
        return sorted(
            int(torch.Size(s).numel()) * d.itemsize for s, d in self.made if torch.Size(s).numel()
        )


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def test_varlen_kernel_allocates_what_flash_attn_does() -> None:
    total, heads, heads_k, dim, batch = 24, 4, 2, 16, 3
    with FakeTensorMode():
        q = torch.randn(total, heads, dim, dtype=BF16, requires_grad=True) * 1
        k, v = (torch.randn(total, heads_k, dim, dtype=BF16, requires_grad=True) * 1 for _ in "kv")
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        with _Allocations() as forward:
            out = fa2.FlashAttentionVarlen.apply(q, k, v, cu, 0.0, False, 108)
        grad = torch.ones_like(out)
        with _Allocations() as backward:
            torch.autograd.grad(out, (q, k, v), grad)
    # mha_varlen_fwd: out (total, H, D), softmax_lse (H, total) float32, rng_state int64[2]
    assert sorted(forward.made, key=str) == sorted(
        [((total, heads, dim), BF16), ((heads, total), FP32), ((2,), torch.int64)], key=str
    )
    rows = total + 128 * batch
    # mha_varlen_bwd: dq, dk, dv; softmax_d (H, total + 128 B) and dq_accum (total + 128 B, H,
    # round32(D)) float32; dK/dV of every query head (GQA), summed per group
    expected = [total * heads * dim * 2, total * heads_k * dim * 2, total * heads_k * dim * 2]
    expected += [heads * rows * 4, rows * heads * 32 * 4, *[total * heads * dim * 2] * 2]
    assert backward.bytes() == sorted(expected)


def _layer_inputs(batch: int, length: int, heads: int, heads_k: int, dim: int) -> Iterator[Any]:
    # q and k as RoPE leaves them ((B, H, L, D) contiguous), v the transposed projection
    yield torch.randn(batch, heads, length, dim, dtype=BF16)
    yield torch.randn(batch, heads_k, length, dim, dtype=BF16)
    yield torch.randn(batch, length, heads_k, dim, dtype=BF16).transpose(1, 2)


def test_padded_batch_is_unpadded_run_and_padded_back() -> None:
    batch, length, heads, heads_k, dim = 2, 8, 4, 2, 16
    module = torch.nn.Linear(4, 4)
    module.is_causal = True  # type: ignore[assignment]
    with FakeTensorMode():
        q, k, v = _layer_inputs(batch, length, heads, heads_k, dim)
        mask = torch.ones(batch, length, dtype=torch.bool)
        with _Allocations() as made:
            out, weights = fa2.flash_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (batch, length, heads, dim) and out.dtype == BF16
    tokens = batch * length  # every token of the padded batch counted (see the module)
    expected = [
        ((batch,), torch.int32),  # the mask's row sums
        ((), torch.int32),  # their maximum
        ((tokens,), torch.int64),  # nonzero's token indices
        ((batch,), torch.int32),  # cumsum
        ((batch + 1,), torch.int32),  # cu_seqlens
        ((batch, length, heads_k, dim), BF16),  # k: reshape's contiguous copy, then the gather
        ((tokens, heads_k, dim), BF16),
        ((tokens, heads_k, dim), BF16),  # v: a view, then the gather
        ((batch, length, heads, dim), BF16),  # q: reshape's contiguous copy, then the gather
        ((tokens, heads, dim), BF16),
        ((tokens, heads, dim), BF16),  # the kernel's output
        ((heads, tokens), FP32),  # its logsumexp
        ((2,), torch.int64),  # its rng_state
        ((tokens, heads, dim), BF16),  # pad_input's zeroed output
    ]
    assert made.made == expected
    # no (B, ·, L, L) tensor anywhere: flash never materializes scores or a 4D mask
    assert not any(len(s) == 4 and s[-2:] == (length, length) for s, _ in made.made)


def test_without_a_padding_mask_the_dense_kernel_runs() -> None:
    batch, length, heads, dim = 2, 8, 4, 16
    module = torch.nn.Linear(4, 4)
    module.is_causal = True  # type: ignore[assignment]
    with FakeTensorMode():
        q, k, v = _layer_inputs(batch, length, heads, heads, dim)
        with _Allocations() as made:
            out, _ = fa2.flash_attention_forward(module, q, k, v, None)
    assert out.shape == (batch, length, heads, dim)
    # mha_fwd: out, softmax_lse (B, H, L) float32, flash-attn's one int64 rng_state
    assert made.bytes() == sorted(
        [batch * length * heads * dim * 2, batch * heads * length * 4, 16]
    )


def test_float32_queries_are_what_flash_attn_refuses() -> None:
    from transformers import PretrainedConfig

    # an fp32 model outside autocast: transformers' target dtype is its weights' (float32)
    module = torch.nn.Linear(4, 4)
    module.is_causal = True  # type: ignore[assignment]
    module.config = PretrainedConfig()  # type: ignore[assignment]
    with FakeTensorMode():
        q, k, v = (t.float() for t in _layer_inputs(1, 8, 2, 2, 16))
        with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
            fa2.flash_attention_forward(module, q, k, v, None)


def test_the_mask_is_the_2d_padding_mask() -> None:
    real = torch.ones(2, 8, dtype=torch.bool)
    # transformers' answer on real tensors: no mask when nothing is padding
    assert fa2.flash_attention_mask(2, 8, 8, attention_mask=real) is None
    real[1, -1] = False
    assert fa2.flash_attention_mask(2, 8, 8, attention_mask=real) is not None
    with FakeTensorMode():
        fake = torch.ones(2, 8, dtype=torch.bool)
        assert fa2.flash_attention_mask(2, 8, 8, attention_mask=fake).shape == (2, 8)


# ---------------------------------------------------------------------------------------------------
# masks per layer type (sliding windows), and what the CUDA kernels make of them
# ---------------------------------------------------------------------------------------------------


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made += [(str(func), tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]  # fmt: skip
        return out


def _forward(family: str, attention: str, batch: int, length: int) -> tuple[Any, _Shapes, CudaSdpa]:
    config = family_config(family)
    task = "causal-lm" if family in DECODERS else "classification"
    spec = workload.StepSpec(task=task, precision="bf16", attn_implementation=attention)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(config, spec, fake_mode)
    with fake_mode, CudaSdpa() as sdpa, _Shapes() as shapes:
        inputs = workload.make_batch(config, spec, batch, length)
        with CudaAutocast(BF16):
            workload.compute_loss(model, inputs, spec)
    return model, shapes, sdpa


@pytest.mark.parametrize(
    ("family", "attention"),
    [("mistral", "sdpa"), ("qwen2", "sdpa"), ("gemma2", "eager"), ("modernbert", "sdpa")],
)
def test_one_mask_per_layer_type_and_sdpa_cannot_use_flash(family: str, attention: str) -> None:
    batch, length = 2, 64  # longer than the 32-token windows
    model, shapes, sdpa = _forward(family, attention, batch, length)
    layer_types = set(getattr(model.config, "layer_types", None) or ["sliding_attention"])
    # the (B, 1, L, L) mask of each layer type, padding folded in: bool for sdpa, additive for eager
    final = "aten.bitwise_and.Tensor" if attention == "sdpa" else "aten.where.self"
    masks = [s for op, s, _ in shapes.made if op == final and s == (batch, 1, length, length)]
    assert len(masks) == len(layer_types)
    if attention == "sdpa":
        # a 4D mask rules the flash backend out: every layer runs memory-efficient attention,
        # which converts the bool mask into an additive one of q's dtype (saved for backward)
        layers = int(model.config.num_hidden_layers)
        assert sdpa.backend_counts[SdpaBackend.EFFICIENT] == layers
        additive = [s for op, s, d in shapes.made if "zeros_like" in op and d == BF16]
        assert additive.count((batch, 1, length, length)) == layers


@pytest.mark.parametrize("family", ["gemma2", "qwen2", "modernbert"])
def test_flash_attention_2_builds_no_4d_mask(family: str) -> None:
    _, shapes, sdpa = _forward(family, fa2.FLASH_ATTENTION_2, 2, 64)
    assert not any(len(s) == 4 and s[-2:] == (64, 64) for _, s, _ in shapes.made)
    assert sum(sdpa.backend_counts.values()) == 0


# ---------------------------------------------------------------------------------------------------
# the trace against a real CPU step (bench/trace_vs_real.py)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "task", "knobs"),
    [
        # DeBERTa-v2's classification loss, a decoder's last-token classifier (pad = eos), a
        # decoder as a mean-pooling sentence embedder, Phi-3's fused LoRA targets
        ("deberta-v2", "classification", {}),
        ("llama", "classification", {}),
        pytest.param("llama", "sentence-embedding", {}, marks=pytest.mark.slow),
        pytest.param("phi3", "classification", {"lora_rank": 4}, marks=pytest.mark.slow),
        pytest.param("modernbert", "sentence-embedding", {}, marks=pytest.mark.slow),
    ],
)
def test_the_trace_allocates_what_a_real_cpu_step_does(
    family: str, task: str, knobs: dict[str, Any]
) -> None:
    from trace_vs_real import differences, real_step, traced_step

    config = family_config(family)
    spec = workload.StepSpec(task=task, device="cpu", loss=DEFAULT_LOSS[task], **knobs)
    real, traced = real_step(config, spec, 2, 32), traced_step(config, spec, 2, 32)
    assert differences(real, traced) == []
    assert real.peak_bytes == traced.peak_bytes


# ---------------------------------------------------------------------------------------------------
# estimates
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_attentions_order(folders: dict[str, str]) -> None:
    def peak(attention: str) -> int:
        est = estimate(
            folders["llama"],
            task="causal-lm",
            batch_size=4,
            seq_len=256,
            precision="bf16",
            attn_implementation=attention,
        )
        return int(est.details["allocated_peak_bytes"])

    sdpa, eager, flash = (peak(a) for a in ("sdpa", "eager", fa2.FLASH_ATTENTION_2))
    # eager keeps the scores and probabilities (B·H·L² each); SDPA on a padded batch keeps an
    # additive mask per layer, FlashAttention no (B, ·, L, L) tensor at all
    assert eager > sdpa > flash


# the pairs of (mode, precision, checkpointing, LoRA rank) values, each at least once
KNOB_ROWS = [
    ("train", "fp32", False, 0),
    ("train", "bf16", True, 4),
    ("train", "fp16", True, 0),
    ("eval", "fp32", True, 4),
    ("eval", "bf16", False, 0),
    ("eval", "fp16", False, 4),
]


def _cells() -> Iterator[tuple[str, str, str, str]]:
    for family in FAMILIES:
        for task, device in itertools.product(tasks_of(family), ("cuda", "cpu")):
            for attention in attentions_of(family, device):
                yield family, task, attention, device


def _estimate(folder: str, task: str, attention: str, device: str, row: tuple[Any, ...]) -> Any:
    mode, precision, checkpointing, rank = row
    return estimate(
        folder,
        task=task,
        batch_size=2,
        seq_len=48,
        precision=precision,
        attn_implementation=attention,
        device=device,
        mode=mode,
        gradient_checkpointing=checkpointing,
        lora_rank=rank or None,
    )


def _check(est: Any) -> None:
    assert sum(est.breakdown.values()) == est.total_bytes
    assert est.breakdown["parameters"] > 0 and est.breakdown["activations"] > 0


# one cell per family (its own task and attention), each with other knobs; checkpointing (the
# slowest to trace) in the slow ones
_SLOW = pytest.mark.slow
REPRESENTATIVE = [
    ("llama", "classification", "sdpa", "cuda", ("eval", "fp16", False, 4)),
    ("qwen2", "causal-lm", fa2.FLASH_ATTENTION_2, "cuda", ("eval", "bf16", False, 0)),
    ("mistral", "sentence-embedding", "eager", "cpu", ("train", "fp32", False, 0)),
    ("gemma2", "causal-lm", "sdpa", "cuda", ("train", "fp32", False, 0)),
    ("phi3", "classification", fa2.FLASH_ATTENTION_2, "cuda", ("train", "fp16", False, 4)),
    ("modernbert", "classification", fa2.FLASH_ATTENTION_2, "cuda", ("train", "bf16", False, 4)),
    ("deberta-v2", "classification", "sdpa", "cpu", ("eval", "bf16", False, 0)),
    pytest.param("llama", "causal-lm", "sdpa", "cuda", KNOB_ROWS[1], marks=_SLOW),
    pytest.param("gemma2", "classification", "eager", "cuda", KNOB_ROWS[2], marks=_SLOW),
    pytest.param("modernbert", "sentence-embedding", "sdpa", "cuda", KNOB_ROWS[1], marks=_SLOW),
    pytest.param("deberta-v2", "sentence-embedding", "eager", "cuda", KNOB_ROWS[3], marks=_SLOW),
]


@pytest.mark.parametrize(("family", "task", "attention", "device", "row"), REPRESENTATIVE)
def test_every_family_estimates(
    folders: dict[str, str], family: str, task: str, attention: str, device: str, row: Any
) -> None:
    _check(_estimate(folders[family], task, attention, device, row))


# the whole product takes about 12 minutes on 2 cores: run it with MEMFIT_FULL_MATRIX=1 (CI runs
# the representative cells above, and test_matrix.py's covering design: every registry family
# with every optimizer, precision, task, mode, device and trace depth)
_FULL_MATRIX = pytest.mark.skipif(
    os.environ.get("MEMFIT_FULL_MATRIX") != "1", reason="set MEMFIT_FULL_MATRIX=1 (~12 minutes)"
)


@pytest.mark.slow
@_FULL_MATRIX
@pytest.mark.parametrize(("family", "task", "attention", "device"), list(_cells()))
def test_every_cell_of_the_matrix_estimates(
    folders: dict[str, str], family: str, task: str, attention: str, device: str
) -> None:
    """family × task × attention × device, each through the knob rows (FlashAttention in fp32
    is the usage error it is on a GPU)."""
    outcomes: collections.Counter[str] = collections.Counter()
    for row in KNOB_ROWS:
        if attention == fa2.FLASH_ATTENTION_2 and row[1] == "fp32":
            with pytest.raises(UsageError, match="fp16 or bf16 only"):
                _estimate(folders[family], task, attention, device, row)
            outcomes["refused"] += 1
            continue
        _check(_estimate(folders[family], task, attention, device, row))
        outcomes["estimated"] += 1
    assert outcomes["estimated"] >= 4


def test_families_cover_the_architectures_memfit_names() -> None:
    for family in FAMILIES:
        assert family_config(family).model_type == family
        assert family in workload.LORA_TARGETS
