"""How long the training texts are, in tokens: what truncation would cut.

``DataProfile.from_file`` reads a CSV/TSV, JSON Lines or JSON (list of objects) file, takes one or
more text columns (a sentence pair counts its longest text), tokenizes with a local tokenizer and
keeps every sample's length. Nothing is dropped: a row without the column is an error naming the
file and line.
"""

from __future__ import annotations

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
    """One list of texts (one per column) per row, read and checked as ``memfit train`` reads."""
    from memfit.data.rows import read_rows, text_of

    for row in read_rows(path, columns, flag="--train-file"):
        yield [text_of(row, column) for column in columns]
