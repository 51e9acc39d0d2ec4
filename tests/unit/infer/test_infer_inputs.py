"""Input rows through memfit's data reader, and the id column passed through as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.data.rows import DataError
from memfit.infer.inputs import id_type, read_ids, read_input


def jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ids_keep_their_type(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", [{"id": 7, "text": "a"}, {"id": "007", "text": "b"}])
    assert read_ids(data, "id", required=False) == [7, "007"]
    csv = tmp_path / "d.csv"
    csv.write_text('id,text\n007,"a, b"\n8,c\n')
    assert read_ids(csv, "id", required=False) == ["007", "8"]
    assert id_type([1, 2]) == "int" and id_type([1, "2"]) == "str"


def test_no_id_column_is_no_ids_unless_asked_for(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    csv = tmp_path / "d.csv"
    csv.write_text("text\na\n")
    assert read_ids(data, "id", required=False) is None
    assert read_ids(csv, "id", required=False) is None
    with pytest.raises(DataError, match=r"--file: .*d\.csv line 1: no column 'doc' in the header"):
        read_ids(csv, "doc", required=True)


def test_every_bad_id_is_reported_with_its_line(tmp_path: Path) -> None:
    data = jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": 1, "text": "a"},
            {"text": "b"},
            {"id": None, "text": "c"},
            {"id": " ", "text": "d"},
        ],
    )
    with pytest.raises(DataError) as info:
        read_ids(data, "id", required=False)
    assert [str(p).split(": ", 1)[1] for p in info.value.problems] == [
        f"{data} line 2: no column 'id' (the id column; every row needs one)",
        f"{data} line 3: column 'id': an id is a string or a number, got null",
        f"{data} line 4: column 'id' (the id) is empty",
    ]


def test_rows_and_ids_line_up_across_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    jsonl(folder / "a.jsonl", [{"id": 1, "text": "one"}, {"id": 2, "text": "two"}])
    jsonl(folder / "b.jsonl", [{"id": 3, "text": "three"}])
    data = read_input(
        folder, ("text",), id_column="id", id_required=False, cache_dir=str(tmp_path / "c")
    )
    assert len(data) == 3 and data.ids == [1, 2, 3] and data.id_column == "id"
    assert [texts for texts, _ in data.texts(0, 3)] == [("one",), ("two",), ("three",)]
    assert data.texts(2, 3)[0][1].endswith("b.jsonl line 1")


def test_text_and_id_problems_come_in_one_report(tmp_path: Path) -> None:
    data = jsonl(
        tmp_path / "d.jsonl", [{"id": 1, "text": ""}, {"text": "b"}, {"id": 3, "text": "c"}]
    )
    with pytest.raises(DataError) as info:
        read_input(data, ("text",), id_column="id", id_required=True, cache_dir=str(tmp_path / "c"))
    assert [(p.line, p.reason) for p in info.value.problems] == [
        (1, "column 'text' is empty"),
        (2, "no column 'id' (the id column; every row needs one)"),
    ]
