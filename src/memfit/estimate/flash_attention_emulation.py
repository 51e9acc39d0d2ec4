"""``attn_implementation="flash_attention_2"`` as transformers runs it on a GPU, on fake tensors.

transformers hands every attention layer to the flash-attn package (``integrations/
flash_attention.py`` -> ``modeling_flash_attention_utils._flash_attention_forward``); the package
is CUDA-only and absent here. memfit registers a stand-in under its own name (:data:`TRACE_NAME`,
with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``; it must not contain
"flash", or transformers would try to fetch a flash kernel from the Hub): the rest of the model
runs its real code, and the stand-in makes the allocations transformers and flash-attn make, with
fake tensors, and returns an output of the right shape (zeros: the numbers are meaningless).

What is modelled, and where it comes from (transformers 5.23, flash-attn 2.8
``flash_attn/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp``):

- Masks: no 4D mask. ``masking_utils.flash_attention_mask`` passes the 2D padding mask through
  (``None`` when nothing is padding). On fake tensors it cannot tell; memfit's batches hold one
  padding token (:func:`memfit.estimate.workload.make_batch`), so the mask is kept: the padded path.
- Unpadding (``_upad_input``/``_get_unpad_data``): per layer, the padding mask's row sums
  (int32), the token indices (``nonzero``: int64), the cumulative lengths (int32, B + 1), then
  ``_index_first_axis`` on q, k and v: a ``reshape`` (a copy where the (B, L, H, D) view of a
  (B, H, L, D) tensor cannot be flattened) and an index gather, (total, H, D) each. Assumption:
  every token of the padded batch is counted as real (total = B·L; the real count is lower by the
  padding), so that sizes stay products of (B, L) dims, as the estimate is of a full-length batch.
- The kernel (``FlashAttnVarlenFunc`` -> ``mha_varlen_fwd``): q, k, v padded to a head dim that is
  a multiple of 8, the output (total, H, D), the logsumexp (H, total) float32 (``unpadded_lse``)
  and an int64 ``rng_state`` (2), saved for backward with q, k, v and the cumulative lengths. No
  split-KV accumulators (the varlen kernel splits only for decoding).
- Its backward (``mha_varlen_bwd``): dq, dk, dv like q, k, v; ``softmax_d`` (H, total + 128·B)
  and ``dq_accum`` (total + 128·B, H, round32(D)) float32 (one per split in deterministic mode);
  for grouped-query attention, dK/dV of every query head, then summed per group.
- Padding back (``pad_input``): a zeroed (B·L, H, D) output and an index put; its backward
  gathers the gradient of the real tokens.
- Without a padding mask (``flash_attn_func``), the dense kernel: the same as SDPA's flash backend
  (:class:`~memfit.estimate.sdpa_kernels.FlashAttention`, with flash-attn's ``rng_state`` and
  ``maybe_contiguous``), split-KV heuristic included.

Not modelled: packed sequences (position ids without a padding mask); the temporaries CUDA's
``index_put_`` with accumulate allocates inside its kernel (sorted indices, int64 per token) in the
gather's backward; the CUDA module of flash-attn's kernels (outside PyTorch's allocator).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.estimate.emulation import autocast_excluded
from memfit.estimate.sdpa_kernels import (
    LOW_PRECISION,
    FlashAttention,
    flash_deterministic_splits,
    flash_head_dim_rounded,
    pad_head_dim,
    sum_grouped_head_grads,
)

__all__ = [
    "FLASH_ATTENTION_2",
    "MIN_COMPUTE_CAPABILITY",
    "TRACE_NAME",
    "FlashAttentionVarlen",
    "flash_attention_forward",
    "flash_attention_gpu_problem",
    "flash_attention_mask",
    "register",
]

FLASH_ATTENTION_2 = "flash_attention_2"
# the name memfit's stand-in is registered under ("flash" in it would make transformers load a
# flash kernel from the Hub: modeling_utils._check_and_adjust_attn_implementation)
TRACE_NAME = "memfit_fa2_trace"
# flash-attn 2 runs on Ampere (sm80) or newer ("FlashAttention only supports Ampere GPUs or newer")
MIN_COMPUTE_CAPABILITY = (8, 0)
# the SM count flash-attn's heuristics read (split-KV, deterministic splits): an A100's, as for
# :class:`memfit.estimate.sdpa_emulation.CudaSdpa`
NUM_SMS = 108


def register() -> None:
    """Register the stand-in with transformers (idempotent; class-wide, as ``register`` is)."""
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRACE_NAME, flash_attention_forward)
    AttentionMaskInterface.register(TRACE_NAME, flash_attention_mask)


def flash_attention_gpu_problem(
    attn_implementation: Any, gpu: str, compute_capability: tuple[int, int]
) -> str | None:
    """What is wrong with this attention on the catalog GPU ``gpu`` (None: nothing):
    flash-attn 2 needs sm80 or newer."""
    if attn_implementation != FLASH_ATTENTION_2 or compute_capability >= MIN_COMPUTE_CAPABILITY:
        return None
    major, minor = compute_capability
    return (
        f"--attn-implementation {FLASH_ATTENTION_2}: FlashAttention 2 runs on Ampere (sm80) or "
        f"newer GPUs; --gpu {gpu} is sm{major}{minor} (use sdpa)"
    )


def flash_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """``masking_utils.flash_attention_mask``: the 2D padding mask, sliced to the keys.

    On fake tensors it cannot ask whether every token is real: the mask is kept (memfit's
    batches are padded), so the stand-in unpads as transformers does for a padded batch.
    """
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers import masking_utils

    if isinstance(attention_mask, FakeTensor):
        return attention_mask[:, -kv_length:]
    extra = {} if mask_function is None else {"mask_function": mask_function}
    return masking_utils.flash_attention_mask(  # type: ignore[no-any-return]
        batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **extra
    )


def flash_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``integrations.flash_attention.flash_attention_forward`` with flash-attn's allocations.

    (B, H, L, D) q, k, v in; (B, L, H, D) out, as transformers returns it. Scaling, causality,
    the sliding window and soft-capping change the kernel's arithmetic, not what it allocates.
    On real CUDA tensors it runs transformers' own flash-attention path (flash-attn installed).
    """
    if not isinstance(query, FakeTensor):
        return _real_flash_attention(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
            is_causal, **kwargs,
        )  # fmt: skip
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers.integrations.flash_attention import get_target_dtype

    seq_len = query.shape[2]
    # flash-attn reads (B, L, H, D): views of transformers' (B, H, L, D) tensors
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:
        # why: flash_attention_forward pads value to the query's head dim (a copy)
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])
    target_dtype = get_target_dtype(query, module)
    if target_dtype is not None and query.dtype == torch.float32:
        # why: fa_peft_integration_check casts float32 q, k, v to the compute dtype (copies)
        query, key, value = (t.to(target_dtype) for t in (query, key, value))
    if query.dtype not in LOW_PRECISION:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    batch = query.shape[0]
    if attention_mask is None:
        out = _dense(query, key, value, dropout)
    else:
        q, k, v, indices, cu_seqlens = _unpad(query, key, value, attention_mask)
        out = FlashAttentionVarlen.apply(
            q, k, v, cu_seqlens, float(dropout), bool(deterministic), NUM_SMS
        )
        assert isinstance(out, torch.Tensor)
        # start-up: transformers takes a second or more to import; only tracing a model needs it
        from transformers.modeling_flash_attention_utils import _pad_input

        # why: pad_input: a zeroed (B·L, H, D) output, the real tokens put back by index
        out = _pad_input(out, indices, batch, seq_len)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """``flash_attn_func`` on (B, L, H, D): mha_fwd / mha_bwd, as SDPA's flash backend runs them."""
    head_dim = q.shape[-1]
    # why: mha_fwd pads q, k, v to a head dim that is a multiple of 8 (copies, saved)
    q, k, v = (pad_head_dim(t).transpose(1, 2) for t in (q, k, v))
    with autocast_excluded():
        out = FlashAttention.apply(q, k, v, float(dropout), NUM_SMS, True)
    assert isinstance(out, torch.Tensor)
    out = out.transpose(1, 2)
    return out[..., :head_dim] if out.shape[-1] != head_dim else out


def _unpad(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_upad_input`` for self-attention (query length = key length), without reading the mask.

    ``_get_unpad_data`` reads the number of real tokens (``nonzero``, ``.item()``): on fake
    tensors every token counts (see the module's assumptions).
    """
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers.modeling_flash_attention_utils import _index_first_axis

    batch, seq_len = attention_mask.shape
    # why: _get_unpad_data: the row sums (int32), their maximum (a device scalar read by .item())
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    seqlens.max()
    # why: ``torch.nonzero(attention_mask.flatten())``: the int64 index of every real token
    indices = torch.arange(batch * seq_len, dtype=torch.int64, device=attention_mask.device)
    # why: ``F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))``: cu_seqlens (B + 1)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    # why: _index_first_axis: reshape (a copy unless the (B, L, H, D) view flattens) then a
    # gather of the real tokens: (total, H, D) copies of q, k and v, saved by the kernel
    k, v = _index_first_axis(k, indices), _index_first_axis(v, indices)
    q = _index_first_axis(q, indices)
    return q, k, v, indices, cu_seqlens


class FlashAttentionVarlen(torch.autograd.Function):
    """flash-attn's ``FlashAttnVarlenFunc`` (``mha_varlen_fwd``/``mha_varlen_bwd``) on
    (total, H, D) q and (total, H_k, D) k, v; self-attention (one ``cu_seqlens`` for both)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        dropout_p: float,
        deterministic: bool,
        num_sms: int,
    ) -> torch.Tensor:
        head_dim = q.shape[-1]
        with autocast_excluded():
            # why: FlashAttnVarlenFunc pads q, k, v to a head dim that is a multiple of 8
            q, k, v = (pad_head_dim(t) for t in (q, k, v))
            total_q, heads = q.shape[:2]
            # why: mha_varlen_fwd ``out = torch::empty({total_q, num_heads, v_head_size})``
            out = torch.empty((total_q, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
            # why: ``softmax_lse = torch::empty({num_heads, total_q}, float)``, saved for backward
            lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
            # why: ``rng_state = torch::empty({2}, kInt64)``, saved for backward, dropout or not
            rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
            out.zero_()
            lse.zero_()
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state)
        ctx.head_dim = head_dim
        ctx.deterministic = deterministic
        ctx.num_sms = num_sms
        ctx.mark_non_differentiable(cu_seqlens)
        return out[..., :head_dim] if out.shape[-1] != head_dim else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, _out, _lse, cu_seqlens, _rng = ctx.saved_tensors
        with autocast_excluded():
            dq, dk, dv = _varlen_backward(
                dout, q, k, v, cu_seqlens.shape[0] - 1, ctx.deterministic, ctx.num_sms
            )
        head_dim = ctx.head_dim
        grads = (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim])
        return (*grads, None, None, None, None)


def _varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: int,
    deterministic: bool,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttnVarlenFunc.backward -> _flash_attn_varlen_backward -> mha_varlen_bwd."""
    # why: FlashAttnVarlenFunc.backward ``dq, dk, dv = torch.empty_like(q/k/v)``
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # why: maybe_contiguous: a copy only when the last dim is strided
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # why: mha_varlen_bwd pads dout to the padded head dim (a copy) when it is not a multiple of 8
    dout_padded = pad_head_dim(dout)
    total_q, heads = q.shape[:2]
    # the sequences are stored 128 rows apart: total_q + 128 * batch rows (LSE is unpadded)
    rows = total_q + 128 * batch
    # why: ``softmax_d = torch::empty({num_heads, total_q + 128 * batch_size}, float)``
    softmax_d = torch.empty((heads, rows), dtype=torch.float32, device=q.device)
    accum = (rows, heads, flash_head_dim_rounded(q.shape[-1]))
    if deterministic:
        # why: ``dq_accum = torch::zeros({nsplits, total_q + 128 * b, h, d_rounded}, float)``
        splits = flash_deterministic_splits(num_sms, batch, heads)
        dq_accum = torch.zeros((splits, *accum), dtype=torch.float32, device=q.device)
    else:
        # why: ``dq_accum = torch::empty({total_q + 128 * b, h, d_rounded}, float)``
        dq_accum = torch.empty(accum, dtype=torch.float32, device=q.device)
    dq.zero_()
    if k.shape[1] != heads:
        sum_grouped_head_grads(dk, dv, heads)
    else:
        dk.zero_()
        dv.zero_()
    # why: mha_varlen_bwd's locals, and the softmax_d it returns (dropped by the caller)
    del dout_padded, softmax_d, dq_accum
    return dq, dk, dv


def _real_flash_attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, None]:
    """transformers' flash-attention path on real tensors (a GPU with flash-attn installed)."""
    query = args[0]
    if query.device.type != "cuda":
        raise RuntimeError(
            f"{FLASH_ATTENTION_2} runs on CUDA GPUs only (flash-attn); got a {query.device.type} "
            "tensor"
        )
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers.integrations.flash_attention import flash_attention_forward as real

    config: Any = module.config
    # transformers' path passes ``module.config._attn_implementation`` down to pick the kernel
    saved = config._attn_implementation
    config._attn_implementation = FLASH_ATTENTION_2
    try:
        return real(module, *args, **kwargs)  # type: ignore[no-any-return]
    finally:
        config._attn_implementation = saved
