"""Cutting one Trainer micro-batch (a dict of tensors) into row chunks, and weighing the chunks.

The Trainer hands ``training_step`` a dict whose tensors share their first dimension, the rows
(``input_ids``, ``attention_mask``, ``labels``, ``sentence_0_input_ids`` …). A chunk is the same
dict with every such tensor sliced to a run of rows: a view, no copy; the padding and the
attention mask stay valid because they are sliced with their rows. Values that are not
row-indexed (strings, scalars, tensors of another length) are handed to every chunk unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, cast

import torch

# the label value transformers' losses ignore (CrossEntropyLoss's ignore_index)
IGNORE_INDEX = -100


def batch_rows(inputs: Mapping[str, Any]) -> int:
    """The rows of a micro-batch: the first dimension of its first tensor that has one."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def split_batch(inputs: Mapping[str, Any], chunk_rows: int) -> list[dict[str, Any]]:
    """``inputs`` as consecutive chunks of at most ``chunk_rows`` rows, in order."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    rows = batch_rows(inputs)
    chunks: list[dict[str, Any]] = []
    for start in range(0, rows, chunk_rows):
        chunk: dict[str, Any] = {}
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                # a view of the collated batch: the chunk costs no memory of its own
                chunk[key] = value[start : start + chunk_rows]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def sequence_starts(inputs: Mapping[str, Any]) -> list[int] | None:
    """Where each sequence of a padding-free micro-batch begins, None for a padded one.

    Padding-free (TRL's ``padding_free`` and its ``bfd`` packing, transformers'
    ``DataCollatorWithFlattening``): the micro-batch's sequences are laid end to end in one row,
    ``input_ids`` of shape (1, T), with ``position_ids`` that restart at 0 where a sequence begins
    and no ``attention_mask`` (the model keeps the sequences apart by their position ids). Its
    pieces are those sequences, not the one row."""
    positions = inputs.get("position_ids")
    ids = inputs.get("input_ids")
    if "attention_mask" in inputs or not isinstance(positions, torch.Tensor):
        return None
    if positions.dim() != 2 or positions.shape[0] != 1:
        return None
    if isinstance(ids, torch.Tensor) and tuple(ids.shape[:2]) != tuple(positions.shape):
        return None
    starts = positions[0].eq(0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        return [0, *starts]  # a first sequence that does not start at 0 is a sequence still
    return [int(i) for i in starts]


def split_sequences(
    inputs: Mapping[str, Any], starts: list[int], chunk_sequences: int
) -> list[dict[str, Any]]:
    """A padding-free micro-batch (see :func:`sequence_starts`) as consecutive chunks of at most
    ``chunk_sequences`` whole sequences, in order.

    Each chunk cuts every (1, T) tensor at sequence boundaries (views): the position ids still
    restart at 0 where a sequence begins, and the label of a sequence's first token is -100 in
    the collated batch already (no target crosses a boundary), so the chunks' target tokens are
    the call's. The varlen attention keywords are the chunk's own: ``cu_seq_lens_q/k`` its
    boundaries from 0, ``max_length_q/k`` its longest sequence, ``seq_idx`` counted from 0."""
    if chunk_sequences < 1:
        raise ValueError(f"chunk_sequences must be at least 1, got {chunk_sequences}")
    width = int(inputs["position_ids"].shape[1])
    bounds = [*starts, width]
    chunks: list[dict[str, Any]] = []
    for first in range(0, len(starts), chunk_sequences):
        edges = bounds[first : first + chunk_sequences + 1]
        begin, end = edges[0], edges[-1]
        longest = max(b - a for a, b in itertools.pairwise(edges))
        chunk: dict[str, Any] = {}
        for key, value in inputs.items():
            if key in ("cu_seq_lens_q", "cu_seq_lens_k") and isinstance(value, torch.Tensor):
                chunk[key] = torch.tensor([e - begin for e in edges], dtype=value.dtype)
                chunk[key] = chunk[key].to(value.device)
            elif key in ("max_length_q", "max_length_k") and isinstance(value, int):
                chunk[key] = longest
            elif (
                isinstance(value, torch.Tensor)
                and value.dim() > 1
                and value.shape[:2]
                == (
                    1,
                    width,
                )
            ):
                part = value[:, begin:end]
                chunk[key] = part - part[0, 0] if key == "seq_idx" else part
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def count_items(inputs: Mapping[str, Any], *, shifted_labels: bool = False) -> int:
    """What a mean-reduced loss averages over, counted the way the Trainer counts
    ``num_items_in_batch``: label entries that are not ``-100`` (``shift_labels`` where the
    collator gives them, else ``labels[..., 1:]`` for causal LMs, which shift inside the loss).
    Without labels: the rows."""
    labels = inputs.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and shifted_labels and labels.dim() > 1:
            labels = labels[..., 1:]
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        return batch_rows(inputs)
    return int(labels.ne(IGNORE_INDEX).sum())


def concat_outputs(parts: list[Any]) -> Any:
    """Chunks' prediction outputs (tensors, or tuples/lists/dicts of them, or None) joined
    along the rows, in order: the chunks came from one padded batch, so their widths agree."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first  # a scalar is not row-indexed
        return torch.cat(parts)
    if isinstance(first, tuple | list):
        joined = [concat_outputs([part[i] for part in parts]) for i in range(len(first))]
        return type(first)(joined)
    if isinstance(first, Mapping):
        joined_map = {key: concat_outputs([part[key] for part in parts]) for key in first}
        return joined_map if type(first) is dict else cast(Any, type(first))(joined_map)
    return first
