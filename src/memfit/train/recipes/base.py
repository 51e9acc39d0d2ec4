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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from memfit.data.batching import padded_width
from memfit.data.rows import DataOptions

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

    # how --train-file/--eval-file are read (--skip-bad-rows, --cache-dir); set by the loop
    data_options: DataOptions = DataOptions()
    # "longest": a micro-batch is as wide as its longest row (dynamic padding); "max_length":
    # every row is padded to max_seq_len (static shapes, and the baseline bench/padding.py beats)
    padding: str = "longest"
    max_seq_len: int

    @abc.abstractmethod
    def read(self, path: Path, flag: str = "--train-file") -> Sequence[Row]:
        """The rows of a data file or folder (see :mod:`memfit.data.rows`), checked: every bad
        row is reported at once (a :class:`~memfit.data.rows.DataError` naming the flag, file and
        line), or skipped and listed with ``data_options.skip_bad_rows``; never dropped silently."""

    @abc.abstractmethod
    def build(self, train_rows: Sequence[Row]) -> None:
        """Load tokenizer and model (the labels are known from ``read`` for classification)."""

    def prepare(self, rows: Sequence[Row]) -> Sequence[Row]:
        """The rows with what every step needs precomputed (tokens, lengths), once and cached
        beside the data (after ``build``: it needs the tokenizer). Plain lists pass unchanged:
        recipes also take rows made by hand, tokenizing them when they are used."""
        return rows

    def lengths(self, rows: Sequence[Row]) -> list[int] | None:
        """Each row's length in tokens as the model sees it (truncated, special tokens in),
        for length-aware batching and the probe; None where the recipe does not know."""
        return None

    def padded_width(self, longest: int) -> int:
        """The width of a micro-batch whose longest row has ``longest`` tokens."""
        if self.padding == "max_length":
            return max(longest, self.max_seq_len)
        # never past max_seq_len, the positions the plan allowed
        return min(padded_width(longest, self.pad_multiple), max(longest, self.max_seq_len))

    @property
    def pad_multiple(self) -> int:
        """Dynamic padding rounds a micro-batch's width up to this: 8 on GPUs (tensor cores
        want aligned shapes), 1 on the CPU."""
        return 8 if self.device.type == "cuda" else 1

    def to(self, device: torch.device) -> None:
        self.device = device
        self.model.to(device)

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the recipe's device; to a GPU from pinned memory without blocking
        (the copy overlaps the queued kernels; the batches are built in the main process from
        tokens cached once, so no DataLoader workers are needed)."""
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

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
    def save(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """A folder that loads as it is (Auto* classes, or SentenceTransformer); ``state_dict``:
        the weights to write instead of the model's own (gathered from FSDP shards)."""
