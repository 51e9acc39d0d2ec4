"""The rows to run: memfit's data reader (:mod:`memfit.data.rows`), plus an id column passed
through as it is.

The text columns go through :func:`memfit.data.rows.read_rows`, so every input kind ``memfit
train`` reads works here (CSV, TSV, JSON Lines, JSON, Parquet, gzipped text formats, folders of
them, ``datasets`` ``save_to_disk`` folders), and a bad row is one line naming ``--file``, the file
and the line, all at once (exit 2). Every row is run: none is skipped.

The id column is read beside them with the same record reader (the same files in the same order,
so the n-th id belongs to the n-th row) and kept as it is: an integer stays an integer, ``"007"``
stays ``"007"`` (the text reader would refuse integers, the label reader would rewrite them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.data.records import FileProblem, read_records
from memfit.data.rows import (
    WHERE,
    Column,
    DataError,
    DataOptions,
    Problem,
    RowTable,
    read_rows,
)
from memfit.data.sources import resolve_sources

# ids must be scalars that JSON and Parquet keep as they are
Id = str | int | float

FLAG = "--file"


@dataclass(frozen=True)
class Input:
    """The checked rows (memory-mapped) and their ids (None: the input has no id column)."""

    rows: RowTable
    text_columns: tuple[str, ...]
    ids: list[Id] | None
    id_column: str | None

    def __len__(self) -> int:
        return len(self.rows)

    def texts(self, start: int, stop: int) -> list[tuple[tuple[str, ...], str]]:
        """Rows ``start`` … ``stop - 1``: (their texts, where they came from)."""
        rows = self.rows.rows(range(start, stop))
        return [(tuple(row[c] for c in self.text_columns), str(row[WHERE])) for row in rows]


def read_input(
    path: str | Path,
    text_columns: tuple[str, ...],
    *,
    id_column: str | None,
    id_required: bool,
    cache_dir: str | None = None,
) -> Input:
    """The rows of ``path`` with ``text_columns`` checked; ids from ``id_column`` when the input
    has it (``id_required``: it must, ``--id-column`` was given)."""
    problems: list[Problem] = []
    table: RowTable | None = None
    try:
        table = read_rows(
            path,
            [Column(c) for c in text_columns],
            flag=FLAG,
            options=DataOptions(cache_dir=cache_dir),
        )
    except DataError as exc:
        problems.extend(exc.problems)
    ids = None
    if id_column is not None:
        try:
            ids = read_ids(path, id_column, required=id_required)
        except DataError as exc:
            problems.extend(exc.problems)
    if problems:
        # the text and the id problems in one report, file by file, line by line
        raise DataError(sorted(problems, key=lambda p: (p.file, p.line or 0)))
    assert table is not None
    if ids is not None and len(ids) != len(table):  # pragma: no cover - one reader for both
        raise RuntimeError(f"{len(ids)} ids for {len(table)} rows of {path}")
    return Input(table, text_columns, ids, id_column if ids is not None else None)


def read_ids(path: str | Path, column: str, *, required: bool) -> list[Id] | None:
    """Every row's value of ``column``, in row order; None when the column is not there and not
    ``required``. A row without a usable id is a problem at its line, all reported at once."""
    # the same record reader read_rows uses, so files, order and line numbers are the same
    ids: list[Id] = []
    problems: list[Problem] = []
    for number_of_source, source in enumerate(resolve_sources(path, FLAG)):
        name, unit = source.name, source.unit
        try:
            for number, record, _parse_problem in read_records(source, [column]):
                first = number_of_source == 0 and not ids and not problems
                if first and not required and isinstance(record, dict) and column not in record:
                    return None  # the input has no id column: none is passed through
                value = record.get(column) if isinstance(record, dict) else None
                reason = _id_problem(
                    column, value, present=isinstance(record, dict) and column in record
                )
                if reason is not None:
                    problems.append(Problem(FLAG, name, number, reason, unit))
                    continue
                assert value is not None
                ids.append(value)
        except FileProblem as exc:
            if number_of_source == 0 and not required and "no column" in exc.reason:
                return None
            reason = f"{exc.reason} (--id-column {column})"
            problems.append(Problem(FLAG, name, exc.line, reason, unit, True))
    if problems:
        raise DataError(problems)
    return ids


def _id_problem(column: str, value: Any, *, present: bool) -> str | None:
    if not present:
        return f"no column {column!r} (the id column; every row needs one)"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        shown = "null" if value is None else type(value).__name__
        return f"column {column!r}: an id is a string or a number, got {shown}"
    if isinstance(value, str) and not value.strip():
        return f"column {column!r} (the id) is empty"
    return None


def id_type(ids: list[Id]) -> str:
    """``int`` when every id is an integer, else ``str``: a Parquet column has one type."""
    return "int" if all(isinstance(i, int) and not isinstance(i, bool) for i in ids) else "str"
