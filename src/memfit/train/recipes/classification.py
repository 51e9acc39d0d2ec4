"""Sequence classification: a text (or a text pair) and a label per row.

The labels are the sorted unique values of the training file's label column: integers stay
integers (CSV cells that read as integers count as integers), anything else is a name; the saved
config maps ids to them (``id2label``/``label2id``). Each chunk is padded to its own longest text,
not to ``max_seq_len``, so a chunk of short texts costs short-text memory. The loss is summed
per-sample cross-entropy over the step's sample count (the contract in ``base.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from memfit.data.rows import read_rows, row_error, text_of
from memfit.train.recipes.base import Recipe, Row
from memfit.train.recipes.loading import load_pretrained

Label = int | str

_INTEGER = re.compile(r"^[+-]?\d+$")


def accuracy(predictions: list[int], labels: list[int]) -> float:
    """Share of predictions equal to their label (0.0 for no samples)."""
    if not labels:
        return 0.0
    return sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)


def macro_f1(predictions: list[int], labels: list[int]) -> float:
    """Unweighted mean of the per-class F1 over every class that is predicted or true (as
    scikit-learn's ``f1_score(average="macro")``; a class with no true positives scores 0)."""
    classes = sorted(set(predictions) | set(labels))
    if not classes:
        return 0.0
    scores = []
    for c in classes:
        tp = sum(p == c and y == c for p, y in zip(predictions, labels, strict=True))
        fp = sum(p == c and y != c for p, y in zip(predictions, labels, strict=True))
        fn = sum(p != c and y == c for p, y in zip(predictions, labels, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores)


def _label_value(row: Row, column: str) -> Label:
    """The label as an int (JSON ints, integer-looking text) or a stripped name."""
    value = row[column]
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise row_error(row, f"column {column!r}: a label is an integer or a name, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise row_error(row, f"column {column!r}: a label is an integer or a name, got {value}")
        return int(value)
    if isinstance(value, str):
        value = value.strip()
        return int(value) if _INTEGER.match(value) else value
    return value


class ClassificationRecipe(Recipe):
    task: ClassVar[str] = "classification"
    metric: ClassVar[str] = "accuracy"
    greater_is_better: ClassVar[bool] = True

    model: Any  # a transformers PreTrainedModel (an nn.Module)

    def __init__(
        self,
        model: str,
        *,
        text_column: str = "text",
        label_column: str = "label",
        max_seq_len: int = 128,
        attn_implementation: str | None = None,
        text_pair_column: str | None = None,
    ) -> None:
        self.model_name = str(model)
        self.text_column = text_column
        self.label_column = label_column
        self.max_seq_len = max_seq_len
        self.attn_implementation = attn_implementation
        self.text_pair_column = text_pair_column
        self.device = torch.device("cpu")
        # filled by build(); until then labels cannot be checked
        self.labels: list[Label] = []
        self.label_ids: dict[Label, int] = {}
        # row sets read before build(): their labels are checked as soon as the labels are known
        self._unchecked: list[list[Row]] = []
        self.tokenizer: Any = None

    # -- data ----------------------------------------------------------------------------------
    def read(self, path: Path, flag: str = "--train-file") -> list[Row]:
        columns = [self.text_column, self.label_column]
        if self.text_pair_column:
            columns.append(self.text_pair_column)
        rows = read_rows(path, columns, flag=flag)
        for row in rows:
            text_of(row, self.text_column)
            if self.text_pair_column:
                text_of(row, self.text_pair_column)
            _label_value(row, self.label_column)
        if self.label_ids:
            self._check_labels(rows)
        elif flag != "--train-file":
            # an eval file is read before the model exists: check it in build(), before loading
            self._unchecked.append(rows)
        return rows

    def _label_id(self, row: Row) -> int:
        if not self.labels:
            raise RuntimeError("ClassificationRecipe: build() sets the labels; call it first")
        value = _label_value(row, self.label_column)
        key: Label = str(value) if isinstance(self.labels[0], str) else value
        if key not in self.label_ids:
            known = ", ".join(str(x) for x in self.labels)
            raise row_error(
                row, f"label {value!r} does not occur in the training data (labels: {known})"
            )
        return self.label_ids[key]

    def _check_labels(self, rows: list[Row]) -> None:
        for row in rows:
            self._label_id(row)

    # -- model ---------------------------------------------------------------------------------
    def build(self, train_rows: list[Row]) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        values = [_label_value(row, self.label_column) for row in train_rows]
        if all(isinstance(v, int) for v in values):
            self.labels = sorted(set(values), key=int)
        else:
            # a mix of integers and names: all are names ("1" and "neg")
            self.labels = sorted({str(v) for v in values})
        self.label_ids = {label: i for i, label in enumerate(self.labels)}
        for rows in self._unchecked:
            if rows is not train_rows:
                self._check_labels(rows)
        self._unchecked.clear()

        id2label = {i: str(label) for i, label in enumerate(self.labels)}
        kwargs: dict[str, Any] = {
            "num_labels": len(self.labels),
            "id2label": id2label,
            "label2id": {name: i for i, name in id2label.items()},
        }
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        self.tokenizer = load_pretrained(AutoTokenizer.from_pretrained, self.model_name)
        self.model = load_pretrained(
            AutoModelForSequenceClassification.from_pretrained, self.model_name, **kwargs
        )
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            # decoder backbones (GPT-2) have no pad token; padding is masked, any id will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(self.model.config, "pad_token_id", None) is None:
            # the classification head finds each row's last real token through pad_token_id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def units(self, rows: list[Row]) -> int:
        return len(rows)

    def _logits(self, rows: list[Row]) -> torch.Tensor:
        texts = [text_of(row, self.text_column) for row in rows]
        pairs = (
            [text_of(row, self.text_pair_column) for row in rows] if self.text_pair_column else None
        )
        # padding="longest": the chunk is as wide as its longest text, not max_seq_len
        batch = self.tokenizer(
            texts,
            pairs,
            truncation=True,
            max_length=self.max_seq_len,
            padding="longest",
            return_tensors="pt",
        )
        batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        # float(): under autocast the logits are half precision; the loss is summed in fp32
        return self.model(**batch).logits.float()

    def _targets(self, rows: list[Row]) -> torch.Tensor:
        return torch.tensor([self._label_id(row) for row in rows], device=self.device)

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        targets = self._targets(rows)
        logits = self._logits(rows)
        # summed, not averaged: chunks of a step then add up to the step's mean (base.py)
        return F.cross_entropy(logits, targets, reduction="sum") / total_units

    # -- eval ----------------------------------------------------------------------------------
    def eval_partial(self, rows: list[Row]) -> tuple[list[int], list[int], float]:
        targets = self._targets(rows)
        logits = self._logits(rows)
        loss_sum = float(F.cross_entropy(logits, targets, reduction="sum"))
        return logits.argmax(dim=-1).tolist(), targets.tolist(), loss_sum

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        predictions = [p for part in partials for p in part[0]]
        labels = [y for part in partials for y in part[1]]
        loss_sum = sum(part[2] for part in partials)
        return {
            "loss": loss_sum / max(len(labels), 1),
            "accuracy": accuracy(predictions, labels),
            "macro_f1": macro_f1(predictions, labels),
        }

    def save(self, folder: Path) -> None:
        self.model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
