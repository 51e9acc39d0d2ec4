"""What CUDA does differently from the CPU, emulated on (fake) CPU tensors.

memfit traces a training step on fake CPU tensors: fake CUDA tensors cannot run autograd on a machine
without a GPU. Everything a CUDA run does differently from that CPU trace, and that changes what is
allocated, has to be emulated while tracing. This module holds those emulations, as
``TorchFunctionMode``s:

``CudaAutocast(dtype)``
    ``torch.autocast("cuda", dtype)`` for CPU tensors: CUDA's cast policies and op lists
    (``aten/src/ATen/autocast_mode.h``, ``AT_FORALL_*`` macros registered for the ``Autocast`` (CUDA)
    dispatch key in ``aten/src/ATen/autocast_mode.cpp``), and its weight cache (``cached_cast``), which
    keeps the low-precision copy of every fp32 parameter alive until the autocast region is left.

``CudaSdpa()``
    ``F.scaled_dot_product_attention`` as an sm80+ GPU runs it: the backend PyTorch would pick
    (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) and the tensors that backend's kernels
    allocate, save for backward and allocate in backward (flash: ``flash_attn/flash_api.cpp``;
    memory-efficient: ``cuda/attention.cu`` and ``cuda/attention_backward.cu``; math: the
    ``_scaled_dot_product_attention_math`` composite in ``transformers/attention.cpp``).

Both modes only change *what is allocated and in which dtype*; the numbers they compute are
meaningless where a fused kernel is emulated (outputs are zero-filled).

Why a TorchFunctionMode and not a dispatch mode: autocast sits above autograd, so its casts must be
recorded by autograd (gradients are cast back in backward, as on CUDA). A function mode sees the
Python-level calls (``F.linear``, ``Tensor.softmax``...) before autograd does. The C++ autocast kernels
see *aten* ops instead, including the ones a composite op (``cross_entropy_loss``) or a Python
function (``F.normalize``) calls internally. To see those too, a Python function is re-dispatched with
the mode re-entered (``torch._C._skip_one_hop_torch_function``), so its body's calls reach the mode;
the C++ composites that matter (``cross_entropy_loss``, ``nll_loss_nd``) are decomposed here as
``LossNLL.cpp`` decomposes them.

Not thread-safe: ``CudaAutocast`` patches ``torch.autocast`` and ``torch.is_autocast_enabled`` (and
friends) for as long as it is entered.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import types as _pytypes
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfit.estimate.trace import sized_allocation

__all__ = [
    "FP32_APPEND_DTYPE_OPS",
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "LOWER_PRECISION_FP_OPS",
    "PROMOTE_OPS",
    "CastPolicy",
    "CudaAutocast",
    "CudaSdpa",
    "SdpaBackend",
    "autocast_policy",
    "efficient_attention_backward_workspace_bytes",
    "flash_forward_num_splits",
    "select_sdpa_backend",
]

# ---------------------------------------------------------------------------------------------------
# CUDA autocast op lists.
#
# Source: aten/src/ATen/autocast_mode.h (PyTorch 2.4+, with the additions up to 2.13: rms_norm,
# linalg_vecdot, the upsample ops, scaled_dot_product_attention), the AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE and
# AT_FORALL_PROMOTE macros, registered for CUDA in aten/src/ATen/autocast_mode.cpp
# (TORCH_LIBRARY_IMPL(aten, Autocast, m)), which also registers cudnn_convolution(_transpose) as
# lower_precision_fp and bans binary_cross_entropy. Keys are aten names, "op" for the default overload
# and "op.overload" otherwise: exactly the overloads CUDA autocast registers (out= and in-place
# overloads are never registered, so never autocast). The unit tests check these lists against the
# AutocastCUDA registrations of the installed torch.
# ---------------------------------------------------------------------------------------------------


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


LOWER_PRECISION_FP_OPS: frozenset[str] = _names(
    """
    _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul
    einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
    rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose
    """
)

FP32_OPS: frozenset[str] = _names(
    """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
    rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
    soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
    upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    """
)

FP32_SET_OPT_DTYPE_OPS: frozenset[str] = _names(
    """
    prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int
    log_softmax.Dimname cumprod cumprod.dimname cumsum cumsum.dimname linalg_vector_norm
    linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList sum.dim_DimnameList
    """
)

# norm overloads without a dtype argument are redispatched to the dtype overload with float32
FP32_APPEND_DTYPE_OPS: frozenset[str] = _names(
    "norm.Scalar norm.ScalarOpt_dim norm.names_ScalarOpt_dim"
)

PROMOTE_OPS: frozenset[str] = _names(
    """
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
    scatter_add
    """
)

BANNED_OPS: frozenset[str] = _names("binary_cross_entropy")

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


class CastPolicy(enum.Enum):
    """at::autocast::CastPolicy, plus what this module does for composite ops and banned ops."""

    LOWER_PRECISION_FP = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    PROMOTE = "promote"
    BANNED = "banned"
    # CompositeImplicitAutograd ops whose C++ decomposition calls autocast ops: the AutocastCUDA key
    # sees those inner calls, a function mode does not, so they are decomposed here.
    CROSS_ENTROPY = "cross_entropy_loss decomposition"


def _build_policy_tables() -> tuple[dict[str, CastPolicy], dict[str, CastPolicy]]:
    exact: dict[str, CastPolicy] = {}
    for ops, policy in (
        (LOWER_PRECISION_FP_OPS, CastPolicy.LOWER_PRECISION_FP),
        (FP32_OPS, CastPolicy.FP32),
        (FP32_SET_OPT_DTYPE_OPS, CastPolicy.FP32_SET_OPT_DTYPE),
        (FP32_APPEND_DTYPE_OPS, CastPolicy.FP32_APPEND_DTYPE),
        (PROMOTE_OPS, CastPolicy.PROMOTE),
        (BANNED_OPS, CastPolicy.BANNED),
    ):
        for op in ops:
            exact[op] = policy
    # LossNLL.cpp: nll_loss_nd only reshapes and calls nll_loss / nll_loss2d (both fp32)
    exact["nll_loss_nd"] = CastPolicy.FP32
    exact["cross_entropy_loss"] = CastPolicy.CROSS_ENTROPY
    # A Python-level builtin (torch.sum, Tensor.softmax, F.linear) names the aten op without the
    # overload; every base name here has a single policy across its registered overloads.
    base = {name.split(".")[0]: policy for name, policy in exact.items()}
    return exact, base


_EXACT_POLICIES, _BASE_POLICIES = _build_policy_tables()
_SOFTMAX_OPS = frozenset({"softmax", "log_softmax"})
_CONV_WITH_STRING_PADDING = frozenset({"conv1d", "conv2d", "conv3d"})

# The torch-function-level callables reach __torch_function__ as builtins named after the aten op
# (F.linear is torch._C._nn.linear, Tensor.softmax is TensorBase.softmax, torch.layer_norm,
# F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention, F.cross_entropy calls
# torch._C._nn.cross_entropy_loss, F.nll_loss calls torch._C._nn.nll_loss_nd), or as torch.ops
# OpOverloads. Python functions (F.softmax, F.layer_norm, torch.einsum, Tensor.__pow__, F.normalize)
# are not matched: their bodies call the builtins, which are.


def _aten_key(func: Any) -> tuple[str, bool] | None:
    """(aten name, exact) for a builtin or an aten OpOverload; None for anything else."""
    if isinstance(func, torch._ops.OpOverload):
        if func.namespace != "aten":
            return None
        overload = func._overloadname
        return (func._opname if overload == "default" else f"{func._opname}.{overload}", True)
    if isinstance(func, torch._ops.OpOverloadPacket):
        qualified = func._qualified_op_name
        return (qualified.split("::", 1)[1], False) if qualified.startswith("aten::") else None
    if isinstance(func, _pytypes.FunctionType):
        return None
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return None
    if name.startswith("__") and name.endswith("__"):
        # Tensor.__matmul__ is aten::matmul; __rpow__ and friends are Python functions (see above)
        name = name[2:-2]
    return name, False


def autocast_policy(func: Any) -> CastPolicy | None:
    """The CUDA autocast policy of a torch-function-level callable (None: not autocast)."""
    key = _aten_key(func)
    if key is None:
        return None
    name, exact = key
    return (_EXACT_POLICIES if exact else _BASE_POLICIES).get(name)


# ---------------------------------------------------------------------------------------------------
# Mode plumbing shared by both emulations.
# ---------------------------------------------------------------------------------------------------

_SKIP_ONE_HOP: Callable[..., Any] | None = getattr(torch._C, "_skip_one_hop_torch_function", None)


@contextlib.contextmanager
def _mode_pushed(mode: TorchFunctionMode) -> Iterator[None]:
    # The low-level push, not ``with mode:``, so that __enter__ (which resets state) is not re-run.
    torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        torch._C._pop_torch_function_stack()


def _redispatch(
    mode: TorchFunctionMode,
    func: Any,
    types: Sequence[type],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``func`` unchanged; for a Python function, with ``mode`` active inside its body.

    Inside ``__torch_function__`` the mode is popped, so the calls a Python function makes (F.normalize
    calls linalg_vector_norm) would not reach it, while on CUDA autocast sees every aten op. Skipping
    one hop of torch-function dispatch runs the body with the mode re-entered. Without
    ``_skip_one_hop_torch_function`` (torch < 2.5) the body runs unseen.
    """
    if _SKIP_ONE_HOP is not None and isinstance(func, _pytypes.FunctionType):
        with _mode_pushed(mode):
            return _SKIP_ONE_HOP(func, tuple(types), tuple(args), kwargs)
    return func(*args, **kwargs)


# Mirrors ExcludeDispatchKeyGuard(AutocastFunctionality): the ops an autocast kernel (or an emulated
# fused kernel) runs internally are not autocast again.
_AUTOCAST_EXCLUDED = [0]


@contextlib.contextmanager
def _autocast_excluded() -> Iterator[None]:
    _AUTOCAST_EXCLUDED[0] += 1
    try:
        yield
    finally:
        _AUTOCAST_EXCLUDED[0] -= 1


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# The trace runs on CPU tensors that stand for CUDA tensors ("cuda" for fake CUDA tensors, if any).
_EMULATED_DEVICE_TYPES = ("cpu", "cuda")


def _is_autocast_eligible(t: torch.Tensor) -> bool:
    # autocast_mode.h is_autocast_eligible(tensor, CUDA): a CUDA floating-point tensor
    return t.is_floating_point() and t.device.type in _EMULATED_DEVICE_TYPES


def _is_eligible(t: Any) -> bool:
    # autocast_mode.h is_eligible: defined, autocast-eligible, not double
    return isinstance(t, torch.Tensor) and _is_autocast_eligible(t) and t.dtype != torch.float64


def _first_arg(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


def _iter_tensors(values: Any) -> Iterator[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for value in values:
            yield from _iter_tensors(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from _iter_tensors(value)


# ---------------------------------------------------------------------------------------------------
# CudaAutocast
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Region:
    """One autocast region: what torch.autocast.__enter__ writes to the thread-local state."""

    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


_ACTIVE_AUTOCASTS: list[CudaAutocast] = []
_ORIGINALS: dict[str, Any] = {}
_TORCH_QUERIES = (
    "is_autocast_enabled",
    "get_autocast_dtype",
    "is_autocast_cache_enabled",
    "get_autocast_gpu_dtype",
    "is_autocast_cpu_enabled",
    "get_autocast_cpu_dtype",
    "clear_autocast_cache",
)


def _active_autocast() -> CudaAutocast | None:
    return _ACTIVE_AUTOCASTS[-1] if _ACTIVE_AUTOCASTS else None


def _emulates(device_type: Any) -> bool:
    return _active_autocast() is not None and device_type in _EMULATED_DEVICE_TYPES


def _install_autocast_patches() -> None:
    """Route torch.autocast regions and autocast queries for "cuda"/"cpu" to the active emulation.

    Model code enters ``torch.autocast(x.device.type, enabled=False)`` to force fp32 (rotary
    embeddings); in the trace ``x.device.type`` is "cpu". transformers' ``maybe_autocast`` and
    ``torch.utils.checkpoint`` first ask ``torch.is_autocast_enabled(device_type)``. Both are answered
    from the emulated CUDA state, and a region entered for "cpu" or "cuda" becomes an emulated CUDA
    autocast region instead of real CPU autocast.
    """
    cls = torch.amp.autocast_mode.autocast
    orig_init = cls.__init__
    orig_enter = cls.__enter__
    orig_exit = cls.__exit__
    _ORIGINALS.update(__init__=orig_init, __enter__=orig_enter, __exit__=orig_exit)
    for name in _TORCH_QUERIES:
        if hasattr(torch, name):
            _ORIGINALS[name] = getattr(torch, name)

    def __init__(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if not _emulates(device_type):
            orig_init(self, device_type, dtype, enabled, cache_enabled)
            return
        with warnings.catch_warnings():
            # "CUDA is not available ... Disabling autocast": the tracer has no GPU, the target has
            warnings.simplefilter("ignore")
            orig_init(self, device_type, dtype, enabled, cache_enabled)
        self._memfit_requested_enabled = enabled

    def __enter__(self: Any) -> Any:
        mode = _active_autocast()
        if mode is None or self.device not in _EMULATED_DEVICE_TYPES:
            return orig_enter(self)
        enabled = bool(self.__dict__.get("_memfit_requested_enabled", self._enabled))
        mode._push_region(_Region(enabled, self.fast_dtype, bool(self._cache_enabled)))
        self.__dict__.setdefault("_memfit_owners", []).append(mode)
        return self

    def __exit__(self: Any, *exc: Any) -> Any:
        owners = self.__dict__.get("_memfit_owners")
        if not owners:
            return orig_exit(self, *exc)
        owners.pop()._pop_region()
        return False

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        mode = _active_autocast()
        if mode is not None and (device_type is None or device_type in _EMULATED_DEVICE_TYPES):
            return mode._region.enabled
        original = _ORIGINALS["is_autocast_enabled"]
        return bool(original() if device_type is None else original(device_type))

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        mode = _active_autocast()
        if mode is not None and device_type in _EMULATED_DEVICE_TYPES:
            return mode._region.dtype
        return _ORIGINALS["get_autocast_dtype"](device_type)  # type: ignore[no-any-return]

    def is_autocast_cache_enabled() -> bool:
        mode = _active_autocast()
        return (
            mode._region.cache_enabled
            if mode is not None
            else bool(_ORIGINALS["is_autocast_cache_enabled"]())
        )

    def get_autocast_gpu_dtype() -> torch.dtype:
        return get_autocast_dtype("cuda")

    def is_autocast_cpu_enabled() -> bool:
        return is_autocast_enabled("cpu")

    def get_autocast_cpu_dtype() -> torch.dtype:
        return get_autocast_dtype("cpu")

    def clear_autocast_cache() -> None:
        mode = _active_autocast()
        if mode is not None:
            mode._cache.clear()
        _ORIGINALS["clear_autocast_cache"]()

    replacements: dict[str, Callable[..., Any]] = {
        "is_autocast_enabled": is_autocast_enabled,
        "get_autocast_dtype": get_autocast_dtype,
        "is_autocast_cache_enabled": is_autocast_cache_enabled,
        "get_autocast_gpu_dtype": get_autocast_gpu_dtype,
        "is_autocast_cpu_enabled": is_autocast_cpu_enabled,
        "get_autocast_cpu_dtype": get_autocast_cpu_dtype,
        "clear_autocast_cache": clear_autocast_cache,
    }
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__enter__ = __enter__  # type: ignore[method-assign]
    cls.__exit__ = __exit__  # type: ignore[method-assign]
    for name, replacement in replacements.items():
        if name in _ORIGINALS:
            setattr(torch, name, replacement)


def _uninstall_autocast_patches() -> None:
    cls = torch.amp.autocast_mode.autocast
    cls.__init__ = _ORIGINALS.pop("__init__")  # type: ignore[method-assign]
    cls.__enter__ = _ORIGINALS.pop("__enter__")  # type: ignore[method-assign]
    cls.__exit__ = _ORIGINALS.pop("__exit__")  # type: ignore[method-assign]
    for name in _TORCH_QUERIES:
        if name in _ORIGINALS:
            setattr(torch, name, _ORIGINALS.pop(name))


class CudaAutocast(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)``, emulated for CPU (and fake CPU) tensors.

    Entering it is entering an autocast region (``enabled=True``), with CUDA's op lists, cast
    policies and weight cache. The weight cache keeps the ``dtype`` copy of each fp32 leaf tensor that
    requires grad (the parameters) from its first use until the region is left, exactly as
    ``cached_cast`` in autocast_mode.cpp does; leaving clears it.

    ``enabled=False`` emulates code that runs outside any autocast region (a ``loss.backward()``
    after the forward's region) while still turning the ``torch.autocast`` regions opened inside it
    into emulated CUDA regions. Wrap the backward of a step that uses gradient checkpointing in
    ``CudaAutocast(dtype, enabled=False)``: the recomputation re-enters the forward's autocast
    state through ``torch.autocast``, which would otherwise run real CPU autocast.

    CUDA behaviours that do not depend on autocast are emulated too while the mode is entered:
    ``softmax``/``log_softmax`` of a float16 tensor with ``dtype=torch.float32`` runs the fused
    half-to-float kernel (``SoftMax.cpp``: no float32 copy of the input; fake tensors only, the CPU
    kernel has no such path).
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        *,
        enabled: bool = True,
        cache_enabled: bool = True,
    ) -> None:
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CUDA autocast runs in float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._regions: list[_Region] = []
        self._nesting = 0
        # id(source) -> (weakref to the source, its cast copy): cached_casts in autocast_mode.cpp,
        # keyed by TensorImpl* with a weakref that guards against a reused address
        self._cache: dict[int, tuple[weakref.ReferenceType[torch.Tensor], torch.Tensor]] = {}

    # -- context management ---------------------------------------------------------------------

    def __enter__(self) -> CudaAutocast:
        if self in _ACTIVE_AUTOCASTS:
            raise RuntimeError(
                "this CudaAutocast is already entered; nest torch.autocast regions instead"
            )
        self._regions = [_Region(self.enabled, self.dtype, self.cache_enabled)]
        # enabled=False stands for "no autocast region": regions entered inside it are outermost
        self._nesting = 1 if self.enabled else 0
        self._cache.clear()
        if not _ACTIVE_AUTOCASTS:
            _install_autocast_patches()
        _ACTIVE_AUTOCASTS.append(self)
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        _ACTIVE_AUTOCASTS.remove(self)
        if not _ACTIVE_AUTOCASTS:
            _uninstall_autocast_patches()
        # why: autocast's __exit__ at nesting 0 calls clear_autocast_cache(); this frees the cast
        # weight copies that nothing else (the autograd graph) still holds
        self._cache.clear()
        self._regions.clear()
        self._nesting = 0

    @property
    def _region(self) -> _Region:
        return (
            self._regions[-1] if self._regions else _Region(False, self.dtype, self.cache_enabled)
        )

    def _push_region(self, region: _Region) -> None:
        self._regions.append(region)
        self._nesting += 1

    def _pop_region(self) -> None:
        self._regions.pop()
        self._nesting -= 1
        if self._nesting == 0:
            # why: leaving the outermost autocast region drops the weight cache (autocast __exit__)
            self._cache.clear()

    # -- introspection (tests, debugging) ---------------------------------------------------------

    @property
    def cache_size(self) -> int:
        """Number of cast copies the weight cache holds."""
        return len(self._cache)

    def cached_copy(self, source: torch.Tensor) -> torch.Tensor | None:
        """The cached low-precision copy of ``source``, if the weight cache holds one."""
        entry = self._cache.get(id(source))
        return entry[1] if entry is not None and entry[0]() is source else None

    # -- casting ----------------------------------------------------------------------------------

    def cached_cast(self, to: torch.dtype, value: Any) -> Any:
        """autocast_mode.cpp ``cached_cast``, for a tensor, a list/tuple of tensors, or anything else."""
        if isinstance(value, torch.Tensor):
            return self._cast_tensor(to, value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            cast = [self.cached_cast(to, v) for v in value]
            return cast if isinstance(value, list) else tuple(cast)
        return value

    def _cast_tensor(self, to: torch.dtype, t: torch.Tensor) -> torch.Tensor:
        if not _is_eligible(t) or t.dtype == to:
            return t
        region = self._region
        can_try_cache = (
            to == region.dtype
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and region.cache_enabled
            and not torch.is_inference_mode_enabled()  # PyTorch #158232: no caching in inference mode
        )
        if not can_try_cache:
            # why: a real, autograd-recorded cast (ToCopyBackward casts the gradient back), as on CUDA
            return t.to(to)
        entry = self._cache.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        # why: the low-precision copy of a parameter, kept alive by the cache until the region ends
        cast = t.to(to)
        self._cache[id(t)] = (weakref.ref(t), cast)
        return cast

    def _cast_all(
        self, to: torch.dtype, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (
            tuple(self.cached_cast(to, a) for a in args),
            {k: self.cached_cast(to, v) for k, v in kwargs.items()},
        )

    def _promote_type(self, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.dtype:
        # autocast_mode.h promote_type / prioritize
        lower = self._region.dtype
        current = lower
        for t in _iter_tensors((tuple(args), kwargs)):
            if not _is_autocast_eligible(t) or t.dtype == torch.float64:
                continue  # non-floating and double tensors do not vote
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif current == lower and t.dtype == lower:
                current = lower
            else:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return current

    # -- dispatch ---------------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        if _AUTOCAST_EXCLUDED[0]:
            return _redispatch(self, func, types, args, kwargs)
        key = _aten_key(func)
        if key is None:
            return _redispatch(self, func, types, args, kwargs)
        name, exact = key
        policy = (_EXACT_POLICIES if exact else _BASE_POLICIES).get(name)
        base_name = name.split(".")[0]
        if policy is None or "out" in kwargs or not self._region.enabled:
            # out= overloads are never registered for autocast; disabled regions cast nothing
            if base_name in _SOFTMAX_OPS:
                return self._softmax(func, args, kwargs)
            return func(*args, **kwargs)
        return self._apply_policy(policy, name, func, args, kwargs)

    def _apply_policy(
        self,
        policy: CastPolicy,
        name: str,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        base_name = name.split(".")[0]
        if policy is CastPolicy.LOWER_PRECISION_FP:
            if base_name in _CONV_WITH_STRING_PADDING and _has_string_padding(args, kwargs):
                # conv*d.padding (string padding) is not in the CUDA list, only conv*d is
                return func(*args, **kwargs)
            args, kwargs = self._cast_all(self._region.dtype, args, kwargs)
        elif policy is CastPolicy.FP32:
            args, kwargs = self._cast_all(torch.float32, args, kwargs)
        elif policy is CastPolicy.FP32_SET_OPT_DTYPE:
            if _is_eligible(_first_arg(args, kwargs)):
                args, kwargs = _set_opt_dtype(base_name, args, kwargs, torch.float32)
            if base_name in _SOFTMAX_OPS:
                return self._softmax(func, args, kwargs)
        elif policy is CastPolicy.FP32_APPEND_DTYPE:
            return self._append_dtype(name, func, args, kwargs)
        elif policy is CastPolicy.PROMOTE:
            args, kwargs = self._cast_all(self._promote_type(args, kwargs), args, kwargs)
        elif policy is CastPolicy.BANNED:
            raise RuntimeError(_BANNED_MESSAGE)
        elif policy is CastPolicy.CROSS_ENTROPY:
            return self._cross_entropy(func, args, kwargs)
        return func(*args, **kwargs)

    def _append_dtype(
        self, name: str, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        # fp32_append_dtype: norm(x, p[, dim, keepdim]) -> norm(..., dtype=float32) if x is eligible
        if not _is_eligible(_first_arg(args, kwargs)) or kwargs.get("dtype") is not None:
            return func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload):
            # redispatch to the dtype overload, as KERNEL_DIFFERENT_REDISPATCH_SIGNATURE does
            if name == "norm.Scalar":
                args = tuple(args) if len(args) > 1 or "p" in kwargs else (*args, 2)
                return torch.ops.aten.norm.ScalarOpt_dtype(*args, **kwargs, dtype=torch.float32)
            return torch.ops.aten.norm.ScalarOpt_dim_dtype(*args, **kwargs, dtype=torch.float32)
        return func(*args, **kwargs, dtype=torch.float32)

    def _softmax(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """softmax/log_softmax, with SoftMax.cpp's CUDA half -> float fused path.

        ``softmax(x, dim, dtype)`` converts x to dtype first (a full-size copy), except on CUDA for a
        float16 x and dtype float32, where ``_softmax(x, dim, half_to_float=True)`` reads the half
        input directly. The CPU kernel has no half_to_float path, so this only applies to fake tensors.
        """
        x = _first_arg(args, kwargs)
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if (
            isinstance(x, torch.Tensor)
            and x.dtype == torch.float16
            and dtype == torch.float32
            and isinstance(dim, int)
            and _is_fake(x)
        ):
            is_log = getattr(func, "__name__", "").startswith("log_softmax") or (
                isinstance(func, torch._ops.OpOverload) and func._opname == "log_softmax"
            )
            fused = torch._log_softmax if is_log else torch._softmax
            return fused(x, dim, True)
        return func(*args, **kwargs)

    def _cross_entropy(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """cross_entropy_loss as LossNLL.cpp decomposes it, with autocast applied to each inner op.

        Note ``log_softmax(self, class_dim, self.scalar_type())``: the dtype is explicit, so autocast
        keeps the log-probabilities in the input's dtype; ``nll_loss`` (fp32) then makes a float32
        copy of them, which nll_loss_forward saves for backward.
        """
        bound = _bind_cross_entropy(args, kwargs)
        if bound is None or not _is_eligible(bound.input):
            return func(*args, **kwargs)
        x, target, weight = bound.input, bound.target, bound.weight
        reduction, ignore_index, smoothing = (
            bound.reduction,
            bound.ignore_index,
            bound.label_smoothing,
        )
        class_dim = 0 if x.dim() == 1 else 1
        n_classes = x.shape[class_dim]
        log_probs = self._call(torch.log_softmax, x, class_dim, dtype=x.dtype)

        def weight_view() -> torch.Tensor:
            assert weight is not None
            shape = [1] * log_probs.dim()
            shape[class_dim] = weight.shape[0]
            return weight.view(shape)

        if x.shape == target.shape:
            # cross_entropy_loss_prob_target
            if smoothing > 0.0:
                target = target * (1 - smoothing) + smoothing / n_classes
            product = log_probs * target
            if weight is not None:
                product = product * weight_view()
            if reduction == _REDUCTION_MEAN:
                return -self._call(torch.sum, product) / (x.numel() / n_classes)
            if reduction == _REDUCTION_SUM:
                return -self._call(torch.sum, product)
            return -self._call(torch.sum, product, class_dim)

        nll = self._call(
            torch._C._nn.nll_loss_nd, log_probs, target, weight, reduction, ignore_index
        )
        if smoothing <= 0.0:
            return nll
        # cross_entropy_loss_label_smoothing
        weighted = log_probs * weight_view() if weight is not None else log_probs
        smooth_loss = -self._call(torch.sum, weighted, class_dim)
        ignore_mask = target == ignore_index
        smooth_loss.masked_fill_(ignore_mask, 0.0)
        if reduction == _REDUCTION_MEAN:
            if weight is not None:
                # the isTensorSubclassLike branch: no data-dependent masked_select
                filtered = target.masked_fill(ignore_mask, 0)
                weight_sum = self._call(
                    torch.sum,
                    weight.gather(0, filtered.flatten()).masked_fill_(ignore_mask.flatten(), 0),
                )
                ret = self._call(torch.sum, smooth_loss) / weight_sum
            else:
                ret = self._call(torch.sum, smooth_loss) / self._call(torch.sum, ~ignore_mask)
        elif reduction == _REDUCTION_SUM:
            ret = self._call(torch.sum, smooth_loss)
        else:
            ret = smooth_loss
        return (1 - smoothing) * nll + ret * (smoothing / n_classes)

    def _call(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Call an op the way the dispatcher would from inside a composite: through autocast."""
        policy = autocast_policy(func)
        if policy is None or not self._region.enabled:
            return func(*args, **kwargs)
        key = _aten_key(func)
        assert key is not None
        return self._apply_policy(policy, key[0], func, args, kwargs)


def _has_string_padding(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    # conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)
    padding = args[4] if len(args) > 4 else kwargs.get("padding")
    return isinstance(padding, str)


def _set_opt_dtype(
    base_name: str, args: Sequence[Any], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """set_opt_dtype: an explicit dtype is respected, a missing one becomes ``dtype``."""
    args = tuple(args)
    if base_name in _SOFTMAX_OPS and len(args) > 2:
        # softmax(input, dim, dtype): the only ones of these ops with a positional dtype
        if args[2] is None:
            args = (*args[:2], dtype, *args[3:])
        return args, kwargs
    if kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": dtype}
    return args, kwargs


_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


@dataclass
class _CrossEntropyArgs:
    input: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor | None
    reduction: int
    ignore_index: int
    label_smoothing: float


def _bind_cross_entropy(args: Sequence[Any], kwargs: dict[str, Any]) -> _CrossEntropyArgs | None:
    # cross_entropy_loss(Tensor self, Tensor target, Tensor? weight=None, int reduction=Mean,
    #                    SymInt ignore_index=-100, float label_smoothing=0.0)
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    values: dict[str, Any] = {
        "weight": None,
        "reduction": 1,
        "ignore_index": -100,
        "label_smoothing": 0.0,
    }
    values.update(zip(names, args, strict=False))
    values.update(kwargs)
    if "input" in values:
        values["self"] = values.pop("input")
    x, target = values.get("self"), values.get("target")
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    return _CrossEntropyArgs(
        x,
        target,
        values["weight"],
        int(values["reduction"]),
        int(values["ignore_index"]),
        float(values["label_smoothing"]),
    )


# ---------------------------------------------------------------------------------------------------
# CudaSdpa
# ---------------------------------------------------------------------------------------------------


class SdpaBackend(str, enum.Enum):
    """The SDPA backends emulated (cuDNN attention is not: see ``select_sdpa_backend``)."""

    FLASH = "flash_attention"
    EFFICIENT = "efficient_attention"
    MATH = "math"


_SDPA_ORDER_CODES = {1: SdpaBackend.FLASH, 2: SdpaBackend.EFFICIENT, 0: SdpaBackend.MATH}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _sdp_priority_order() -> list[SdpaBackend]:
    # at::globalContext().sDPPriorityOrder(); cuDNN (3) and overrideable (4) are not emulated
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    codes = list(get_order()) if get_order is not None else [1, 2, 0]
    return [_SDPA_ORDER_CODES[c] for c in codes if c in _SDPA_ORDER_CODES]


def _sm(compute_capability: tuple[int, int]) -> int:
    return compute_capability[0] * 10 + compute_capability[1]


def _input_requires_grad(*tensors: torch.Tensor) -> bool:
    # sdp_utils_cpp.h input_requires_grad
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_batch_size_and_num_heads_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool
) -> bool:
    # sdp_utils_cpp.h check_batch_size_and_num_heads_dense<supports_gqa=true, requires_same_num_heads=true>
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if enable_gqa:
        # check_grouped_query_attention<requires_same_num_heads=true>
        return k.size(-3) == v.size(-3) and q.size(-3) % k.size(-3) == 0
    return q.size(-3) == k.size(-3) == v.size(-3)


def _can_use_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    sm: int,
) -> bool:
    """sdp_utils.cpp can_use_flash_attention (dense inputs)."""
    if not torch.backends.cuda.flash_sdp_enabled():  # check_runtime_disabled_flash
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    if attn_mask is not None:  # check_for_attn_mask
        return False
    head_dim = q.size(-1)
    if not (head_dim == k.size(-1) == v.size(-1) and head_dim <= 256):  # check_head_dim_size_flash
        return False
    if not 80 <= sm <= 121:  # check_flash_attention_hardware_support
        return False
    if (
        (86 <= sm <= 89 or 120 <= sm <= 121)
        and _input_requires_grad(q, k, v)
        and not (head_dim <= 192 or (dropout_p == 0.0 and head_dim > 224))
    ):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if is_causal and q.size(-2) != k.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    if q.dtype not in _LOW_PRECISION or not (q.dtype == k.dtype == v.dtype):  # check_dtypes_flash
        return False
    if not _check_batch_size_and_num_heads_dense(q, k, v, enable_gqa):
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    # check_last_dim_stride_equals_1_dense<ignore_singleton_dim=true>
    return (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1) or head_dim == 1


def _minimum_gemm_alignment(dtype: torch.dtype, sm: int) -> int:
    # sdp_utils.cpp minimum_gemm_alignment / use_tensor_cores
    is_half = dtype in _LOW_PRECISION
    use_tc = sm >= 80 or (sm >= 70 and is_half)
    alignment = 4 if sm >= 80 else 1
    if use_tc:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _can_use_mem_efficient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
    sm: int,
) -> bool:
    """sdp_utils.cpp can_use_mem_efficient_attention (dense inputs, CUDA build)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():  # check_runtime_disabled_mem_efficient
        return False
    if not 50 <= sm <= 121:  # check_mem_efficient_hardware_support
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    alignment = _minimum_gemm_alignment(q.dtype, sm)
    qk, vk = q.size(-1), v.size(-1)
    if not (qk == k.size(-1) and qk % alignment == 0 and qk > 0 and vk % alignment == 0 and vk > 0):
        return False  # check_head_dim_size_mem_efficient
    if sm >= 80:
        # check_data_ptr_alignment_mem_efficient: storage_offset * element_size % alignment bytes
        for t in (q, k, v):
            if t.numel() and (t.storage_offset() * t.element_size()) % (
                alignment * t.element_size()
            ):
                return False
    if q.size(-2) == 0 or k.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    # check_last_dim_stride_equals_1_dense<ignore_singleton_dim=false>: GPU masks need stride 1 too
    if not (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1):
        return False
    if attn_mask is not None and attn_mask.stride(-1) != 1:
        return False
    if not _check_batch_size_and_num_heads_dense(q, k, v, enable_gqa):
        return False
    allowed = (
        (torch.float16, torch.float32, torch.bfloat16)
        if sm >= 80
        else (torch.float16, torch.float32)
    )
    return q.dtype in allowed and q.dtype == k.dtype == v.dtype


def select_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    *,
    compute_capability: tuple[int, int] = (8, 0),
) -> SdpaBackend:
    """The backend ``select_sdp_backend`` (sdp_utils.cpp) picks on a GPU of this compute capability.

    Honours ``torch.backends.cuda.{flash,mem_efficient,math}_sdp_enabled()`` and the priority order
    that ``torch.nn.attention.sdpa_kernel`` sets. Not emulated: cuDNN attention, which PyTorch puts
    first only on sm90/sm100 with cuDNN > 9.15 (check_prefer_cudnn_attention), and nested tensors.
    """
    sm = _sm(compute_capability)
    for backend in _sdp_priority_order():
        if backend is SdpaBackend.FLASH:
            if _can_use_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, sm):
                return backend
        elif backend is SdpaBackend.EFFICIENT:
            if _can_use_mem_efficient(query, key, value, attn_mask, enable_gqa, sm):
                return backend
        elif torch.backends.cuda.math_sdp_enabled():
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")


def _split_kv_bytes(
    dropout_p: float,
    num_sms: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    *,
    lse: bool,
) -> int:
    """Bytes of flash forward's split-KV ``softmax_lse_accum`` (lse) or ``out_accum``; 0 unsplit."""
    splits = flash_forward_num_splits(
        batch, heads, seqlen_q, seqlen_k, head_dim, dropout_p, num_sms
    )
    if splits <= 1:
        return 0
    if lse:
        return splits * batch * heads * seqlen_q * 4
    head_dim_rounded = _round_up(head_dim, 32) if _round_up(head_dim, 32) < 224 else 256
    return splits * batch * heads * seqlen_q * head_dim_rounded * 4


def _placeholder(nbytes: int, device: Any) -> torch.Tensor:
    """A byte tensor of ``nbytes`` (empty where the real kernel allocates nothing)."""
    return torch.empty((nbytes,), dtype=torch.uint8, device=device)


def _rounded_bytes(itemsize: int, multiples: tuple[int, ...], *dims: int) -> int:
    """Bytes of a buffer whose dims a kernel rounds up to ``multiples``."""
    return math.prod(_round_up(d, m) for d, m in zip(dims, multiples, strict=True)) * itemsize


def _rounded_zeros(
    dims: tuple[int, ...], multiples: tuple[int, ...], dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """A zeroed buffer of ``dims`` rounded up to ``multiples``, declared by its unrounded dims.

    The rounded dims are no bilinear function of the sequence length (round_up(S, 128) is not),
    the unrounded ones are: the fit predicts those and the formula rounds them, exactly.
    """
    padded = tuple(_round_up(d, m) for d, m in zip(dims, multiples, strict=True))
    with sized_allocation(dims, functools.partial(_rounded_bytes, dtype.itemsize, multiples)):
        return torch.zeros(padded, dtype=dtype, device=device)


def _padded_mask_bytes(itemsize: int, *dims: int) -> int:
    """pad_bias: a copy with the last dim padded to a multiple of 8, only when misaligned."""
    *lead, rows, last = dims
    # a contiguous (or broadcast) mask's leading strides are multiples of its last dim, so it is
    # aligned exactly when the last dim is (a sliced, non-contiguous mask is not covered)
    if last % 8 == 0:
        return 0
    return math.prod(lead) * rows * _round_up(last, 8) * itemsize


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


# -- flash attention --------------------------------------------------------------------------------


def flash_forward_num_splits(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    dropout_p: float,
    num_sms: int,
) -> int:
    """flash_api.cpp set_params_splitkv / num_splits_heuristic: split-KV blocks of mha_fwd.

    With more than one split, mha_fwd allocates float32 ``softmax_lse_accum`` and ``out_accum`` for the
    duration of the kernel.
    """
    if dropout_p != 0.0:
        return 1  # "SplitKV is not implemented for dropout"
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    num_n_blocks = _ceil_div(seqlen_k, block_n)
    num_m_blocks = _ceil_div(seqlen_q, 64)
    batch_nheads_mblocks = batch * heads * num_m_blocks
    sms = num_sms * 2  # "multiply number of SMs by 2 to hard-code ... 128 threads per block"
    if batch_nheads_mblocks >= 0.8 * sms:
        return 1
    max_splits = min(128, sms, num_n_blocks)
    efficiency: list[float] = []
    max_efficiency = 0.0

    def eligible(splits: int) -> bool:
        return splits == 1 or _ceil_div(num_n_blocks, splits) != _ceil_div(num_n_blocks, splits - 1)

    for splits in range(1, max_splits + 1):
        if not eligible(splits):
            efficiency.append(0.0)
            continue
        n_waves = batch_nheads_mblocks * splits / sms
        eff = n_waves / math.ceil(n_waves)
        max_efficiency = max(max_efficiency, eff)
        efficiency.append(eff)
    for splits in range(1, max_splits + 1):
        if eligible(splits) and efficiency[splits - 1] >= 0.85 * max_efficiency:
            return splits
    return 1


class _FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` on CUDA (attention.cu -> flash_api.cpp mha_fwd/mha_bwd).

    Inputs are (B, H, L, D) with D already padded to a multiple of 8 by the SDPA composite.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, num_sms: int
    ) -> torch.Tensor:
        batch, heads, seqlen_q, head_dim = q.shape
        seqlen_k = k.shape[2]
        # _scaled_dot_product_flash_attention_cuda works on (B, L, H, D) views
        q_t = q.transpose(1, 2)
        # why: mha_fwd ``out = at::empty_like(q_padded)``: the attention output, strides like q
        out_t = torch.empty_like(q_t)
        # why: mha_fwd ``softmax_lse = at::empty({b, h, seqlen_q}, float)``, saved for backward
        logsumexp = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        # why: set_params_splitkv float32 accumulators, live while the split-KV kernel runs; only
        # some shapes split, so the allocations are declared by formula (empty when unsplit) and
        # every shape traces the same sequence of allocations
        dims = (batch, heads, seqlen_q, seqlen_k, head_dim)
        with sized_allocation(
            dims, functools.partial(_split_kv_bytes, dropout_p, num_sms, lse=True)
        ):
            lse_accum = _placeholder(_split_kv_bytes(dropout_p, num_sms, *dims, lse=True), q.device)
        with sized_allocation(
            dims, functools.partial(_split_kv_bytes, dropout_p, num_sms, lse=False)
        ):
            out_accum = _placeholder(
                _split_kv_bytes(dropout_p, num_sms, *dims, lse=False), q.device
            )
        # why: mha_fwd ``rng_state = at::empty({2}, kUInt64)`` and ``_unused = at::empty({}, kUInt64)``
        # (CUDA tensors, returned as philox seed/offset and saved for backward, dropout or not)
        philox_seed = torch.empty((2,), dtype=torch.uint64, device=q.device)
        philox_offset = torch.empty((), dtype=torch.uint64, device=q.device)
        # why: the split-KV accumulators are locals of mha_fwd: freed when the kernel returns
        del lse_accum, out_accum
        out_t.zero_()
        logsumexp.zero_()
        out = out_t.transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, logsumexp, philox_seed, philox_offset)
        ctx.num_sms = num_sms
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, _logsumexp, _seed, _offset = ctx.saved_tensors
        with _autocast_excluded():
            return (*_flash_backward(grad_out, q, k, v, out, ctx.num_sms), None, None)


def _deterministic() -> bool:
    # the fused backward kernels switch to their deterministic variant only without warn_only
    return (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_scaled_dot_product_flash_attention_backward_cuda -> _flash_attention_backward -> mha_bwd."""
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # why: _flash_attention_backward ``grad_out.contiguous()`` / ``out.contiguous()`` (a copy unless
    # already contiguous in the (B, L, H, D) layout the kernel reads)
    grad_out_t = grad_out.transpose(1, 2).contiguous()
    out_t = out.transpose(1, 2).contiguous()
    # why: mha_bwd ``dq/dk/dv = at::empty_like(q/k/v)``: the input gradients
    dq_t = torch.empty_like(q_t)
    dk_t = torch.empty_like(k_t)
    dv_t = torch.empty_like(v_t)
    head_dim_rounded = _round_up(head_dim, 32) if _round_up(head_dim, 32) < 224 else 256
    # why: mha_bwd ``softmax_d = at::empty({b, h, seqlen_q_rounded}, float)``, the sequence
    # rounded up to 128
    softmax_d = _rounded_zeros((batch, heads, seqlen_q), (1, 1, 128), torch.float32, q.device)
    # why: mha_bwd ``dq_accum = at::empty({b, seqlen_q_rounded, h, head_size_rounded}, float)``
    dq_accum_dims = (batch, seqlen_q, heads, head_dim_rounded)
    if _deterministic():
        # deterministic mode: one accumulator per split, ``nsplits = ceil(num_SMs / (b * h))``
        # (no bilinear dim: shapes in this mode are traced one by one)
        splits = _ceil_div(num_sms, batch * heads)
        dq_accum = _rounded_zeros(
            (splits, *dq_accum_dims), (1, 1, 128, 1, 1), torch.float32, q.device
        )
    else:
        dq_accum = _rounded_zeros(dq_accum_dims, (1, 128, 1, 1), torch.float32, q.device)
    dq_t.zero_()
    if heads_k != heads:
        # why: MQA/GQA: mha_bwd computes dK/dV for every query head, then sums each group
        dk_expanded = torch.zeros(
            (batch, seqlen_k, heads, head_dim), dtype=q.dtype, device=q.device
        )
        dv_expanded = torch.zeros(
            (batch, seqlen_k, heads, head_dim), dtype=q.dtype, device=q.device
        )
        group = heads // heads_k
        torch.sum(dk_expanded.view(batch, seqlen_k, heads_k, group, head_dim), dim=3, out=dk_t)
        torch.sum(dv_expanded.view(batch, seqlen_k, heads_k, group, head_dim), dim=3, out=dv_t)
        del dk_expanded, dv_expanded
    else:
        dk_t.zero_()
        dv_t.zero_()
    del grad_out_t, out_t, softmax_d, dq_accum
    return dq_t.transpose(1, 2), dk_t.transpose(1, 2), dv_t.transpose(1, 2)


# -- memory-efficient attention ---------------------------------------------------------------------

# (kBlockSizeI, kBlockSizeJ, kMaxK) of the backward kernels, in dispatch order, from
# mem_eff_attention/kernels/cutlassB.h dispatch_cutlassB_{bf16,f16,f32}_sm80 (the seq-aligned
# variants have the same tiles and are left out). The first kernel whose kMaxK fits is assumed to
# be launched; the shared-memory fit check of the launcher is not emulated.
_KernelTiles = tuple[tuple[int, int, int], ...]
_CUTLASS_B_HALF: _KernelTiles = (
    (64, 64, 32),
    (64, 64, 64),
    (128, 128, 128),
    (64, 64, 128),
    (128, 64, 65536),
    (64, 64, 65536),
)
_CUTLASS_B_HALF_SM86_89: _KernelTiles = (
    (64, 64, 32),
    (64, 64, 64),
    (128, 64, 96),
    (128, 128, 128),
    (64, 64, 128),
    (128, 64, 65536),
    (64, 64, 65536),
)
_CUTLASS_B_HALF_DROPOUT: _KernelTiles = (
    (64, 64, 32),
    (64, 64, 64),
    (128, 128, 128),
    (64, 64, 128),
    (128, 64, 65536),
    (64, 64, 65536),
)
_CUTLASS_B_F32: _KernelTiles = (
    (64, 64, 32),
    (64, 64, 64),
    (128, 64, 128),
    (64, 64, 128),
    (128, 64, 65536),
    (64, 64, 65536),
)


def _cutlass_b_kernel(
    dtype: torch.dtype, max_k: int, dropout: bool, sm: int
) -> tuple[int, int, int]:
    table: _KernelTiles
    if dtype == torch.float32:
        table = _CUTLASS_B_F32
    elif dropout:
        table = _CUTLASS_B_HALF_DROPOUT
    else:
        table = _CUTLASS_B_HALF_SM86_89 if sm in (86, 89) else _CUTLASS_B_HALF
    for block_i, block_j, kernel_max_k in table:
        if kernel_max_k >= max_k:
            return block_i, block_j, kernel_max_k
    return table[-1]


def efficient_attention_backward_workspace_bytes(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    *,
    dropout: bool = False,
    compute_capability: tuple[int, int] = (8, 0),
) -> int:
    """The float32 workspace of _efficient_attention_backward (kernel_backward.h workspace_size()).

    Per (batch, head): the grad-Q accumulator tiles (kNeedsAccumGradQ: always, split-keys are
    enabled from sm70) and, for 16-bit kernels whose output does not fit in registers
    (kMaxK > kBlockSizeI), grad-K / grad-V staging per key split.
    """
    sm = _sm(compute_capability)
    block_i, block_j, kernel_max_k = _cutlass_b_kernel(
        dtype, max(head_dim, head_dim_v), dropout, sm
    )
    is_half = dtype in _LOW_PRECISION
    output_in_rf = is_half and kernel_max_k <= block_i  # kOutputInRF
    needs_accum_kv = is_half and not output_in_rf  # kNeedsAccumGradK/V: accum type differs
    # GradQTempStorage: int32 lock, counter, pad[2] + kBlockSizeI x kBlockSizeJ float tile
    grad_q = _ceil_div(seqlen_q, block_i) * _ceil_div(head_dim, block_j) * (4 + block_i * block_j)
    # attention_backward.cu split-keys heuristic
    num_splits_key = _ceil_div(seqlen_k, block_j)
    if batch * heads >= 256 and seqlen_k <= 2 * block_j:
        num_splits_key = 1
    if needs_accum_kv:
        num_splits_key = min(num_splits_key, 200 // (batch * heads))
    num_splits_key = max(num_splits_key, 1)
    if _deterministic():
        num_splits_key = 1
    grad_k = num_splits_key * block_j * _round_up(head_dim, block_i) if needs_accum_kv else 0
    grad_v = num_splits_key * block_j * _round_up(head_dim_v, block_i) if needs_accum_kv else 0
    stride_bh = _round_up(grad_k + grad_v + grad_q, 4)  # workspace_strideBH: 128-bit aligned
    return batch * heads * stride_bh * 4


def _workspace_formula(
    dtype: torch.dtype,
    dropout: bool,
    compute_capability: tuple[int, int],
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: int,
) -> int:
    return efficient_attention_backward_workspace_bytes(
        batch,
        heads,
        seqlen_q,
        seqlen_k,
        head_dim,
        head_dim_v,
        dtype,
        dropout=dropout,
        compute_capability=compute_capability,
    )


class _EfficientAttention(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention`` on CUDA (attention.cu, attention_backward.cu)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        dropout_p: float,
        compute_logsumexp: bool,
        compute_capability: tuple[int, int],
    ) -> torch.Tensor:
        batch, heads, seqlen_q, head_dim = q.shape
        head_dim_v = v.shape[-1]
        # why: philox seed/offset, 0-dim int64 (host tensors on a real GPU outside graph capture)
        philox_seed = torch.empty((), dtype=torch.int64, device=q.device)
        philox_offset = torch.empty((), dtype=torch.int64, device=q.device)
        # why: _efficient_attention_forward ``res = at::empty({B, M, num_heads, Kv})``, a contiguous
        # (B, L, H, Dv) buffer returned transposed to (B, H, L, Dv)
        res = torch.empty((batch, seqlen_q, heads, head_dim_v), dtype=q.dtype, device=q.device)
        # why: ``logsumexp = at::empty({B, num_heads, compute_logsumexp ? ceil_div(M, kAlignLSE) *
        # kAlignLSE : 0}, float)`` with kAlignLSE = 32, saved for backward
        lse_len = seqlen_q if compute_logsumexp else 0
        logsumexp = _rounded_zeros((batch, heads, lse_len), (1, 1, 32), torch.float32, q.device)
        if q.dtype in _LOW_PRECISION and max(head_dim, head_dim_v) > 128:
            # why: kNeedsOutputAccumulatorBuffer (the kSingleValueIteration=false kernel for head
            # dims over 128 accumulates in a float32 (B, M, H, Kv) buffer during the kernel)
            output_accum = torch.empty(
                (batch, seqlen_q, heads, head_dim_v), dtype=torch.float32, device=q.device
            )
            del output_accum
        res.zero_()
        logsumexp.zero_()
        out = res.transpose(1, 2)
        if bias is None:
            ctx.save_for_backward(q, k, v, out, logsumexp, philox_seed, philox_offset)
        else:
            ctx.save_for_backward(q, k, v, out, logsumexp, philox_seed, philox_offset, bias)
        ctx.dropout_p = dropout_p
        ctx.compute_capability = compute_capability
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        q, k, v, out = saved[:4]
        bias = saved[7] if len(saved) > 7 else None
        bias_requires_grad = bool(ctx.needs_input_grad[3]) and bias is not None
        with _autocast_excluded():
            grad_q, grad_k, grad_v, grad_bias = _efficient_backward(
                grad_out,
                q,
                k,
                v,
                out,
                bias,
                bias_requires_grad,
                ctx.dropout_p,
                ctx.compute_capability,
            )
        return grad_q, grad_k, grad_v, grad_bias, None, None, None


def _efficient_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    bias_requires_grad: bool,
    dropout_p: float,
    compute_capability: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """_scaled_dot_product_efficient_attention_backward_cuda -> _efficient_attention_backward."""
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k, head_dim_v = k.shape[2], v.shape[3]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out_t = out.transpose(1, 2)
    # why: ``grad_out = grad_out_.contiguous()`` (copy unless (B, M, H, Kv)-contiguous already)
    grad_out_t = grad_out.transpose(1, 2).contiguous()
    # why: ``grad_q/k/v = at::empty(query/key/value.sizes())``: contiguous (B, M, H, K) gradients
    # (shared_storage_dqdkdv is false on this path)
    grad_q = torch.zeros(q_t.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.zeros(k_t.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.zeros(v_t.shape, dtype=v.dtype, device=v.device)
    grad_bias: torch.Tensor | None = None
    if bias_requires_grad:
        assert bias is not None
        # why: ``grad_bias = at::empty(sz with last dim rounded up to 16).slice(-1, 0, lastDim)``
        multiples = (*(1,) * (bias.dim() - 1), 16)
        grad_bias = _rounded_zeros(tuple(bias.shape), multiples, bias.dtype, bias.device)[
            ..., : bias.shape[-1]
        ]
    if q.dtype in _LOW_PRECISION:
        # why: kKernelComputesDelta (16-bit, sm80+): ``delta = at::empty({B, nH, M}, float)``
        delta = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    else:
        # why: float32 kernels: ``(grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1)
        # .contiguous()``: a (B, M, H, Kv) product, its (B, M, H) sum, a (B, H, M) copy
        delta = (grad_out_t.float() * out_t.float()).sum(-1).transpose(-2, -1).contiguous()
    workspace_bytes = efficient_attention_backward_workspace_bytes(
        batch,
        heads,
        seqlen_q,
        seqlen_k,
        head_dim,
        head_dim_v,
        q.dtype,
        dropout=dropout_p > 0.0,
        compute_capability=compute_capability,
    )
    # why: ``workspace = at::empty({p.workspace_size()}, kByte)``: grad-Q float32 accumulators
    # (declared by formula: its size is no product of the shape's dims)
    formula = functools.partial(_workspace_formula, q.dtype, dropout_p > 0.0, compute_capability)
    with sized_allocation((batch, heads, seqlen_q, seqlen_k, head_dim, head_dim_v), formula):
        workspace = torch.empty((workspace_bytes,), dtype=torch.uint8, device=q.device)
    del grad_out_t, delta, workspace
    return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2), grad_bias


# -- the SDPA composite (transformers/attention.cpp scaled_dot_product_attention) --------------------


def _convert_boolean_attn_mask(
    mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    # attention.cpp convert_boolean_attn_mask: a bool mask becomes an additive mask (a new tensor)
    if mask is None or mask.dtype != torch.bool:
        return mask
    # why: ``at::zeros_like(attn_mask, dtype)`` then an in-place masked_fill_ (logical_not is a temp)
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp preprocess_mask (mem_eff_alignment = 8): pad unless every stride but the last is
    # a multiple of 8 and the last is 1, then expand to (B, H, L, S)
    aligned = all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    last = mask.shape[-1]
    # only misaligned masks are copied: declared by formula, an empty placeholder when aligned, so
    # that every sequence length traces the same allocations
    formula = functools.partial(_padded_mask_bytes, mask.element_size())
    with sized_allocation(tuple(mask.shape), formula):
        if not aligned:
            # why: pad_bias: ``at::pad(attn_bias, {0, 8 - last % 8})`` (a new, wider mask), sliced
            mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
        else:
            placeholder = _placeholder(0, mask.device)
    expanded = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if aligned:
        # the placeholder lives as long as the mask view, as the padded copy would
        expanded._memfit_placeholder = placeholder  # type: ignore[attr-defined]
    return expanded


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp pad_last_dim<8, false>
    if t.shape[-1] % alignment == 0:
        return t
    # why: FlashAttention V2 needs head_dim % 8 == 0: a padded copy, saved by the flash op
    return F.pad(t, (0, alignment - t.shape[-1] % alignment))


def _repeat_kv(query: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    # attention.cpp pre_process_group_query_attention_input
    if kv.shape[-3] == query.shape[-3]:
        return kv
    return kv.repeat_interleave(query.shape[-3] // kv.shape[-3], dim=-3)


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` as CUDA runs it, decomposed so no CPU kernel choice leaks.

    Mirrors attention.cpp: float32 upcast of fp16/bf16 inputs (unless
    allow_fp16_bf16_reduction_math_sdp), scaled q and k, the causal mask as an additive tensor,
    in-place mask add, _safe_softmax, CUDA's fused dropout (``at::dropout`` is ``native_dropout`` with
    a bool mask on CUDA; the CPU path keeps a float noise tensor), and the ``attn.to(origin_dtype)``
    copy the composite returns next to the output.
    """
    attn_mask = _convert_boolean_attn_mask(attn_mask, q.dtype)
    origin_dtype = q.dtype
    upcast = not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def acc(t: torch.Tensor) -> torch.Tensor:
        # why: "Keep query, key, value in high precision for accuracy": float32 copies
        return t.to(torch.float32) if upcast and t.dtype in _LOW_PRECISION else t

    q_acc, k_acc, v_acc = acc(q), acc(k), acc(v)
    negative = scale is not None and scale < 0.0
    base_scale = abs(scale) if scale is not None else 1.0 / math.sqrt(q_acc.shape[-1])
    scaling_factor = math.sqrt(base_scale)
    query = q_acc * (-scaling_factor if negative else scaling_factor)
    if is_causal:
        seqlen_q, seqlen_k = query.shape[-2], k_acc.shape[-2]
        causal = torch.ones((seqlen_q, seqlen_k), dtype=torch.bool, device=q.device).tril()
        attn_mask = _convert_boolean_attn_mask(causal, query.dtype)
    if enable_gqa:
        k_acc, v_acc = _repeat_kv(query, k_acc), _repeat_kv(query, v_acc)
    attn = torch.matmul(query, k_acc.transpose(-2, -1) * scaling_factor)
    if attn_mask is not None:
        attn.add_(attn_mask)  # in place on CUDA (plain tensors)
    safe_softmax = getattr(torch.ops.aten, "_safe_softmax", None)
    attn = safe_softmax(attn, -1) if safe_softmax is not None else torch.softmax(attn, -1)
    if dropout_p > 0.0:
        # why: CUDA dropout is native_dropout: the kept mask is bool, not a float noise tensor
        attn = torch.ops.aten.native_dropout(attn, dropout_p, True)[0]
    output = torch.matmul(attn, v_acc).to(origin_dtype)
    # why: the composite also returns ``attn.to(origin_dtype)`` (a copy when upcast), then drops it
    discarded = attn.to(origin_dtype)
    del discarded
    return output


_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


class CudaSdpa(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as an sm80+ GPU runs it.

    Picks the backend like ``select_sdp_backend`` (flash, then memory-efficient, then math, or the
    ``sdpa_kernel`` priority order) and runs an emulation that allocates, saves for backward and
    allocates in backward what that backend's CUDA kernels do. Training vs inference follows the
    inputs, as on CUDA: the memory-efficient kernel only computes the logsumexp when an input
    requires grad and grad mode is on.

    Works with ``CudaAutocast`` in either nesting order: under an enabled emulated autocast region
    q/k/v/attn_mask are cast first (scaled_dot_product_attention is on CUDA's lower-precision
    list), and the emulated kernels' own ops are not autocast.

    ``compute_capability`` selects the GPU generation (the default, sm80, is an A100; (9, 0) is an
    H100); ``num_sms`` is its SM count (108 on an A100, 132 on an H100 SXM), used by flash's split-KV
    heuristic. ``backend_counts`` counts the backends chosen.
    """

    def __init__(self, *, compute_capability: tuple[int, int] = (8, 0), num_sms: int = 108) -> None:
        super().__init__()
        if _sm(compute_capability) < 80:
            raise ValueError("CudaSdpa emulates sm80+ GPUs")
        self.compute_capability = compute_capability
        self.num_sms = num_sms
        self.backend_counts: dict[SdpaBackend, int] = dict.fromkeys(SdpaBackend, 0)

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        if (
            func is F.scaled_dot_product_attention
            or func is torch.ops.aten.scaled_dot_product_attention.default
        ):
            bound = dict(zip(_SDPA_PARAMS, args, strict=False))
            bound.update(kwargs)
            return self._sdpa(func, args, kwargs, **bound)
        return _redispatch(self, func, types, args, kwargs)

    def _sdpa(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if any(
            t.is_nested or t.device.type not in _EMULATED_DEVICE_TYPES for t in (query, key, value)
        ):
            return func(*args, **kwargs)
        emulated_autocast = _active_autocast()
        if (
            emulated_autocast is not None
            and emulated_autocast._region.enabled
            and not _AUTOCAST_EXCLUDED[0]
        ):
            # scaled_dot_product_attention is lower_precision_fp: every floating input, mask included
            lower = emulated_autocast._region.dtype
            query, key, value, attn_mask = (
                emulated_autocast.cached_cast(lower, t) for t in (query, key, value, attn_mask)
            )
        _validate_sdpa_input(query, key, value, attn_mask)
        backend = select_sdpa_backend(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            enable_gqa,
            compute_capability=self.compute_capability,
        )
        self.backend_counts[backend] += 1
        with _autocast_excluded():
            if backend is SdpaBackend.FLASH:
                return self._flash(query, key, value, dropout_p)
            if backend is SdpaBackend.EFFICIENT:
                return self._efficient(
                    query, key, value, attn_mask, dropout_p, is_causal, enable_gqa
                )
            return _math_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
            )

    def _flash(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        head_dim = q.shape[-1]
        q_pad, k_pad, v_pad = (_pad_last_dim(t, 8) for t in (q, k, v))
        out = _FlashAttention.apply(q_pad, k_pad, v_pad, float(dropout_p), self.num_sms)
        assert isinstance(out, torch.Tensor)
        # post_process_flash_output: a view back to the original head dim
        return out[..., :head_dim] if out.shape[-1] != head_dim else out

    def _efficient(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        enable_gqa: bool,
    ) -> torch.Tensor:
        bias = _convert_boolean_attn_mask(attn_mask, q.dtype)
        if bias is not None:
            bias = _preprocess_mask(bias, q, k)
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            # Assumption: the cutlass kernel needs equal head counts (_efficient_attention_forward
            # TORCH_CHECKs it), so grouped K/V heads are expanded (repeat_interleave, as the math path)
            k, v = _repeat_kv(q, k), _repeat_kv(q, v)
        compute_logsumexp = _input_requires_grad(q, k, v)  # should_compute_logsumexp
        out = _EfficientAttention.apply(
            q, k, v, bias, float(dropout_p), compute_logsumexp, self.compute_capability
        )
        assert isinstance(out, torch.Tensor)
        return out


def _validate_sdpa_input(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> None:
    # attention.cpp validate_sdpa_input
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead."
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            f"attn_mask.dtype: {attn_mask.dtype} and  query.dtype: {q.dtype} instead."
        )
