"""The tracer's own machinery (the traces themselves are checked against real steps elsewhere)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from memfit.estimate.fake_model import BackwardModes
from memfit.estimate.trace import _no_gc


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_recompute_restores_the_modes_backward_was_called_in() -> None:
    # torch 2.11's autograd engine recomputes checkpointed blocks without the torch-function
    # modes that were active around backward(); the recompute context puts them back
    keeper = BackwardModes()
    mode = _Counting()
    with keeper.wrap(lambda: mode)():
        _, recompute = keeper.context_fn()
        with _NoModes():
            assert not any(m is mode for m in _get_current_function_mode_stack())
            torch.ones(2) + 1
            assert mode.calls == 0
            with recompute:
                torch.ones(2) + 1
                assert any(m is mode for m in _get_current_function_mode_stack())
            assert not any(m is mode for m in _get_current_function_mode_stack())
    assert mode.calls == 2  # torch.ones and the addition, under the restored mode


def test_recompute_adds_nothing_where_the_modes_are_still_there() -> None:
    keeper = BackwardModes()
    mode = _Counting()
    with keeper.wrap(lambda: mode)():
        depth = len(_get_current_function_mode_stack())
        _, recompute = keeper.context_fn()
        with recompute:
            assert len(_get_current_function_mode_stack()) == depth
    # outside backward nothing was recorded: recomputation there adds no mode
    _, recompute = keeper.context_fn()
    with recompute:
        assert not _get_current_function_mode_stack()


class _NoModes:
    """Pop every torch-function mode for a while, as the autograd engine of torch 2.11 does."""

    def __enter__(self) -> None:
        self._popped = []
        while _get_current_function_mode_stack():
            self._popped.append(torch._C._pop_torch_function_stack())

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._popped):
            torch._C._push_on_torch_function_stack(mode)


def test_objects_alive_before_a_trace_are_not_walked_again_after_it() -> None:
    # the collection due when a trace ends must walk only what the trace made: what lived before
    # it (torch's and transformers' modules) comes back as the oldest generation, not the youngest
    class Alive:
        pass

    enabled = gc.isenabled()
    gc.disable()  # no collection may move the object on its own
    try:
        before = Alive()
        assert any(o is before for o in gc.get_objects(0))
        with _no_gc():
            assert not gc.isenabled()
        assert any(o is before for o in gc.get_objects(2))
        assert gc.get_freeze_count() == 0  # nothing left frozen
        assert not gc.isenabled()  # the caller's setting is kept
    finally:
        if enabled:
            gc.enable()


def test_a_traces_garbage_is_collected_when_it_ends() -> None:
    # left in the young generation, the next trace would set it aside with what lived before it

    class Node:
        other: Any = None

    enabled = gc.isenabled()
    gc.enable()
    try:
        with _no_gc():
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle: only the collector frees it
            gone = weakref.ref(a)
            del a, b
        assert gone() is None
    finally:
        if not enabled:
            gc.disable()
