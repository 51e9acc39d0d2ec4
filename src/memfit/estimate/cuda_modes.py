"""The modes a trace runs under so that the CPU trace allocates what a CUDA step would.

On the CPU the fake CPU trace is the device: no mode at all. For CUDA, the step runs under the
emulations of :mod:`memfit.estimate.autocast_emulation` (mixed precision) and
:mod:`memfit.estimate.sdpa_emulation`, and with CUDA's dropout (:class:`CudaDropout`).
``flash_attention_2`` needs no mode: the model's config names memfit's stand-in for the flash-attn
package (:mod:`memfit.estimate.flash_attention_emulation`, chosen by ``workload._task_config``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from memfit.estimate import workload
from memfit.estimate.autocast_emulation import CudaAutocast
from memfit.estimate.emulation import redispatch
from memfit.estimate.sdpa_emulation import CudaSdpa
from memfit.estimate.workload import StepSpec
from memfit.step import linear_ce

__all__ = ["CudaDropout", "TraceModes", "trace_modes"]

Modes = Callable[[], contextlib.AbstractContextManager[Any]]


class TraceModes(NamedTuple):
    """What :func:`memfit.estimate.trace.trace_steps` enters (None: nothing)."""

    autocast: Modes | None
    step_modes: Modes | None
    backward_modes: Modes | None


def trace_modes(spec: StepSpec) -> TraceModes:
    """On CPU the fake CPU trace is the device; for CUDA, emulate its autocast and SDPA kernels."""
    if spec.device == "cpu":
        return TraceModes(None, None, None)
    autocast: Modes
    backward_modes: Modes | None = None
    if spec.precision != "fp32":
        dtype = workload.PRECISION_DTYPES[spec.precision]
        autocast = lambda: CudaAutocast(dtype)  # noqa: E731
        # checkpointed recompute in backward re-enters autocast: the emulation must answer it
        backward_modes = lambda: CudaAutocast(dtype, enabled=False)  # noqa: E731
    else:
        autocast = contextlib.nullcontext

    def step_modes() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        # the attention kernels of the GPU's generation (StepSpec.sdpa_sm; 80: any sm80+ GPU)
        stack.enter_context(CudaSdpa(compute_capability=divmod(spec.sdpa_sm, 10)))
        # CUDA's dropout keeps a 1-byte bool mask for backward; the CPU kernel keeps a float one
        stack.enter_context(CudaDropout())
        # the fused-linear cross-entropy accumulates the head's gradient as Liger does on the
        # GPU's generation: addmm into the fp32 gradient (out_dtype) on sm80+, no V x H temporary
        stack.enter_context(linear_ce.fp32_out_accumulation(spec.sdpa_sm >= 80))
        return stack

    return TraceModes(autocast, step_modes, backward_modes)


class CudaDropout(torch.overrides.TorchFunctionMode):
    """``F.dropout`` in training as CUDA runs it: ``native_dropout``, whose saved mask is bool."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False)) | kwargs
            p, training = bound.get("p", 0.5), bound.get("training", True)
            if training and p > 0 and not bound.get("inplace", False):
                return torch.native_dropout(bound["input"], p, True)[0]
        # a Python function (Tensor.backward, whose checkpoint recompute calls dropout again)
        # runs with this mode still active
        return redispatch(self, func, types, args, kwargs)
