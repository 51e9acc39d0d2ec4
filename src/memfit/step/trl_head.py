"""TRL's fused LM head (``--cross-entropy trl-chunked``): the loss TRL's ``SFTTrainer`` computes.

trl 1.16's ``SFTTrainer.__init__`` calls ``add_fused_lm_head(model, outputs=("log_probs",
"entropy", "is_top1"))`` (``trl/trainer/utils.py``) and its ``compute_loss`` calls
``model(**inputs, fused_lm_head=True)``: the backbone runs without the head, and
``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` computes each target token's
log-probability in tiles of ``TOKEN_CHUNK_SIZE`` (4096) tokens × ``chunk_size`` (32768, TRL's
``_CHUNKED_LOGPROB_CHUNK_SIZE``) vocabulary columns; the loss is ``-Σ log_probs / tokens``. What it
allocates, read from TRL's source (``trl/kernels/chunked_logprob.py``, ``trl/trainer/utils.py``
at trl 1.16):

- Before its head: ``last_hidden_state[:, :-1]`` and ``labels[:, 1:]`` (views). On a device with
  Triton (CUDA) only the positions whose label is not -100 are projected: ``hidden[mask]`` (a
  copy of the valid rows × H) and ``labels[mask]``; elsewhere (the CPU) every position is:
  ``hidden.reshape(-1, H)`` (a copy: the slice is not contiguous) and ``labels.clamp(min=0)``.
- Forward: seven fp32 accumulators of N tokens, one ``mm_buf`` of ``[min(N, 4096), 32768]`` in the
  compute dtype (the autocast dtype, else the hidden states'), reused by every tile; per token
  tile its rows cast to the compute dtype (a copy when the dtype differs), per vocabulary tile the
  weight's rows so cast, ``torch.mm(..., out=tile)``; the Triton kernel folds a tile in registers
  (no allocation), the torch fallback (``_forward_tile``) allocates the tile's fp32 logits and
  their temporaries. Saved for the backward: the inputs and ``log_z``, ``entropy`` (N, fp32).
- Backward: ``grad_hidden`` (N × H, fp32) when the hidden states need one, ``grad_weight`` (V × H,
  fp32) when the head is trained, another ``mm_buf``; per tile the same casts and matmul, the
  gradient written into the tile in place (Triton) or through ``_backward_tile``'s temporaries,
  then ``_addmm_fp32`` into the fp32 gradients (``addmm`` with ``out_dtype=float32`` on CUDA for
  16-bit tiles, torch >= 2.8; elsewhere ``acc.addmm_(a.float(), b.float())``: fp32 copies of
  16-bit operands); the gradients are returned cast to the inputs' dtypes.
- After its head: each output scattered back to ``[B, T-1]`` (``masked_scatter`` into zeros under
  Triton, ``masked_fill`` elsewhere); ``-log_probs.sum()``.

On real tensors :func:`trl_chunked_loss` runs TRL's own function. On the estimator's fake tensors
it runs :class:`_Traced`, the same loop with TRL's own tile folds (``_forward_tile``,
``_backward_tile``) for a CPU target and none for a CUDA target (Triton's kernels allocate
nothing), and only two token tiles: the first and the last (a middle tile allocates and frees what
the first does over the same live set). Their allocations are declared with
:func:`tile_bytes`, so that the estimator's fit predicts any shape from a few traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memfit.step import linear_ce

# trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE and trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
# (trl 1.16), read from the installed TRL where it has them
TOKEN_TILE = 4096
VOCAB_TILE = 32768
# the per-token outputs SFTTrainer asks add_fused_lm_head for
OUTPUTS = ("log_probs", "entropy", "is_top1")
IGNORE_INDEX = -100
INSTALL = "pip install 'memfit[trl]'"


@functools.cache
def _trl() -> tuple[Any, Any] | None:
    """(trl.kernels.chunked_logprob, trl.trainer.utils) where TRL with its fused head imports."""
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        # optional: the trl extra
        from trl.kernels import chunked_logprob
        from trl.trainer import utils
    except Exception:  # an old or broken TRL: no fused head
        return None
    if not hasattr(utils, "add_fused_lm_head"):
        return None
    return chunked_logprob, utils


def trl_problem() -> str | None:
    """Why ``--cross-entropy trl-chunked`` cannot be priced here (one line), or None."""
    if _trl() is None:
        return (
            "--cross-entropy trl-chunked: TRL's fused LM head (trl >= 1.16) is not installed; "
            f"{INSTALL}"
        )
    return None


def tiles() -> tuple[int, int]:
    """(tokens, vocabulary columns) of one of TRL's tiles, from the installed TRL."""
    found = _trl()
    if found is None:
        return TOKEN_TILE, VOCAB_TILE
    kernels, utils = found
    return (
        int(getattr(kernels, "TOKEN_CHUNK_SIZE", TOKEN_TILE)),
        int(getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", VOCAB_TILE)),
    )


def implementation(device_type: str) -> str:
    """The head the estimate prices on ``device_type``, in words."""
    if device_type == "cuda":
        return "TRL SFTTrainer's fused LM head (ChunkedLogProbFunction's Triton tile kernels)"
    return "TRL SFTTrainer's fused LM head (ChunkedLogProbFunction's torch tile folds)"


def _slot_rows(rows: int, tile: int, slot: int) -> int:
    """The tokens of traced ``slot``: 0, the first tile; 1, the last one (none when one tile)."""
    if slot == 0:
        return min(rows, tile)
    count = -(-rows // tile)
    return rows - (count - 1) * tile if count >= 2 else 0


def tile_bytes(rows: int, tile: int, slot: int, itemsize: int, by_rows: int, *dims: int) -> int:
    """The bytes of an allocation in ``slot`` of the traced head over ``rows`` tokens (``tile``
    tokens a tile): ``dims`` × ``itemsize``, times the slot's tokens where ``by_rows``. Every
    argument is constant or linear in the tokens: the estimator's fit predicts them."""
    count = _slot_rows(rows, tile, slot)
    if count == 0:
        return 0
    return (count if by_rows else 1) * math.prod(dims) * itemsize


@dataclasses.dataclass(frozen=True)
class _TileDeclarer:
    """Declares the allocations of one traced slot (a :data:`memfit.step.linear_ce.Declarer`)."""

    rows: int
    tile: int
    slot: int

    def __call__(self, tensor: torch.Tensor, op: str) -> Any:
        count = _slot_rows(self.rows, self.tile, self.slot)
        shape = tuple(int(d) for d in tensor.shape)
        axis = next((i for i, d in enumerate(shape) if d == count), None) if count else None
        if count == 0:
            # an empty slot allocates nothing; its dims are the first slot's shape's others
            axis = next((i for i, d in enumerate(shape) if d == 0), None)
        dims: tuple[int, ...] = (self.rows, self.tile, self.slot, tensor.element_size())
        dims += (0, *shape) if axis is None else (1, *shape[:axis], *shape[axis + 1 :])
        if count and tile_bytes(*dims) != tensor.untyped_storage().nbytes():
            return None  # a view onto a larger storage: as it is
        return dims, tile_bytes


def _declare(rows: int, tile: int, slot: int) -> contextlib.AbstractContextManager[Any]:
    # the estimator's declaring region (memfit.step.linear_ce.declared_chunks), when tracing
    declare = linear_ce._DECLARE.get()
    if declare is None:
        return contextlib.nullcontext()
    return declare(_TileDeclarer(rows, tile, slot))


def _cuda_target(device: torch.device) -> bool:
    """Whether the head runs Triton's kernels: a CUDA device, or a CUDA target traced on fake CPU
    tensors (the estimator enters linear_ce.fp32_out_accumulation for those)."""
    return device.type == "cuda" or linear_ce._OUT_DTYPE_ACCUMULATION.get() is not None


def _compute_dtype(device: torch.device, hidden: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return hidden.dtype


class _Traced(torch.autograd.Function):
    """ChunkedLogProbFunction's loop (trl 1.16), two token tiles, on fake tensors (see above)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        softcap: float | None,
        logit_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        device, rows, vocab = hidden.device, hidden.shape[0], weight.shape[0]
        tile, columns = tiles()
        compute_dtype = _compute_dtype(device, hidden)
        triton = _cuda_target(device)
        fold = None if triton else _trl_fold("_forward_tile")
        f32: dict[str, Any] = {"device": device, "dtype": torch.float32}
        running_max = torch.full((rows,), float("-inf"), **f32)
        sum_exp = torch.zeros((rows,), **f32)
        x_sum_exp = torch.zeros((rows,), **f32)
        sq_sum_exp = torch.zeros((rows,), **f32)
        z_sum = torch.zeros((rows,), **f32)
        max_before_target = torch.full((rows,), float("-inf"), **f32)
        target_logit = torch.zeros((rows,), **f32)
        with _declare(rows, tile, 0):
            mm_buf = torch.empty((min(rows, tile), columns), device=device, dtype=compute_dtype)
        for slot in (0, 1):
            start_row = 0 if slot == 0 else rows - _slot_rows(rows, tile, 1)
            n = _slot_rows(rows, tile, slot)
            with _declare(rows, tile, slot):
                hidden_chunk = hidden[start_row : start_row + n].to(compute_dtype)
                for start in range(0, vocab, columns):
                    end = min(start + columns, vocab)
                    part = mm_buf[:n, : end - start]
                    torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=part)
                    if bias is not None:
                        part.add_(bias[start:end].to(compute_dtype))
                    if fold is not None:
                        fold(part, part.stride(0), targets[start_row : start_row + n],
                             running_max[start_row : start_row + n],
                             sum_exp[start_row : start_row + n],
                             x_sum_exp[start_row : start_row + n],
                             sq_sum_exp[start_row : start_row + n],
                             z_sum[start_row : start_row + n],
                             max_before_target[start_row : start_row + n],
                             target_logit[start_row : start_row + n], start, end - start,
                             **_kernel_args(softcap, logit_scale), **_output_flags(),
                             BLOCK_SIZE=1024)  # fmt: skip
                del hidden_chunk
        del mm_buf
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.compute_dtype, ctx.kernel = compute_dtype, (softcap, logit_scale)
        ctx.mark_non_differentiable(is_top1)
        return logprobs, entropy, is_top1

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any, *_: Any) -> tuple[Any, ...]:
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        compute_dtype = ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        device, rows, vocab = hidden.device, hidden.shape[0], weight.shape[0]
        tile, columns = tiles()
        triton = _cuda_target(device)
        fold = None if triton else _trl_fold("_backward_tile")
        grad_hidden = (
            torch.zeros(hidden.shape, device=device, dtype=torch.float32) if needs_hidden else None
        )
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            if needs_weight
            else None
        )
        grad_bias = (
            torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if needs_bias else None
        )  # fmt: skip
        with _declare(rows, tile, 0):
            mm_buf = torch.empty((min(rows, tile), columns), device=device, dtype=compute_dtype)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        for slot in (0, 1):
            start_row = 0 if slot == 0 else rows - _slot_rows(rows, tile, 1)
            n = _slot_rows(rows, tile, slot)
            span = slice(start_row, start_row + n)
            with _declare(rows, tile, slot):
                hidden_chunk = hidden[span].to(compute_dtype)
                for start in range(0, vocab, columns):
                    end = min(start + columns, vocab)
                    w_chunk = weight[start:end].to(compute_dtype)
                    part = mm_buf[:n, : end - start]
                    torch.mm(hidden_chunk, w_chunk.t(), out=part)
                    if bias is not None:
                        part.add_(bias[start:end].to(compute_dtype))
                    if fold is not None:
                        fold(part, part.stride(0), targets[span], log_z[span], entropy[span],
                             grad_logprobs[span] if grad_logprobs is not None else log_z,
                             grad_entropy[span] if grad_entropy is not None else log_z,
                             start, end - start, **_kernel_args(*ctx.kernel),
                             HAS_LOGPROB_GRAD=grad_logprobs is not None,
                             HAS_ENTROPY_GRAD=grad_entropy is not None, BLOCK_SIZE=1024)  # fmt: skip
                    if grad_hidden is not None:
                        _addmm_fp32(grad_hidden[span], part, w_chunk, triton)
                    if grad_weight is not None:
                        _addmm_fp32(grad_weight[start:end], part.t(), hidden_chunk, triton)
                    if grad_bias is not None:
                        grad_bias[start:end] += part.sum(dim=0, dtype=torch.float32)
                    del w_chunk
                del hidden_chunk
        del mm_buf
        return (
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
        )


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, triton: bool) -> None:
    """TRL's ``_addmm_fp32``: on CUDA (torch >= 2.8) 16-bit operands accumulate with
    ``out_dtype=float32`` and no temporary; elsewhere their fp32 copies (none for fp32)."""
    if triton and a.dtype in (torch.float16, torch.bfloat16):
        # the fake CPU tensors of a CUDA target: what addmm's out_dtype allocates (nothing)
        return
    acc.addmm_(a.float(), b.float())


def _kernel_args(softcap: float | None, logit_scale: float) -> dict[str, Any]:
    return {
        "logit_scale": logit_scale,
        "softcap": softcap or 1.0,
        "inv_t": 1.0,
        "HAS_SOFTCAP": softcap is not None,
    }


def _output_flags() -> dict[str, bool]:
    optional = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    return {f"HAS_{name.upper()}": name in OUTPUTS for name in optional}


def _trl_fold(name: str) -> Callable[..., Any]:
    found = _trl()
    if found is None:
        raise ValueError(trl_problem())
    fold: Callable[..., Any] = getattr(found[0], name)
    return fold


def _head_scale(text_config: Any) -> float:
    """The logit scale add_fused_lm_head reads from the config (trl 1.16's order)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    scaling = getattr(text_config, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def trl_chunked_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    units: int,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss TRL's SFTTrainer computes with its fused LM head: ``-Σ log_probs / units`` from
    the backbone's last hidden states, TRL's ``ChunkedLogProbFunction`` on real tensors and
    :class:`_Traced` on the estimator's fake ones. ValueError without TRL's fused head."""
    found = _trl()
    if found is None:
        raise ValueError(trl_problem())
    get_base = getattr(model, "get_base_model", None)  # a peft model: the transformers model
    base: Any = get_base() if callable(get_base) else model
    text_config = base.config.get_text_config()
    positions = {} if position_ids is None else {"position_ids": position_ids}
    # add_fused_lm_head's backbone: base_model (transformers 5)
    outputs = base.base_model(input_ids=input_ids, attention_mask=attention_mask, **positions,
                              use_cache=False)  # fmt: skip
    hidden_states = outputs.last_hidden_state[:, :-1]
    shifted = labels[:, 1:]
    head = base.get_output_embeddings()
    mask = shifted != IGNORE_INDEX
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = _head_scale(text_config)
    fake = isinstance(hidden_states, FakeTensor)
    compact = _cuda_target(hidden_states.device)
    if compact and not fake:
        rows, targets = hidden_states[mask], shifted[mask]
    elif compact:
        # hidden[mask], labels[mask]: copies of the valid rows, all of them in the estimator's
        # batches (fake tensors cannot say how many are valid); the slices are not contiguous,
        # so reshape copies as many bytes
        rows = hidden_states.reshape(-1, hidden_states.size(-1))
        targets = shifted.reshape(-1)
    else:
        rows = hidden_states.reshape(-1, hidden_states.size(-1))
        targets = shifted.clamp(min=0).reshape(-1)
    if fake:
        log_probs, entropy, is_top1 = _Traced.apply(
            rows, head.weight, head.bias, targets, softcap, scale
        )
    else:
        kernels = found[0]
        _tokens, columns = tiles()
        log_probs, entropy, _, _, is_top1 = kernels.ChunkedLogProbFunction.apply(
            rows, head.weight, head.bias, targets, 1.0, columns, softcap, scale, OUTPUTS
        )
    if compact:
        per_token = [
            x.new_zeros(mask.shape).masked_scatter(mask, x) for x in (log_probs, entropy, is_top1)
        ]
    else:
        per_token = [x.view(mask.shape).masked_fill(~mask, 0) for x in (log_probs, entropy, is_top1)]  # fmt: skip
    log_probs = per_token[0]
    return -log_probs.sum() / units
