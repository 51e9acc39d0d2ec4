"""Reading a training or eval file into rows, checked: every bad row is one line naming the flag,
the file and the line; no row is dropped silently.

Formats: CSV (``.csv``), TSV (``.tsv``), JSON Lines (``.jsonl``, and ``.json`` that does not start
with ``[``) and JSON (``.json``, a list of objects). ``memfit train``'s recipes and
``memfit plan --train-file`` (``memfit.plan.data_profile``) both read through here. A row is the dict from the file plus one key, ``WHERE``
(``"--train-file: data.csv line 7"``), so that a recipe can report a problem it only finds later
(an eval label that training never saw) at the right line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

Row = dict[str, Any]

# the key every row carries: where it came from, ready to start an error message
WHERE = "__where__"


def where(row: Row) -> str:
    """``"--train-file: data.csv line 7"``, or ``"a row"`` for a row not read by ``read_rows``."""
    return str(row.get(WHERE, "a row"))


def row_error(row: Row, message: str) -> UsageError:
    """A UsageError for ``row``: ``--train-file: data.csv line 7: <message>``."""
    return UsageError(f"{where(row)}: {message}")


def text_of(row: Row, column: str) -> str:
    """The text in ``column``: a non-empty string, or a UsageError naming the line."""
    value = row.get(column)
    if not isinstance(value, str):
        raise row_error(row, f"column {column!r} is not text (got {type(value).__name__})")
    if not value.strip():
        raise row_error(row, f"column {column!r} is empty")
    return value


def read_rows(path: Path, required: Sequence[str], *, flag: str) -> list[Row]:
    """The rows of ``path``; each must have every ``required`` column with a non-empty value."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag}: {path}: no such file")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag}: {path}: not UTF-8 text ({exc.reason})") from None
    if not text.strip():
        raise UsageError(f"{flag}: {path}: the file is empty")
    if suffix in (".csv", ".tsv"):
        rows = _read_csv(text, "\t" if suffix == ".tsv" else ",", required, f"{flag}: {path}")
    elif suffix == ".json" and text.lstrip().startswith("["):
        rows = _read_json_list(text, f"{flag}: {path}")
    elif suffix in (".jsonl", ".json"):
        rows = _read_json_lines(text, f"{flag}: {path}")
    else:
        raise UsageError(
            f"{flag}: {path}: unknown format {suffix!r}; use .csv, .tsv, .jsonl or .json"
        )
    if not rows:
        raise UsageError(f"{flag}: {path}: no rows")
    for row in rows:
        for column in required:
            if column not in row:
                present = ", ".join(k for k in row if k != WHERE)
                raise row_error(row, f"no column {column!r} (columns: {present})")
            value = row[column]
            if value is None or (isinstance(value, str) and not value.strip()):
                raise row_error(row, f"column {column!r} is empty")
    return rows


def _read_csv(text: str, delimiter: str, required: Sequence[str], source: str) -> list[Row]:
    # newline="": the csv module sees the line endings as they are (quoted fields may hold them)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader)
        missing = [c for c in required if c not in header]
        if missing:
            raise UsageError(
                f"{source} line 1: no column {missing[0]!r} (columns: {', '.join(header)})"
            )
        rows: list[Row] = []
        for fields in reader:
            # reader.line_num is the line the record ends on (a quoted field may span lines)
            line = reader.line_num
            if not fields:
                # a blank line holds no row; a line of only delimiters is a row (with empty fields)
                continue
            if len(fields) != len(header):
                raise UsageError(
                    f"{source} line {line}: {len(fields)} fields, the header has {len(header)}"
                )
            row: Row = dict(zip(header, fields, strict=True))
            row[WHERE] = f"{source} line {line}"
            rows.append(row)
    except csv.Error as exc:
        raise UsageError(f"{source} line {reader.line_num}: not valid CSV ({exc})") from None
    return rows


def _read_json_lines(text: str, source: str) -> list[Row]:
    rows: list[Row] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{source} line {number}: not JSON ({exc.msg})") from None
        rows.append(_as_row(value, f"{source} line {number}"))
    return rows


def _read_json_list(text: str, source: str) -> list[Row]:
    """A JSON list of objects, item by item so that each row knows the line it starts on."""
    decoder = json.JSONDecoder()

    def line_at(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def skip_space(index: int) -> int:
        while index < len(text) and text[index].isspace():
            index += 1
        return index

    def fail(index: int, what: str) -> UsageError:
        return UsageError(f"{source} line {line_at(index)}: not JSON ({what})")

    rows: list[Row] = []
    index = skip_space(text.index("[") + 1)
    if index < len(text) and text[index] == "]":
        return _after_list(text, index + 1, rows, fail)
    while True:
        start = skip_space(index)
        try:
            value, index = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            raise fail(exc.pos, exc.msg) from None
        rows.append(_as_row(value, f"{source} line {line_at(start)}"))
        index = skip_space(index)
        if index < len(text) and text[index] == ",":
            index += 1
        elif index < len(text) and text[index] == "]":
            return _after_list(text, index + 1, rows, fail)
        else:
            raise fail(index, "expecting ',' or ']'")


def _after_list(text: str, index: int, rows: list[Row], fail: Any) -> list[Row]:
    if text[index:].strip():
        raise fail(index + len(text[index:]) - len(text[index:].lstrip()), "extra data")
    return rows


def _as_row(value: Any, location: str) -> Row:
    if not isinstance(value, dict):
        raise UsageError(f"{location}: not a JSON object")
    row: Row = dict(value)
    row[WHERE] = location
    return row
