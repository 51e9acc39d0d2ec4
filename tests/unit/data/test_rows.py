"""``memfit.data.rows.read_rows`` on every input kind it reads: Parquet, a folder of files,
``datasets`` ``save_to_disk`` folders, gzipped JSON Lines, CSV records spanning lines, a byte-order
mark; the Arrow cache (reused while the input is unchanged, never in the input folder); and
``skip_bad_rows`` (the good rows, the bad ones listed)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from memfit.data.labels import LabelRule
from memfit.data.rows import (
    WHERE,
    Column,
    DataError,
    DataOptions,
    Problem,
    RowTable,
    read_rows,
)
from memfit.errors import UsageError

COLUMNS = [Column("text"), Column("label", "label")]


def _read(
    path: Path,
    cache: Path,
    *,
    flag: str = "--train-file",
    labels: LabelRule | None = None,
    options: DataOptions | None = None,
) -> RowTable:
    return read_rows(
        path,
        COLUMNS,
        flag=flag,
        labels=labels,
        options=options or DataOptions(cache_dir=str(cache)),
    )


def _triples(rows: RowTable) -> list[tuple[str, str, str]]:
    """(text, label, where) of every row, in order."""
    return [(r["text"], r["label"], r[WHERE]) for r in rows]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# --- input kinds ---------------------------------------------------------------------------------
def test_parquet_rows_are_numbered_and_labels_canonical(tmp_path: Path, cache: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    table = pa.table({"text": ["a b", "c", "d e f"], "label": [3, 0, 3], "extra": [1.5, 2.5, 3.5]})
    pq.write_table(table, path, row_group_size=2)  # two row groups: the numbering goes on
    rows = _read(path, cache)
    assert len(rows) == 3
    assert _triples(rows) == [
        ("a b", "3", f"--train-file: {path} row 1"),
        ("c", "0", f"--train-file: {path} row 2"),
        ("d e f", "3", f"--train-file: {path} row 3"),
    ]
    assert set(rows[0]) == {"text", "label", WHERE}  # only the columns asked for
    assert rows.label_texts == {"0", "3"}


def test_parquet_bad_rows_name_the_row(tmp_path: Path, cache: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"], "label": [0, 1, 2]}), path)
    with pytest.raises(DataError) as caught:
        _read(path, cache, labels=LabelRule(frozenset({"0", "1"}), "--labels"))
    problems = caught.value.problems
    assert [(p.file, p.unit, p.line) for p in problems] == [
        (str(path), "row", 2),
        (str(path), "row", 3),
    ]
    assert problems[0].reason == "column 'text' is empty"
    assert problems[1].reason == "label 2 is not one of the labels given by --labels (0, 1)"
    assert str(caught.value).splitlines() == [
        f"--train-file: {path} row 2: column 'text' is empty",
        f"--train-file: {path} row 3: label 2 is not one of the labels given by --labels (0, 1)",
    ]


def test_parquet_missing_column_is_a_file_problem(tmp_path: Path, cache: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"sentence": ["a"], "label": [0]}), path)
    with pytest.raises(DataError) as caught:
        _read(path, cache)
    [problem] = caught.value.problems
    assert problem.line is None and problem.whole_file
    assert problem.reason == "no column 'text' (columns: sentence, label)"


def test_a_folder_of_csv_and_jsonl_files(tmp_path: Path, cache: Path) -> None:
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    (folder / "a.csv").write_text("text,label\nx1,0\nx2,1\n")
    (folder / "b.jsonl").write_text('{"text": "y1", "label": 1}\n\n{"text": "y2", "label": "0"}\n')
    (folder / "more" / "c.tsv").write_text("label\ttext\n1\tz1\n")
    (folder / "_SUCCESS").write_text("")  # a marker, no data
    (folder / ".hidden.csv").write_text("garbage")
    rows = _read(folder, cache)
    assert _triples(rows) == [
        ("x1", "0", f"--train-file: {folder / 'a.csv'} line 2"),
        ("x2", "1", f"--train-file: {folder / 'a.csv'} line 3"),
        ("y1", "1", f"--train-file: {folder / 'b.jsonl'} line 1"),
        ("y2", "0", f"--train-file: {folder / 'b.jsonl'} line 3"),  # the blank line 2 counts
        ("z1", "1", f"--train-file: {folder / 'more' / 'c.tsv'} line 2"),
    ]


def test_a_folder_reports_the_problems_of_every_file_at_once(tmp_path: Path, cache: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.csv").write_text("text,label\nx1,0\n,1\nx3,0,extra\n")
    (folder / "b.csv").write_text("")
    (folder / "c.jsonl").write_text('{"text": "y1", "label": 1}\n{"text": "y2"\n')
    (folder / "d.csv").write_text("text,label\n")
    with pytest.raises(DataError) as caught:
        _read(folder, cache)
    got = [(Path(p.file).name, p.line, p.reason) for p in caught.value.problems]
    assert got[0] == ("a.csv", 3, "column 'text' is empty")
    assert got[1] == ("a.csv", 4, "3 fields, the header has 2")
    assert got[2] == ("b.csv", None, "the file is empty")
    assert got[3][:2] == ("c.jsonl", 2) and got[3][2].startswith("not JSON (")
    assert got[4] == ("d.csv", None, "no rows")
    assert len(got) == 5


def test_a_folder_with_an_unreadable_file_is_refused(tmp_path: Path, cache: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.csv").write_text("text,label\nx,0\n")
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(UsageError, match=r"--train-file: .*data: .*cannot read: notes\.txt"):
        _read(folder, cache)


def test_save_to_disk_dataset(tmp_path: Path, cache: Path) -> None:
    from datasets import Dataset

    folder = tmp_path / "saved"
    Dataset.from_dict({"text": ["a", "b"], "label": [1, 0], "idx": [7, 8]}).save_to_disk(
        str(folder)
    )
    rows = _read(folder, cache)
    assert _triples(rows) == [
        ("a", "1", f"--train-file: {folder} row 1"),
        ("b", "0", f"--train-file: {folder} row 2"),
    ]


def test_save_to_disk_dataset_dict_splits(tmp_path: Path, cache: Path) -> None:
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    DatasetDict(
        {
            "train": Dataset.from_dict({"text": ["t1", "t2", "t3"], "label": [0, 1, 0]}),
            "validation": Dataset.from_dict({"text": ["v1"], "label": [1]}),
        }
    ).save_to_disk(str(folder))
    train = _read(folder, cache, flag="--train-file")
    evaluation = _read(folder, cache, flag="--eval-file")
    assert [(r["text"], r["label"]) for r in train] == [("t1", "0"), ("t2", "1"), ("t3", "0")]

    # the location names the split the row came from
    assert _triples(evaluation) == [("v1", "1", f"--eval-file: {folder} [split validation] row 1")]
    assert train[0]["__where__"] == f"--train-file: {folder} [split train] row 1"


def test_save_to_disk_dataset_dict_without_an_eval_split(tmp_path: Path, cache: Path) -> None:
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    part = Dataset.from_dict({"text": ["a"], "label": [0]})
    DatasetDict({"train": part, "extra": part}).save_to_disk(str(folder))
    with pytest.raises(UsageError, match=r"--eval-file: .*splits train, extra; none is validation"):
        _read(folder, cache, flag="--eval-file")


def test_gzipped_jsonl(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.jsonl.gz"
    lines = ['{"text": "a", "label": 1}', "", '{"text": "b", "label": 0}']
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    assert _triples(_read(path, cache)) == [
        ("a", "1", f"--train-file: {path} line 1"),
        ("b", "0", f"--train-file: {path} line 3"),
    ]


def test_gzipped_jsonl_bad_line(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(b'{"text": "a", "label": 1}\n{"text": "b", \n{"text": "\xff", "label": 0}\n')
    with pytest.raises(DataError) as caught:
        _read(path, cache)
    got = [(p.line, p.reason.split(" (")[0].split(":")[0]) for p in caught.value.problems]
    assert got == [(2, "not JSON"), (3, "undecodable bytes")]


def test_csv_record_spanning_lines_is_numbered_where_it_ends(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text('text,label\n"one\ntwo\nthree",1\nfour,0\n"five\nsix",\n')
    with pytest.raises(DataError) as caught:
        _read(path, cache)
    # the bad record spans lines 6-7: reported at 7, where it ends
    assert [(p.line, p.reason) for p in caught.value.problems] == [(7, "column 'label' is empty")]
    path.write_text('text,label\n"one\ntwo\nthree",1\nfour,0\n')
    assert _triples(_read(path, cache)) == [
        ("one\ntwo\nthree", "1", f"--train-file: {path} line 4"),
        ("four", "0", f"--train-file: {path} line 5"),
    ]


def test_byte_order_mark_is_no_data(tmp_path: Path, cache: Path) -> None:
    csv_path = tmp_path / "data.csv"
    csv_path.write_bytes(b"\xef\xbb\xbftext,label\r\nx,0\r\n")
    assert _triples(_read(csv_path, cache)) == [("x", "0", f"--train-file: {csv_path} line 2")]
    jsonl_path = tmp_path / "data.jsonl"
    jsonl_path.write_bytes(b'\xef\xbb\xbf{"text": "y", "label": 1}\n')
    assert _triples(_read(jsonl_path, cache)) == [("y", "1", f"--train-file: {jsonl_path} line 1")]


def test_json_list_rows_know_their_line(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "a", "label": 0},\n\n  {"text": "b", "label": 1}\n]\n')
    assert [r[WHERE] for r in _read(path, cache)] == [
        f"--train-file: {path} line 2",
        f"--train-file: {path} line 4",
    ]


# --- the cache -----------------------------------------------------------------------------------
def test_a_second_read_reuses_the_arrow_cache(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("text,label\na,0\nb,1\n")
    first = _read(path, cache)
    [entry] = first.dataset.cache_files
    arrow = Path(entry["filename"])
    assert arrow.is_file() and cache in arrow.parents  # in the cache folder given
    written = arrow.stat().st_mtime_ns
    second = _read(path, cache)
    assert [Path(e["filename"]) for e in second.dataset.cache_files] == [arrow]
    assert arrow.stat().st_mtime_ns == written  # not generated again
    assert _triples(second) == _triples(first)


def test_a_changed_file_is_read_again(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("text,label\na,0\nb,1\n")
    first = _read(path, cache)
    path.write_text("text,label\na,0\nb,1\nc,1\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = _read(path, cache)
    assert [r["text"] for r in second] == ["a", "b", "c"]
    assert first.dataset.cache_files != second.dataset.cache_files


def test_other_label_rules_are_not_served_from_the_cache(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("text,label\na,0\nb,5\n")
    assert len(_read(path, cache)) == 2
    with pytest.raises(DataError, match=r"line 3: label '5' is not one of the labels"):
        _read(path, cache, labels=LabelRule(frozenset({"0", "1"}), "--labels"))


def test_nothing_is_written_into_the_input_folder(tmp_path: Path, cache: Path) -> None:
    from datasets import Dataset

    folder = tmp_path / "inputs"
    (folder / "files").mkdir(parents=True)
    (folder / "files" / "a.csv").write_text("text,label\na,0\n")
    (folder / "files" / "b.jsonl").write_text('{"text": "b", "label": 1}\n')
    Dataset.from_dict({"text": ["c"], "label": [0]}).save_to_disk(str(folder / "saved"))
    before = _snapshot(folder)
    # read-only (tests may run as root, whom this does not stop: the snapshot is the check)
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir():
            path.chmod(0o555)
    try:
        for target in (folder / "files", folder / "saved", folder / "files" / "a.csv"):
            assert len(_read(target, cache)) >= 1
            assert len(_read(target, cache)) >= 1  # and again, from the cache
    finally:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
    assert _snapshot(folder) == before
    assert any((cache / "memfit").rglob("*.arrow"))  # the cache went where it was told


# --- skipping bad rows ---------------------------------------------------------------------------
def test_skip_bad_rows_returns_the_good_rows_and_lists_the_bad(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_bytes(b"text,label\na,0\n,1\nb,1\nc,9\nd \xff,0\ne,0,x\nf,1\n")
    options = DataOptions(skip_bad_rows=True, cache_dir=str(cache))
    rows = _read(path, cache, labels=LabelRule(frozenset({"0", "1"}), "--labels"), options=options)
    assert [(r["text"], r["label"]) for r in rows] == [("a", "0"), ("b", "1"), ("f", "1")]
    assert [r[WHERE] for r in rows] == [f"--train-file: {path} line {n}" for n in (2, 4, 8)]
    expected = [
        Problem("--train-file", str(path), 3, "column 'text' is empty"),
        Problem(
            "--train-file",
            str(path),
            5,
            "label '9' is not one of the labels given by --labels (0, 1)",
        ),
        Problem(
            "--train-file",
            str(path),
            6,
            "undecodable bytes: not UTF-8 text (save the file as UTF-8)",
        ),
        Problem("--train-file", str(path), 7, "3 fields, the header has 2"),
    ]
    assert options.skipped == expected
    assert rows.skipped == expected
    assert json.loads(json.dumps(expected[0].record())) == {
        "file": str(path),
        "line": 3,
        "reason": "column 'text' is empty",
        "flag": "--train-file",
    }


def test_skip_bad_rows_does_not_skip_a_whole_file_problem(tmp_path: Path, cache: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.csv").write_text("text,label\na,0\n,1\n")
    (folder / "b.csv").write_text("sentence,label\nb,1\n")
    options = DataOptions(skip_bad_rows=True, cache_dir=str(cache))
    with pytest.raises(DataError) as caught:
        _read(folder, cache, options=options)
    whole = [p for p in caught.value.problems if p.whole_file]
    assert [(Path(p.file).name, p.line) for p in whole] == [("b.csv", 1)]


def test_skip_bad_rows_with_no_good_row_left_is_refused(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "", "label": 0}\n{"text": "a"}\n')
    options = DataOptions(skip_bad_rows=True, cache_dir=str(cache))
    with pytest.raises(DataError, match="no rows left after skipping bad rows"):
        _read(path, cache, options=options)
    assert [p.line for p in options.skipped] == [1, 2]


def test_an_unclosed_quote_is_a_problem_at_its_line_not_a_field_that_eats_the_file(
    tmp_path: Path, cache: Path
) -> None:
    data = tmp_path / "t.csv"
    data.write_text('text,label\nw1,0\nw2,1\nw3,"0\nw4,1\nw5,0\n')
    with pytest.raises(
        UsageError, match=r"t\.csv line 4: a quote opened on this line is never closed"
    ):
        read_rows(
            data,
            ["text", Column("label", "label")],
            flag="--train-file",
            options=DataOptions(cache_dir=str(cache)),
        )
    stray = tmp_path / "s.csv"
    stray.write_text('text,label\nw1,0\nw2,"1"x\nw3,1\n')
    with pytest.raises(UsageError, match=r"s\.csv line 3: not valid CSV") as caught:
        read_rows(
            stray,
            ["text", Column("label", "label")],
            flag="--train-file",
            options=DataOptions(cache_dir=str(cache)),
        )
    assert len(str(caught.value).splitlines()) == 1  # the rows after it are read and good


def test_underscore_names_are_data_and_only_job_markers_are_ignored(
    tmp_path: Path, cache: Path
) -> None:
    folder = tmp_path / "channel"
    folder.mkdir()
    (folder / "_part0.csv").write_text("text\na\n")
    (folder / "part1.csv").write_text("text\nb\n")
    (folder / "_SUCCESS").write_text("")
    rows = read_rows(
        folder, ["text"], flag="--train-file", options=DataOptions(cache_dir=str(cache))
    )
    assert sorted(r["text"] for r in rows) == ["a", "b"]
