"""Cutting a Trainer micro-batch into row chunks: views, order, what is counted."""

from __future__ import annotations

import pytest
import torch

from memfit.integrations._batch import batch_rows, concat_outputs, count_items, split_batch


def test_split_batch_slices_rows_as_views_and_passes_other_values() -> None:
    ids = torch.arange(14).reshape(7, 2)
    inputs = {"input_ids": ids, "labels": torch.arange(7), "scale": torch.tensor(2.0), "name": "x"}
    chunks = split_batch(inputs, 3)
    assert [batch_rows(c) for c in chunks] == [3, 3, 1]
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), ids)
    assert torch.equal(torch.cat([c["labels"] for c in chunks]), torch.arange(7))
    # a view of the collated batch, not a copy
    assert chunks[1]["input_ids"].untyped_storage().data_ptr() == ids.untyped_storage().data_ptr()
    # values that are not row-indexed go to every chunk as they are
    assert all(c["name"] == "x" and c["scale"] is inputs["scale"] for c in chunks)


def test_split_batch_refuses_an_empty_chunk() -> None:
    with pytest.raises(ValueError, match="chunk_rows must be at least 1, got 0"):
        split_batch({"x": torch.zeros(2, 1)}, 0)


def test_count_items_counts_labels_like_the_trainer() -> None:
    labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, -100]])
    assert count_items({"labels": labels}) == 5
    # causal LMs shift inside the loss: the first position of each row is never a target
    assert count_items({"labels": labels}, shifted_labels=True) == 3
    # a collator's shift_labels are already shifted
    assert count_items({"labels": labels, "shift_labels": labels[:, 1:]}, shifted_labels=True) == 3
    # sequence classification: one label per row; no labels: the rows
    assert count_items({"labels": torch.tensor([0, 2, 1])}) == 3
    assert count_items({"input_ids": torch.zeros(4, 3)}) == 4


def test_concat_outputs_joins_nested_outputs_in_order() -> None:
    parts = [
        (torch.ones(2, 3), {"h": torch.zeros(2)}),
        (2 * torch.ones(1, 3), {"h": torch.ones(1)}),
    ]
    logits, extra = concat_outputs(parts)
    assert torch.equal(logits, torch.tensor([[1.0] * 3, [1.0] * 3, [2.0] * 3]))
    assert torch.equal(extra["h"], torch.tensor([0.0, 0.0, 1.0]))
    assert concat_outputs([None, None]) is None
