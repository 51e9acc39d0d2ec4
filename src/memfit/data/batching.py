"""Batching that neither wastes memory nor fails late: dynamic padding, token-budget chunks, and a
deterministic, resumable length-grouped order of samples.

- **Dynamic padding**: a micro-batch is as wide as its longest sample (rounded up to
  ``pad_multiple``, 8 on GPUs so tensor cores get aligned shapes), not ``max_seq_len``.
- **Token-budget chunks** (:func:`split_into_chunks`): an optimizer step's samples, longest first,
  cut into the fewest micro-batches of at most ``max_rows`` samples and ``max_tokens`` tokens
  *including padding* (and among those, the cut that pads least), so one long sample does not drag
  its micro-batch neighbours to its length and the peak stays what the plan allowed. The step's samples are the same whatever the split, so
  the guard's equal-gradient rule holds (each chunk's loss is weighed by its samples or tokens).
- **Length-grouped order** (:func:`length_grouped_order`): like Hugging Face's
  ``group_by_length``: a seeded permutation cut into mega-batches of 50 steps, each sorted by length
  and cut into steps, the steps shuffled. Steps then hold samples of similar lengths, so padding
  shrinks further. It is a pure function of (seed, epoch, lengths): a resumed run recomputes the
  same order and continues at its position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def padded_width(length: int, pad_multiple: int = 1) -> int:
    """``length`` rounded up to a multiple of ``pad_multiple``."""
    multiple = max(1, int(pad_multiple))
    return -(-int(length) // multiple) * multiple


def padded_tokens(lengths: Sequence[int], pad_multiple: int = 1) -> int:
    """Tokens of one micro-batch of these samples, padding included (rows × padded width)."""
    if not lengths:
        return 0
    return len(lengths) * padded_width(max(lengths), pad_multiple)


def split_into_chunks(
    lengths: Sequence[int],
    *,
    max_rows: int,
    max_tokens: int | None = None,
    pad_multiple: int = 1,
    sort: bool = True,
    width_of: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """Indices into ``lengths``, cut into micro-batches: the fewest micro-batches that keep every
    one within ``max_rows`` samples and ``max_tokens`` tokens including padding, and among those
    the cut that pads least.

    With ``sort`` the samples go longest first, so a micro-batch is a run of similar lengths and
    its width is its first sample's. The cut is exact (dynamic programming over the sorted run,
    O(rows × max_rows) with numpy), not greedy: a greedy cut fills the first micro-batch of a step
    with the longest sample and seven short ones padded to its length. A sample longer than the
    budget on its own gets a micro-batch of its own (the guard's back-off, or the probe, decides
    whether that fits). ``width_of`` maps a micro-batch's longest sample to the width it is fed
    at (a recipe's ``padded_width``: ``max_seq_len`` for ``--padding max_length``); by default
    the length rounded up to ``pad_multiple``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    n = len(lengths)
    order = list(range(n))
    if sort:
        # stable: equal lengths keep the step's order
        order.sort(key=lambda i: -int(lengths[i]))
    if n == 0:
        return []
    width = width_of or (lambda length: padded_width(length, pad_multiple))
    widths = np.array([width(int(lengths[i])) for i in order], dtype=np.int64)
    # best[j]: (micro-batches, padded tokens) for the samples from position j on, as one key
    # (micro-batches × scale + padded tokens: fewest micro-batches first, then least padding)
    scale = int(widths.sum()) * n + 1
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n, dtype=np.int64)
    for j in range(n - 1, -1, -1):
        first = int(widths[j])  # the width of any chunk that starts here (sorted: its longest)
        most = min(max_rows, n - j)
        if max_tokens is not None:
            most = min(most, max(1, max_tokens // first))
        sizes = np.arange(1, most + 1, dtype=np.int64)
        keys = scale + sizes * first + best[j + 1 : j + most + 1]
        pick = int(np.argmin(keys))
        best[j], cut[j] = keys[pick], pick + 1
    chunks: list[list[int]] = []
    j = 0
    while j < n:
        size = int(cut[j])
        chunks.append(order[j : j + size])
        j += size
    return chunks


def length_grouped_order(
    lengths: Sequence[int], step_size: int, *, seed: int, epoch: int, mega_steps: int = 50
) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose consecutive ``step_size`` runs hold samples
    of similar length; a pure function of its arguments (resumable)."""
    n = len(lengths)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    permutation = torch.randperm(n, generator=generator).tolist()
    mega = max(step_size, step_size * mega_steps)
    steps: list[list[int]] = []
    for start in range(0, n, mega):
        group = sorted(permutation[start : start + mega], key=lambda i: -int(lengths[i]))
        steps.extend(group[s : s + step_size] for s in range(0, len(group), step_size))
    # the last step of the epoch may be short; keep it last so every other step is whole
    whole = [s for s in steps if len(s) == step_size]
    short = [s for s in steps if len(s) != step_size]
    shuffled = torch.randperm(len(whole), generator=generator).tolist()
    return [i for k in shuffled for i in whole[k]] + [i for s in short for i in s]
