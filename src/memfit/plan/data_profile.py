"""How long the training texts are, in tokens: what truncation would cut.

``DataProfile.from_file`` reads a CSV/TSV, JSON Lines or JSON (list of objects) file, takes one or
more text columns (a sentence pair counts its longest text), tokenizes with a local tokenizer and
keeps every sample's length. Nothing is dropped: a row without the column is an error naming the
file and line.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.errors import UsageError


@dataclass(frozen=True)
class DataProfile:
    """Token lengths of the training samples (special tokens included)."""

    lengths: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.lengths:
            raise UsageError(f"{self.source or 'data profile'}: no samples")

    def percentile(self, q: float) -> int:
        return int(np.ceil(np.percentile(np.array(self.lengths), q)))

    def tokens_lost(self, max_seq_len: int, seq_len: int) -> float:
        """Share of the tokens a run at ``seq_len`` sees that truncating to ``max_seq_len`` cuts."""
        lengths = np.minimum(np.array(self.lengths), seq_len)
        kept = lengths.sum()
        if kept == 0:
            return 0.0
        return float(np.maximum(lengths - max_seq_len, 0).sum() / kept)

    def samples_truncated(self, max_seq_len: int) -> float:
        return float((np.array(self.lengths) > max_seq_len).mean())

    @classmethod
    def from_file(
        cls, path: str | Path, text_columns: Sequence[str], tokenizer: str | Path
    ) -> DataProfile:
        texts = list(_read_texts(Path(path), list(text_columns)))
        tok = _load_tokenizer(tokenizer)
        lengths = []
        for column_texts in zip(*texts, strict=True) if texts else []:
            encoded = tok(list(column_texts), add_special_tokens=True, truncation=False)
            lengths.append(np.array([len(ids) for ids in encoded["input_ids"]]))
        if not lengths:
            raise UsageError(f"--train-file: {path}: no rows")
        longest = np.max(np.stack(lengths), axis=0)
        return cls(tuple(int(x) for x in longest), source=str(path))


def _load_tokenizer(name: str | Path) -> Any:
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/... for bad folders
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--tokenizer: cannot load a tokenizer from {name}: {first}") from None


def _read_texts(path: Path, columns: list[str]) -> Iterator[list[str]]:
    """One list of texts (one per column) per row."""
    if not path.is_file():
        raise UsageError(f"--train-file: {path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        yield from _read_csv(path, columns, "\t" if suffix == ".tsv" else ",")
    elif suffix in (".jsonl", ".json"):
        yield from _read_json(path, columns)
    else:
        raise UsageError(
            f"--train-file: {path}: unknown format {suffix!r}; use .csv, .tsv, .jsonl or .json"
        )


def _row_texts(row: dict[str, Any], columns: list[str], where: str) -> list[str]:
    texts = []
    for column in columns:
        value = row.get(column)
        if not isinstance(value, str):
            raise UsageError(f"{where}: no text in column {column!r}")
        texts.append(value)
    return texts


def _read_csv(path: Path, columns: list[str], delimiter: str) -> Iterator[list[str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise UsageError(
                f"--text-column: {path}: no column {missing[0]!r} (columns: {', '.join(reader.fieldnames or [])})"
            )
        for row in reader:
            yield _row_texts(row, columns, f"--train-file: {path}, line {reader.line_num}")


def _read_json(path: Path, columns: list[str]) -> Iterator[list[str]]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--train-file: {path}, line {exc.lineno}: not JSON ({exc.msg})"
            ) from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise UsageError(f"--train-file: {path}: item {i} is not an object")
            yield _row_texts(row, columns, f"--train-file: {path}, item {i}")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--train-file: {path}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise UsageError(f"--train-file: {path}, line {number}: not a JSON object")
        yield _row_texts(row, columns, f"--train-file: {path}, line {number}")
