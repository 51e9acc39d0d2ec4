"""Reading training and eval data into checked rows: every problem found at once, each naming the
flag, the file and the line; nothing dropped silently.

Inputs (``--train-file``/``--eval-file``):

- a file: CSV (``.csv``), TSV (``.tsv``), JSON Lines (``.jsonl``, and ``.json`` that does not
  start with ``[``), JSON (``.json``, a list of objects), Parquet (``.parquet``); CSV, TSV and
  JSON Lines may be gzipped (``.csv.gz`` …);
- a folder holding such files (read in name order, as managed services hand over input channels);
  a link in it to a regular file is read as that file; any other entry (a link to a folder, a
  broken or looping link, a FIFO, a socket) is refused by name and never opened;
- a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose
  ``train`` split is read for ``--train-file`` and ``validation``/``eval``/``test`` for
  ``--eval-file``).

Two passes. :func:`scan_rows` streams the raw files once (no file is held in memory whole) and
checks every row; a line number is the 1-based line an editor shows, header included (Parquet and
``save_to_disk`` data have no lines: ``row N``). Then :func:`read_rows` writes the good rows
through ``datasets`` into an Arrow file in the cache folder (never the input folder, which may be
read-only) and returns a :class:`RowTable` over it, memory-mapped; the Arrow file is reused while
the input files and the columns asked for are unchanged.

A gzipped file that is corrupt or cut short refuses the whole file (a lost tail is no bad row);
a JSON line nested too deeply to parse is a bad row at its line.

A row is a dict of the columns asked for plus ``WHERE`` (``"--train-file: data.csv line 7"``), so
that a recipe can report a problem it only finds later at the right line. Text columns are
non-empty strings; a label column holds the label's canonical text (``"3"`` for ``3``, ``3.0``,
``"3.0"`` and ``" 3 "``; a name stripped). No label: a fraction, NaN, an infinity, a list. Without
a fixed label set (``--labels``, ``--num-labels``) integer labels are 0 … 2**31-1, and the labels
of an input are all integers or all names: where both occur, the rows of the rarer kind are bad.
"""

from __future__ import annotations

import csv
import errno
import gzip
import hashlib
import json
import os
import re
import stat
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

Row = dict[str, Any]

# the key every row carries: where it came from, ready to start an error message
WHERE = "__where__"
# the column a recipe's ``prepare`` adds: the row's length in tokens as the model sees it
LENGTH = "__length__"

FORMATS = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
# how many problems a refusal prints before it counts the rest
SHOWN_PROBLEMS = 50

_INTEGER = re.compile(r"^[+-]?\d+$")
# a number written in a label cell ("3.0", "1e30", "1.5"): a label when it is a whole number
_NUMBER = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")
_NOT_A_NUMBER = frozenset({"nan", "+nan", "-nan"})
_INFINITE = frozenset({"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})
# the largest integer label without a fixed label set (a class id; past it, a data accident)
MAX_INTEGER_LABEL = 2**31 - 1
# a JSON value nested past what the parser's recursion allows
TOO_DEEP = "nested too deeply to read as JSON"


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


# --- problems ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One bad row (or a bad file: ``line`` None) and why."""

    flag: str
    file: str
    line: int | None
    reason: str
    unit: str = "line"  # "row" for Parquet and save_to_disk data
    # a problem of the whole file (empty, a column missing from the header): never skipped
    whole_file: bool = False

    def __str__(self) -> str:
        at = f" {self.unit} {self.line}" if self.line is not None else ""
        return f"{self.flag}: {self.file}{at}: {self.reason}"

    def record(self) -> dict[str, Any]:
        """The line of ``DIR/skipped_rows.jsonl`` for this problem."""
        out: dict[str, Any] = {"file": self.file, "line": self.line, "reason": self.reason}
        if self.unit != "line":
            out = {"file": self.file, "line": None, self.unit: self.line, "reason": self.reason}
        return {**out, "flag": self.flag}


class DataError(UsageError):
    """Bad data: every problem found, one line each (exit 2)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        self.labels: set[str] = set()  # the label values of the rows that were good
        shown = [str(p) for p in self.problems[:SHOWN_PROBLEMS]]
        rest = len(self.problems) - len(shown)
        if rest > 0:
            shown.append(
                f"… and {rest} more problems ({len(self.problems)} in all; --skip-bad-rows skips "
                "bad rows and lists each in DIR/skipped_rows.jsonl)"
            )
        super().__init__("\n".join(shown))


def problem_at(where_text: str, reason: str) -> Problem:
    """The Problem of a row from its ``WHERE`` (``"--train-file: data.csv line 7"``)."""
    flag, _, rest = where_text.partition(": ")
    for unit in ("line", "row"):
        head, sep, number = rest.rpartition(f" {unit} ")
        if sep and number.isdigit():
            return Problem(flag, head, int(number), reason, unit)
    return Problem(flag, rest, None, reason)


# --- columns and labels ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A column a recipe needs: ``text`` (a non-empty string) or ``label`` (integer or name)."""

    name: str
    kind: str = "text"


@dataclass(frozen=True)
class LabelRule:
    """Which label values a file may hold: ``allowed`` canonical texts (None: any), and where
    that set came from, for the message (``"--labels"``, ``"the training data"``)."""

    allowed: frozenset[str] | None = None
    source: str = ""
    # without ``allowed``: the one kind of label the input holds ("integer" or "name"; None:
    # not decided yet) and how many rows have it (for the message)
    kind: str | None = None
    kind_rows: int = 0

    def check(self, value: str) -> str | None:
        if self.allowed is None:
            return self._check_free(value)
        if value in self.allowed:
            return None
        known = ", ".join(sorted(self.allowed, key=_label_sort_key))
        if self.source == "the training data":
            return f"does not occur in the training data (labels: {known})"
        return f"is not one of the labels given by {self.source} ({known})"

    def _check_free(self, value: str) -> str | None:
        integer = bool(_INTEGER.match(value))
        if integer and int(value) < 0:
            return (
                "is negative: integer labels count from 0 (name every label with --labels "
                "to use it)"
            )
        if integer and int(value) > MAX_INTEGER_LABEL:
            return (
                f"is too large for an integer label (at most {MAX_INTEGER_LABEL}; name every "
                "label with --labels to use it)"
            )
        kind = "integer" if integer else "name"
        if self.kind is None or kind == self.kind:
            return None
        return (
            f"is {'an integer' if integer else 'a name'}, but the other labels are "
            f"{self.kind}s ({self.kind_rows} rows): labels are all integers or all names "
            "(give --labels to name every label)"
        )


def canonical_label(value: Any) -> str | None:
    """A label's canonical text, or None when ``value`` is no label (a fraction, NaN, a list…)."""
    return _label_text(value)[0]


def _label_text(value: Any) -> tuple[str | None, str]:
    """(the canonical text, "") or (None, why it is no label: "a fraction", "not a number"…)."""
    if isinstance(value, bool) or value is None:
        return None, ""
    if isinstance(value, int):
        return str(value), ""
    if isinstance(value, float):
        return _float_label(value)
    if isinstance(value, str):
        text = value.strip()
        if not text or any(ch in text for ch in "\n\r\t"):
            return None, ""  # a line break in a label is a quoting accident, not a name
        if _INTEGER.match(text):
            try:
                return str(int(text)), ""
            except ValueError:  # more digits than Python converts (4300)
                return None, "a number too long"
        if _NUMBER.match(text):
            return _float_label(float(text))
        if text.lower() in _NOT_A_NUMBER:
            return None, "not a number"
        if text.lower() in _INFINITE:
            return None, "infinite"
        return text, ""
    return None, ""


def _float_label(value: float) -> tuple[str | None, str]:
    if value != value:
        return None, "not a number"
    if value in (float("inf"), float("-inf")):
        return None, "infinite"
    if not value.is_integer():
        return None, "a fraction"
    return str(int(value)), ""


def _label_sort_key(text: str) -> tuple[int, int, str]:
    return (0, int(text), "") if _INTEGER.match(text) else (1, 0, text)


def label_values(texts: Iterable[str]) -> list[int | str]:
    """The sorted label set from canonical texts: integers in numeric order when every label is
    an integer, else names in text order (a mix of ``1`` and ``neg``, which only a fixed label
    set allows: all are names)."""
    unique = set(texts)
    if unique and all(_INTEGER.match(t) for t in unique):
        return sorted(int(t) for t in unique)
    return sorted(unique)


# --- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One readable input: a data file, or a ``save_to_disk`` folder (``split`` for a dict)."""

    path: Path
    kind: str  # csv | tsv | jsonl | json | parquet | arrow
    split: str | None = None


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for suffix in FORMATS:
        if name.endswith(suffix):
            if suffix == ".parquet" and path.name.lower().endswith(".gz"):
                return None
            return suffix[1:]
    return None


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def resolve_sources(path: str | Path, flag: str) -> list[Source]:
    """The inputs ``path`` stands for; a UsageError naming ``flag`` when there are none."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag}: {path}: no such file or folder")
    if not path.is_file() and not path.is_dir():
        # a FIFO (``<(zcat …)``) would block the first open and could not be read twice
        raise UsageError(
            f"{flag}: {path}: {_entry_kind(path.stat())}, not a file or folder (memfit reads "
            "its data more than once: write it to a file)"
        )
    if path.is_file():
        kind = _kind_of(path)
        if kind is None:
            raise UsageError(
                f"{flag}: {path}: unknown format {_suffix(path)!r}; use .csv, .tsv, .jsonl, "
                ".json or .parquet (or a folder of them, or a datasets save_to_disk folder)"
            )
        return [Source(path, kind)]
    if _is_saved_dataset(path):
        return [Source(path, "arrow", _split_for(path, flag))]
    listing = _Listing()
    _walk(path, path, listing)
    files = sorted(listing.files)
    readable = [p for p in files if _kind_of(p) is not None]
    unreadable = [p for p in files if _kind_of(p) is None]
    problems = []
    if listing.odd:
        odd = sorted(listing.odd)
        names = ", ".join(f"{p.relative_to(path)} ({why})" for p, why in odd[:5])
        more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
        problems.append(
            f"{flag}: {path}: the folder holds entries memfit does not read: {names}{more} "
            "(it reads regular files and links to them; move the others out)"
        )
    if unreadable:
        names = ", ".join(str(p.relative_to(path)) for p in unreadable[:5])
        more = f" and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        problems.append(
            f"{flag}: {path}: the folder holds files memfit cannot read: {names}{more} "
            "(it reads .csv, .tsv, .jsonl, .json, .parquet; move the others out)"
        )
    if problems:
        raise UsageError("\n".join(problems))
    if not readable:
        what = "only hidden files and job markers" if listing.hidden else "nothing"
        raise UsageError(
            f"{flag}: {path}: the folder holds no data files ({what}; memfit reads .csv, .tsv, "
            ".jsonl, .json, .parquet)"
        )
    return [Source(p, _kind_of(p) or "") for p in readable]


@dataclass
class _Listing:
    """What a data folder holds: its data files (regular files, or links to them), the entries
    refused (with why) and whether hidden entries were passed over."""

    files: list[Path] = field(default_factory=list)
    odd: list[tuple[Path, str]] = field(default_factory=list)
    hidden: bool = False


def _walk(folder: Path, root: Path, listing: _Listing) -> None:
    """List ``folder`` into ``listing``, down its subfolders; never opens an entry that is not a
    regular file (a FIFO blocks its reader) and never follows a link to a folder (loops)."""
    try:
        with os.scandir(folder) as scan:
            entries = list(scan)
    except OSError as exc:
        listing.odd.append((folder, f"a folder that cannot be listed: {exc.strerror or exc}"))
        return
    for entry in entries:
        path = Path(entry.path)
        if _hidden(path, root):
            listing.hidden = True
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                _walk(path, root, listing)
                continue
            if entry.is_file(follow_symlinks=False):
                listing.files.append(path)
                continue
            why = _odd_entry(path)
        except OSError as exc:
            why = f"cannot be read: {exc.strerror or exc}"
        if why is None:
            listing.files.append(path)  # a link to a regular file: read as that file
        else:
            listing.odd.append((path, why))


def _odd_entry(path: Path) -> str | None:
    """Why a folder entry that is neither a folder nor a regular file is refused; None for a
    link that resolves to a regular file."""
    if not path.is_symlink():
        return _entry_kind(path.lstat())
    try:
        target = path.stat()
    except OSError as exc:
        return "a link that loops" if exc.errno == errno.ELOOP else "a broken link"
    if stat.S_ISREG(target.st_mode):
        return None
    if stat.S_ISDIR(target.st_mode):
        return "a link to a folder"
    return f"a link to {_entry_kind(target)}"


def _entry_kind(info: os.stat_result) -> str:
    mode = info.st_mode
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _suffix(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if path.name.lower().endswith(".gz") else path.suffix


# marker files that jobs (Spark, Hadoop, managed services) leave beside their data
_MARKERS = ("_SUCCESS", "_metadata", "_common_metadata")


def _hidden(path: Path, root: Path) -> bool:
    # hidden files (.crc, .DS_Store) and job markers: never data
    parts = path.relative_to(root).parts
    name = path.name
    return (
        any(p.startswith(".") for p in parts)
        or name in _MARKERS
        or name.startswith(("_committed_", "_started_"))
    )


def _split_for(folder: Path, flag: str) -> str | None:
    index = folder / "dataset_dict.json"
    if not index.is_file():
        return None
    try:
        splits = list(json.loads(index.read_text(encoding="utf-8")).get("splits", []))
    except (OSError, ValueError):
        raise UsageError(f"{flag}: {folder}: dataset_dict.json is not readable JSON") from None
    wanted = ("train",) if flag == "--train-file" else ("validation", "eval", "test", "dev")
    for name in wanted:
        if name in splits:
            return name
    if len(splits) == 1:
        return splits[0]
    raise UsageError(
        f"{flag}: {folder}: a DatasetDict with splits {', '.join(splits)}; none is "
        f"{' or '.join(wanted)}: point {flag} at the split's own folder"
    )


# --- the scan ------------------------------------------------------------------------------------
@dataclass
class ScanResult:
    """What a scan found: the problems, the number of good rows and their label values."""

    problems: list[Problem] = field(default_factory=list)
    rows: int = 0
    labels: set[str] = field(default_factory=set)
    # the good rows by the kind of their labels ("integer", "name"), in the order first seen
    kinds: Counter[str] = field(default_factory=Counter)


RawRecord = tuple[int | None, Any, str | None]  # (line or row, the record, a parse problem)


def scan_rows(
    path: str | Path,
    columns: Sequence[Column],
    *,
    flag: str,
    labels: LabelRule | None = None,
) -> ScanResult:
    """Check every row of ``path`` for ``columns``; streams the files (nothing kept but problems)."""
    return _checked_scan(resolve_sources(path, flag), columns, flag, labels or LabelRule())[0]


def _checked_scan(
    sources: Sequence[Source], columns: Sequence[Column], flag: str, labels: LabelRule
) -> tuple[ScanResult, LabelRule]:
    """The scan, and the label rule it ends with: without a fixed label set, an input whose
    labels mix integers and names is scanned again with the kind most rows have (on a tie, the
    kind seen first), so that every row of the other kind is a bad row at its line."""
    scan = _scan(sources, columns, flag, labels)
    if labels.allowed is None and labels.kind is None and len(scan.kinds) > 1:
        kind, rows = max(scan.kinds.items(), key=lambda item: item[1])  # first seen wins a tie
        labels = replace(labels, kind=kind, kind_rows=rows)
        scan = _scan(sources, columns, flag, labels)
    return scan, labels


def _scan(
    sources: Sequence[Source], columns: Sequence[Column], flag: str, labels: LabelRule
) -> ScanResult:
    result = ScanResult()
    for _ in _good_rows(sources, columns, flag, labels, result):
        pass
    return result


def _good_rows(
    sources: Sequence[Source],
    columns: Sequence[Column],
    flag: str,
    labels: LabelRule,
    result: ScanResult,
) -> Iterator[Row]:
    for source in sources:
        name = str(source.path) + (f" [split {source.split}]" if source.split else "")
        unit = "row" if source.kind in ("parquet", "arrow") else "line"
        found = 0
        try:
            for number, record, parse_problem in _records(source, columns, flag):
                if parse_problem is not None:
                    result.problems.append(Problem(flag, name, number, parse_problem, unit))
                    continue
                try:
                    row, reasons = _check(record, columns, labels)
                except RecursionError:  # a value nested just below the parser's limit
                    row, reasons = {}, [TOO_DEEP]
                if reasons:
                    result.problems.extend(Problem(flag, name, number, r, unit) for r in reasons)
                    continue
                found += 1
                result.rows += 1
                for column in columns:
                    if column.kind == "label":
                        result.labels.add(row[column.name])
                        integer = _INTEGER.match(row[column.name])
                        result.kinds["integer" if integer else "name"] += 1
                at = f" {unit} {number}" if number is not None else ""
                row[WHERE] = f"{flag}: {name}{at}"
                yield row
        except _FileProblem as exc:
            result.problems.append(Problem(flag, name, exc.line, exc.reason, unit, True))
            continue
        if found == 0 and not any(p.file == name for p in result.problems):
            result.problems.append(Problem(flag, name, None, "no rows", unit, True))


class _FileProblem(Exception):
    """A problem that ends the reading of one file (empty, a missing column in its header)."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.line = reason, line


def _check(record: Any, columns: Sequence[Column], labels: LabelRule) -> tuple[Row, list[str]]:
    if not isinstance(record, dict):
        return {}, ["not a JSON object"]
    row: Row = {}
    reasons: list[str] = []
    for column in columns:
        if column.name not in record:
            present = ", ".join(str(k) for k in record) or "none"
            reasons.append(f"no column {column.name!r} (columns: {present})")
            continue
        value = record[column.name]
        if column.kind == "label":
            if value is None or (isinstance(value, str) and not value.strip()):
                reasons.append(f"column {column.name!r} is empty")
                continue
            label, why = _label_text(value)
            if label is None:
                reasons.append(
                    f"column {column.name!r}: a label is an integer or a name, got "
                    f"{_shown_value(value)}" + (f" ({why})" if why else "")
                )
                continue
            bad = labels.check(label)
            if bad:
                reasons.append(f"label {_shown(value)} {bad}")
                continue
            row[column.name] = label
        else:
            if value is None or (isinstance(value, str) and not value.strip()):
                reasons.append(f"column {column.name!r} is empty")
            elif not isinstance(value, str):
                reasons.append(f"column {column.name!r} is not text (got {type(value).__name__})")
            else:
                row[column.name] = value
    return row, reasons


def _shown(value: Any) -> str:
    return repr(value.strip()) if isinstance(value, str) else _shown_value(value)


def _shown_value(value: Any, limit: int = 60) -> str:
    """A value for a message: a short repr, and what a list or an object is, not its text (it may
    be huge, or nested too deep to print)."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- raw records, with their lines -------------------------------------------------------------------
def _records(source: Source, columns: Sequence[Column], flag: str) -> Iterator[RawRecord]:
    if not source.path.name.lower().endswith(".gz"):
        yield from _records_of(source, columns)
        return
    try:
        yield from _records_of(source, columns)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        # the rows past the break are lost: the whole file is refused, never skipped
        raise _FileProblem(
            f"not a readable gzip file (corrupt or truncated: {_first_line(exc)})"
        ) from None


def _records_of(source: Source, columns: Sequence[Column]) -> Iterator[RawRecord]:
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


def _csv_records(path: Path, delimiter: str, columns: Sequence[Column]) -> Iterator[RawRecord]:
    if _is_blank_file(path):
        raise _FileProblem("the file is empty")
    bad_lines: set[int] = set()
    # newline="" semantics: the csv module sees the line endings as they are
    # strict: a stray or unclosed quote is an error at its line, never a field that swallows
    # the rows after it
    reader = csv.reader(_decoded_lines(path, bad_lines), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except csv.Error as exc:
        raise _FileProblem(f"not valid CSV ({exc})", 1) from None
    if 1 in bad_lines:
        raise _FileProblem(_undecodable(bad_lines, 1, 1) or "", 1)
    header = [h.strip() for h in header]
    # a column the run reads, named twice: zip() into a dict would keep the last of them, a
    # column lost without a word (others, and the empty names of trailing commas, are not read)
    wanted = {c.name for c in columns}
    twice = [h for i, h in enumerate(header) if h in wanted and h in header[:i]]
    if twice:
        times = header.count(twice[0])
        raise _FileProblem(
            f"the header names column {twice[0]!r} {'twice' if times == 2 else f'{times} times'} "
            f"(columns: {', '.join(header)})",
            1,
        )
    missing = [c.name for c in columns if c.name not in header]
    if missing:
        raise _FileProblem(
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
        raise _FileProblem("the file is empty")
    bad_lines: set[int] = set()
    lines = _decoded_lines(path, bad_lines)
    if kind == "json":
        first_text = ""
        with _open_binary(path) as handle:
            first_text = handle.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")[:1].decode("latin-1")
        if first_text == "[":
            text = "".join(lines)
            if bad_lines:
                raise _FileProblem(_undecodable(bad_lines, 1, max(bad_lines)) or "", min(bad_lines))
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
            raise _FileProblem(
                f"not JSON ({exc.msg}); the rest of the file is unread", line_at(exc.pos)
            ) from None
        except (RecursionError, ValueError) as exc:
            # too deep (or too long a number) to parse, but its end can be found: a bad row
            end = _value_end(text, start)
            if end is None:
                raise _FileProblem(
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
                raise _FileProblem(
                    "not JSON (extra data after the list)",
                    line_at(index + 1 + len(rest) - len(rest.lstrip())),
                )
            return
        else:
            raise _FileProblem("not JSON (expecting ',' or ']')", line_at(index))


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


def _parquet_records(path: Path, columns: Sequence[Column]) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for files that are not Parquet
        raise _FileProblem(f"not a Parquet file ({_first_line(exc)})") from None
    names = handle.schema_arrow.names
    wanted = {c.name for c in columns}
    twice = [n for i, n in enumerate(names) if n in wanted and n in names[:i]]
    if twice:
        raise _FileProblem(f"column {twice[0]!r} occurs twice (columns: {', '.join(names)})")
    missing = [c.name for c in columns if c.name not in names]
    if missing:
        raise _FileProblem(f"no column {missing[0]!r} (columns: {', '.join(names)})")
    if handle.metadata.num_rows == 0:
        raise _FileProblem("no rows")
    number = 0
    for batch in handle.iter_batches(columns=[c.name for c in columns], batch_size=4096):
        for record in batch.to_pylist():
            number += 1
            yield number, record, None


def _saved_records(source: Source, columns: Sequence[Column]) -> Iterator[RawRecord]:
    from datasets import load_from_disk

    try:
        loaded: Any = load_from_disk(str(source.path))
    except Exception as exc:  # datasets raises FileNotFoundError/ValueError for broken folders
        raise _FileProblem(f"not a readable save_to_disk folder ({_first_line(exc)})") from None
    if source.split is not None:
        loaded = loaded[source.split]
    names = list(loaded.column_names)
    missing = [c.name for c in columns if c.name not in names]
    if missing:
        raise _FileProblem(f"no column {missing[0]!r} (columns: {', '.join(names)})")
    number = 0
    for batch in loaded.select_columns([c.name for c in columns]).iter(batch_size=4096):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys), strict=True):
            number += 1
            yield number, dict(zip(keys, values, strict=True)), None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- the table -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataOptions:
    """How ``memfit train`` reads data: ``--skip-bad-rows`` and ``--cache-dir``; ``skipped``
    collects the problems of every row skipped while reading (for ``DIR/skipped_rows.jsonl``)."""

    skip_bad_rows: bool = False
    cache_dir: str | None = None  # None: the Hugging Face datasets cache
    skipped: list[Problem] = field(default_factory=list, compare=False)


class RowTable(Sequence[Row]):
    """Rows in an Arrow table (memory-mapped by ``datasets``); indexing gives dicts.

    ``skipped`` lists the problems of the rows ``--skip-bad-rows`` left out.
    """

    def __init__(
        self, dataset: Any, *, skipped: Sequence[Problem] = (), labels: set[str] | None = None
    ):
        self.dataset = dataset
        self.skipped = list(skipped)
        self.label_texts = set(labels or ())

    def __len__(self) -> int:
        return int(self.dataset.num_rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.rows(range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.dataset[int(index)]

    def rows(self, indices: Iterable[int]) -> list[Row]:
        """Several rows in one read of the table (much cheaper than one by one)."""
        picked = [int(i) for i in indices]
        if not picked:
            return []
        columns = self.dataset[picked]
        keys = list(columns)
        return [
            dict(zip(keys, values, strict=True))
            for values in zip(*(columns[k] for k in keys), strict=True)
        ]

    def column(self, name: str) -> list[Any]:
        return list(self.dataset[name])

    def map_rows(
        self,
        function: Callable[[dict[str, list[Any]]], dict[str, list[Any]]],
        key: str,
        *,
        cache_dir: str | None = None,
    ) -> RowTable:
        """A table with the columns ``function`` adds to each batch of rows (batched), cached as
        an Arrow file named by the table's fingerprint and ``key`` (what the function depends on:
        tokenizer, length limit)."""
        name = hashlib.sha256(f"{self.dataset._fingerprint}|{key}".encode()).hexdigest()[:24]
        folder = _cache_folder(cache_dir)
        mapped = self.dataset.map(
            function,
            batched=True,
            batch_size=1000,
            cache_file_name=str(folder / f"memfit-map-{name}.arrow"),
            new_fingerprint=name,
            desc=None,
        )
        return RowTable(mapped, skipped=self.skipped, labels=self.label_texts)


def _cache_folder(cache_dir: str | None) -> Path:
    if cache_dir:
        folder = Path(cache_dir)
    else:
        from datasets import config

        folder = Path(config.HF_DATASETS_CACHE)
    folder = folder / "memfit"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _fingerprint(sources: Sequence[Source], columns: Sequence[Column], labels: LabelRule) -> str:
    parts = [
        repr([(c.name, c.kind) for c in columns]),
        repr(sorted(labels.allowed or [])),
        repr(labels.kind),
        "v2",
    ]
    for source in sources:
        root = source.path
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            stat = f.stat()
            parts.append(f"{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{source.split}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _generate(
    fingerprint: str,
    sources: Sequence[Source],
    columns: Sequence[Column],
    flag: str,
    allowed: list[str] | None,
    source_text: str,
    kind: str | None = None,
    kind_rows: int = 0,
) -> Iterator[Row]:
    labels = LabelRule(
        frozenset(allowed) if allowed is not None else None, source_text, kind, kind_rows
    )
    yield from _good_rows(sources, columns, flag, labels, ScanResult())


def read_rows(
    path: str | Path,
    required: Sequence[str | Column],
    *,
    flag: str,
    labels: LabelRule | None = None,
    options: DataOptions | None = None,
) -> RowTable:
    """The checked rows of ``path`` (a file or folder); a :class:`DataError` listing every bad row,
    unless ``options.skip_bad_rows`` (then the table's ``skipped`` lists them)."""
    options = options or DataOptions()
    columns = [c if isinstance(c, Column) else Column(c) for c in required]
    labels = labels or LabelRule()
    sources = resolve_sources(path, flag)
    scan, labels = _checked_scan(sources, columns, flag, labels)
    whole_file = any(p.whole_file for p in scan.problems)
    if scan.problems and (whole_file or not options.skip_bad_rows):
        error = DataError(scan.problems)
        # the good rows' labels: an eval file can still be checked against them, at once
        error.labels = set(scan.labels)
        raise error
    options.skipped.extend(scan.problems)
    if scan.rows == 0:
        raise DataError(
            [
                Problem(
                    flag, str(path), None, "no rows left after skipping bad rows", whole_file=True
                )
            ]
        )
    from datasets import Dataset, Features, Value
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    fingerprint = _fingerprint(sources, columns, labels)
    features = Features({**{c.name: Value("string") for c in columns}, WHERE: Value("string")})
    folder = _cache_folder(options.cache_dir)
    dataset = Dataset.from_generator(
        _generate,
        features=features,
        cache_dir=str(folder),
        gen_kwargs={
            "fingerprint": fingerprint,
            # tuples: datasets would shard a generator over its list arguments
            "sources": tuple(sources),
            "columns": tuple(columns),
            "flag": flag,
            "allowed": sorted(labels.allowed) if labels.allowed is not None else None,
            "source_text": labels.source,
            "kind": labels.kind,
            "kind_rows": labels.kind_rows,
        },
    )
    return RowTable(dataset, skipped=scan.problems, labels=scan.labels)


def all_lengths(
    rows: Sequence[Row], measure: Callable[[Sequence[Row]], list[int] | None]
) -> list[int] | None:
    """Every row's token length: the ``LENGTH`` column of a prepared table (one read), else
    ``measure(rows)`` (a recipe's ``lengths``)."""
    if isinstance(rows, RowTable) and LENGTH in rows.dataset.column_names:
        return [int(x) for x in rows.dataset[LENGTH]]
    return measure(list(rows))


def tokenizer_key(tokenizer: Any) -> str:
    """What names a tokenizer in the cache of tokenized data: its class, special tokens and
    vocabulary (a digest: the same in every process)."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(x) for x in getattr(tokenizer, "all_special_tokens", []))
    text = json.dumps([type(tokenizer).__name__, special, vocab], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def write_skipped(path: Path, problems: Sequence[Problem]) -> None:
    """``DIR/skipped_rows.jsonl``: one line per skipped row (file, line, reason), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for problem in problems:
            handle.write(json.dumps(problem.record()) + "\n")
    os.replace(tmp, path)


__all__ = [
    "LENGTH",
    "WHERE",
    "Column",
    "DataError",
    "DataOptions",
    "LabelRule",
    "Problem",
    "Row",
    "RowTable",
    "all_lengths",
    "canonical_label",
    "label_values",
    "problem_at",
    "read_rows",
    "resolve_sources",
    "row_error",
    "scan_rows",
    "text_of",
    "tokenizer_key",
    "where",
    "write_skipped",
]
