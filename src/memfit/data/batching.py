"""Batching that neither wastes memory nor fails late: dynamic padding, token-budget chunks, and a
deterministic, resumable length-grouped order of samples.

- **Dynamic padding**: a micro-batch is as wide as its longest sample (rounded up to
  ``pad_multiple``, 8 on GPUs so tensor cores get aligned shapes), not ``max_seq_len``.
- **Token-budget chunks** (:func:`split_into_chunks`): an optimizer step's samples, longest first,
  packed greedily into micro-batches of at most ``max_rows`` samples and ``max_tokens`` tokens
  *including padding*, so one long sample does not drag its micro-batch neighbours to its length
  and the peak stays what the plan allowed. The step's samples are the same whatever the split, so
  the guard's equal-gradient rule holds (each chunk's loss is weighed by its samples or tokens).
- **Length-grouped order** (:func:`length_grouped_order`): like Hugging Face's
  ``group_by_length``: a seeded permutation cut into mega-batches of 50 steps, each sorted by length
  and cut into steps, the steps shuffled. Steps then hold samples of similar lengths, so padding
  shrinks further. It is a pure function of (seed, epoch, lengths): a resumed run recomputes the
  same order and continues at its position.
"""

from __future__ import annotations

from collections.abc import Sequence

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
) -> list[list[int]]:
    """Indices into ``lengths``, cut into micro-batches.

    With ``sort`` the samples go longest first (chunks of similar lengths waste least padding);
    a chunk takes the next sample while it holds fewer than ``max_rows`` samples and its padded
    tokens stay within ``max_tokens``. A sample longer than the budget on its own gets a chunk of
    its own (the guard's back-off, or the probe, decides whether that fits).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    order = list(range(len(lengths)))
    if sort:
        # stable: equal lengths keep the step's order
        order.sort(key=lambda i: -int(lengths[i]))
    chunks: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for index in order:
        width = max(widest, padded_width(lengths[index], pad_multiple))
        fits_rows = len(current) < max_rows
        fits_tokens = max_tokens is None or (len(current) + 1) * width <= max_tokens
        if current and not (fits_rows and fits_tokens):
            chunks.append(current)
            current, width = [], padded_width(lengths[index], pad_multiple)
        current.append(index)
        widest = width
    if current:
        chunks.append(current)
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
