"""CUDA autocast and SDPA emulation on (fake) CPU tensors."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.estimate import autocast_emulation as ac
from memfit.estimate import sdpa_emulation as sd
from memfit.estimate import sdpa_kernels as sk
from memfit.estimate.autocast_emulation import CudaAutocast
from memfit.estimate.sdpa_emulation import CudaSdpa, SdpaBackend

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(params=["real", "fake"])
def tensor_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a test on plain CPU tensors and on fake CPU tensors."""
    ctx = FakeTensorMode() if request.param == "fake" else contextlib.nullcontext()
    with ctx:
        yield


class OpLog(TorchDispatchMode):
    """Records every aten op below autograd, with its inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out

    def ops(self) -> list[str]:
        return [str(func.overloadpacket.__name__) for func, *_ in self.calls]


class AllocationRecorder(TorchDispatchMode):
    """Bytes of every new storage an op returns (storages that are not among its inputs')."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            _storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:
                inputs.add(_storage_key(t))
                self.allocations.append((str(func), t.untyped_storage().nbytes()))
        return out

    def sizes(self) -> list[int]:
        """Sorted bytes of the non-empty allocations (empty ones are size placeholders)."""
        return sorted(n for _, n in self.allocations if n)


def _saved_tensors(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    node: Any = out.grad_fn
    return tuple(node.saved_tensors)


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


# ---------------------------------------------------------------------------------------------------
# op lists
# ---------------------------------------------------------------------------------------------------

ALL_LISTED = (
    ac.LOWER_PRECISION_FP_OPS
    | ac.FP32_OPS
    | ac.FP32_SET_OPT_DTYPE_OPS
    | ac.FP32_APPEND_DTYPE_OPS
    | ac.PROMOTE_OPS
    | ac.BANNED_OPS
)


def test_op_lists_cover_every_autocast_cuda_registration() -> None:
    registered = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    }
    assert registered, "this torch build registers no AutocastCUDA kernels"
    assert registered <= ALL_LISTED, sorted(registered - ALL_LISTED)


def test_op_lists_are_disjoint() -> None:
    lists = [
        ac.LOWER_PRECISION_FP_OPS,
        ac.FP32_OPS,
        ac.FP32_SET_OPT_DTYPE_OPS,
        ac.FP32_APPEND_DTYPE_OPS,
        ac.PROMOTE_OPS,
    ]
    assert sum(len(ops) for ops in lists) == len(frozenset().union(*lists))


@pytest.mark.parametrize(
    ("func", "policy"),
    [
        (F.linear, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.matmul, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.Tensor.__matmul__, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.Tensor.matmul, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.bmm, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.baddbmm, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.addmm, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch._C._VariableFunctions.einsum, ac.CastPolicy.LOWER_PRECISION_FP),  # type: ignore[attr-defined]
        (F.scaled_dot_product_attention, ac.CastPolicy.LOWER_PRECISION_FP),
        (torch.layer_norm, ac.CastPolicy.FP32),  # what F.layer_norm calls
        (torch.exp, ac.CastPolicy.FP32),
        (torch.rsqrt, ac.CastPolicy.FP32),
        (torch.Tensor.pow, ac.CastPolicy.FP32),
        (F.cosine_similarity, ac.CastPolicy.FP32),
        (torch._C._nn.mse_loss, ac.CastPolicy.FP32),
        (torch._C._nn.nll_loss_nd, ac.CastPolicy.FP32),
        (torch.softmax, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.Tensor.softmax, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.Tensor.log_softmax, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.cumsum, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.Tensor.sum, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.linalg.vector_norm, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.ops.aten.sum.dim_IntList, ac.CastPolicy.FP32_SET_OPT_DTYPE),
        (torch.ops.aten.norm.Scalar, ac.CastPolicy.FP32_APPEND_DTYPE),
        (torch.addcmul, ac.CastPolicy.PROMOTE),
        (torch._C._nn.cross_entropy_loss, ac.CastPolicy.CROSS_ENTROPY),
        (torch._C._nn.binary_cross_entropy, ac.CastPolicy.BANNED),
        (F.gelu, None),
        (torch.mean, None),
        (torch.cat, None),
        (torch.add, None),
        (torch.Tensor.exp_, None),  # in-place: never autocast
        (F.softmax, None),  # a Python function: the Tensor.softmax it calls is matched
        (torch.ops.aten.pow.Tensor_Scalar, ac.CastPolicy.FP32),
        (torch.ops.aten.mean.default, None),
    ],
)
def test_autocast_policy_of_callables(func: Any, policy: ac.CastPolicy | None) -> None:
    assert ac.autocast_policy(func) is policy


# ---------------------------------------------------------------------------------------------------
# CudaAutocast: dtypes
# ---------------------------------------------------------------------------------------------------


def test_linear_output_is_low_precision(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    with CudaAutocast(BF16):
        assert layer(torch.randn(4, 8)).dtype == BF16
        assert (torch.randn(4, 8) @ torch.randn(8, 3)).dtype == BF16
        assert torch.einsum("ij,jk->ik", torch.randn(4, 8), torch.randn(8, 3)).dtype == BF16
    with CudaAutocast(FP16):
        assert layer(torch.randn(4, 8)).dtype == FP16


def test_fp32_and_set_opt_dtype_ops(tensor_mode: None) -> None:
    x = torch.randn(4, 16).to(BF16)
    with CudaAutocast(BF16):
        assert F.layer_norm(x, (16,)).dtype == FP32
        assert F.layer_norm(x, (16,), torch.ones(16), torch.zeros(16)).dtype == FP32
        assert torch.softmax(x, -1).dtype == FP32
        assert F.softmax(x, dim=-1).dtype == FP32
        assert x.softmax(-1).dtype == FP32
        assert F.log_softmax(x, -1).dtype == FP32
        assert x.sum().dtype == FP32
        assert x.sum(dim=1, keepdim=True).dtype == FP32
        assert torch.cumsum(x, 0).dtype == FP32
        assert torch.exp(x).dtype == FP32
        assert x.pow(2).dtype == FP32
        assert (x**2).dtype == FP32
        assert torch.rsqrt(x.abs() + 1).dtype == FP32
        # F.normalize is a Python function: its linalg_vector_norm is autocast, then type promotion
        assert F.normalize(x, dim=-1).dtype == FP32
        # an explicit dtype is respected
        assert torch.softmax(x, -1, dtype=BF16).dtype == BF16
        assert x.sum(dtype=BF16).dtype == BF16


def test_ops_outside_the_lists_keep_their_dtype(tensor_mode: None) -> None:
    x = torch.randn(4, 16).to(BF16)
    with CudaAutocast(BF16):
        assert F.gelu(x).dtype == BF16
        assert x.mean().dtype == BF16
        assert torch.tanh(x).dtype == BF16
        # type promotion, not autocast: bf16 + fp32 is fp32
        assert (x + torch.randn(4, 16)).dtype == FP32


def test_promote_policy(tensor_mode: None) -> None:
    x = torch.randn(4, 4).to(BF16)
    with CudaAutocast(BF16):
        assert torch.addcmul(x, x, x).dtype == BF16
        assert torch.addcmul(x, torch.randn(4, 4), x).dtype == FP32


def test_integer_tensors_are_left_alone(tensor_mode: None) -> None:
    ids = torch.arange(12).view(3, 4)
    with CudaAutocast(BF16):
        assert ids.sum().dtype == torch.int64
        assert ids.cumsum(-1).dtype == torch.int64
        assert torch.matmul(ids, ids.T).dtype == torch.int64
        assert torch.ones(3, dtype=torch.float64).exp().dtype == torch.float64


def test_cross_entropy_of_low_precision_logits(tensor_mode: None) -> None:
    logits = torch.randn(6, 10).to(BF16)
    target = torch.tensor([0, 1, 2, 3, 4, -100])
    with CudaAutocast(BF16):
        assert F.cross_entropy(logits, target).dtype == FP32
        assert F.cross_entropy(logits, target, label_smoothing=0.1).dtype == FP32
        assert F.cross_entropy(logits, target, reduction="none").dtype == FP32
        assert (
            F.cross_entropy(logits, target, weight=torch.rand(10), label_smoothing=0.1).dtype
            == FP32
        )
        assert F.cross_entropy(logits, torch.rand(6, 10).softmax(-1)).dtype == FP32
        assert F.nll_loss(F.log_softmax(logits, -1), target).dtype == FP32


def test_cross_entropy_decomposes_like_cuda() -> None:
    """log_softmax stays in the logits' dtype (explicit dtype), nll_loss makes a float32 copy."""
    with FakeTensorMode():
        logits = torch.randn(6, 10).to(BF16).requires_grad_()
        target = torch.zeros(6, dtype=torch.long)
        with CudaAutocast(BF16), OpLog() as log:
            loss = F.cross_entropy(logits, target)
    ops = [(name, out) for (func, _, _, out), name in zip(log.calls, log.ops(), strict=True)]
    names = [name for name, _ in ops]
    assert names.index("_log_softmax") < names.index("_to_copy") < names.index("nll_loss_forward")
    log_probs = next(out for name, out in ops if name == "_log_softmax")
    assert log_probs.dtype == BF16
    assert next(out for name, out in ops if name == "_to_copy").dtype == FP32
    assert loss.dtype == FP32


def test_fp16_softmax_to_float_uses_the_fused_kernel() -> None:
    """SoftMax.cpp: CUDA half input with dtype=float32 runs _softmax(half_to_float), no fp32 copy."""
    with FakeTensorMode():
        x = torch.randn(4, 128).to(FP16)
        with CudaAutocast(FP16), AllocationRecorder() as rec:
            y = F.softmax(x, dim=-1, dtype=FP32)
            z = x.softmax(-1)  # autocast sets dtype=float32
    assert y.dtype == z.dtype == FP32
    assert rec.sizes() == [4 * 128 * 4, 4 * 128 * 4]  # the outputs only


def test_binary_cross_entropy_is_banned(tensor_mode: None) -> None:
    with CudaAutocast(FP16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(torch.rand(4), torch.rand(4))


def test_backward_gives_fp32_weight_grads(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with CudaAutocast(BF16):
        y = layer(x)
    assert y.dtype == BF16
    y.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == FP32
    assert layer.bias.grad is not None and layer.bias.grad.dtype == FP32
    assert x.grad is not None and x.grad.dtype == FP32


# ---------------------------------------------------------------------------------------------------
# CudaAutocast: the weight cache
# ---------------------------------------------------------------------------------------------------


def _casts_of(log: OpLog, source: torch.Tensor) -> int:
    return sum(
        1
        for func, args, _, _ in log.calls
        if func is torch.ops.aten._to_copy.default and args[0] is source
    )


def test_weight_cache_casts_each_parameter_once(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with CudaAutocast(BF16) as autocast, OpLog() as log:
        layer(x)
        layer(x)
        assert autocast.cache_size == 2  # weight and bias
        cached = autocast.cached_copy(layer.weight)
        assert cached is not None and cached.dtype == BF16
    assert _casts_of(log, layer.weight) == 1
    assert _casts_of(log, layer.bias) == 1
    assert _casts_of(log, x) == 2  # activations are not cached


def test_weight_cache_is_freed_at_exit(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)  # so the graph saves the cast weight for grad(x)
    with CudaAutocast(BF16) as autocast:
        y = layer(x)
        cached = autocast.cached_copy(layer.weight)
        assert cached is not None
        ref = weakref.ref(cached)
        del cached
        gc.collect()
        assert ref() is not None  # the cache keeps it alive through the whole region
    assert autocast.cache_size == 0
    gc.collect()
    assert ref() is not None  # ...the autograd graph still holds it for backward, as on CUDA
    del y
    gc.collect()
    assert ref() is None


def test_weight_cache_without_graph_is_freed_at_exit(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    with torch.no_grad(), CudaAutocast(BF16) as autocast:
        y = layer(torch.randn(4, 8))
        cached = autocast.cached_copy(layer.weight)
        assert cached is not None
        ref = weakref.ref(cached)
        del cached
        gc.collect()
        assert ref() is not None
    gc.collect()
    assert ref() is None
    assert y.dtype == BF16


def test_weight_cache_conditions(tensor_mode: None) -> None:
    frozen = torch.nn.Linear(8, 16).requires_grad_(False)
    trained = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with CudaAutocast(BF16) as autocast:
        frozen(x)  # does not require grad: not cached
        assert autocast.cache_size == 0
        with torch.no_grad():
            trained(x)  # the cache ignores grad mode (autocast_mode.cpp cached_cast)
        assert autocast.cache_size == 2
    with CudaAutocast(BF16, cache_enabled=False) as autocast:
        trained(x)
        assert autocast.cache_size == 0
    with CudaAutocast(BF16) as autocast, torch.inference_mode():
        trained(x)
        assert autocast.cache_size == 0


# ---------------------------------------------------------------------------------------------------
# CudaAutocast: nested torch.autocast regions
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_nested_autocast_disabled_region(tensor_mode: None, device_type: str) -> None:
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with CudaAutocast(BF16) as autocast:
        assert torch.is_autocast_enabled(device_type)
        assert torch.get_autocast_dtype(device_type) == BF16
        with torch.autocast(device_type, enabled=False):
            assert not torch.is_autocast_enabled(device_type)
            assert layer(x).dtype == FP32
            with torch.autocast(device_type, dtype=BF16):
                assert layer(x).dtype == BF16
        assert layer(x).dtype == BF16
        assert autocast.cache_size == 2  # inner regions do not clear the cache
    assert not torch.is_autocast_enabled("cpu")
    assert torch.autocast.__enter__ is torch.amp.autocast_mode.autocast.__enter__


def test_transformers_maybe_autocast_sees_the_emulated_region() -> None:
    from transformers.utils.generic import maybe_autocast

    layer = torch.nn.Linear(8, 16)
    with CudaAutocast(BF16), maybe_autocast("cpu", enabled=False):
        assert layer(torch.randn(4, 8)).dtype == FP32


def test_disabled_mode_only_emulates_inner_regions(tensor_mode: None) -> None:
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with CudaAutocast(BF16, enabled=False) as autocast:
        assert layer(x).dtype == FP32
        assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=BF16):
            assert layer(x).dtype == BF16
            assert autocast.cache_size == 2
        assert autocast.cache_size == 0  # leaving the outermost region clears the cache


# ---------------------------------------------------------------------------------------------------
# CudaAutocast against the real CUDA autocast kernels (AutocastCUDA on fake CUDA tensors)
# ---------------------------------------------------------------------------------------------------

PARITY_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "linear": lambda x, w: F.linear(x, w),
    "matmul": lambda x, w: x @ w.T,
    "bmm": lambda x, w: torch.bmm(x[None], w.T[None]),
    "addmm": lambda x, w: torch.addmm(x[:, :1], x, w.T),
    "einsum": lambda x, w: torch.einsum("ij,kj->ik", x, w),
    "layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]),
    "group_norm": lambda x, w: F.group_norm(x, 2),
    "softmax": lambda x, w: F.softmax(x, -1),
    "log_softmax": lambda x, w: x.log_softmax(-1),
    "softmax_dtype": lambda x, w: torch.softmax(x, -1, dtype=x.dtype),
    "sum": lambda x, w: x.sum(),
    "sum_dim": lambda x, w: x.sum(-1),
    "prod": lambda x, w: x.prod(-1),
    "cumsum": lambda x, w: x.cumsum(-1),
    "mean": lambda x, w: x.mean(),
    "exp": lambda x, w: x.exp(),
    "pow": lambda x, w: x.pow(2),
    "rpow": lambda x, w: 2**x,
    "rsqrt": lambda x, w: x.rsqrt(),
    "gelu": lambda x, w: F.gelu(x),
    "silu": lambda x, w: F.silu(x),
    "normalize": lambda x, w: F.normalize(x, dim=-1),
    "cosine_similarity": lambda x, w: F.cosine_similarity(x, x),
    "mse_loss": lambda x, w: F.mse_loss(x, x),
    "cross_entropy": lambda x, w: F.cross_entropy(
        x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    ),
    "ce_smoothing": lambda x, w: F.cross_entropy(
        x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device), label_smoothing=0.1
    ),
    "logsumexp": lambda x, w: torch.logsumexp(x, -1),
    "addcmul": lambda x, w: torch.addcmul(x, x, x),
    "vector_norm": lambda x, w: torch.linalg.vector_norm(x, dim=-1),
    "cat": lambda x, w: torch.cat([x, x]),
    "sdpa": lambda x, w: F.scaled_dot_product_attention(
        x[None, None], x[None, None], x[None, None]
    ),
}


def _real_cuda_autocast_dtype(
    op: Callable[..., Any], x_dtype: torch.dtype, autocast_dtype: torch.dtype
) -> Any:
    """Output dtype of ``op`` under the real AutocastCUDA kernels, on fake CUDA tensors.

    Some ops (bmm, addmm, SDPA) need a CUDA runtime even on fake tensors: those are skipped.
    """
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda", dtype=x_dtype)
        w = torch.empty(6, 8, device="cuda")
        prev_enabled = torch.is_autocast_enabled("cuda")
        prev_dtype = torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", autocast_dtype)
        try:
            return op(x, w).dtype
        except RuntimeError as error:
            if "not linked with support for cuda" in str(error):
                pytest.skip("this op needs a CUDA runtime even on fake CUDA tensors")
            raise
        finally:
            torch.set_autocast_enabled("cuda", prev_enabled)
            torch.set_autocast_dtype("cuda", prev_dtype)
            torch.clear_autocast_cache()


def _emulated_autocast_dtype(
    op: Callable[..., Any], x_dtype: torch.dtype, autocast_dtype: torch.dtype
) -> Any:
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=x_dtype)
        w = torch.empty(6, 8)
        with CudaAutocast(autocast_dtype):
            return op(x, w).dtype


def _fake_cuda_available() -> bool:
    try:
        _real_cuda_autocast_dtype(lambda x, w: F.linear(x, w), FP32, BF16)
    except Exception:
        return False
    return True


@pytest.mark.skipif(
    not _fake_cuda_available(), reason="fake CUDA tensors unavailable in this build"
)
@pytest.mark.parametrize("x_dtype", [FP32, BF16])
@pytest.mark.parametrize("name", sorted(PARITY_OPS))
def test_dtypes_match_the_real_autocast_cuda_kernels(name: str, x_dtype: torch.dtype) -> None:
    op = PARITY_OPS[name]
    assert _emulated_autocast_dtype(op, x_dtype, BF16) == _real_cuda_autocast_dtype(
        op, x_dtype, BF16
    )


# ---------------------------------------------------------------------------------------------------
# CudaAutocast on a transformers model
# ---------------------------------------------------------------------------------------------------


def _tiny_bert() -> Any:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return BertModel(config)


@pytest.mark.parametrize("with_sdpa", [False, True])
def test_bert_forward_backward_under_fake_cuda_autocast(with_sdpa: bool) -> None:
    with FakeTensorMode():
        model = _tiny_bert().train()
        ids = torch.randint(0, 128, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        sdpa = CudaSdpa() if with_sdpa else contextlib.nullcontext()
        with sdpa, CudaAutocast(BF16) as autocast:
            out = model(input_ids=ids, attention_mask=mask)
            assert autocast.cache_size > 0
        # BERT's last hidden state comes out of a LayerNorm: float32 under CUDA autocast
        assert out.last_hidden_state.dtype == FP32
        assert out.pooler_output.dtype == BF16  # Linear then tanh
        out.last_hidden_state.sum().backward()
        grad = model.encoder.layer[0].attention.self.query.weight.grad
        assert grad is not None and grad.dtype == FP32
    if with_sdpa:
        assert isinstance(sdpa, CudaSdpa) and sum(sdpa.backend_counts.values()) == 2


def test_bert_gradient_checkpointing_needs_the_disabled_mode_around_backward() -> None:
    with FakeTensorMode():
        model = _tiny_bert().train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 128, (2, 16))
        with CudaSdpa(), CudaAutocast(BF16):
            out = model(input_ids=ids)
        loss = out.last_hidden_state.sum()
        # the recomputation re-enters torch.autocast("cpu", bf16): emulated, not real CPU autocast
        with CudaSdpa(), CudaAutocast(BF16, enabled=False):
            loss.backward()
        grad = model.encoder.layer[0].output.dense.weight.grad
        assert grad is not None and grad.dtype == FP32


# ---------------------------------------------------------------------------------------------------
# CudaSdpa: backend choice
# ---------------------------------------------------------------------------------------------------


def _qkv(
    b: int = 2,
    h: int = 4,
    lq: int = 32,
    d: int = 64,
    *,
    lk: int | None = None,
    hk: int | None = None,
    dv: int | None = None,
    dtype: torch.dtype = BF16,
    requires_grad: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(B, H, L, D) views of (B, L, H, D) tensors, the layout transformers produces, plus the bases."""
    lk = lq if lk is None else lk
    hk = h if hk is None else hk
    dv = d if dv is None else dv
    bases = (
        torch.randn(b, lq, h, d, dtype=dtype),
        torch.randn(b, lk, hk, d, dtype=dtype),
        torch.randn(b, lk, hk, dv, dtype=dtype),
    )
    for base in bases:
        base.requires_grad_(requires_grad)
    q, k, v = (base.transpose(1, 2) for base in bases)
    return q, k, v, *bases


def test_backend_choice() -> None:
    select = sd.select_sdpa_backend
    with FakeTensorMode():
        q, k, v, *_ = _qkv(dtype=FP32)
        mask = torch.zeros(2, 1, 32, 32)
        assert select(q, k, v, mask) is SdpaBackend.EFFICIENT
        assert select(q, k, v) is SdpaBackend.EFFICIENT  # float32: no flash
        q, k, v, *_ = _qkv(dtype=BF16)
        assert select(q, k, v) is SdpaBackend.FLASH
        assert select(q, k, v, torch.zeros(2, 1, 32, 32, dtype=BF16)) is SdpaBackend.EFFICIENT
        assert select(q, k, v, torch.ones(32, 32, dtype=torch.bool)) is SdpaBackend.EFFICIENT
        q, k, v, *_ = _qkv(d=512, dtype=BF16)
        # flash needs head_dim <= 256; the CUDA mem-efficient kernels have no head-dim limit
        assert select(q, k, v) is SdpaBackend.EFFICIENT
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            assert select(q, k, v) is SdpaBackend.MATH
        q, k, v, *_ = _qkv(lq=16, lk=32, dtype=BF16)
        assert select(q, k, v, is_causal=True) is SdpaBackend.EFFICIENT  # non-square causal
        q, k, v, *_ = _qkv(d=60, dtype=BF16)
        assert select(q, k, v) is SdpaBackend.FLASH  # head dim padded to 64 by the composite
        q, k, v, *_ = _qkv(d=60, dtype=FP32)
        assert select(q, k, v) is SdpaBackend.EFFICIENT  # 60 % 4 == 0
        q, k, v, *_ = _qkv(d=62, dtype=FP32)
        assert select(q, k, v) is SdpaBackend.MATH  # mem-efficient needs head_dim % 4 == 0
        q, k, v, *_ = _qkv(hk=2, dtype=BF16)
        assert select(q, k, v, enable_gqa=True) is SdpaBackend.FLASH
        assert select(q, k, v, enable_gqa=False) is SdpaBackend.MATH
        q, k, v, *_ = _qkv(dtype=torch.float64)
        assert select(q, k, v) is SdpaBackend.MATH
        q, k, v, *_ = _qkv(dtype=BF16)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            assert select(q, k, v) is SdpaBackend.EFFICIENT
        with sdpa_kernel([SDPBackend.MATH]):
            assert select(q, k, v) is SdpaBackend.MATH


def test_sm86_training_with_large_head_dim_is_not_flash() -> None:
    with FakeTensorMode():
        q, k, v, *_ = _qkv(d=200, dtype=BF16)
        assert sd.select_sdpa_backend(q, k, v, compute_capability=(8, 0)) is SdpaBackend.FLASH
        assert sd.select_sdpa_backend(q, k, v, compute_capability=(8, 6)) is SdpaBackend.EFFICIENT


# ---------------------------------------------------------------------------------------------------
# CudaSdpa: forward/backward and allocations
# ---------------------------------------------------------------------------------------------------


def _sdpa_grads(
    out: torch.Tensor, inputs: tuple[torch.Tensor, ...], recorder: AllocationRecorder | None = None
) -> tuple[torch.Tensor, ...]:
    # ones_like keeps the output's strides; autograd.grad avoids gradient-accumulation copies
    grad = torch.ones_like(out)
    with recorder if recorder is not None else contextlib.nullcontext():
        return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize(
    ("dtype", "with_mask", "head_dim", "backend"),
    [
        (BF16, False, 64, SdpaBackend.FLASH),
        (BF16, True, 64, SdpaBackend.EFFICIENT),
        (FP32, True, 64, SdpaBackend.EFFICIENT),
        (FP32, False, 62, SdpaBackend.MATH),
        (BF16, False, 60, SdpaBackend.FLASH),
    ],
)
def test_sdpa_forward_backward_under_fake_mode(
    dtype: torch.dtype, with_mask: bool, head_dim: int, backend: SdpaBackend
) -> None:
    with FakeTensorMode():
        q, k, v, *bases = _qkv(d=head_dim, dtype=dtype)
        mask = torch.zeros(2, 1, 32, 32, dtype=dtype) if with_mask else None
        with CudaSdpa() as sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert sdpa.backend_counts[backend] == 1
        assert out.shape == (2, 4, 32, head_dim) and out.dtype == dtype
        grads = _sdpa_grads(out, tuple(bases))
    assert [g.shape for g in grads] == [b.shape for b in bases]
    assert all(g.dtype == dtype for g in grads)


def test_sdpa_on_real_cpu_tensors_and_dropout() -> None:
    q, k, v, *bases = _qkv(dtype=BF16)
    with CudaSdpa():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        out_math = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), dropout_p=0.1, scale=0.5
        )
    assert out.dtype == BF16 and out_math.dtype == FP32
    grads = _sdpa_grads(out, tuple(bases))
    assert all(g.shape == b.shape for g, b in zip(grads, bases, strict=True))


def test_flash_allocations() -> None:
    b, h, length, d = 2, 8, 256, 64
    with FakeTensorMode():
        q, k, v, *bases = _qkv(b, h, length, d, dtype=BF16)
        assert sk.flash_forward_num_splits(b, h, length, length, d, 0.0, 108) == 1
        with CudaSdpa(), AllocationRecorder() as forward:
            out = F.scaled_dot_product_attention(q, k, v)
        saved = _saved_tensors(out)
        backward = AllocationRecorder()
        _sdpa_grads(out, tuple(bases), backward)
    elements = b * length * h * d
    # mha_fwd: out (q's layout), softmax_lse (B, H, L) fp32, rng_state uint64[2], _unused uint64[]
    assert forward.sizes() == sorted([elements * 2, b * h * length * 4, 16, 8])
    lse = saved[4]
    assert lse.shape == (b, h, length) and lse.dtype == FP32
    # mha_bwd: dq, dk, dv, softmax_d (B, H, round128(L)) fp32, dq_accum (B, round128(L), H,
    # round32(D)) fp32; grad_out and out are already (B, L, H, D)-contiguous: no copies
    assert backward.sizes() == sorted([elements * 2] * 3 + [b * h * 256 * 4, b * 256 * h * 64 * 4])


def test_flash_backward_copies_non_contiguous_grad_out_and_out() -> None:
    b, h, length, d = 1, 2, 128, 64
    with FakeTensorMode():
        # contiguous (B, H, L, D) inputs: the (B, L, H, D) views the kernel reads are not
        q, k, v = (torch.randn(b, h, length, d, dtype=BF16, requires_grad=True) for _ in range(3))
        with CudaSdpa():
            out = F.scaled_dot_product_attention(q, k, v)
        grad = torch.ones(b, h, length, d, dtype=BF16)
        with AllocationRecorder() as backward:
            torch.autograd.grad(out, (q, k, v), grad)
    elements = b * length * h * d
    # the output buffer copies q's (B, H, L, D) layout, so its (B, L, H, D) view is not contiguous
    copies = [elements * 2, elements * 2]
    assert backward.sizes() == sorted(
        [elements * 2] * 3 + copies + [b * h * 128 * 4, b * 128 * h * 64 * 4]
    )


def test_flash_split_kv_accumulators() -> None:
    b, h, length, d = 1, 2, 1024, 64
    splits = sk.flash_forward_num_splits(b, h, length, length, d, 0.0, 108)
    assert splits == 4
    with FakeTensorMode():
        q, k, v, *_ = _qkv(b, h, length, d, dtype=BF16)
        with CudaSdpa(num_sms=108), AllocationRecorder() as forward:
            F.scaled_dot_product_attention(q, k, v)
    accumulators = [splits * b * h * length * 4, splits * b * h * length * 64 * 4]
    assert forward.sizes() == sorted(
        [b * length * h * d * 2, b * h * length * 4, 16, 8, *accumulators]
    )


def test_flash_gqa_backward_expands_dk_dv() -> None:
    b, h, hk, length, d = 2, 8, 2, 128, 64
    with FakeTensorMode():
        q, k, v, *bases = _qkv(b, h, length, d, hk=hk, dtype=BF16)
        with CudaSdpa() as sdpa:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert sdpa.backend_counts[SdpaBackend.FLASH] == 1
        backward = AllocationRecorder()
        grads = _sdpa_grads(out, tuple(bases), backward)
    q_elements, kv_elements = b * length * h * d, b * length * hk * d
    expected = [
        q_elements * 2,
        kv_elements * 2,
        kv_elements * 2,
        b * h * 128 * 4,
        b * 128 * h * 64 * 4,
    ]
    expected += [q_elements * 2, q_elements * 2]  # dk_expanded, dv_expanded over all query heads
    assert backward.sizes() == sorted(expected)
    assert grads[1].shape == bases[1].shape


def test_flash_pads_head_dim_to_a_multiple_of_8() -> None:
    b, h, length, d = 2, 4, 32, 60
    with FakeTensorMode():
        q, k, v, *_ = _qkv(b, h, length, d, dtype=BF16)
        with CudaSdpa(), AllocationRecorder() as forward:
            out = F.scaled_dot_product_attention(q, k, v)
    assert out.shape[-1] == 60
    padded = b * length * h * 64 * 2
    # three padded inputs (saved by the flash op), the padded output, lse, rng state
    assert forward.sizes() == sorted([padded] * 4 + [b * h * length * 4, 16, 8])


def test_efficient_allocations_float32() -> None:
    b, h, length, d = 2, 4, 40, 64
    with FakeTensorMode():
        q, k, v, *bases = _qkv(b, h, length, d, dtype=FP32)
        mask = torch.zeros(b, 1, length, length)  # strides multiples of 8: no padding
        with CudaSdpa(), AllocationRecorder() as forward:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        saved = _saved_tensors(out)
        backward = AllocationRecorder()
        _sdpa_grads(out, tuple(bases), backward)
    elements = b * length * h * d
    # res (B, M, H, Kv), logsumexp (B, H, round32(M)) fp32, philox seed and offset
    assert forward.sizes() == sorted([elements * 4, b * h * 64 * 4, 8, 8])
    assert saved[4].shape == (b, h, 64)
    workspace = sk.efficient_attention_backward_workspace_bytes(b, h, length, length, d, d, FP32)
    # kernel 64x64 (kMaxK 64): grad-Q tiles ceil(40/64) * ceil(64/64) * (4 + 64*64) floats per (b, h)
    assert workspace == b * h * 4100 * 4
    # grad q/k/v; float32 delta: (B, M, H, Kv) product, (B, M, H) sum, (B, H, M) copy; workspace
    delta = [elements * 4, b * length * h * 4, b * h * length * 4]
    assert backward.sizes() == sorted([elements * 4] * 3 + delta + [workspace])


def test_efficient_allocations_bf16_bool_mask() -> None:
    b, h, length, d = 2, 4, 40, 128
    with FakeTensorMode():
        q, k, v, *bases = _qkv(b, h, length, d, dtype=BF16)
        mask = torch.ones(b, 1, length, length, dtype=torch.bool)
        with CudaSdpa(), AllocationRecorder() as forward:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        backward = AllocationRecorder()
        _sdpa_grads(out, tuple(bases), backward)
    elements = b * length * h * d
    mask_elements = b * length * length
    # convert_boolean_attn_mask: logical_not (bool temp) and the additive bf16 mask
    assert forward.sizes() == sorted(
        [mask_elements, mask_elements * 2, elements * 2, b * h * 64 * 4, 8, 8]
    )
    workspace = sk.efficient_attention_backward_workspace_bytes(b, h, length, length, d, d, BF16)
    # kernel 128x128 (kMaxK 128, output in registers): only grad-Q tiles
    assert workspace == b * h * 1 * 1 * (4 + 128 * 128) * 4
    # 16-bit kernels compute delta themselves: only delta (B, H, M) fp32 is allocated
    assert backward.sizes() == sorted([elements * 2] * 3 + [b * h * length * 4, workspace])


def test_efficient_pads_unaligned_mask_and_skips_logsumexp_without_grad() -> None:
    b, h, length, d = 1, 2, 36, 64
    with FakeTensorMode():
        q, k, v, *_ = _qkv(b, h, length, d, dtype=FP32, requires_grad=False)
        mask = torch.zeros(b, 1, length, length)  # stride 36 is not a multiple of 8
        with CudaSdpa(), AllocationRecorder() as forward:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.grad_fn is None
    padded_mask = b * length * 40 * 4  # pad_bias: last dim 36 -> 40
    # no logsumexp bytes without grad (``compute_logsumexp ? ceil_div(M, 32) * 32 : 0``)
    assert forward.sizes() == sorted([padded_mask, b * length * h * d * 4, 8, 8])


def test_efficient_workspace_for_head_dim_over_output_registers() -> None:
    # bf16, head dim 96 on sm80: kernel 128x128 k128 keeps the output in registers
    assert sk.efficient_attention_backward_workspace_bytes(1, 1, 128, 128, 96, 96, BF16) == (
        (4 + 128 * 128) * 4
    )
    # head dim 160: kernel 128x64 k65536: grad-K/V staged in float32 per key split
    got = sk.efficient_attention_backward_workspace_bytes(1, 1, 128, 128, 160, 160, BF16)
    grad_q = 1 * 3 * (4 + 128 * 64)
    splits = min(2, 200 // 1)
    grad_kv = 2 * splits * 64 * 256
    assert got == (grad_q + grad_kv) * 4


def test_sdpa_with_autocast_in_either_order() -> None:
    with FakeTensorMode():
        q, k, v, *_ = _qkv(dtype=FP32)
        mask = torch.zeros(2, 1, 32, 32)
        for outer in (CudaSdpa, CudaAutocast):
            sdpa = CudaSdpa()
            autocast = CudaAutocast(BF16)
            first, second = (sdpa, autocast) if outer is CudaSdpa else (autocast, sdpa)
            with first, second:
                out = F.scaled_dot_product_attention(q, k, v)
                masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            assert out.dtype == masked.dtype == BF16
            assert sdpa.backend_counts[SdpaBackend.FLASH] == 1
            assert sdpa.backend_counts[SdpaBackend.EFFICIENT] == 1


def test_math_fallback_upcasts_like_cuda() -> None:
    with FakeTensorMode():
        q, k, v, *bases = _qkv(d=512, dtype=BF16)
        with sdpa_kernel([SDPBackend.MATH]), CudaSdpa(), OpLog() as log:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        assert out.dtype == BF16
        _sdpa_grads(out, tuple(bases))
    ops = log.ops()
    # the float32 upcast of q, k, v, then CUDA's fused dropout with a bool mask
    assert ops.count("_to_copy") >= 3
    assert "native_dropout" in ops
    dropout = next(
        out for func, _, _, out in log.calls if func.overloadpacket.__name__ == "native_dropout"
    )
    assert dropout[1].dtype == torch.bool


@pytest.mark.parametrize("shape", [(1, 1, 36, 36), (1, 1, 36, 40), (2, 1, 40, 40), (2, 4, 8, 12)])
def test_padded_mask_size_formula_matches_the_trace(shape: tuple[int, ...]) -> None:
    with FakeTensorMode():
        q = torch.empty(shape[0], 4, shape[2], 64)
        k = torch.empty(shape[0], 4, shape[3], 64)
        mask = torch.zeros(shape)
        with AllocationRecorder() as recorder:
            sd._preprocess_mask(mask, q, k)
    assert sum(recorder.sizes()) == sk._padded_mask_bytes(4, *shape)
