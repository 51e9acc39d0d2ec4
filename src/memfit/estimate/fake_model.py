"""The model a trace runs: built on the meta device, given fake CPU storage.

Also :class:`BackwardModes`, which keeps the torch-function modes around a checkpointed block's
recomputation (the CUDA emulation lives in them), so that the recomputation runs what the
forward ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import _get_current_function_mode_stack

from memfit.estimate import workload
from memfit.estimate.workload import StepSpec


class BackwardModes:
    """Checkpoint recomputation under the torch-function modes the backward was called in.

    The CUDA emulation lives in torch-function modes around the step. torch 2.13 keeps them on
    the stack while the autograd engine recomputes a checkpointed block; torch 2.11 does not, and
    the recomputation then runs CPU kernels (math SDPA, float dropout masks) whose saved tensors
    differ from the forward's (``CheckpointError``). ``wrap`` records the stack when backward
    starts; ``context_fn`` (``torch.utils.checkpoint``'s) pushes what is missing from it during
    a recomputation, and nothing where the modes are still there.
    """

    def __init__(self) -> None:
        self._stack: list[Any] = []

    def wrap(
        self, inner: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        @contextlib.contextmanager
        def modes() -> Iterator[None]:
            with inner():
                saved, self._stack = self._stack, list(_function_mode_stack())
                try:
                    yield
                finally:
                    self._stack = saved

        return modes

    def context_fn(self) -> tuple[contextlib.AbstractContextManager[Any], Any]:
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        present = _function_mode_stack()
        missing = [m for m in self._stack if not any(m is p for p in present)]
        for mode in missing:
            torch._C._push_on_torch_function_stack(mode)
        try:
            yield
        finally:
            for _ in missing:
                torch._C._pop_torch_function_stack()


def _function_mode_stack() -> list[Any]:
    return list(_get_current_function_mode_stack())


def build_fake_model(
    config: Any,
    spec: StepSpec,
    fake_mode: FakeTensorMode,
    backward: BackwardModes | None = None,
) -> torch.nn.Module:
    """Build on the meta device (no init cost), then give it fake CPU storage."""
    with torch.device("meta"):
        model = workload.build_model(
            config, spec, checkpoint_context_fn=backward.context_fn if backward else None
        )
    with fake_mode:
        model = model.to_empty(device="cpu")
    # to_empty replaces parameters one by one, which unties shared weights (GPT-2's lm_head)
    for module in model.modules():
        if (
            hasattr(module, "tie_weights")
            and isinstance(module, torch.nn.Module)
            and hasattr(module, "config")
        ):
            module.tie_weights()  # type: ignore[operator]
    return model
