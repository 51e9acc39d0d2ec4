"""The fused-linear cross-entropy (``--cross-entropy fused-linear``): the causal-LM loss computed
from the last hidden states and the head's weight chunk by chunk, so that neither the
(tokens × vocabulary) logits nor their gradient ever exist whole.

The algorithm is Liger Kernel's ``fused_linear_cross_entropy`` (read at linkedin/Liger-Kernel
commit ead96b6, version 0.8.2: ``src/liger_kernel/ops/fused_linear_cross_entropy.py``,
``ops/cross_entropy.py``, ``transformers/functional.py``). The facts this module relies on:

- Chunk rule: ``inc_factor = ceil(V / H)``; ``chunk = next_power_of_2(ceil(BT / inc_factor))``
  rows; ``ceil(BT / chunk)`` chunks (:func:`chunk_rows`). One chunk's logits then take about as
  much memory as the hidden states.
- Buffers before the loop: ``grad_input = zeros_like(input)`` (BT × H, the input's dtype; always,
  even when no gradient is computed); ``grad_weight = zeros_like(weight)`` only when the input
  requires grad and the weight does; ``grad_bias = zeros_like(bias)`` when the input requires grad
  and there is a bias; ``loss_1d`` (BT, fp32).
- Per chunk: ``logits = input_chunk @ weight.t()`` (chunk × V, the matmul's dtype: the autocast
  dtype under autocast); with a bias ``logits = logits + bias`` (a second chunk × V tensor, the first
  freed). The Triton kernel then computes, row by row in registers (fp32), the log-sum-exp and the
  loss, and overwrites the logits with their gradient (``softmax - onehot``; unscaled for
  ``reduction="sum"``; zero rows for ignored targets; softcap's ``1 - tanh²`` chain factor; the target
  entry recomputed in fp32 before rounding). Then ``grad_input[chunk] = grad_logits @ weight`` (a
  chunk × H temporary copied in), and ``grad_weight`` accumulates ``grad_logits.t() @ input_chunk``:
  with ``torch.addmm(..., out_dtype=float32, out=grad_weight)`` on CUDA devices of compute
  capability ≥ 8 (torch ≥ 2.8) when ``grad_weight`` is fp32 and the logits 16-bit (the input chunk
  cast to the logits' dtype first when it differs), else ``grad_weight += torch.mm(...).float()``
  (a V × H temporary, and its fp32 copy when the matmul is 16-bit). ``grad_bias`` adds
  ``grad_logits.sum(0)``.
- The gradients are computed in the forward (the input does not require grad, as in an eval under
  ``no_grad``: none at all); ``backward`` multiplies the saved ones by ``grad_output`` in place
  (skipped when it is exactly 1) and returns them.
- ``forward`` is decorated with ``torch.amp.custom_fwd(device_type=...)`` without ``cast_inputs``:
  under autocast its matmuls run in the autocast dtype, as any op would.
- ``reduction="sum"`` returns ``loss_1d.sum()``: fp32.
- Liger's model patches (``transformers/model/llama.py``'s ``lce_forward``, through
  ``loss_utils.LigerForCausalLMLoss``: labels padded with one ignore_index and shifted, hidden
  states viewed (-1, H), ``reduction="sum"`` over ``num_items_in_batch``) take the body's
  ``outputs[0]`` and ``lm_head.weight`` (no bias) only in training mode; in eval they build the
  logits. memfit's ``causal_lm_loss`` uses it in eval too.

Why memfit has its own implementation beside Liger's: Liger's (and Apple's Cut Cross-Entropy's)
kernels are Triton, CUDA only (``cut_cross_entropy``'s ``torch_compile`` fallback computes the
whole ``e @ c.T``); torchtune's ``LinearCrossEntropyLoss`` runs on the CPU but autograd keeps every
chunk's logits (and, uncompiled, their fp32 log-softmax) until the backward: it saves the upcast,
not the logits. This one runs anywhere torch does, and allocates what Liger's allocates, so the
estimator traces it (on fake tensors) to price Liger's on a CUDA target. Where it departs from
Liger it says so: row blocks of fp32 scratch for 16-bit logits and softcap (:func:`_log_softmax_`),
and gradients whenever grad is enabled and any of input, weight and bias requires one (Liger's
compute none unless the input requires grad, so a head trained under a frozen body gets none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = [
    "chunk_rows",
    "declared_chunks",
    "fp32_out_accumulation",
    "implementation",
    "linear_cross_entropy",
    "slot_bytes",
]

# a chunk's softmax is computed in row blocks of at most this fraction of its rows where it needs
# an fp32 scratch copy (16-bit logits, softcap's derivative): each scratch block is then at most
# 1/16 of an fp32 chunk (1/8 of a 16-bit one), where Liger's kernel keeps its fp32 rows in registers
_BLOCKS_PER_CHUNK = 16

# set by the estimator (fp32_out_accumulation) when it traces a CUDA target on (fake) CPU tensors
_OUT_DTYPE_ACCUMULATION: ContextVar[bool | None] = ContextVar("fp32_out_accumulation", default=None)

# what declares a traced allocation's size (see declared_chunks): given the tensor just allocated
# and the tracer's name for its op, its dims and the formula of its bytes, or None (undeclared)
Declaration = tuple[tuple[int, ...], Callable[..., int]]
Declarer = Callable[[torch.Tensor, str], "Declaration | None"]
# set by the estimator (declared_chunks): enters a region whose allocations ``declarer`` declares
_DECLARE: ContextVar[Callable[[Declarer], contextlib.AbstractContextManager[Any]] | None] = (
    ContextVar("declared_chunks", default=None)
)
# the loss being traced declares its chunks' sizes (the slots of _chunk_starts): set by
# linear_cross_entropy's forward for the duration of its loop
_SLOTS: ContextVar[bool] = ContextVar("chunk_slots", default=False)
# the tracer's name for autocast's low-precision copy of a parameter (the head's weight here)
_WEIGHT_CAST = "weight_cast"


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.8.0+cu128`` or ``2.9.0a0``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


_TORCH_VERSION = _version(torch.__version__)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """The rows of one chunk for ``rows`` tokens, a ``vocab``-wide head and ``hidden``-wide hidden
    states: Liger's rule, the power of two at or above ``rows / ceil(vocab / hidden)`` (so that a
    chunk's logits are about the size of the hidden states). At least 1."""
    inc_factor = _cdiv(vocab, hidden)
    return _next_power_of_2(_cdiv(max(rows, 1), inc_factor))


def implementation(device_type: str) -> str:
    """Which implementation :func:`linear_cross_entropy` runs on ``device_type``, in words."""
    if device_type == "cuda":
        # on a CUDA target the step is Liger's wherever liger-kernel is installed; the estimate
        # prices Liger's allocations either way (memfit's implementation makes the same)
        if importlib.util.find_spec("liger_kernel") is not None:
            return "Liger Kernel's fused linear cross-entropy (liger-kernel)"
        return (
            "Liger Kernel's fused linear cross-entropy with liger-kernel installed, else "
            "memfit's torch implementation of it (the same allocations)"
        )
    return (
        "memfit's torch implementation of Liger Kernel's fused linear cross-entropy "
        "(Liger's kernels need CUDA)"
    )


@contextlib.contextmanager
def fp32_out_accumulation(enabled: bool = True) -> Iterator[None]:
    """While entered, the head's gradient is accumulated as Liger accumulates it on a CUDA device
    of compute capability ≥ 8 (``addmm`` with ``out_dtype=float32`` into the fp32 gradient, no
    V × H temporary) whatever the tensors' device (``enabled``), or as elsewhere (not
    ``enabled``). The estimator enters it to trace a CUDA target on fake CPU tensors, whose
    ``addmm`` with ``out_dtype`` runs (a meta kernel) where a real CPU tensor's does not. While
    entered (either way), 16-bit and soft-capped logits also take Liger's allocations: the
    softmax in place, without memfit's fp32 row-block scratch."""
    token = _OUT_DTYPE_ACCUMULATION.set(enabled)
    try:
        yield
    finally:
        _OUT_DTYPE_ACCUMULATION.reset(token)


@contextlib.contextmanager
def declared_chunks(
    declare: Callable[[Declarer], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """While entered, a trace of the loss on fake tensors runs the same chunks, in the same
    order, whatever the number of rows, and declares how each of their allocations' bytes follow
    from the rows: the estimator then fits the loss over (batch size, sequence length) as it fits
    the rest of the step, where a chunk's rows (a power of two) and the number of chunks are no
    bilinear function of them.

    The trace runs three slots (:func:`_chunk_starts`): the first chunk, the second and the last;
    a slot the rows do not fill (one or two chunks) runs on no rows, its allocations declared
    empty. ``declare(declarer)`` enters a region in which the tracer records each allocation with
    the dims and size formula ``declarer(tensor, op)`` gives (:func:`slot_bytes`; the tracer's
    op, ``"weight_cast"`` for autocast's copy of a parameter), or as it is where it gives None.
    memfit's own row blocks of fp32 scratch (a CPU target's 16-bit or soft-capped logits) are not
    covered: their number follows the chunk's rows, so each shape's trace stays its own."""
    token = _DECLARE.set(declare)
    try:
        yield
    finally:
        _DECLARE.reset(token)


# the traced slots of a declared loss: the first chunk, the second, the last (see _chunk_starts)
_SLOT_COUNT = 3


def _slot_start(rows: int, chunk: int, slot: int) -> int:
    """The first row of ``slot`` (0, 1 or 2) of the traced loss; ``rows`` where it is empty."""
    if slot == _SLOT_COUNT - 1:
        count = _cdiv(rows, chunk)
        return (count - 1) * chunk if count >= _SLOT_COUNT else rows
    return min(slot * chunk, rows)


def _slot_rows(rows: int, vocab: int, hidden: int, slot: int) -> int:
    """How many rows ``slot`` of the traced loss computes (0: a slot the rows do not fill)."""
    chunk = chunk_rows(rows, vocab, hidden)
    start = _slot_start(rows, chunk, slot)
    return min(start + chunk, rows) - start


def slot_bytes(
    rows: int, vocab: int, hidden: int, slot: int, itemsize: int, by_rows: int, *dims: int
) -> int:
    """The bytes of an allocation in ``slot`` of the traced loss over ``rows`` tokens (a
    ``vocab`` × ``hidden`` head): ``dims`` times ``itemsize``, times the slot's rows where
    ``by_rows`` (a tensor of the chunk's rows: logits, a row's loss), nothing in a slot the rows
    do not fill. Every argument is constant or linear in the rows: the estimator's fit predicts
    them for any shape."""
    slot_rows = _slot_rows(rows, vocab, hidden, slot)
    if slot_rows == 0:
        return 0
    return (slot_rows if by_rows else 1) * math.prod(dims) * itemsize


@dataclasses.dataclass(frozen=True)
class _SlotDeclarer:
    """Declares the allocations of one slot of the traced loss (a :data:`Declarer`)."""

    rows: int
    vocab: int
    hidden: int
    slot: int
    slot_rows: int

    def __call__(self, tensor: torch.Tensor, op: str) -> Declaration | None:
        shape = tuple(int(d) for d in tensor.shape)
        # a tensor of the chunk's rows has them as one of its dims (first, or second where it
        # is transposed: the logits' gradient cast for the head's); the head's copies and
        # gradients (V × H, V) have none. Where the rows equal another dim, the bytes are the
        # same whichever is read as the rows (only the dims differ: a traced shape's signature
        # then differs, and the fit fails its check rather than err)
        axis = (
            None
            if op == _WEIGHT_CAST
            else next((i for i, d in enumerate(shape) if d == self.slot_rows), None)
        )
        dims: tuple[int, ...] = (self.rows, self.vocab, self.hidden, self.slot)
        dims += (tensor.element_size(),)
        if axis is None:
            dims += (0, *shape)
        else:
            dims += (1, *shape[:axis], *shape[axis + 1 :])
        if self.slot_rows and slot_bytes(*dims) != tensor.untyped_storage().nbytes():
            return None  # not what the rule says (a view onto a larger storage): as it is
        return dims, slot_bytes


def _slot_declarers(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> Callable[[Declarer], contextlib.AbstractContextManager[Any]] | None:
    """The estimator's ``declare`` (:func:`declared_chunks`) where this call of the loss is
    traced with its chunks declared, else None (a real run; memfit's own row blocks)."""
    declare = _DECLARE.get()
    if declare is None or not isinstance(hidden, FakeTensor):
        return None
    if _OUT_DTYPE_ACCUMULATION.get() is None:
        device_type = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else torch.promote_types(hidden.dtype, weight.dtype)
        )
        if bias is not None:
            dtype = torch.promote_types(dtype, bias.dtype)
        if softcap is not None or dtype != torch.float32:
            return None  # _log_softmax_'s row blocks: as many as the chunk's rows make
    return declare


def _accumulates_out_dtype(device: torch.device) -> bool:
    chosen = _OUT_DTYPE_ACCUMULATION.get()
    if chosen is not None:
        return chosen
    # Liger's condition: torch >= 2.8 (addmm's out_dtype), a CUDA device of capability >= 8
    return (
        _TORCH_VERSION >= (2, 8)
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


@functools.cache
def _liger_function() -> Any:
    """Liger's functional ``liger_fused_linear_cross_entropy``, or None where it does not import."""
    try:
        # optional: the liger extra (Triton, CUDA only)
        functional = importlib.import_module("liger_kernel.transformers.functional")
    except Exception:  # not installed, or Triton cannot load here
        return None
    return getattr(functional, "liger_fused_linear_cross_entropy", None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """The summed cross-entropy (fp32 scalar) of ``hidden @ weight.T + bias`` (``hidden``: tokens
    × H, ``weight``: V × H, ``bias``: V) against ``targets`` (tokens), over the targets that are
    not ``ignore_index``, with Gemma 2's ``softcap`` (logits ``c·tanh(z/c)``) when given; the
    logits are never built whole. The gradients of ``hidden``, ``weight`` and ``bias`` are
    computed during this call when grad is enabled and they require it, and scaled by the loss's
    gradient in the backward.

    Liger Kernel's on CUDA when it imports; memfit's :class:`_LinearCrossEntropy` elsewhere.
    """
    if hidden.device.type == "cuda":
        liger = _liger_function()
        if liger is not None:
            loss: torch.Tensor = liger(
                hidden,
                weight,
                targets,
                bias,
                ignore_index=ignore_index,
                reduction="sum",
                softcap=softcap,
            )
            return loss
    # decided here: inside an autograd Function's forward grad mode is always off
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    function = _function(hidden.device.type)
    summed: torch.Tensor = function.apply(
        hidden, weight, bias, targets, ignore_index, softcap, needs_grad
    )
    return summed


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def _function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function for tensors of ``device_type``: ``torch.amp.custom_fwd`` /
    ``custom_bwd`` need the device type when they decorate (Liger decorates with its device's)."""
    function = _FUNCTIONS.get(device_type)
    if function is None:
        function = type(
            f"_LinearCrossEntropy_{device_type}",
            (_LinearCrossEntropy,),
            {
                "forward": staticmethod(
                    torch.amp.custom_fwd(_LinearCrossEntropy._forward, device_type=device_type)
                ),
                "backward": staticmethod(
                    torch.amp.custom_bwd(_LinearCrossEntropy._backward, device_type=device_type)
                ),
            },
        )
        _FUNCTIONS[device_type] = function
    return function


class _LinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy in torch ops, allocation for allocation (see the module's
    notes); :func:`_function` gives the subclass decorated for a device type."""

    @staticmethod
    def _forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        needs_grad: bool,
    ) -> torch.Tensor:
        rows, width = hidden.shape
        vocab = weight.shape[0]
        chunk = chunk_rows(rows, vocab, width)
        # Liger allocates the input's gradient whether or not it computes one
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if needs_grad and weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if needs_grad and bias is not None else None
        loss_1d = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        # traced with the chunks declared (the estimator): three slots, whatever the rows
        declare = _slot_declarers(hidden, weight, bias, softcap)
        token = _SLOTS.set(declare is not None)
        try:
            starts = _chunk_starts(hidden, rows, chunk)
        finally:
            _SLOTS.reset(token)
        for slot, start in enumerate(starts):
            end = min(start + chunk, rows)
            declared: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if (
                declare is not None
                and slot < _SLOT_COUNT
                and end - start == _slot_rows(rows, vocab, width, slot)
            ):
                declared = declare(_SlotDeclarer(rows, vocab, width, slot, end - start))
            with declared:
                hidden_chunk = hidden[start:end]
                logits = hidden_chunk @ weight.t()
                if bias is not None:
                    logits = logits + bias
                target_chunk = targets[start:end]
                ignored = target_chunk == ignore_index
                index = target_chunk.masked_fill(ignored, 0).unsqueeze(1)
                # the target's logit, before the logits are overwritten
                target_logit = logits.gather(1, index).float().squeeze(1)
                lse = _log_softmax_(logits, softcap, needs_grad)
                if softcap is not None:
                    target_tanh = torch.tanh(target_logit / softcap)
                    target_logit = target_tanh * softcap
                loss_1d[start:end] = (lse - target_logit).masked_fill_(ignored, 0.0)
                if not needs_grad:
                    continue
                # logits now holds softmax (times softcap's chain factor); the target's entry is
                # recomputed in fp32 (softmax - 1 cancels in 16 bits), ignored rows are zero
                target_grad = torch.exp(target_logit - lse) - 1.0
                if softcap is not None:
                    target_grad = target_grad * (1.0 - target_tanh * target_tanh)
                logits.scatter_(1, index, target_grad.unsqueeze(1).to(logits.dtype))
                logits.masked_fill_(ignored.unsqueeze(1), 0.0)
                grad_logits = logits
                grad_input[start:end] = grad_logits @ weight
                if grad_weight is not None:
                    _accumulate(grad_weight, grad_logits, hidden_chunk)
                if grad_bias is not None:
                    torch.add(grad_bias, grad_logits.sum(dim=0), out=grad_bias)
        ctx.save_for_backward(
            grad_input if needs_grad and hidden.requires_grad else None, grad_weight, grad_bias
        )
        return loss_1d.sum()

    @staticmethod
    def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # in place, as Liger's element_mul kernel: no second copy of the gradients. (Liger skips
        # the multiplication when grad_output is exactly 1; comparing would sync, and fake
        # tensors cannot answer it: the product allocates nothing either way.)
        for grad in (grad_input, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(grad_output)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _chunk_starts(hidden: torch.Tensor, rows: int, chunk: int) -> list[int]:
    """The first row of each chunk the loop runs. After the first chunk every full chunk
    allocates, then frees, the same tensors over the same live set (its logits and their
    scratch; the gradients go in place into buffers allocated before the loop; what the first
    chunk leaves behind, such as autocast's cached 16-bit copy of an fp32 head, is there from the
    second on). So on fake tensors, which hold no values (the estimator's trace), the first two
    chunks and the last, shorter one allocate what all of them do, at the same peak: the trace
    runs those, not the dozens a 128k-vocabulary head has (each chunk is ten or more traced ops,
    and a plan traces the loss many times).

    Traced with the chunks declared (:func:`declared_chunks`), always three slots: the first
    chunk, the second, the last (a full one where the chunks divide the rows, a third copy of
    the second); a slot the rows do not fill starts at ``rows`` (no rows), after the real ones,
    so the chunks that run, run as in the real loop."""
    starts = list(range(0, rows, chunk))
    if not isinstance(hidden, FakeTensor):
        return starts
    if _SLOTS.get():
        return [_slot_start(rows, chunk, slot) for slot in range(_SLOT_COUNT)]
    if len(starts) > 3:
        return starts[:2] + ([starts[-1]] if rows % chunk else [])
    return starts


def _accumulate(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor
) -> None:
    """``grad_weight += grad_logits.T @ hidden_chunk``, as Liger accumulates it."""
    if (
        grad_weight.dtype == torch.float32
        and grad_logits.dtype in (torch.float16, torch.bfloat16)
        and _accumulates_out_dtype(grad_weight.device)
    ):
        if hidden_chunk.dtype != grad_logits.dtype:
            hidden_chunk = hidden_chunk.to(grad_logits.dtype)
        torch.addmm(
            grad_weight,
            grad_logits.t(),
            hidden_chunk,
            out_dtype=torch.float32,
            out=grad_weight,
        )
    else:
        grad_weight += torch.mm(grad_logits.t(), hidden_chunk).float()


def _log_softmax_(logits: torch.Tensor, softcap: float | None, needs_grad: bool) -> torch.Tensor:
    """The rows' log-sum-exp (fp32) of ``logits`` (softcapped when ``softcap``); with
    ``needs_grad`` ``logits`` is left holding the softmax times softcap's chain factor
    ``1 - tanh²(z/c)`` (the gradient but for the target's entry), else scratch.

    fp32 logits without softcap are done in place, whole (amax, sub_, exp_, sum, div_): no
    chunk-sized temporary. Softcap's derivative needs ``tanh(z/c)`` after the softmax has
    overwritten it, and 16-bit logits need fp32 arithmetic (Liger's kernel works in fp32 registers):
    those go in row blocks with an fp32 scratch of at most 1/16 of the chunk's rows each (two with
    both), the one allocation Liger's kernel does not make.
    """
    if logits.dtype == torch.float32 and softcap is None:
        return _softmax_rows_(logits, needs_grad)
    if _OUT_DTYPE_ACCUMULATION.get() is not None:
        # the estimator tracing a CUDA target (fake tensors: no values): Liger's kernel works
        # row by row in registers and allocates nothing beside the logits, which these in-place
        # ops reproduce without the row blocks' scratch (and without their dozens of ops per
        # chunk, which made the trace of a 128k-vocabulary head several times slower)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        return _softmax_rows_(logits, needs_grad).float()
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = max(1, logits.shape[0] // _BLOCKS_PER_CHUNK)
    for start in range(0, logits.shape[0], step):
        block = logits[start : start + step]
        # fp32 work rows: the block itself when fp32 (softcap only), else an fp32 copy
        work = block if block.dtype == torch.float32 else block.float()
        chain = None
        if softcap is not None:
            work.div_(softcap).tanh_()
            if needs_grad:
                chain = torch.mul(work, work).neg_().add_(1.0)  # 1 - tanh²
            work.mul_(softcap)
        lse[start : start + step] = _softmax_rows_(work, needs_grad)
        if needs_grad:
            if chain is not None:
                work.mul_(chain)
            if work is not block:
                block.copy_(work)
    return lse


def _softmax_rows_(rows: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """The log-sum-exp of each row of fp32 ``rows``, which are overwritten: with their softmax
    when ``needs_grad``, else with scratch."""
    peak = rows.amax(dim=1, keepdim=True)
    rows.sub_(peak).exp_()
    total = rows.sum(dim=1, keepdim=True)
    if needs_grad:
        rows.div_(total)
    return (peak + total.log()).squeeze(1)
