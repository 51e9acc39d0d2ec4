"""``torch.autocast("cuda", dtype)``, emulated on (fake) CPU tensors: :class:`CudaAutocast`.

CUDA's cast policies and op lists (``aten/src/ATen/autocast_mode.h``, ``AT_FORALL_*`` macros
registered for the ``Autocast`` (CUDA) dispatch key in ``aten/src/ATen/autocast_mode.cpp``), and its
weight cache (``cached_cast``), which keeps the low-precision copy of every fp32 parameter alive until
the autocast region is left. Why a ``TorchFunctionMode``: see :mod:`memfit.estimate.emulation`.

Not thread-safe: ``CudaAutocast`` patches ``torch.autocast`` and ``torch.is_autocast_enabled`` (and
friends) for as long as it is entered.
"""

from __future__ import annotations

import enum
import types as _pytypes
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from memfit.estimate.emulation import EMULATED_DEVICE_TYPES, autocast_is_excluded, redispatch

__all__ = [
    "BANNED_OPS",
    "FP32_APPEND_DTYPE_OPS",
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "LOWER_PRECISION_FP_OPS",
    "PROMOTE_OPS",
    "CastPolicy",
    "CudaAutocast",
    "active_autocast",
    "autocast_policy",
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
# Which tensors autocast casts
# ---------------------------------------------------------------------------------------------------


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def _is_autocast_eligible(t: torch.Tensor) -> bool:
    # autocast_mode.h is_autocast_eligible(tensor, CUDA): a CUDA floating-point tensor
    return t.is_floating_point() and t.device.type in EMULATED_DEVICE_TYPES


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


def active_autocast() -> CudaAutocast | None:
    return _ACTIVE_AUTOCASTS[-1] if _ACTIVE_AUTOCASTS else None


def _emulates(device_type: Any) -> bool:
    return active_autocast() is not None and device_type in EMULATED_DEVICE_TYPES


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
        mode = active_autocast()
        if mode is None or self.device not in EMULATED_DEVICE_TYPES:
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
        mode = active_autocast()
        if mode is not None and (device_type is None or device_type in EMULATED_DEVICE_TYPES):
            return mode._region.enabled
        original = _ORIGINALS["is_autocast_enabled"]
        return bool(original() if device_type is None else original(device_type))

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        mode = active_autocast()
        if mode is not None and device_type in EMULATED_DEVICE_TYPES:
            return mode._region.dtype
        return _ORIGINALS["get_autocast_dtype"](device_type)  # type: ignore[no-any-return]

    def is_autocast_cache_enabled() -> bool:
        mode = active_autocast()
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
        mode = active_autocast()
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

    def lower_precision_dtype(self) -> torch.dtype | None:
        """The dtype lower-precision ops are cast to in the current region; None when disabled."""
        region = self._region
        return region.dtype if region.enabled else None

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
        if autocast_is_excluded():
            return redispatch(self, func, types, args, kwargs)
        key = _aten_key(func)
        if key is None:
            return redispatch(self, func, types, args, kwargs)
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
