"""What a traced step is made of: event kinds, categories, phases, and the traced records.

:mod:`memfit.estimate.trace` writes these records and everything downstream (the fit, the
replays, sharding, depth extrapolation, the trace cache) reads them; the kernel emulations declare
sizes through :func:`sized_allocation`. They live here, apart from the tracer, so that their readers
and the emulations do not import the tracer and the step it runs (no torch is needed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "transient")
CAT = {name: i for i, name in enumerate(CATEGORIES)}
PHASES = ("setup", "forward", "backward", "optimizer_step")
PHASE = {name: i for i, name in enumerate(PHASES)}

ALLOC, FREE, MARK, FREE_PREV, FREE_RES, BLOCK = 0, 1, 2, 3, 4, 5
# (BLOCK, block * 4 + stage): a transformer block (see ``fsdp_blocks``) starts or ends its forward
# or its backward. Unsharded replays ignore them; FSDP's replay gathers and frees by them
BLOCK_FORWARD_START, BLOCK_FORWARD_END, BLOCK_BACKWARD_START, BLOCK_BACKWARD_END = 0, 1, 2, 3

SizeFormula = Callable[..., int]
_pending_hint: list[tuple[tuple[int, ...], SizeFormula]] = []


@contextlib.contextmanager
def sized_allocation(dims: tuple[int, ...], formula: SizeFormula) -> Iterator[None]:
    """Declare how the next allocation's bytes follow from integer dims (each bilinear in B, S).

    For the few sizes that are no product of bilinear dims (a kernel's workspace, a mask padded
    only when misaligned, split-KV accumulators only for some shapes), emulation code allocates
    under this hint; where the real kernel would allocate nothing it allocates an empty placeholder,
    so the sequence of allocations is the same for every shape. The fit then predicts ``dims`` and
    evaluates ``formula(*dims)``.
    """
    _pending_hint.append((tuple(int(d) for d in dims), formula))
    try:
        yield
    finally:
        _pending_hint.clear()


# the op of an allocation that is host memory, not the device's: an offloaded activation's host
# copy (memfit.step.offload). The replays keep its bytes apart (Peak.host_peak_bytes)
HOST_OP = "host_copy"
_host_marks: list[bool] = []


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Record the next allocation as host memory (op :data:`HOST_OP`): it is fitted, extended in
    depth and cached with the device's allocations, and counted apart from them by the replays."""
    _host_marks.append(True)
    try:
        yield
    finally:
        _host_marks.clear()


def take_host_mark() -> bool:
    """Whether the allocation being recorded is inside :func:`host_allocation` (taken, so that it
    applies to that allocation only)."""
    return bool(_host_marks) and _host_marks.pop()


def take_size_hint() -> tuple[tuple[int, ...], SizeFormula] | None:
    """The (dims, formula) of a :func:`sized_allocation` around the allocation being recorded,
    taken so that it applies to that allocation only; None outside one."""
    return _pending_hint.pop() if _pending_hint else None


@dataclass
class Segment:
    """The events of one part of the trace (a step's forward+backward, or its optimizer step).

    ``events`` holds ``(kind, ref)`` pairs: ``(ALLOC, j)`` allocates the segment's j-th local
    allocation; ``(FREE, j)`` frees local allocation j when ``j >= 0``, or the resident allocation
    ``-j - 1`` (a parameter, a gradient of the previous step, ...) when ``j < 0``; ``(MARK, p)``
    starts phase ``p``.
    """

    events: list[tuple[int, int]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    categories: list[int] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    # the dims of the tensor that created each storage, and its element size: sizes of a new batch
    # size and sequence length are predicted dim by dim (see memfit.estimate.fit)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    itemsizes: list[int] = field(default_factory=list)
    formulas: list[SizeFormula | None] = field(default_factory=list)
    # the parameter (an index into StepTrace.params) each allocation belongs to: a gradient, a
    # low-precision copy of a weight (op "weight_cast"), an optimizer state tensor; -1 otherwise.
    # Sharded replays (memfit.estimate.sharding) resize these by their parameter's shard
    params: list[int] = field(default_factory=list)
    # the parameter an optimizer-step allocation was computed from (its inputs' parameter, list
    # item by list item for foreach ops), -1 where none: depth extrapolation
    # (memfit.estimate.depth) files each temporary under its parameter's block
    origins: list[int] = field(default_factory=list)

    def signature(self) -> tuple[Any, ...]:
        """What must agree between traces of different shapes for their sizes to be fitted."""
        ranks = tuple(len(shape) for shape in self.shapes)
        formulas = tuple(getattr(f, "__qualname__", None) for f in self.formulas)
        return (
            tuple(self.events),
            tuple(self.categories),
            tuple(self.ops),
            ranks,
            tuple(self.itemsizes),
            formulas,
        )


@dataclass
class StepTrace:
    """A traced run: the resident allocations and one entry per traced step.

    Each step is ``(shape, forward_backward, optimizer)``: the optimizer segment's
    ``(FREE_PREV, j)`` events free allocation j of the same step's forward+backward segment (the
    gradients at ``zero_grad``, the input batch), so a steady optimizer segment can follow the
    forward+backward segment of any other shape with the same structure.
    """

    resident_sizes: list[int]
    resident_categories: list[int]
    steps: list[tuple[tuple[int, int], Segment, Segment | None]]
    num_parameters: int
    parameter_bytes: int
    trainable_parameters: int = 0
    trainable_gradient_bytes: int = 0  # what one float32 gradient per trainable parameter takes
    # global ids: parameters and buffers (allocated before any step), what is alive between steps
    # (those plus optimizer state), and the global id of each allocation of the first optimizer step
    initial: list[int] = field(default_factory=list)
    steady: list[int] = field(default_factory=list)
    first_optimizer_globals: list[int] = field(default_factory=list)
    # what a sharded replay needs (memfit.estimate.sharding): every parameter, the parameter
    # each resident allocation belongs to (the parameters themselves, optimizer state), and the
    # most parameters any one module holds itself (DeepSpeed's "largest layer")
    params: list[ParamInfo] = field(default_factory=list)
    resident_params: dict[int, int] = field(default_factory=dict)
    largest_module_parameters: int = 0
    # what depth extrapolation (memfit.estimate.depth) needs: the layer (the index in the model's
    # stack of repeated layers) of each FSDP block, -1 for the others (embeddings), and the block
    # of each initial resident (parameters and buffers), -1 for the root module's
    block_layers: list[int] = field(default_factory=list)
    resident_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the traced model, as sharding schemes see it."""

    alloc: int  # global allocation id of its storage
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    # the FSDP unit that holds it: the index of its transformer block (``fsdp_blocks``), or -1
    # for the root module (embeddings, final norm, heads)
    block: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n
