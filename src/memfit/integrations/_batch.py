"""Cutting one Trainer micro-batch (a dict of tensors) into row chunks, and weighing the chunks.

The Trainer hands ``training_step`` a dict whose tensors share their first dimension, the rows
(``input_ids``, ``attention_mask``, ``labels``, ``sentence_0_input_ids`` …). A chunk is the same
dict with every such tensor sliced to a run of rows: a view, no copy; the padding and the
attention mask stay valid because they are sliced with their rows. Values that are not
row-indexed (strings, scalars, tensors of another length) are handed to every chunk unchanged.
"""

from __future__ import annotations

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
