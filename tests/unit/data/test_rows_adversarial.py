"""``memfit.data.rows`` on adversarial input (issue 16): label values that are no labels, labels
mixing integers and names, JSON nested past the parser, corrupt gzip, a header naming a column
twice, and data folders holding links and FIFOs. The CLI side is in
``tests/e2e/test_user_errors_data.py``."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from memfit.data.labels import LabelRule, canonical_label
from memfit.data.records import TOO_DEEP, _value_end
from memfit.data.rows import (
    Column,
    DataError,
    DataOptions,
    RowTable,
    read_rows,
    scan_rows,
)
from memfit.data.sources import resolve_sources
from memfit.errors import UsageError

COLUMNS = [Column("text"), Column("label", "label")]
DEEP = "[" * 50_000 + "]" * 50_000


def _read(path: Path, tmp_path: Path, *, skip: bool = False, **labels: object) -> RowTable:
    options = DataOptions(skip_bad_rows=skip, cache_dir=str(tmp_path / "cache"))
    rule = LabelRule(**labels) if labels else None  # type: ignore[arg-type]
    return read_rows(path, COLUMNS, flag="--train-file", labels=rule, options=options)


def _problems(path: Path, **labels: object) -> list[tuple[int | None, str]]:
    rule = LabelRule(**labels) if labels else None  # type: ignore[arg-type]
    scan = scan_rows(path, COLUMNS, flag="--train-file", labels=rule)
    return [(p.line, p.reason) for p in scan.problems]


# --- labels --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        (3, "3"),
        (3.0, "3"),
        ("3.0", "3"),
        (" 3 ", "3"),
        ("+3", "3"),
        ("007", "7"),
        ("1e3", "1000"),
        (-1, "-1"),  # a label text; only a fixed label set may hold it
        ("neg", "neg"),
        (" pos ", "pos"),
        (1.5, None),
        ("1.5", None),
        (float("nan"), None),
        ("NaN", None),
        ("nan", None),
        (float("inf"), None),
        ("-Infinity", None),
        ("inf", None),
        (True, None),
        (None, None),
        ([1], None),
        ("a\nb", None),
        ("9" * 5000, None),  # more digits than Python converts
    ],
)
def test_canonical_label(value: object, canonical: str | None) -> None:
    assert canonical_label(value) == canonical


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("0", None),
        ("2147483647", None),
        ("-1", "is negative"),
        ("2147483648", "is too large for an integer label (at most 2147483647"),
        ("neg", None),
    ],
)
def test_integer_labels_without_a_fixed_set_are_class_numbers(
    value: str, reason: str | None
) -> None:
    found = LabelRule().check(value)
    assert (found is None) if reason is None else (found or "").startswith(reason)


def test_a_fixed_label_set_may_hold_any_integer() -> None:
    assert LabelRule(frozenset({"-1", "0", "1"}), "--labels").check("-1") is None


def test_the_rarer_kind_of_label_is_the_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("text,label\nw1,0\nw2,pos\nw3,neg\nw4,pos\n")
    assert _problems(path) == [
        (
            2,
            "label '0' is an integer, but the other labels are names (3 rows): labels are all "
            "integers or all names (give --labels to name every label)",
        )
    ]


def test_a_tie_of_kinds_keeps_the_kind_seen_first(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("text,label\nw1,pos\nw2,0\n")
    assert [line for line, _ in _problems(path)] == [3]


def test_a_fixed_label_set_may_mix_integers_and_names(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("text,label\nw1,0\nw2,pos\n")
    assert _problems(path, allowed=frozenset({"0", "pos"}), source="--labels") == []


def test_skipping_the_rarer_kind_trains_on_one_kind(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    records = [{"text": f"w{i}", "label": x} for i, x in enumerate([0, 1, "pos", 1, 0])]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = _read(path, tmp_path, skip=True)
    assert [r["label"] for r in rows] == ["0", "1", "1", "0"]
    assert rows.label_texts == {"0", "1"}
    assert [(p.line, p.reason.split(",")[0]) for p in rows.skipped] == [
        (3, "label 'pos' is a name")
    ]


# --- JSON nested past the parser -----------------------------------------------------------------
def test_deep_json_lines_are_bad_rows_that_can_be_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"text": "w1", "label": 0}),
        DEEP,
        '{"text": ' + DEEP + ', "label": 1}',
        '{"text": "w2", "label": ' + DEEP + "}",
        json.dumps({"text": "w3", "label": 1}),
    ]
    path.write_text("\n".join(lines) + "\n")
    assert _problems(path) == [(2, TOO_DEEP), (3, TOO_DEEP), (4, TOO_DEEP)]
    rows = _read(path, tmp_path, skip=True)
    assert [r["text"] for r in rows] == ["w1", "w3"]


def test_a_deep_item_of_a_json_list_is_a_bad_row_and_the_list_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tricky = {"text": 'w9 "]]} [[', "label": 0}  # brackets and quotes inside a string
    items = [json.dumps(tricky), DEEP, json.dumps({"text": "w2", "label": 1})]
    path.write_text("[\n" + ",\n".join(items) + "\n]\n")
    assert _problems(path) == [(3, TOO_DEEP)]
    rows = _read(path, tmp_path, skip=True)
    assert [r["text"] for r in rows] == ['w9 "]]} [[', "w2"]


def test_a_deep_unclosed_json_list_item_ends_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('[{"text": "w1", "label": 0},\n' + "[" * 50_000)
    with pytest.raises(DataError) as caught:
        _read(path, tmp_path, skip=True)
    assert [(p.line, p.whole_file) for p in caught.value.problems] == [(2, True)]
    assert caught.value.problems[0].reason.startswith(TOO_DEEP)


def test_value_end_counts_brackets_outside_strings() -> None:
    text = 'x [1, "]", {"a": "\\"]"}] tail'
    assert text[_value_end(text, 2) or 0 :] == " tail"
    assert _value_end("[[1]", 0) is None
    assert _value_end("12", 0) is None


def test_an_integer_of_too_many_digits_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "w1", "label": 0}\n{"text": "w2", "label": 1' + "0" * 5000 + "}\n")
    assert _problems(path) == [
        (2, "not JSON memfit reads (Exceeds the limit (4300 digits) for integer string conversion)")
    ]


# --- corrupt gzip --------------------------------------------------------------------------------
def test_a_truncated_gzip_is_a_problem_of_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    data = gzip.compress(("text,label\n" + "w1 w2,0\n" * 2000).encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as caught:
        _read(path, tmp_path, skip=True)  # a lost tail is no bad row: never skipped
    (problem,) = caught.value.problems
    assert problem.whole_file and problem.line is None
    assert problem.reason.startswith("not a readable gzip file (corrupt or truncated: ")


# --- a header naming a column twice ----------------------------------------------------------------
def test_a_tsv_header_naming_a_column_three_times(tmp_path: Path) -> None:
    path = tmp_path / "t.tsv"
    path.write_text("label\ttext\ttext\ttext\n0\ta\tb\tc\n")
    assert _problems(path) == [
        (1, "the header names column 'text' 3 times (columns: label, text, text, text)")
    ]


def test_trailing_commas_and_a_column_twice_that_is_not_read_are_accepted(tmp_path: Path) -> None:
    # Excel's trailing commas make empty header names; 'note' is named twice but never read
    path = tmp_path / "t.csv"
    path.write_text("text,label,note,note,,\nw1 w2,0,a,b,,\nw3 w4,1,c,d,,\n")
    assert _problems(path) == []


def test_a_parquet_file_with_a_column_twice(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    table = pa.Table.from_arrays(
        [pa.array(["a"]), pa.array(["b"]), pa.array([0])], names=["text", "text", "label"]
    )
    pq.write_table(table, path)
    assert _problems(path) == [(None, "column 'text' occurs twice (columns: text, text, label)")]


# --- data folders ------------------------------------------------------------------------------------
def test_a_link_to_a_file_is_read_and_hidden_entries_are_never_looked_at(tmp_path: Path) -> None:
    folder, other = tmp_path / "d", tmp_path / "o"
    (folder / "sub").mkdir(parents=True)
    other.mkdir()
    (folder / "a.csv").write_text("text,label\nw1,0\n")
    (folder / "sub" / "c.csv").write_text("text,label\nw2,1\n")
    (other / "b.csv").write_text("text,label\nw3,1\n")
    (folder / "b.csv").symlink_to(other / "b.csv")
    os.mkfifo(folder / ".pipe")  # hidden: passed over, never opened
    (folder / ".link").symlink_to(other)
    names = [s.path.relative_to(folder).as_posix() for s in resolve_sources(folder, "--x")]
    assert names == ["a.csv", "b.csv", "sub/c.csv"]
    rows = _read(folder, tmp_path)
    assert [r["text"] for r in rows] == ["w1", "w3", "w2"]


def test_every_odd_entry_of_a_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.csv").write_text("text,label\nw1,0\n")
    (folder / "notes.txt").write_text("x")
    (folder / "sub" / "pipe.csv").parent.mkdir(exist_ok=True)
    os.mkfifo(folder / "sub" / "pipe.csv")
    (folder / "gone.csv").symlink_to(folder / "missing.csv")
    (folder / "up").symlink_to(tmp_path)
    with pytest.raises(UsageError) as caught:
        resolve_sources(folder, "--train-file")
    assert str(caught.value).splitlines() == [
        f"--train-file: {folder}: the folder holds entries memfit does not read: gone.csv (a "
        "broken link), sub/pipe.csv (a FIFO), up (a link to a folder) (it reads regular files "
        "and links to them; move the others out)",
        f"--train-file: {folder}: the folder holds files memfit cannot read: notes.txt (it reads "
        ".csv, .tsv, .jsonl, .json, .parquet; move the others out)",
    ]


def test_a_fifo_as_the_input_itself_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p.csv")
    with pytest.raises(UsageError, match=r"p\.csv: a FIFO, not a file or folder"):
        resolve_sources(tmp_path / "p.csv", "--train-file")
