"""The fused attention kernels :class:`~memfit.estimate.sdpa_emulation.CudaSdpa` runs, as CUDA runs them.

What each kernel allocates, saves for backward and allocates in backward (flash:
``flash_attn/flash_api.cpp``; memory-efficient: ``cuda/attention.cu`` and
``cuda/attention_backward.cu``), on (fake) CPU tensors: the outputs are zero-filled. Sizes that are no
product of a shape's dims are declared by formula (:func:`~memfit.estimate.step_trace.sized_allocation`);
the trace cache stores those formulas by name (:data:`memfit.estimate.cache.FORMULAS`), so they are
functions of this module bound to plain arguments.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from memfit.estimate.emulation import autocast_excluded
from memfit.estimate.step_trace import sized_allocation

__all__ = [
    "LOW_PRECISION",
    "EfficientAttention",
    "FlashAttention",
    "efficient_attention_backward_workspace_bytes",
    "efficient_kernel_computes_delta",
    "flash_deterministic_splits",
    "flash_forward_num_splits",
    "flash_head_dim_rounded",
    "pad_head_dim",
    "placeholder",
    "sm_number",
    "sum_grouped_head_grads",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def sm_number(compute_capability: tuple[int, int]) -> int:
    """The SM version number of a compute capability: 80 for (8, 0)."""
    return compute_capability[0] * 10 + compute_capability[1]


# The size formulas (_split_kv_bytes, _rounded_bytes, _padded_mask_bytes, _workspace_formula): the
# trace cache stores them by these names (memfit.estimate.cache.FORMULAS), so the names stay.


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


def placeholder(nbytes: int, device: Any) -> torch.Tensor:
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
# PyTorch's flash backend is a copy of flash-attn 2's ``csrc/flash_attn/flash_api.cpp`` (mha_fwd,
# mha_bwd); the helpers below are what both use. ``transformers``' ``flash_attention_2`` calls the
# flash-attn package itself: see :mod:`memfit.estimate.flash_attention_emulation`.


def flash_head_dim_rounded(head_dim: int) -> int:
    """flash_api.cpp ``head_size_rounded``: a multiple of 32 up to 192, else 256."""
    rounded = _round_up(head_dim, 32)
    return rounded if rounded <= 192 else 256


def flash_deterministic_splits(num_sms: int, batch: int, heads: int) -> int:
    """mha_bwd's deterministic ``dq_accum`` splits: ``ceil(num_SMs / (b * h))``."""
    return _ceil_div(num_sms, batch * heads)


def pad_head_dim(t: torch.Tensor, alignment: int = 8) -> torch.Tensor:
    """The head dim padded to a multiple of ``alignment`` (a copy), or ``t`` itself if it is one.

    FlashAttention 2 needs head_dim % 8 == 0: SDPA's composite (attention.cpp ``pad_last_dim<8,
    false>``) and flash-attn's ``mha_fwd`` pad q, k and v, and the kernel saves the padded copies.
    """
    if t.shape[-1] % alignment == 0:
        return t
    # why: a padded copy of the whole tensor, saved for backward by the flash op
    return torch.nn.functional.pad(t, (0, alignment - t.shape[-1] % alignment))


def sum_grouped_head_grads(dk: torch.Tensor, dv: torch.Tensor, heads: int) -> None:
    """mha_bwd / mha_varlen_bwd for MQA/GQA: dK and dV of every query head, summed per group.

    ``dk``/``dv`` are (..., heads_k, D); the kernel writes ``dk_expanded``/``dv_expanded``
    (..., heads, D) in the inputs' dtype, then ``at::sum_out`` reduces each group into dk/dv.
    """
    *lead, heads_k, _ = dk.shape
    group = heads // heads_k
    # why: ``dk_expanded = torch::empty({..., num_heads, head_size})`` and the same for dV
    expanded = [
        torch.zeros((*lead, heads, t.shape[-1]), dtype=t.dtype, device=t.device) for t in (dk, dv)
    ]
    for grad, full in zip((dk, dv), expanded, strict=True):
        torch.sum(full.view(*lead, heads_k, group, grad.shape[-1]), dim=-2, out=grad)
    # why: locals of mha_bwd, freed when it returns
    del expanded


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


class FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` on CUDA (attention.cu -> flash_api.cpp mha_fwd/mha_bwd).

    Inputs are (B, H, L, D) with D already padded to a multiple of 8 (:func:`pad_head_dim`).
    ``flash_attn_package``: the same kernel as the flash-attn package's ``FlashAttnFunc`` runs
    it (``flash_attn/flash_attn_interface.py``): one int64 ``rng_state``, and its backward copies
    ``dout``/``out`` only when their last dim is strided (``maybe_contiguous``) where PyTorch's
    ``_flash_attention_backward`` makes them contiguous.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        num_sms: int,
        flash_attn_package: bool = False,
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
            lse_accum = placeholder(_split_kv_bytes(dropout_p, num_sms, *dims, lse=True), q.device)
        with sized_allocation(
            dims, functools.partial(_split_kv_bytes, dropout_p, num_sms, lse=False)
        ):
            out_accum = placeholder(_split_kv_bytes(dropout_p, num_sms, *dims, lse=False), q.device)
        rng: tuple[torch.Tensor, ...]
        if flash_attn_package:
            # why: flash-attn's mha_fwd ``rng_state = torch::empty({2}, kInt64)``, saved
            rng = (torch.empty((2,), dtype=torch.int64, device=q.device),)
        else:
            # why: PyTorch's mha_fwd ``rng_state = at::empty({2}, kUInt64)`` and ``_unused =
            # at::empty({}, kUInt64)`` (returned as philox seed/offset, saved, dropout or not)
            rng = (
                torch.empty((2,), dtype=torch.uint64, device=q.device),
                torch.empty((), dtype=torch.uint64, device=q.device),
            )
        # why: the split-KV accumulators are locals of mha_fwd: freed when the kernel returns
        del lse_accum, out_accum
        out_t.zero_()
        logsumexp.zero_()
        out = out_t.transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, logsumexp, *rng)
        ctx.num_sms = num_sms
        ctx.flash_attn_package = flash_attn_package
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors[:4]
        with autocast_excluded():
            grads = _flash_backward(grad_out, q, k, v, out, ctx.num_sms, ctx.flash_attn_package)
        return (*grads, None, None, None)


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
    flash_attn_package: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_scaled_dot_product_flash_attention_backward_cuda -> _flash_attention_backward -> mha_bwd
    (or flash-attn's ``FlashAttnFunc.backward`` -> ``_flash_attn_backward`` -> mha_bwd)."""
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k = k.shape[1]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    grad_out_t, out_t = grad_out.transpose(1, 2), out.transpose(1, 2)
    if flash_attn_package:
        # why: flash-attn's ``maybe_contiguous``: a copy only when the last dim is strided
        grad_out_t, out_t = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (grad_out_t, out_t)
        )
    else:
        # why: _flash_attention_backward ``grad_out.contiguous()`` / ``out.contiguous()`` (a copy
        # unless already contiguous in the (B, L, H, D) layout the kernel reads)
        grad_out_t, out_t = grad_out_t.contiguous(), out_t.contiguous()
    # why: mha_bwd ``dq/dk/dv = at::empty_like(q/k/v)``: the input gradients
    dq_t = torch.empty_like(q_t)
    dk_t = torch.empty_like(k_t)
    dv_t = torch.empty_like(v_t)
    # why: mha_bwd ``softmax_d = at::empty({b, h, seqlen_q_rounded}, float)``, the sequence
    # rounded up to 128
    softmax_d = _rounded_zeros((batch, heads, seqlen_q), (1, 1, 128), torch.float32, q.device)
    # why: mha_bwd ``dq_accum = at::empty({b, seqlen_q_rounded, h, head_size_rounded}, float)``
    dq_accum_dims = (batch, seqlen_q, heads, flash_head_dim_rounded(head_dim))
    if _deterministic():
        # deterministic mode: one accumulator per split (no bilinear dim: shapes in this mode
        # are traced one by one)
        splits = flash_deterministic_splits(num_sms, batch, heads)
        dq_accum = _rounded_zeros(
            (splits, *dq_accum_dims), (1, 1, 128, 1, 1), torch.float32, q.device
        )
    else:
        dq_accum = _rounded_zeros(dq_accum_dims, (1, 128, 1, 1), torch.float32, q.device)
    dq_t.zero_()
    if heads_k != heads:
        sum_grouped_head_grads(dk_t, dv_t, heads)
    else:
        dk_t.zero_()
        dv_t.zero_()
    del grad_out_t, out_t, softmax_d, dq_accum
    return dq_t.transpose(1, 2), dk_t.transpose(1, 2), dv_t.transpose(1, 2)


# -- memory-efficient attention ---------------------------------------------------------------------

# (kBlockSizeI, kBlockSizeJ, kMaxK) of the backward kernels, in dispatch order, from
# mem_eff_attention/kernels/cutlassB.h dispatch_cutlassB_{bf16,f16,f32}_sm{50,70,75,80} (the
# seq-aligned and not-aligned variants have the same tiles and are left out). The first kernel whose
# kMaxK fits is assumed to be launched; the shared-memory fit check of the launcher is not emulated.
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
# sm70-79 (V100, T4): f16 with or without dropout (dispatch_cutlassB_f16_sm70 / _sm75) launches
# the same tiles as sm80's f32
_CUTLASS_B_HALF_SM70_79 = _CUTLASS_B_F32
# sm50-69 (P100) f16 and f32, and sm70-79 f32: 64 x 64 tiles only
_CUTLASS_B_64: _KernelTiles = (
    (64, 64, 32),
    (64, 64, 64),
    (64, 64, 128),
    (64, 64, 65536),
)


def _cutlass_b_kernel(
    dtype: torch.dtype, max_k: int, dropout: bool, sm: int
) -> tuple[int, int, int]:
    table: _KernelTiles
    if sm < 70 or (sm < 80 and dtype == torch.float32):
        table = _CUTLASS_B_64
    elif sm < 80:
        table = _CUTLASS_B_HALF_SM70_79
    elif dtype == torch.float32:
        table = _CUTLASS_B_F32
    elif dropout:
        table = _CUTLASS_B_HALF_DROPOUT
    else:
        table = _CUTLASS_B_HALF_SM86_89 if sm in (86, 89) else _CUTLASS_B_HALF
    for block_i, block_j, kernel_max_k in table:
        if kernel_max_k >= max_k:
            return block_i, block_j, kernel_max_k
    return table[-1]


def efficient_kernel_computes_delta(
    dtype: torch.dtype, max_k: int, dropout: bool, compute_capability: tuple[int, int]
) -> bool:
    """kernel_backward.h kKernelComputesDelta: 16-bit kernels, but for the sm70 ones (V100) whose
    output does not stay in registers; the others get ``delta`` computed on the host first."""
    sm = sm_number(compute_capability)
    if dtype not in LOW_PRECISION:
        return False
    block_i, _, kernel_max_k = _cutlass_b_kernel(dtype, max_k, dropout, sm)
    output_in_rf = kernel_max_k <= block_i
    return output_in_rf or not 70 <= sm < 75  # ArchTag Sm70 serves sm70-74


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

    Per (batch, head): the grad-Q accumulator tiles (kNeedsAccumGradQ: split keys, enabled from
    sm70, or a 16-bit kernel) and, for 16-bit kernels whose output does not fit in registers
    (kMaxK > kBlockSizeI), grad-K / grad-V staging per key split.
    """
    sm = sm_number(compute_capability)
    block_i, block_j, kernel_max_k = _cutlass_b_kernel(
        dtype, max(head_dim, head_dim_v), dropout, sm
    )
    is_half = dtype in LOW_PRECISION
    output_in_rf = is_half and kernel_max_k <= block_i  # kOutputInRF
    needs_accum_kv = is_half and not output_in_rf  # kNeedsAccumGradK/V: accum type differs
    # GradQTempStorage: int32 lock, counter, pad[2] + kBlockSizeI x kBlockSizeJ float tile
    split_keys = sm >= 70  # kEnableSplitKeys
    needs_accum_q = split_keys or is_half  # kNeedsAccumGradQ
    grad_q = (
        _ceil_div(seqlen_q, block_i) * _ceil_div(head_dim, block_j) * (4 + block_i * block_j)
        if needs_accum_q
        else 0
    )
    # attention_backward.cu split-keys heuristic
    num_splits_key = _ceil_div(seqlen_k, block_j)
    if batch * heads >= 256 and seqlen_k <= 2 * block_j:
        num_splits_key = 1
    if needs_accum_kv:
        num_splits_key = min(num_splits_key, 200 // (batch * heads))
    num_splits_key = max(num_splits_key, 1) if split_keys else 1
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


class EfficientAttention(torch.autograd.Function):
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
        if q.dtype in LOW_PRECISION and max(head_dim, head_dim_v) > 128:
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
        with autocast_excluded():
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
    if efficient_kernel_computes_delta(
        q.dtype, max(head_dim, head_dim_v), dropout_p > 0.0, compute_capability
    ):
        # why: kKernelComputesDelta (16-bit but sm70's larger heads): ``delta = at::empty({B, nH, M},
        # float)``
        delta = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    else:
        # why: float32 kernels (and sm70's 16-bit ones for head dims over their block):
        # ``(grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1)
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
