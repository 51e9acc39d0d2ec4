"""memfit.step.linear_ce and ``causal_lm_loss(..., cross_entropy="fused-linear")``: the loss and
every gradient equal the standard loss's (fp32, CPU, 1e-5 relative), and the logits are never
built whole (an allocation recorder on real CPU tensors)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.step import IGNORE_INDEX, causal_lm_loss, linear_ce, target_count, token_loss
from memfit.step.linear_ce import chunk_rows, linear_cross_entropy
from tiny_models import gpt2_config

RTOL = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within RTOL, relative to the expected tensor's norm."""
    assert actual.shape == expected.shape
    error = (actual.double() - expected.double()).norm().item()
    assert error <= RTOL * expected.double().norm().item(), (error, expected.norm().item())


class _Allocations(TorchDispatchMode):
    """Each storage an op allocates while entered (storages of ``known`` tensors left out): the
    largest single one, and the peak of those alive at once (freed when their storage is)."""

    def __init__(self, *known: torch.Tensor | None) -> None:
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known if t is not None}
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.live += storage.nbytes()
            self.sizes.append(storage.nbytes())
            self.largest = max(self.largest, storage.nbytes())
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def _inputs(
    rows: int, hidden: int, vocab: int, *, bias: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) * 0.5).requires_grad_()
    b = torch.randn(vocab, generator=generator).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::3] = IGNORE_INDEX  # a completion-only mask's holes
    return x, w, b, targets


def _reference(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    targets: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    logits = F.linear(x, w, b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _grads(
    loss_of: Callable[[], torch.Tensor], tensors: list[torch.Tensor], scale: float = 1.0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for tensor in tensors:
        tensor.grad = None
    loss = loss_of()
    (loss * scale).backward()
    return loss.detach(), [tensor.grad.clone() for tensor in tensors]  # type: ignore[union-attr]


def test_the_chunk_rule_is_ligers() -> None:
    # Liger's own example: BT = 4096·4, V = 32000, H = 4096 → inc_factor 8, chunks of 2048 rows
    assert chunk_rows(4096 * 4, 32000, 4096) == 2048
    # a power of two at or above BT / ceil(V / H): 1000 / ceil(128256 / 2048) = 15.9 → 16
    assert chunk_rows(1000, 128256, 2048) == 16
    assert chunk_rows(1, 128256, 2048) == 1
    assert chunk_rows(0, 64, 16) == 1


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 40, 300])  # 1, 2, 5 and 38 chunks of 8 rows (V/H = 32)
def test_loss_and_gradients_equal_the_standard_ones(
    rows: int, bias: bool, softcap: float | None
) -> None:
    x, w, b, targets = _inputs(rows, 8, 256, bias=bias)
    tensors = [t for t in (x, w, b) if t is not None]
    # a grad_output other than 1 (the step divides by its units): the backward scales by it
    fused, fused_grads = _grads(
        lambda: linear_cross_entropy(x, w, b, targets, softcap=softcap), tensors, 1 / 7
    )
    standard, standard_grads = _grads(lambda: _reference(x, w, b, targets, softcap), tensors, 1 / 7)
    assert fused.dtype == torch.float32
    _close(fused, standard)
    for got, expected in zip(fused_grads, standard_grads, strict=True):
        _close(got, expected)


def test_a_bf16_chunk_is_exact_to_bf16() -> None:
    # 16-bit logits take the fp32 row-block path: the softmax in fp32, the target entry's
    # softmax - 1 without 16-bit cancellation
    x, w, _, targets = _inputs(64, 16, 300)
    expected, (gx, gw) = _grads(
        lambda: _reference(x.double(), w.double(), None, targets, 5.0), [x, w]
    )
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    loss, (gxb, gwb) = _grads(
        lambda: linear_cross_entropy(xb, wb, None, targets, softcap=5.0), [xb, wb]
    )
    assert abs(loss.item() - expected.item()) <= 1e-3 * expected.item()
    for got, want in ((gxb, gx), (gwb, gw)):
        assert (got.double() - want.double()).norm() <= 2e-2 * want.double().norm()


def test_under_autocast_the_chunk_matmul_runs_in_the_autocast_dtype() -> None:
    x, w, _, targets = _inputs(64, 16, 300)
    dtypes: list[torch.dtype] = []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                dtypes.append(out.dtype)
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16), Matmuls():
        loss = linear_cross_entropy(x, w, None, targets)
    loss.backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert loss.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.float32
    expected = _reference(x.double(), w.double(), None, targets, None)
    assert abs(loss.item() - expected.item()) <= 1e-2 * expected.item()


def test_under_no_grad_the_loss_is_the_same_and_no_gradient_is_computed() -> None:
    x, w, _, targets = _inputs(300, 8, 256)
    with torch.no_grad(), _Allocations(x, w, targets) as recorder:
        loss = linear_cross_entropy(x, w, None, targets)
    assert not loss.requires_grad
    _close(loss, _reference(x, w, None, targets, None).detach())
    # Liger's zero input gradient is allocated all the same; nothing the size of the weight's
    # gradient, nor the gradient's matmuls
    assert w.numel() * 4 not in recorder.sizes
    with _Allocations(x, w, targets) as training:
        linear_cross_entropy(x, w, None, targets)
    assert w.numel() * 4 in training.sizes


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_logits_never_exist_whole(softcap: float | None) -> None:
    rows, hidden, vocab = 1000, 16, 256
    x, w, _, targets = _inputs(rows, hidden, vocab)
    chunk = chunk_rows(rows, vocab, hidden)
    chunk_logits = chunk * vocab * 4
    whole_logits = rows * vocab * 4
    assert chunk_logits * 8 <= whole_logits  # the shapes make several chunks

    with _Allocations(x, w, targets) as fused:
        loss = linear_cross_entropy(x, w, None, targets, softcap=softcap)
        loss.backward()
    assert fused.largest <= chunk_logits
    # one chunk-sized allocation per full chunk, its logits: the softmax and the gradient are
    # computed in them
    assert fused.sizes.count(chunk_logits) == rows // chunk
    assert fused.peak <= whole_logits / 4

    # the recorder catches the standard loss: its logits are one allocation of N × V
    with _Allocations(x, w, targets) as standard:
        _reference(x, w, None, targets, softcap).backward()
    assert standard.largest >= whole_logits
    assert standard.peak > whole_logits


def test_the_implementation_is_named() -> None:
    assert "memfit" in linear_ce.implementation("cpu")
    cuda = linear_ce.implementation("cuda")
    assert "Liger" in cuda


def test_a_cuda_targets_head_gradient_accumulates_with_addmm_out_dtype_on_fake_tensors() -> None:
    # the estimator traces a CUDA target on fake CPU tensors: there Liger accumulates the fp32
    # head gradient from 16-bit logits with addmm(out_dtype=float32), no V × H temporary
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops: list[Any] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            ops.append(func)
            return func(*args, **(kwargs or {}))

    def run(out_dtype: bool) -> list[Any]:
        ops.clear()
        with FakeTensorMode():
            x, w, _, targets = _inputs(64, 16, 300)
            with (
                torch.autocast("cpu", dtype=torch.bfloat16),
                Ops(),
                linear_ce.fp32_out_accumulation(out_dtype),
            ):
                linear_cross_entropy(x, w, None, targets)
        return list(ops)

    assert torch.ops.aten.addmm.dtype_out in run(True)
    assert torch.ops.aten.addmm.dtype_out not in run(False)


# --- causal_lm_loss(cross_entropy="fused-linear") on tiny models -----------------------------

_DECODER: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def _model(family: str) -> Any:
    torch.manual_seed(0)
    if family == "llama":
        config: Any = transformers.LlamaConfig(**_DECODER, tie_word_embeddings=False)
    elif family == "qwen2":  # tied head
        config = transformers.Qwen2Config(**_DECODER, tie_word_embeddings=True)
    elif family == "gemma2":  # soft-capped logits
        config = transformers.Gemma2Config(
            **_DECODER, head_dim=8, sliding_window=8, final_logit_softcapping=3.0
        )
    else:
        config = gpt2_config(256)  # 32 wide: chunks of 8 rows
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if family == "gemma2":  # Gemma's zero-initialized norms would make every logit equal
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def _batch(rows: int = 2, length: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -5:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :7] = IGNORE_INDEX  # the prompt: completion only
    return input_ids, attention_mask, labels


def _step_grads(
    model: Any, kind: str, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], units: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trained = [p for p in model.parameters() if p.requires_grad]
    input_ids, attention_mask, labels = batch
    return _grads(
        lambda: causal_lm_loss(model, input_ids, attention_mask, labels, units, cross_entropy=kind),
        trained,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gpt2"])
def test_causal_lm_loss_fused_linear_equals_the_standard_loss(family: str) -> None:
    model = _model(family)
    batch = _batch()
    units = target_count(batch[2])
    # 2 × 24 rows, V / H = 16: chunks of 4 rows
    assert chunk_rows(48, 256, 16) == 4
    standard, standard_grads = _step_grads(model, "standard", batch, units)
    fused, fused_grads = _step_grads(model, "fused-linear", batch, units)
    _close(fused, standard)
    for got, expected in zip(fused_grads, standard_grads, strict=True):
        _close(got, expected)


def test_gemma2s_final_logit_softcapping_is_applied() -> None:
    # the config's softcap changes the fused loss; without it the fused loss is the uncapped one
    model = _model("gemma2")
    batch = _batch()
    units = target_count(batch[2])
    with torch.no_grad():
        fused = causal_lm_loss(model, *batch, units, cross_entropy="fused-linear")
        model.config.final_logit_softcapping = None
        uncapped = causal_lm_loss(model, *batch, units, cross_entropy="fused-linear")
        standard_uncapped = causal_lm_loss(model, *batch, units)
    assert abs(fused.item() - uncapped.item()) > 1e-3
    _close(uncapped, standard_uncapped)


def test_a_split_step_adds_up_to_the_whole_step() -> None:
    model = _model("llama")
    input_ids, attention_mask, labels = _batch(rows=4)
    labels[2, 7:15] = IGNORE_INDEX  # micro-batches with different target counts
    units = target_count(labels)
    trained = list(model.parameters())
    whole, whole_grads = _step_grads(model, "standard", (input_ids, attention_mask, labels), units)

    for parameter in trained:
        parameter.grad = None
    total = torch.zeros(())
    for part in (slice(0, 2), slice(2, 4)):
        loss = causal_lm_loss(
            model,
            input_ids[part],
            attention_mask[part],
            labels[part],
            units,
            cross_entropy="fused-linear",
        )
        loss.backward()
        total += loss.detach()
    _close(total, whole)
    for parameter, expected in zip(trained, whole_grads, strict=True):
        assert parameter.grad is not None
        _close(parameter.grad, expected)


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_lora_gradients_equal_the_standard_ones(modules_to_save: list[str] | None) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _model("llama"),
        peft.LoraConfig(
            r=4,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=modules_to_save,
            init_lora_weights=False,
        ),
    )
    batch = _batch()
    units = target_count(batch[2])
    standard, standard_grads = _step_grads(model, "standard", batch, units)
    fused, fused_grads = _step_grads(model, "fused-linear", batch, units)
    assert len(fused_grads) > 0
    _close(fused, standard)
    for got, expected in zip(fused_grads, standard_grads, strict=True):
        _close(got, expected)


def test_under_no_grad_causal_lm_loss_is_the_same() -> None:
    model = _model("qwen2")
    batch = _batch()
    units = target_count(batch[2])
    with torch.no_grad():
        fused = causal_lm_loss(model, *batch, units, cross_entropy="fused-linear")
        standard = causal_lm_loss(model, *batch, units)
    assert not fused.requires_grad
    _close(fused, standard)


def test_token_loss_is_the_standard_path() -> None:
    # the standard path is unchanged: the model's logits through token_loss
    model = _model("llama")
    batch = _batch()
    units = target_count(batch[2])
    with torch.no_grad():
        logits = model(input_ids=batch[0], attention_mask=batch[1]).logits
        _close(causal_lm_loss(model, *batch, units), token_loss(logits, batch[2], units))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (lambda: transformers.CohereConfig(**_DECODER, logit_scale=0.0625), "logit_scale"),
        (lambda: transformers.GraniteConfig(**_DECODER, logits_scaling=8.0), "logits_scaling"),
    ],
)
def test_a_head_that_scales_its_logits_is_refused(config: Callable[[], Any], field: str) -> None:
    model = transformers.AutoModelForCausalLM.from_config(config())
    batch = _batch()
    with pytest.raises(ValueError, match=f"--cross-entropy.*{field}|{field}.*--cross-entropy"):
        causal_lm_loss(model, *batch, 10, cross_entropy="fused-linear")


def test_a_head_with_adapters_is_refused() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    )
    with pytest.raises(ValueError, match="--cross-entropy standard"):
        causal_lm_loss(model, *_batch(), 10, cross_entropy="fused-linear")


def test_an_unknown_cross_entropy_is_refused() -> None:
    with pytest.raises(ValueError, match="fused-linear"):
        causal_lm_loss(_model("llama"), *_batch(), 10, cross_entropy="chunked")
