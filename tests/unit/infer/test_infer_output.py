"""Outputs are written atomically: complete, or not at all (an old file stays as it was)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memfit.infer.output import (
    AtomicOutput,
    JsonlOutput,
    NpyOutput,
    ParquetOutput,
    Terminated,
    check_output,
)


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


# --- SIGTERM/SIGHUP: the output is whole or absent (issue 30) --------------------------------------
@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM and SIGHUP at their default (which kills the process) for the test, whatever the
    runner set."""
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_now(signum: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), signum)
    # the handler runs at the next bytecode; a process that the signal killed never gets here
    time.sleep(5)


@pytest.mark.usefixtures("default_sigterm")
@pytest.mark.parametrize(
    ("kind", "signum"),
    [
        ("jsonl", signal.SIGTERM),
        ("npy", signal.SIGTERM),
        ("parquet", signal.SIGTERM),
        ("jsonl", signal.SIGHUP),
    ],
)
def test_sigterm_while_writing_removes_the_temporary_file(
    tmp_path: Path, kind: str, signum: int
) -> None:
    path = tmp_path / f"out.{kind}"
    path.write_bytes(b"old\n")  # an earlier output: untouched
    out: AtomicOutput
    if kind == "jsonl":
        out = JsonlOutput(path)
    elif kind == "npy":
        out = NpyOutput(path, rows=4)
    else:
        out = ParquetOutput(path, id_column=None, id_kind=None)
    with pytest.raises(Terminated) as caught, out:
        if isinstance(out, JsonlOutput):
            out.write([{"row": 0}])
        elif isinstance(out, NpyOutput):
            out.write(np.ones((2, 3), dtype=np.float32))
        else:
            out.write([0, 1], None, np.ones((2, 3), dtype=np.float32))
        assert out.temporary.exists()
        _signal_now(signum)
    name = signal.Signals(signum).name
    assert caught.value.exit_code == 128 + signum
    assert str(caught.value) == (
        f"stopped by {name}: --output {path} was not written (the partial file was removed)"
    )
    assert path.read_bytes() == b"old\n"
    assert leftovers(tmp_path) == [path.name]
    # the handler was memfit's only while the output was open
    assert signal.getsignal(signum) is signal.SIG_DFL


@pytest.mark.usefixtures("default_sigterm")
def test_sigterm_during_the_rename_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal while the finished file is renamed into place: the file is whole, and the
    message says so."""
    path = tmp_path / "out.jsonl"
    rename = os.replace

    def replace(source: Any, target: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler has run by now: it only noted the signal
        rename(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with (
        pytest.raises(Terminated, match=r"after --output .* was written in full"),
        JsonlOutput(path) as out,
    ):
        out.write([{"row": 0}, {"row": 1}])
    assert path.read_text().splitlines() == ['{"row": 0}', '{"row": 1}']
    assert leftovers(tmp_path) == ["out.jsonl"]


def test_a_handler_someone_set_stays_theirs(tmp_path: Path) -> None:
    """SIG_IGN (nohup) or a handler of the caller's: memfit leaves the signal to it."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with JsonlOutput(tmp_path / "out.jsonl") as out:
            out.write([{"row": 0}])
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
    assert leftovers(tmp_path) == ["out.jsonl"]
