"""Raw records, with their lines: each format's reader (CSV, TSV, JSON Lines, JSON, Parquet,
``save_to_disk``) yields ``(line or row, record, parse problem)``, streaming the file; a problem
that ends the reading of a whole file is a :class:`FileProblem`.

A gzipped file that is corrupt or cut short refuses the whole file (a lost tail is no bad row);
a JSON line nested too deeply to parse is a bad row at its line.
"""

from __future__ import annotations

import csv
import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from memfit.data.sources import Source

# a JSON value nested past what the parser's recursion allows
TOO_DEEP = "nested too deeply to read as JSON"

RawRecord = tuple[int | None, Any, str | None]  # (line or row, the record, a parse problem)


class FileProblem(Exception):
    """A problem that ends the reading of one file (empty, a missing column in its header)."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.line = reason, line


def read_records(source: Source, columns: Sequence[str]) -> Iterator[RawRecord]:
    """The records of ``source`` that hold the ``columns`` named, each with its line (or row)
    or why it could not be parsed; a :class:`FileProblem` ends the file."""
    if not source.path.name.lower().endswith(".gz"):
        yield from _records_of(source, columns)
        return
    try:
        yield from _records_of(source, columns)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        # the rows past the break are lost: the whole file is refused, never skipped
        raise FileProblem(
            f"not a readable gzip file (corrupt or truncated: {_first_line(exc)})"
        ) from None


def _records_of(source: Source, columns: Sequence[str]) -> Iterator[RawRecord]:
    if source.kind in ("csv", "tsv"):
        yield from _csv_records(source.path, "\t" if source.kind == "tsv" else ",", columns)
    elif source.kind == "parquet":
        yield from _parquet_records(source.path, columns)
    elif source.kind == "arrow":
        yield from _saved_records(source, columns)
    else:
        yield from _json_records(source.path, source.kind)


def _open_binary(path: Path) -> Any:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decoded_lines(path: Path, bad_lines: set[int]) -> Iterator[str]:
    """The file's lines as text; a line that is not UTF-8 is noted in ``bad_lines`` and decoded
    with replacement characters so the parse can go on to the next row."""
    with _open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a byte-order mark is no data
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad_lines.add(number)
                yield raw.decode("utf-8", errors="replace") if exc.start >= 0 else ""


def _is_blank_file(path: Path) -> bool:
    with _open_binary(path) as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip(b" \t\r\n\xef\xbb\xbf"):
                return False
    return True


def _undecodable(bad_lines: set[int], first: int, last: int) -> str | None:
    hit = [n for n in range(first, last + 1) if n in bad_lines]
    if not hit:
        return None
    return "undecodable bytes: not UTF-8 text (save the file as UTF-8)"


def _csv_records(path: Path, delimiter: str, columns: Sequence[str]) -> Iterator[RawRecord]:
    if _is_blank_file(path):
        raise FileProblem("the file is empty")
    bad_lines: set[int] = set()
    # newline="" semantics: the csv module sees the line endings as they are
    # strict: a stray or unclosed quote is an error at its line, never a field that swallows
    # the rows after it
    reader = csv.reader(_decoded_lines(path, bad_lines), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except csv.Error as exc:
        raise FileProblem(f"not valid CSV ({exc})", 1) from None
    if 1 in bad_lines:
        raise FileProblem(_undecodable(bad_lines, 1, 1) or "", 1)
    header = [h.strip() for h in header]
    # a column the run reads, named twice: zip() into a dict would keep the last of them, a
    # column lost without a word (others, and the empty names of trailing commas, are not read)
    wanted = set(columns)
    twice = [h for i, h in enumerate(header) if h in wanted and h in header[:i]]
    if twice:
        times = header.count(twice[0])
        raise FileProblem(
            f"the header names column {twice[0]!r} {'twice' if times == 2 else f'{times} times'} "
            f"(columns: {', '.join(header)})",
            1,
        )
    missing = [c for c in columns if c not in header]
    if missing:
        raise FileProblem(
            f"no column {missing[0]!r} in the header (columns: {', '.join(header)})", 1
        )
    last = reader.line_num
    while True:
        first = last + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            last = reader.line_num
            if "unexpected end of data" in str(exc):
                yield first, None, "a quote opened on this line is never closed (not valid CSV)"
                return
            yield last, None, f"not valid CSV ({exc})"
            continue
        # reader.line_num is the line the record ends on (a quoted field may span lines)
        last = reader.line_num
        if not fields:
            continue  # a blank line holds no row; a line of delimiters is a row of empty fields
        undecodable = _undecodable(bad_lines, first, last)
        if undecodable:
            yield last, None, undecodable
        elif len(fields) != len(header):
            yield last, None, f"{len(fields)} fields, the header has {len(header)}"
        else:
            yield last, dict(zip(header, fields, strict=True)), None


def _json_records(path: Path, kind: str) -> Iterator[RawRecord]:
    if _is_blank_file(path):
        raise FileProblem("the file is empty")
    bad_lines: set[int] = set()
    lines = _decoded_lines(path, bad_lines)
    if kind == "json":
        first_text = ""
        with _open_binary(path) as handle:
            first_text = handle.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")[:1].decode("latin-1")
        if first_text == "[":
            text = "".join(lines)
            if bad_lines:
                raise FileProblem(_undecodable(bad_lines, 1, max(bad_lines)) or "", min(bad_lines))
            yield from _json_list_records(text)
            return
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if number in bad_lines:
            yield number, None, _undecodable(bad_lines, number, number)
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, None, f"not JSON ({exc.msg})"
            continue
        except RecursionError:
            yield number, None, TOO_DEEP
            continue
        except ValueError as exc:  # an integer of more digits than Python converts
            yield number, None, f"not JSON memfit reads ({_first_line(exc).split(':')[0]})"
            continue
        yield number, value, None


def _json_list_records(text: str) -> Iterator[RawRecord]:
    """A JSON list of objects, item by item so that each row knows the line it starts on."""
    decoder = json.JSONDecoder()

    def line_at(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def skip_space(index: int) -> int:
        while index < len(text) and text[index].isspace():
            index += 1
        return index

    index = skip_space(text.index("[") + 1)
    if index < len(text) and text[index] == "]":
        return
    while True:
        start = skip_space(index)
        try:
            value, index = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            # a broken list cannot be read past the break: the rest of the file is unread
            raise FileProblem(
                f"not JSON ({exc.msg}); the rest of the file is unread", line_at(exc.pos)
            ) from None
        except (RecursionError, ValueError) as exc:
            # too deep (or too long a number) to parse, but its end can be found: a bad row
            end = _value_end(text, start)
            if end is None:
                raise FileProblem(
                    f"{TOO_DEEP if isinstance(exc, RecursionError) else 'not JSON'}; the rest "
                    "of the file is unread",
                    line_at(start),
                ) from None
            reason = TOO_DEEP if isinstance(exc, RecursionError) else "not JSON memfit reads"
            yield line_at(start), None, reason
            index = end
        else:
            yield line_at(start), value, None
        index = skip_space(index)
        if index < len(text) and text[index] == ",":
            index += 1
        elif index < len(text) and text[index] == "]":
            rest = text[index + 1 :]
            if rest.strip():
                raise FileProblem(
                    "not JSON (extra data after the list)",
                    line_at(index + 1 + len(rest) - len(rest.lstrip())),
                )
            return
        else:
            raise FileProblem("not JSON (expecting ',' or ']')", line_at(index))


def _value_end(text: str, start: int) -> int | None:
    """The index just past the JSON array or object that starts at ``start`` (brackets counted
    outside strings, without recursion), or None when it is not one or never closes."""
    if start >= len(text) or text[start] not in "[{":
        return None
    depth, index, length = 0, start, len(text)
    while index < length:
        char = text[index]
        if char == '"':
            index += 1
            while index < length and text[index] != '"':
                index += 2 if text[index] == "\\" else 1
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None


def _parquet_records(path: Path, columns: Sequence[str]) -> Iterator[RawRecord]:
    # start-up: pyarrow (which datasets installs) is imported only for a Parquet file
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for files that are not Parquet
        raise FileProblem(f"not a Parquet file ({_first_line(exc)})") from None
    names = handle.schema_arrow.names
    wanted = set(columns)
    twice = [n for i, n in enumerate(names) if n in wanted and n in names[:i]]
    if twice:
        raise FileProblem(f"column {twice[0]!r} occurs twice (columns: {', '.join(names)})")
    missing = [c for c in columns if c not in names]
    if missing:
        raise FileProblem(f"no column {missing[0]!r} (columns: {', '.join(names)})")
    if handle.metadata.num_rows == 0:
        raise FileProblem("no rows")
    number = 0
    for batch in handle.iter_batches(columns=list(columns), batch_size=4096):
        for record in batch.to_pylist():
            number += 1
            yield number, record, None


def _saved_records(source: Source, columns: Sequence[str]) -> Iterator[RawRecord]:
    # start-up: datasets takes a second or more to import; only a saved dataset needs it
    from datasets import load_from_disk

    try:
        loaded: Any = load_from_disk(str(source.path))
    except Exception as exc:  # datasets raises FileNotFoundError/ValueError for broken folders
        raise FileProblem(f"not a readable save_to_disk folder ({_first_line(exc)})") from None
    if source.split is not None:
        loaded = loaded[source.split]
    names = list(loaded.column_names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise FileProblem(f"no column {missing[0]!r} (columns: {', '.join(names)})")
    number = 0
    for batch in loaded.select_columns(list(columns)).iter(batch_size=4096):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys), strict=True):
            number += 1
            yield number, dict(zip(keys, values, strict=True)), None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
