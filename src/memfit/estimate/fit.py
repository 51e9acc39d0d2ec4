"""From a handful of traced shapes to any batch size and sequence length, in milliseconds.

A step's sequence of allocations does not depend on the batch size B or sequence length S, only
their sizes do. Every dim of every allocated tensor is bilinear in (B, S) — a constant, B, S, B·S,
S - 1, 2·B — so four forward+backward traces on a 2×2 grid of shapes determine each dim exactly,
and products of dims give every polynomial that occurs (B·H·S² attention scores, B² in-batch
similarity matrices, B·S·V logits). A fifth trace at a shape off the grid checks the prediction;
if any allocation disagrees, the estimator traces the requested shape itself instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.estimate.step_trace import Segment, StepTrace


@dataclass
class FittedSegment:
    """A forward+backward segment whose sizes can be predicted for any (B, S)."""

    template: Segment
    coefficients: np.ndarray  # (n_allocs, max_rank, k): dim = coefficients · basis(B, S)
    ranks: np.ndarray  # (n_allocs,)
    itemsizes: np.ndarray  # (n_allocs,)
    per_sequence_only: bool = (
        False  # fitted at one batch size: basis (1, S) instead of (1, B, S, B·S)
    )
    # dims a kernel pads (CUDA's flash attention rounds the sequence up to 128, memory-efficient
    # attention its logsumexp to 32): round up to this multiple; 1 elsewhere
    multiples: np.ndarray | None = None

    def dims(self, batch_size: int, seq_len: int) -> np.ndarray:
        basis = _basis(batch_size, seq_len, self.per_sequence_only)
        dims = np.rint(self.coefficients @ basis).astype(np.int64)
        if self.multiples is not None:
            dims = -(-dims // self.multiples) * self.multiples
        return dims

    def sizes(self, batch_size: int, seq_len: int) -> np.ndarray:
        dims = self.dims(batch_size, seq_len)
        # dims beyond a tensor's rank are padded with 1 (coefficients c=1), so the product is exact
        numel = np.prod(np.maximum(dims, 0), axis=1)
        sizes = numel * self.itemsizes
        for i, formula in self._formulas:
            sizes[i] = formula(*(int(d) for d in dims[i, : self.ranks[i]]))
        return sizes

    @property
    def _formulas(self) -> list[tuple[int, Any]]:
        return [(i, f) for i, f in enumerate(self.template.formulas) if f is not None]


def _basis(batch_size: int, seq_len: int, per_sequence_only: bool) -> np.ndarray:
    if per_sequence_only:
        return np.array([1.0, seq_len])
    return np.array([1.0, batch_size, seq_len, batch_size * seq_len])


def grid_shapes(
    max_positions: int, batch_size: int | None = None, aligned: bool = True
) -> tuple[tuple[int, int], list[tuple[int, int]], tuple[int, int]]:
    """The check shape, the grid, and a second check shape, inside the model's usable positions.

    With ``batch_size`` (used for 1: PyTorch takes other paths for a single sample, e.g. ``expand``
    then ``reshape`` is a view instead of a copy) the grid varies the sequence length only.
    ``aligned`` picks sequence lengths that are multiples of 8 or not: CUDA's memory-efficient
    attention copies a misaligned mask, so the two kinds of length trace different allocations.
    """
    if max_positions >= 272:
        # multiples of 128 on the grid: kernels that pad the sequence are exact there, and the
        # off-grid checks reveal the padding
        shift = 0 if aligned else 4
        s0, s1, sv, s2 = 128 + shift, 256 + shift, 200 + shift, 104 - shift
    elif max_positions >= 40:
        # small position tables: every length a multiple of 8 (or none), as for the large ones
        shift = 0 if aligned else 3
        s0, s1, sv, s2 = 16 + shift, 32 + shift, 24 + shift, 8 + shift
    else:
        # a toy table: whatever fits (misaligned lengths may need exact traces)
        top = max(8, max_positions)
        s0, s1 = top // 4 + 1, top // 2 + 1
        sv, s2 = (s0 + s1) // 2 + 1, max(2, top // 8)
    if batch_size is not None:
        return (batch_size, sv), [(batch_size, s0), (batch_size, s1)], (batch_size, s2)
    return (3, sv), [(2, s0), (4, s0), (2, s1), (4, s1)], (5, s2)


def fit_segments(grid: list[tuple[tuple[int, int], Segment]]) -> FittedSegment | None:
    """Fit every dim of every allocation; None if the traces do not align.

    Four shapes on a 2×2 grid fit the bilinear basis (1, B, S, B·S); two shapes of one batch size
    fit (1, S).
    """
    _, seg00 = grid[0]
    signature = seg00.signature()
    if any(seg.signature() != signature for _, seg in grid[1:]):
        return None
    n = len(seg00.shapes)
    max_rank = max((len(shape) for shape in seg00.shapes), default=1) or 1
    # values[g, i, k]: dim k of allocation i in grid trace g (padded with 1)
    values = np.ones((len(grid), n, max_rank), dtype=np.float64)
    for g, (_, seg) in enumerate(grid):
        for i, shape in enumerate(seg.shapes):
            values[g, i, : len(shape)] = shape
    per_sequence_only = len(grid) == 2
    design = np.array([_basis(b, s, per_sequence_only) for (b, s), _ in grid])
    # solve the small square system once for all dims: coefficients = design^-1 · values
    inverse = np.linalg.inv(design)
    coefficients = np.einsum("cg,gik->ikc", inverse, values)
    return FittedSegment(
        template=seg00,
        coefficients=coefficients,
        ranks=np.array([len(shape) for shape in seg00.shapes], dtype=np.int64),
        itemsizes=np.array(seg00.itemsizes, dtype=np.int64),
        per_sequence_only=per_sequence_only,
    )


def check_fit(fitted: FittedSegment, shape: tuple[int, int], actual: Segment) -> bool:
    """True when the fit reproduces a trace at a shape it was not fitted on, byte for byte."""
    if actual.signature() != fitted.template.signature():
        return False
    predicted = fitted.sizes(*shape)
    return bool(np.array_equal(predicted, np.array(actual.sizes, dtype=np.int64)))


def infer_padding(
    fitted: FittedSegment,
    shape: tuple[int, int],
    actual: Segment,
    grid: list[tuple[int, int]] | None = None,
) -> bool:
    """Find dims that a kernel rounds up: the check trace holds the rounded value of the fitted one.

    Sets ``fitted.multiples``; False when some dim is neither the fitted value nor its round-up to
    a power of two up to 256. When the grid's own values were rounded (sequence lengths that are
    no multiple of the padding), the fitted line runs above the true one by an unknown offset
    below the multiple: every offset consistent with the grid and the check is tried, and the
    one that brings the line's constant term nearest zero is kept (kernels pad S, not S + c).
    """
    if actual.signature() != fitted.template.signature():
        return False
    predicted = fitted.dims(*shape)
    observed = np.ones_like(predicted)
    for i, dims in enumerate(actual.shapes):
        observed[i, : len(dims)] = dims
    on_grid = [fitted.dims(*g) for g in grid or []]
    multiples = np.ones_like(predicted)
    for i, k in zip(*np.nonzero(predicted != observed), strict=True):
        constant = fitted.coefficients[i, k, 0]
        candidates = [
            (abs(constant - d), multiple, d)
            for multiple in (2, 4, 8, 16, 32, 64, 128, 256)
            # a padded dim is a multiple of its padding at every grid point
            if not any(values[i, k] % multiple for values in on_grid)
            for d in range(multiple)
            if -(-(predicted[i, k] - d) // multiple) * multiple == observed[i, k]
        ]
        if not candidates:
            return False
        _, multiple, offset = min(candidates)
        fitted.coefficients[i, k, 0] = constant - offset
        multiples[i, k] = multiple
    fitted.multiples = multiples if (multiples > 1).any() else None
    return True


def fit_trace(trace: StepTrace) -> FittedSegment | None:
    """Fit a trace made of ``[check, *grid, second_check]``; None if the checks fail."""
    (check_shape, check_seg, _), *grid_steps, (second_shape, second_seg, _) = trace.steps
    fitted = fit_segments([(shape, seg) for shape, seg, _ in grid_steps])
    grid_shapes_ = [shape for shape, _, _ in grid_steps]
    if fitted is None or not infer_padding(fitted, check_shape, check_seg, grid_shapes_):
        return None
    if not check_fit(fitted, second_shape, second_seg):
        return None
    return fitted
