"""Sequence classification: a text (or a text pair) and a label per row.

The labels are the sorted unique values of the training file's label column: integers stay
integers (CSV cells that read as integers count as integers), anything else is a name; the saved
config maps ids to them (``id2label``/``label2id``). Each chunk is padded to its own longest text,
not to ``max_seq_len``, so a chunk of short texts costs short-text memory. The loss is summed
per-sample cross-entropy over the step's sample count (the contract in ``base.py``).

Labels (see :mod:`memfit.data.rows`): ``--labels a,b,c`` fixes the set (ids in that order),
``--num-labels N`` makes it the integers 0…N-1 (any other value is a bad row at its line);
without either it is the training file's values, all integers (0 … 2**31-1, in numeric order) or
all names. No label: a fraction, NaN, an infinity, a negative or huge integer without ``--labels``.

A ``--model`` that already has a classification head (its config names a
``…ForSequenceClassification`` architecture) keeps that head when its ``id2label`` names are the
data's labels: the labels then take the head's ids. Any other label set gets a fresh head of the
right size (the body's weights kept), and memfit says so on stderr; ``head_note`` says what was
done, for ``run.json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from memfit import step
from memfit.data.labels import LabelRule, canonical_label, label_values
from memfit.data.rows import (
    LENGTH,
    Column,
    DataError,
    RowTable,
    read_rows,
    row_error,
    text_of,
    tokenizer_key,
)
from memfit.errors import UsageError
from memfit.train.recipes.base import Recipe, Row
from memfit.train.recipes.loading import load_pretrained

Label = int | str

# the prefix of the token columns ``prepare`` adds to the rows
ENCODED = "__enc_"
# how many label names a message shows
SHOWN_LABELS = 10


def _names(labels: Sequence[Any]) -> str:
    shown = ", ".join(str(x) for x in labels[:SHOWN_LABELS])
    return shown + (f", … ({len(labels)} in all)" if len(labels) > SHOWN_LABELS else "")


def head_labels(config: Any) -> list[str] | None:
    """The label names of the classification head a model config describes, in id order; None
    when the model has no such head (its architectures name no ``…ForSequenceClassification``)."""
    architectures = getattr(config, "architectures", None) or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    id2label = getattr(config, "id2label", None) or {}
    try:
        ids = sorted(int(i) for i in id2label)
    except (TypeError, ValueError):
        return None
    if ids != list(range(len(ids))) or not ids:
        return None
    by_id = {int(i): str(name) for i, name in id2label.items()}
    return [by_id[i] for i in ids]


def _head_texts(names: Sequence[str]) -> list[str | None]:
    """The canonical label texts of a head's names; transformers' default names ``LABEL_0`` …
    (a head trained on integer labels) stand for the integers."""
    if all(name == f"LABEL_{i}" for i, name in enumerate(names)):
        return [str(i) for i in range(len(names))]
    return [canonical_label(name) for name in names]


def fresh_head(model: Any) -> None:
    """Re-initialise every module of ``model`` outside its body (``base_model_prefix``): the
    head, as transformers initialises a head it did not find in the checkpoint."""
    prefix = getattr(model, "base_model_prefix", "")
    init = getattr(model, "_init_weights", None)
    for name, child in model.named_children():
        if name == prefix or not list(child.parameters()):
            continue
        for module in child.modules():
            # transformers 5 skips tensors it marked as loaded
            module._is_hf_initialized = False
            for parameter in module.parameters(recurse=False):
                parameter._is_hf_initialized = False
            if init is not None:
                init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()


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


class ClassificationRecipe(Recipe):
    task: ClassVar[str] = "classification"
    metric: ClassVar[str] = "accuracy"
    greater_is_better: ClassVar[bool] = True

    model: Any  # a transformers PreTrainedModel (an nn.Module)

    @classmethod
    def config_options(cls, cfg: Any) -> dict[str, Any]:
        return {
            "text_column": cfg.text_column,
            "label_column": cfg.label_column,
            "attn_implementation": cfg.attn_implementation,
            "max_seq_len": cfg.max_seq_len or cfg.seq_len or 128,
            "labels": cfg.labels,
            "num_labels": cfg.num_labels,
            "text_pair_column": cfg.text_pair_column,
        }

    def __init__(
        self,
        model: str,
        *,
        text_column: str = "text",
        label_column: str = "label",
        max_seq_len: int = 128,
        attn_implementation: str | None = None,
        text_pair_column: str | None = None,
        labels: Sequence[str] | None = None,
        num_labels: int | None = None,
    ) -> None:
        if labels is not None and num_labels is not None and len(labels) != num_labels:
            raise UsageError(
                f"--labels names {len(labels)} labels but --num-labels is {num_labels}; "
                "give one of them"
            )
        if num_labels is not None and num_labels < 1:
            raise UsageError(f"--num-labels: must be ≥ 1, got {num_labels}")
        # one class: nothing to tell apart (the softmax of one logit is 1, the loss 0 at once)
        if num_labels == 1:
            raise UsageError("--num-labels: a classifier needs at least two labels, got 1")
        named = [str(x).strip() for x in labels or [] if str(x).strip()]
        if len(named) == 1:
            raise UsageError(
                f"--labels: names one label ({named[0]}); a classifier needs at least two "
                "(--labels neg,pos)"
            )
        self.model_name = str(model)
        self.text_column = text_column
        self.label_column = label_column
        self.max_seq_len = max_seq_len
        self.attn_implementation = attn_implementation
        self.text_pair_column = text_pair_column
        self.device = torch.device("cpu")
        # the label set: fixed by --labels / --num-labels, else the training file's values
        self.labels: list[Label] = []
        self.label_ids: dict[str, int] = {}  # a label's canonical text -> its id
        self._fixed = ""
        if labels is not None:
            names = [str(x).strip() for x in labels]
            canonical = [canonical_label(x) for x in names]
            bad = [n for n, c in zip(names, canonical, strict=True) if c is None]
            if bad or not names:
                raise UsageError(f"--labels: {bad[0] if bad else '(none)'!r} is not a label name")
            if len(set(canonical)) != len(canonical):
                raise UsageError(f"--labels: a label is named twice ({', '.join(names)})")
            self._set_labels(names, [str(c) for c in canonical])
            self._fixed = "--labels"
        elif num_labels is not None:
            self._set_labels(list(range(num_labels)), [str(i) for i in range(num_labels)])
            self._fixed = f"--num-labels {num_labels}"
        self.tokenizer: Any = None
        # what became of the head of a --model that has one (kept, or replaced and why), for
        # run.json; None when the model had no head (a fresh one, as for any base model)
        self.head_note: str | None = None

    def _set_labels(self, labels: Sequence[Label], canonical: Sequence[str]) -> None:
        self.labels = list(labels)
        self.label_ids = {text: i for i, text in enumerate(canonical)}

    # -- data ----------------------------------------------------------------------------------
    def read(self, path: Path, flag: str = "--train-file") -> RowTable:
        columns = [Column(self.text_column), Column(self.label_column, "label")]
        if self.text_pair_column:
            columns.append(Column(self.text_pair_column))
        rule = LabelRule()
        if self._fixed:
            rule = LabelRule(frozenset(self.label_ids), self._fixed)
        elif flag != "--train-file" and self.label_ids:
            rule = LabelRule(frozenset(self.label_ids), "the training data")
        try:
            rows = read_rows(path, columns, flag=flag, labels=rule, options=self.data_options)
        except DataError as exc:
            if not self._fixed and flag == "--train-file" and exc.labels:
                # the good rows' labels, so that the eval file's are checked in the same report
                values = label_values(exc.labels)
                self._set_labels(values, [str(v) for v in values])
            raise
        if not self._fixed and flag == "--train-file":
            values = label_values(rows.label_texts)
            self._set_labels(values, [str(v) for v in values])
        if flag == "--train-file" and len(rows.label_texts) == 1:
            # one class: nothing to tell apart (a one-label head's loss is 0 from the first
            # step; beside --labels' other labels, it learns to answer this one always)
            (label,) = label_values(rows.label_texts)
            if not self._fixed:
                self._set_labels([], [])  # the eval file's labels are not checked against it
            skipped = f", after {len(rows.skipped)} bad rows skipped" if rows.skipped else ""
            raise UsageError(
                f"--train-file: {path}: every row has the label {label!r} ({len(rows)} "
                f"row{'s' if len(rows) != 1 else ''}{skipped}); a classifier needs rows of at "
                "least two labels"
            )
        return rows

    def _label_id(self, row: Row) -> int:
        if not self.labels:
            raise RuntimeError("ClassificationRecipe: read() sets the labels; call it first")
        text = canonical_label(row[self.label_column])
        if text is None or text not in self.label_ids:
            known = ", ".join(str(x) for x in self.labels)
            raise row_error(
                row,
                f"label {row[self.label_column]!r} does not occur in the training data "
                f"(labels: {known})",
            )
        return self.label_ids[text]

    # -- model ---------------------------------------------------------------------------------
    def build(self, train_rows: Sequence[Row]) -> None:
        # start-up: transformers' Auto classes are loaded when a run builds a model
        from transformers import AutoModelForSequenceClassification

        if not self.labels:
            raise RuntimeError("ClassificationRecipe: read() sets the labels; call it first")
        fresh = self._match_head()
        id2label = {i: str(label) for i, label in enumerate(self.labels)}
        kwargs: dict[str, Any] = {
            "num_labels": len(self.labels),
            "id2label": id2label,
            "label2id": {name: i for i, name in id2label.items()},
        }
        if fresh:
            # an old head of another size is no error: the head is replaced below anyway
            kwargs["ignore_mismatched_sizes"] = True
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        self._load_tokenizer()
        self.model = load_pretrained(
            AutoModelForSequenceClassification.from_pretrained, self.model_name, **kwargs
        )
        if fresh:
            fresh_head(self.model)
        if getattr(self.model.config, "pad_token_id", None) is None:
            # the classification head finds each row's last real token through pad_token_id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def _match_head(self) -> bool:
        """Whether the model's own classification head must be replaced by a fresh one (said on
        stderr); when its label names are the data's, the labels take its ids instead."""
        from transformers import AutoConfig  # start-up: loaded when a run builds a model

        self.head_note = None
        config = load_pretrained(AutoConfig.from_pretrained, self.model_name)
        names = head_labels(config)
        if names is None:
            return False
        texts = _head_texts(names)
        mine = {str(label): label for label in self.labels}
        if None not in texts and len(texts) == len(mine) and set(texts) == set(mine):
            order = [str(t) for t in texts]
            self._set_labels([mine[t] for t in order], order)
            self.head_note = (
                f"the classifier head of {self.model_name} has the labels of the data "
                f"({_names(names)}): it is kept, with its label ids"
            )
            return False
        given = "the data has" if not self._fixed else f"{self._fixed.split()[0]} gives"
        count = len(self.labels)
        self.head_note = (
            f"the classifier head of {self.model_name} has {len(names)} labels "
            f"({_names(names)}); {given} {count} ({_names(self.labels)}): a new {count}-label "
            "head is trained (the body's weights are kept)"
        )
        if os.environ.get("RANK", "0") in ("", "0"):  # several ranks: rank 0 says it once
            print(f"memfit: {self.head_note}", file=sys.stderr, flush=True)
        return True

    def _load_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # start-up: loaded when a run reads data

            self.tokenizer = load_pretrained(AutoTokenizer.from_pretrained, self.model_name)
            if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
                # decoder backbones (GPT-2) have no pad token; padding is masked, any id will do
                self.tokenizer.pad_token = self.tokenizer.eos_token
        return self.tokenizer

    def _encode(self, texts: list[str], pairs: list[str] | None) -> dict[str, list[Any]]:
        # truncated, unpadded: each micro-batch pads to its own longest row
        encoded = self._load_tokenizer()(texts, pairs, truncation=True, max_length=self.max_seq_len)
        out = {ENCODED + k: list(v) for k, v in encoded.items()}
        out[LENGTH] = [len(ids) for ids in encoded["input_ids"]]
        return out

    def prepare(self, rows: Sequence[Row]) -> Sequence[Row]:
        if not isinstance(rows, RowTable):
            return rows
        text, pair = self.text_column, self.text_pair_column

        def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            return self._encode(batch[text], batch[pair] if pair else None)

        key = f"classification|{tokenizer_key(self._load_tokenizer())}|{self.max_seq_len}|{text}|{pair}"
        return rows.map_rows(encode, key, cache_dir=self.data_options.cache_dir)

    def _encodings(self, rows: Sequence[Row]) -> list[dict[str, list[int]]]:
        """Each row's token ids (and type ids): precomputed by ``prepare``, else encoded now."""
        if all(ENCODED + "input_ids" in row for row in rows):
            return [
                {k[len(ENCODED) :]: v for k, v in row.items() if k.startswith(ENCODED)}
                for row in rows
            ]
        texts = [text_of(row, self.text_column) for row in rows]
        pairs = (
            [text_of(row, self.text_pair_column) for row in rows] if self.text_pair_column else None
        )
        encoded = self._encode(texts, pairs)
        # the model's inputs only (not the rows' lengths, which _encode adds beside them)
        names = [k for k in encoded if k.startswith(ENCODED)]
        return [{k[len(ENCODED) :]: encoded[k][i] for k in names} for i in range(len(rows))]

    def lengths(self, rows: Sequence[Row]) -> list[int]:
        if all(LENGTH in row for row in rows):
            return [int(row[LENGTH]) for row in rows]
        return [len(e["input_ids"]) for e in self._encodings(rows)]

    def units(self, rows: Sequence[Row]) -> int:
        return len(rows)

    def _inputs(self, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        """The chunk's model inputs (ids, attention mask, a pair's type ids) on the device."""
        encodings = self._encodings(rows)
        # dynamic padding: the chunk is as wide as its longest text (rounded up to the device's
        # multiple), not max_seq_len
        width = self.padded_width(max(len(e["input_ids"]) for e in encodings))
        batch = self._load_tokenizer().pad(
            encodings, padding="max_length", max_length=width, return_tensors="pt"
        )
        return {name: self.on_device(tensor) for name, tensor in batch.items()}

    def _logits(self, rows: Sequence[Row]) -> torch.Tensor:
        # float(): under autocast the logits are half precision; the loss is summed in fp32
        return self.model(**self._inputs(rows)).logits.float()

    def _targets(self, rows: Sequence[Row]) -> torch.Tensor:
        return torch.tensor([self._label_id(row) for row in rows], device=self.device)

    def loss(
        self, rows: Sequence[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        targets = self._targets(rows)
        # summed, not averaged: chunks of a step add up to the step's mean (base.py); the loss
        # the estimator traces (memfit.step)
        return step.classification_loss(self.model, self._inputs(rows), targets, total_units)

    # -- eval ----------------------------------------------------------------------------------
    def eval_partial(self, rows: Sequence[Row]) -> tuple[list[int], list[int], float]:
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

    def save(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
