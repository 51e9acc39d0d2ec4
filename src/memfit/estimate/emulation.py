"""The plumbing the CUDA emulations share: what CUDA does differently from the CPU, on CPU tensors.

memfit traces a training step on fake CPU tensors: fake CUDA tensors cannot run autograd on a machine
without a GPU. Everything a CUDA run does differently from that CPU trace, and that changes what is
allocated, has to be emulated while tracing. The emulations are ``TorchFunctionMode``s:
:class:`~memfit.estimate.autocast_emulation.CudaAutocast` (CUDA's autocast: op lists, cast policies,
weight cache) and :class:`~memfit.estimate.sdpa_emulation.CudaSdpa` (``F.scaled_dot_product_attention``
as an sm80+ GPU runs it); :mod:`memfit.estimate.cuda_modes` enters them for a CUDA trace
(transformers' ``flash_attention_2`` is emulated by an attention function registered with
transformers instead: :mod:`memfit.estimate.flash_attention_emulation`). They only
change *what is allocated and in which dtype*; the numbers they compute are meaningless where a fused
kernel is emulated (outputs are zero-filled).

Why a TorchFunctionMode and not a dispatch mode: autocast sits above autograd, so its casts must be
recorded by autograd (gradients are cast back in backward, as on CUDA). A function mode sees the
Python-level calls (``F.linear``, ``Tensor.softmax``...) before autograd does. The C++ autocast kernels
see *aten* ops instead, including the ones a composite op (``cross_entropy_loss``) or a Python
function (``F.normalize``) calls internally. To see those too, a Python function is re-dispatched with
the mode re-entered (:func:`redispatch`), so its body's calls reach the mode; the C++ composites that
matter (``cross_entropy_loss``, ``nll_loss_nd``) are decomposed as ``LossNLL.cpp`` decomposes them.
"""

from __future__ import annotations

import contextlib
import types as _pytypes
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["EMULATED_DEVICE_TYPES", "autocast_excluded", "autocast_is_excluded", "redispatch"]

_SKIP_ONE_HOP: Callable[..., Any] | None = getattr(torch._C, "_skip_one_hop_torch_function", None)


def redispatch(
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
        # the low-level push, not ``with mode:``, so that __enter__ (which resets state) is not
        # re-run; spelled out, not a context manager: this runs for every Python function called
        torch._C._push_on_torch_function_stack(mode)
        try:
            return _SKIP_ONE_HOP(func, tuple(types), tuple(args), kwargs)
        finally:
            torch._C._pop_torch_function_stack()
    return func(*args, **kwargs)


# Mirrors ExcludeDispatchKeyGuard(AutocastFunctionality): the ops an autocast kernel (or an emulated
# fused kernel) runs internally are not autocast again.
_AUTOCAST_EXCLUDED = [0]


@contextlib.contextmanager
def autocast_excluded() -> Iterator[None]:
    _AUTOCAST_EXCLUDED[0] += 1
    try:
        yield
    finally:
        _AUTOCAST_EXCLUDED[0] -= 1


def autocast_is_excluded() -> bool:
    """Whether an autocast kernel (or an emulated fused kernel) is running its own ops."""
    return _AUTOCAST_EXCLUDED[0] > 0


# The trace runs on CPU tensors that stand for CUDA tensors ("cuda" for fake CUDA tensors, if any).
EMULATED_DEVICE_TYPES = ("cpu", "cuda")
