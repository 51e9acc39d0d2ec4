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

Every recipe's ``build`` is followed by the check that ``max_seq_len`` fits the model's position
embeddings (before the model loads too, where ``--model`` is a local folder): past them a long row
would fail inside the model's forward, after the run folder is written. A ``--max-seq-len`` asked
for is refused in one line; the recipe's default is lowered to the model's limit.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from memfit.data.batching import padded_width
from memfit.data.rows import DataOptions
from memfit.errors import UsageError
from memfit.job import positions_problem
from memfit.models import usable_positions
from memfit.models.folder import model_config

Row = dict[str, Any]


def _loaded_config(model: Any) -> Any:
    """The transformers config of a loaded model (a SentenceTransformer's Transformer module's)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        return config
    for module in getattr(model, "children", lambda: [])():
        inner = getattr(module, "auto_model", None) or getattr(module, "model", None)
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None


def _fitting_positions(build: Callable[..., None]) -> Callable[..., None]:
    """``build`` between the position checks of :meth:`Recipe.fit_positions`."""

    @functools.wraps(build)
    def checked(self: Recipe, train_rows: Sequence[Row]) -> None:
        self.fit_folder_positions()
        build(self, train_rows)
        config = _loaded_config(getattr(self, "model", None))
        if config is not None:
            self.fit_positions(config)

    checked._fits_positions = True  # type: ignore[attr-defined]
    return checked


class Recipe(abc.ABC):
    task: ClassVar[str]
    # the eval metric that picks DIR/best/, and its direction
    metric: ClassVar[str]
    greater_is_better: ClassVar[bool]
    # False: the step's loss couples its samples (in-batch negatives); see the module docstring
    splittable: ClassVar[bool] = True
    # several ranks (memfit.train.distributed.Ranks; None: one process), set by the loop for a
    # recipe whose loss couples the ranks' samples (sentence-embedding gathers its embeddings)
    ranks: Any = None

    model: nn.Module
    device: torch.device

    # how --train-file/--eval-file are read (--skip-bad-rows, --cache-dir); set by the loop
    data_options: DataOptions = DataOptions()
    # "longest": a micro-batch is as wide as its longest row (dynamic padding); "max_length":
    # every row is padded to max_seq_len (static shapes, and the baseline bench/padding.py beats)
    padding: str = "longest"
    max_seq_len: int
    model_name: str
    # whether max_seq_len was asked for (--max-seq-len / --seq-len; set by the loop): asked for, a
    # length past the model's positions is refused; not asked for, lowered to them. None: not
    # told, then a max_seq_len other than the recipe's default counts as asked for
    max_seq_len_given: bool | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> Recipe:
        """The recipe of a run's settings (a :class:`memfit.train.TrainConfig`): the task's own
        options (:meth:`config_options`), then how the loop reads and pads the data."""
        recipe = cls(cfg.model, **cls.config_options(cfg))  # type: ignore[call-arg]
        recipe.data_options = DataOptions(skip_bad_rows=cfg.skip_bad_rows, cache_dir=cfg.cache_dir)
        recipe.padding = cfg.padding
        # a length the user asked for is refused past the model's positions (a default is lowered)
        recipe.max_seq_len_given = bool(cfg.max_seq_len or cfg.seq_len)
        return recipe

    @classmethod
    def config_options(cls, cfg: Any) -> dict[str, Any]:
        """This task's keyword options (after the model) from a run's settings; each recipe
        picks its own."""
        return {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_fits_positions", False):
            cls.build = _fitting_positions(build)  # type: ignore[method-assign]

    def fit_positions(self, config: Any) -> None:
        """``max_seq_len`` within the positions of the model whose config is ``config``: an
        asked-for length past them is a UsageError, a default one is lowered to them."""
        limit = usable_positions(config)
        if self.max_seq_len <= limit:
            return
        if self._max_seq_len_asked():
            problem = positions_problem("--max-seq-len", self.max_seq_len, limit, self.model_name)
            raise UsageError(problem or f"--max-seq-len: {self.max_seq_len}")
        self.max_seq_len = limit
        model = getattr(self, "model", None)
        if model is not None and hasattr(model, "max_seq_length"):
            model.max_seq_length = limit  # a SentenceTransformer truncates by its own field

    def _max_seq_len_asked(self) -> bool:
        if self.max_seq_len_given is not None:
            return self.max_seq_len_given
        default = inspect.signature(type(self).__init__).parameters.get("max_seq_len")
        return default is None or self.max_seq_len != default.default

    def fit_folder_positions(self) -> None:
        """:meth:`fit_positions` from a local ``--model`` folder's config.json, before anything
        is loaded (a Hub id is checked once its model is loaded)."""
        folder = Path(self.model_name).expanduser()
        if folder.is_dir():
            self.fit_positions(model_config(folder, "--model")[1])

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
