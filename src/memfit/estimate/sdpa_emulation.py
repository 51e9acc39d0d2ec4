"""``F.scaled_dot_product_attention`` as an sm80+ GPU runs it, on (fake) CPU tensors: :class:`CudaSdpa`.

The backend PyTorch would pick (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), the SDPA
composite around the kernels (``transformers/attention.cpp``: mask conversion and padding, head-dim
padding, the math path) and the kernels themselves (:mod:`memfit.estimate.sdpa_kernels`). Why a
``TorchFunctionMode``: see :mod:`memfit.estimate.emulation`.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfit.estimate.autocast_emulation import active_autocast
from memfit.estimate.emulation import (
    EMULATED_DEVICE_TYPES,
    autocast_excluded,
    autocast_is_excluded,
    redispatch,
)
from memfit.estimate.sdpa_kernels import (
    LOW_PRECISION,
    EfficientAttention,
    FlashAttention,
    _padded_mask_bytes,
    pad_head_dim,
    placeholder,
    sm_number,
)
from memfit.estimate.step_trace import sized_allocation

__all__ = ["CudaSdpa", "SdpaBackend", "select_sdpa_backend"]

# ---------------------------------------------------------------------------------------------------
# The backend (sdp_utils.cpp select_sdp_backend)
# ---------------------------------------------------------------------------------------------------


class SdpaBackend(str, enum.Enum):
    """The SDPA backends emulated (cuDNN attention is not: see ``select_sdpa_backend``)."""

    FLASH = "flash_attention"
    EFFICIENT = "efficient_attention"
    MATH = "math"


_SDPA_ORDER_CODES = {1: SdpaBackend.FLASH, 2: SdpaBackend.EFFICIENT, 0: SdpaBackend.MATH}


def _sdp_priority_order() -> list[SdpaBackend]:
    # at::globalContext().sDPPriorityOrder(); cuDNN (3) and overrideable (4) are not emulated
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    codes = list(get_order()) if get_order is not None else [1, 2, 0]
    return [_SDPA_ORDER_CODES[c] for c in codes if c in _SDPA_ORDER_CODES]


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
    if q.dtype not in LOW_PRECISION or not (q.dtype == k.dtype == v.dtype):  # check_dtypes_flash
        return False
    if not _check_batch_size_and_num_heads_dense(q, k, v, enable_gqa):
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    # check_last_dim_stride_equals_1_dense<ignore_singleton_dim=true>
    return (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1) or head_dim == 1


def _minimum_gemm_alignment(dtype: torch.dtype, sm: int) -> int:
    # sdp_utils.cpp minimum_gemm_alignment / use_tensor_cores
    is_half = dtype in LOW_PRECISION
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
    sm = sm_number(compute_capability)
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
            empty = placeholder(0, mask.device)
    expanded = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if aligned:
        # the placeholder lives as long as the mask view, as the padded copy would
        expanded._memfit_placeholder = empty  # type: ignore[attr-defined]
    return expanded


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
        return t.to(torch.float32) if upcast and t.dtype in LOW_PRECISION else t

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
    """``F.scaled_dot_product_attention`` as a GPU of a given compute capability runs it.

    Picks the backend like ``select_sdp_backend`` (flash, then memory-efficient, then math, or the
    ``sdpa_kernel`` priority order) and runs an emulation that allocates, saves for backward and
    allocates in backward what that backend's CUDA kernels do. Training vs inference follows the
    inputs, as on CUDA: the memory-efficient kernel only computes the logsumexp when an input
    requires grad and grad mode is on.

    Works with ``CudaAutocast`` in either nesting order: under an enabled emulated autocast region
    q/k/v/attn_mask are cast first (scaled_dot_product_attention is on CUDA's lower-precision
    list), and the emulated kernels' own ops are not autocast.

    ``compute_capability`` selects the GPU generation (the default, sm80, is an A100; (9, 0) is an
    H100; below sm80 there is no flash attention, and below sm50 no memory-efficient attention
    either: a T4 (7, 5), V100 (7, 0) or P100 (6, 0) runs the memory-efficient kernel, a K80 (3, 7)
    the math path); ``num_sms`` is its SM count (108 on an A100, 132 on an H100 SXM), used by flash's split-KV
    heuristic. ``backend_counts`` counts the backends chosen.
    """

    def __init__(self, *, compute_capability: tuple[int, int] = (8, 0), num_sms: int = 108) -> None:
        super().__init__()
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
        return redispatch(self, func, types, args, kwargs)

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
            t.is_nested or t.device.type not in EMULATED_DEVICE_TYPES for t in (query, key, value)
        ):
            return func(*args, **kwargs)
        emulated_autocast = active_autocast()
        lower = None if emulated_autocast is None else emulated_autocast.lower_precision_dtype()
        if emulated_autocast is not None and lower is not None and not autocast_is_excluded():
            # scaled_dot_product_attention is lower_precision_fp: every floating input, mask included
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
        with autocast_excluded():
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
        q_pad, k_pad, v_pad = (pad_head_dim(t) for t in (q, k, v))
        out = FlashAttention.apply(q_pad, k_pad, v_pad, float(dropout_p), self.num_sms)
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
        out = EfficientAttention.apply(
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
