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

import numpy as np

from memfit.estimate.trace import Segment, StepTrace


@dataclass
class FittedSegment:
    """A forward+backward segment whose sizes can be predicted for any (B, S)."""

    template: Segment
    coefficients: np.ndarray  # (n_allocs, max_rank, 4): dim = c + a·B + b·S + d·B·S
    ranks: np.ndarray  # (n_allocs,)
    itemsizes: np.ndarray  # (n_allocs,)

    def sizes(self, batch_size: int, seq_len: int) -> np.ndarray:
        basis = np.array([1.0, batch_size, seq_len, batch_size * seq_len])
        dims = np.rint(self.coefficients @ basis).astype(np.int64)
        # dims beyond a tensor's rank are padded with 1 (coefficients c=1), so the product is exact
        numel = np.prod(np.maximum(dims, 0), axis=1)
        return numel * self.itemsizes


def grid_shapes(max_positions: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The off-grid check shape and the 2×2 grid, inside the model's usable positions."""
    top = max(8, min(max_positions, 64))
    s0, s1 = top // 4, top // 2
    check = (3, (s0 + s1) // 2 + 1)
    return check, [(2, s0), (4, s0), (2, s1), (4, s1)]


def fit_segments(grid: list[tuple[tuple[int, int], Segment]]) -> FittedSegment | None:
    """Fit a bilinear model for every dim of every allocation; None if the traces do not align."""
    (b0, s0), seg00 = grid[0]
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
    design = np.array([[1.0, b, s, b * s] for (b, s), _ in grid])
    # solve the 4×4 system once for all dims: coefficients = design^-1 · values
    inverse = np.linalg.inv(design)
    coefficients = np.einsum("cg,gik->ikc", inverse, values)
    return FittedSegment(
        template=seg00,
        coefficients=coefficients,
        ranks=np.array([len(shape) for shape in seg00.shapes], dtype=np.int64),
        itemsizes=np.array(seg00.itemsizes, dtype=np.int64),
    )


def check_fit(fitted: FittedSegment, shape: tuple[int, int], actual: Segment) -> bool:
    """True when the fit reproduces a trace at a shape it was not fitted on, byte for byte."""
    if actual.signature() != fitted.template.signature():
        return False
    predicted = fitted.sizes(*shape)
    return bool(np.array_equal(predicted, np.array(actual.sizes, dtype=np.int64)))


def fit_trace(trace: StepTrace) -> FittedSegment | None:
    """Fit the forward+backward segments of a trace made on ``grid_shapes``; None if it fails."""
    (check_shape, check_seg, _), *grid_steps = trace.steps
    fitted = fit_segments([(shape, seg) for shape, seg, _ in grid_steps])
    if fitted is None or not check_fit(fitted, check_shape, check_seg):
        return None
    return fitted
