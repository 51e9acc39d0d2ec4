"""What a training recipe gives the loop and the guard (one readable file per task beside this one).

The loop owns the optimizer, precision (autocast, loss scaling), devices, checkpoints and logs; the
guard owns the split of an optimizer step into micro-batches. A recipe owns the task: reading and
checking the data, the model and tokenizer, the loss, the eval metrics and the saved model folder.

Exactness contract: ``loss(rows, total_units)`` returns this chunk's summed loss divided by
``total_units`` (the whole step's units), so that the gradients of all chunks of a step add up to
the gradient of the step's mean loss: per sample for classification and sentence embeddings, per
target token for causal LM (``units``). Recipes whose loss does not decompose over samples
(in-batch negatives) set ``splittable = False``: the guard then hands them the whole step with a
``mini_batch_size`` and they split internally without changing the gradient (GradCache).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

Row = dict[str, Any]


class Recipe(abc.ABC):
    task: ClassVar[str]
    # the eval metric that picks DIR/best/, and its direction
    metric: ClassVar[str]
    greater_is_better: ClassVar[bool]
    # False: the step's loss couples its samples (in-batch negatives); see the module docstring
    splittable: ClassVar[bool] = True

    model: nn.Module
    device: torch.device

    @abc.abstractmethod
    def read(self, path: Path, flag: str = "--train-file") -> list[Row]:
        """The rows of a data file (csv, tsv, jsonl, json), checked: a bad row is a UsageError
        naming the flag (``--train-file``, ``--eval-file``), the file and line; no row is dropped
        silently."""

    @abc.abstractmethod
    def build(self, train_rows: list[Row]) -> None:
        """Load tokenizer and model (labels from ``train_rows`` for classification)."""

    def to(self, device: torch.device) -> None:
        self.device = device
        self.model.to(device)

    @abc.abstractmethod
    def units(self, rows: list[Row]) -> int:
        """The weight of these rows in a step: samples, or target tokens (causal LM)."""

    @abc.abstractmethod
    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        """Summed loss of ``rows`` divided by ``total_units`` (a scalar to call backward on)."""

    @abc.abstractmethod
    def eval_partial(self, rows: list[Row]) -> Any:
        """What an eval chunk contributes (run under ``torch.no_grad``); chunks are concatenated."""

    @abc.abstractmethod
    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        """The eval metrics from all chunks' partials (keys without the ``eval_`` prefix)."""

    @abc.abstractmethod
    def save(self, folder: Path) -> None:
        """A folder that loads as it is (Auto* classes, or SentenceTransformer)."""
