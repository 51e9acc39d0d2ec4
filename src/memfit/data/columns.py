"""Which columns of a task's rows hold the texts the model reads, as ``memfit train`` reads them.

One place for the recipes (``memfit train``) and for what measures the same rows before a run
(``memfit plan --train-file``, ``memfit data profile``): a sentence-embedding row is an (anchor,
positive) pair, a classification row a text (and, for sentence pairs, a second one), a causal-LM
row a text (instruction rows: :mod:`memfit.data.instructions`).
"""

from __future__ import annotations

# the columns memfit train reads when no flag names others
TEXT_COLUMN = "text"
ANCHOR_COLUMN = "anchor"
POSITIVE_COLUMN = "positive"


def text_columns(
    task: str,
    *,
    text_column: str | None = None,
    text_pair_column: str | None = None,
    anchor_column: str | None = None,
    positive_column: str | None = None,
) -> list[str]:
    """The text columns of ``task``'s rows, in order (a column not named: memfit train's
    default for it). A sentence-embedding row is its anchor and its positive; any other task's,
    its text column and, for classification, its pair's second text column when named."""
    if task == "sentence-embedding":
        return [anchor_column or ANCHOR_COLUMN, positive_column or POSITIVE_COLUMN]
    columns = [text_column or TEXT_COLUMN]
    if task == "classification" and text_pair_column:
        columns.append(text_pair_column)
    return columns


__all__ = ["ANCHOR_COLUMN", "POSITIVE_COLUMN", "TEXT_COLUMN", "text_columns"]
