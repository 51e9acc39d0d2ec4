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

The parts: :mod:`memfit.data.sources` finds the files an input stands for,
:mod:`memfit.data.records` reads each format's raw records with their lines and
:mod:`memfit.data.labels` checks label values; this module checks the rows and keeps the table.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit.data.instructions import parse_messages
from memfit.data.labels import LabelRule, label_kind, label_text
from memfit.data.records import TOO_DEEP, FileProblem, read_records
from memfit.data.sources import Source, resolve_sources
from memfit.errors import UsageError

Row = dict[str, Any]

# the key every row carries: where it came from, ready to start an error message
WHERE = "__where__"
# the column a recipe's ``prepare`` adds: the row's length in tokens as the model sees it
LENGTH = "__length__"

# how many problems a refusal prints before it counts the rest
SHOWN_PROBLEMS = 50


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
    """Bad data: every problem found, one line each (a reason many rows of a file share: one
    line, :func:`_lines`), exit 2."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        self.labels: set[str] = set()  # the label values of the rows that were good
        lines = _lines(self.problems)
        rest = len(self.problems) - sum(count for _, count in lines[:SHOWN_PROBLEMS])
        shown = [line for line, _ in lines[:SHOWN_PROBLEMS]]
        if rest > 0:
            shown.append(
                f"… and {rest} more problems ({len(self.problems)} in all; --skip-bad-rows skips "
                "bad rows and lists each in DIR/skipped_rows.jsonl)"
            )
        super().__init__("\n".join(shown))


# a reason shared by more rows of a file than this (a column missing from the file) is one line
SAME_REASON_LINES = 3


def _lines(problems: Sequence[Problem]) -> list[tuple[str, int]]:
    """A refusal's lines, in order, each with how many problems it stands for: one a problem,
    but a reason shared by more than :data:`SAME_REASON_LINES` rows of a file is one line, where
    it first occurs, naming that row and how many more (never the same sentence for every row)."""
    groups: dict[tuple[str, str, str, str], list[Problem]] = {}
    for problem in problems:
        groups.setdefault((problem.flag, problem.file, problem.unit, problem.reason), []).append(
            problem
        )
    lines: list[tuple[str, int]] = []
    for problem in problems:
        group = groups[(problem.flag, problem.file, problem.unit, problem.reason)]
        if len(group) <= SAME_REASON_LINES or problem.line is None:
            lines.append((str(problem), 1))
        elif problem is group[0]:
            more = len(group) - 1
            line = f"{problem.flag}: {problem.file} {problem.unit} {problem.line} and {more} more"
            lines.append((f"{line} {problem.unit}s: {problem.reason}", len(group)))
    return lines


def problem_at(where_text: str, reason: str) -> Problem:
    """The Problem of a row from its ``WHERE`` (``"--train-file: data.csv line 7"``)."""
    flag, _, rest = where_text.partition(": ")
    for unit in ("line", "row"):
        head, sep, number = rest.rpartition(f" {unit} ")
        if sep and number.isdigit():
            return Problem(flag, head, int(number), reason, unit)
    return Problem(flag, rest, None, reason)


# --- columns -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A column a recipe needs: ``text`` (a non-empty string), ``label`` (integer or name) or
    ``messages`` (chat messages with an assistant turn, kept as their JSON text: see
    :func:`memfit.data.instructions.parse_messages`)."""

    name: str
    kind: str = "text"


# --- the scan ------------------------------------------------------------------------------------
@dataclass
class ScanResult:
    """What a scan found: the problems, the number of good rows and their label values."""

    problems: list[Problem] = field(default_factory=list)
    rows: int = 0
    labels: set[str] = field(default_factory=set)
    # the good rows by the kind of their labels ("integer", "name"), in the order first seen
    kinds: Counter[str] = field(default_factory=Counter)


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
    names = [c.name for c in columns]
    for source in sources:
        name, unit = source.name, source.unit
        found = 0
        try:
            for number, record, parse_problem in read_records(source, names):
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
                        result.kinds[label_kind(row[column.name])] += 1
                at = f" {unit} {number}" if number is not None else ""
                row[WHERE] = f"{flag}: {name}{at}"
                yield row
        except FileProblem as exc:
            result.problems.append(Problem(flag, name, exc.line, exc.reason, unit, True))
            continue
        if found == 0 and not any(p.file == name for p in result.problems):
            result.problems.append(Problem(flag, name, None, "no rows", unit, True))


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
            label, why = label_text(value)
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
        elif column.kind == "messages":
            messages, problem = parse_messages(value, column.name)
            if messages is None:
                reasons.append(problem or f"column {column.name!r} is not a list of messages")
            else:
                # JSON text: one Arrow type whatever keys the messages carry
                row[column.name] = json.dumps(messages, ensure_ascii=False)
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
        # start-up: datasets takes a second or more to import; only its cache folder needs it
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
    # start-up: datasets takes a second or more to import; reading and checking rows needs none
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
    "Problem",
    "Row",
    "RowTable",
    "all_lengths",
    "problem_at",
    "read_rows",
    "row_error",
    "scan_rows",
    "text_of",
    "tokenizer_key",
    "where",
    "write_skipped",
]
