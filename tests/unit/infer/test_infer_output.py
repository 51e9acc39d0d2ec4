"""Outputs are written atomically: complete, or not at all (an old file stays as it was)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memfit.infer.output import JsonlOutput, NpyOutput, ParquetOutput, check_output


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_jsonl_is_renamed_into_place_when_complete(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with JsonlOutput(path) as out:
        out.write([{"row": 0}, {"row": 1}])
        assert not path.exists()  # nothing under the final name until the end
        out.write([{"row": 2, "label": "é"}])
    assert [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] == [
        {"row": 0},
        {"row": 1},
        {"row": 2, "label": "é"},
    ]
    assert leftovers(tmp_path) == ["out.jsonl"]


def test_a_failure_leaves_the_old_output_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="half-way"), JsonlOutput(path) as out:
        out.write([{"row": 0}])
        raise RuntimeError("stopped half-way")
    assert path.read_text() == "old\n"
    assert leftovers(tmp_path) == ["out.jsonl"]


def test_npy_is_filled_block_by_block(tmp_path: Path) -> None:
    path = tmp_path / "e.npy"
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    with NpyOutput(path, rows=4) as out:
        out.write(matrix[:3])
        out.write(matrix[3:])
    loaded = np.load(path)
    assert loaded.dtype == np.float32 and np.array_equal(loaded, matrix)
    assert leftovers(tmp_path) == ["e.npy"]


def test_npy_that_fails_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "e.npy"
    with pytest.raises(KeyboardInterrupt), NpyOutput(path, rows=4) as out:
        out.write(np.ones((2, 3), dtype=np.float32))
        raise KeyboardInterrupt
    assert leftovers(tmp_path) == []


def test_parquet_keeps_rows_ids_and_embeddings(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "e.parquet"
    with ParquetOutput(path, id_column="doc", id_kind="str") as out:
        out.write([0, 1], ["a", 7], np.array([[1, 2], [3, 4]], dtype=np.float32))
        out.write([2], ["007"], np.array([[5, 6]], dtype=np.float32))
    table = pq.read_table(path).to_pydict()
    assert table == {
        "row": [0, 1, 2],
        "doc": ["a", "7", "007"],
        "embedding": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
    }
    schema = pq.read_schema(path)
    assert str(schema.field("embedding").type) == "list<element: float>"


def test_output_names_are_checked_before_anything_runs(tmp_path: Path) -> None:
    assert check_output(tmp_path / "e.npy", (".npy", ".parquet")) == []
    assert check_output(tmp_path / "e.csv", (".npy", ".parquet")) == [
        f"--output: {tmp_path / 'e.csv'} must end in .npy or .parquet (got '.csv')"
    ]
    assert check_output(tmp_path / "no" / "o.jsonl", (".jsonl",)) == [
        f"--output: the folder {tmp_path / 'no'} does not exist"
    ]
