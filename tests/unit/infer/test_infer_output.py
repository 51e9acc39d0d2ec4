"""Outputs are written atomically: complete, or not at all (an old file stays as it was)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from memfit.infer.output import (
    AtomicOutput,
    JsonlOutput,
    NpyOutput,
    ParquetOutput,
    Terminated,
    _predict_output,
    check_output,
)
from memfit.infer.output import destination_problems as output_destination_problems


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


# --- which existing files memfit knows as its own (issue 30 review) ------------------------------
def _written(path: Path, records: list[dict[str, Any]]) -> Path:
    with JsonlOutput(path) as out:
        out.write(records)
    return path


def _predict_records(kind: str, ids: list[Any] | None) -> list[dict[str, Any]]:
    """Three lines as memfit predict writes them (its own record code) for a model of ``kind``."""
    from memfit.infer.predict import Classifier, LanguageModel, _record

    runner: Any
    if kind == "causal-lm":
        runner, outputs = LanguageModel, [(None, 0), (3.25, 7), (0.5, 1)]
    else:
        runner = Classifier.__new__(Classifier)  # its record() needs no model
        # "regression-2": a regression head of two outputs (its record holds "scores")
        runner.kind, runner.names = kind.removesuffix("-2"), ["neg", "pos"]
        width = 1 if kind == "regression" else 2
        outputs = [np.array([0.25, 0.75][:width]), np.array([0.5, 0.5][:width]), np.ones(width)]
    data = SimpleNamespace(ids=ids, id_column="doc" if ids is not None else None)
    return [_record(data, runner, i, o) for i, o in enumerate(outputs)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kind", ["single_label", "multi_label", "regression", "regression-2", "causal-lm"]
)
@pytest.mark.parametrize("ids", [None, [7, "007", 1.5]], ids=["no-id", "id"])
def test_a_predict_output_is_known_for_a_rerun(
    tmp_path: Path, kind: str, ids: list[Any] | None
) -> None:
    path = _written(tmp_path / "p.jsonl", _predict_records(kind, ids))
    assert _predict_output(path)


@pytest.mark.parametrize(
    "lines",
    [
        # the reviewer's case: a user's file whose first record starts with "row": 0 and a label
        [{"row": 0, "label": "pos"}, {"row": 1, "label": "neg"}],
        [{"row": 0, "label": "pos", "text": "w1 w2"}],
        [{"row": 0, "text": "w1 w2", "label": "pos", "label_id": 1}],
        # memfit's keys, values of other types
        [{"row": 0, "label": "pos", "label_id": 1, "probabilities": {"neg": 0, "pos": 1}}],
        [{"row": 0, "label": "x", "label_id": 1, "probabilities": {"neg": 0.1, "pos": 0.9}}],
        [{"row": 0, "score": "0.5"}],
        [{"row": 0, "loss": None, "perplexity": 1.5, "tokens": 3}],
        [{"row": True, "score": 0.5}],
        # rows that do not count 0, 1, 2 or keys that change from line to line
        [{"row": 1, "score": 0.5}],
        [{"row": 0, "score": 0.5}, {"row": 2, "score": 0.5}],
        [{"row": 0, "score": 0.5}, {"row": 1, "id": 3, "score": 0.5}],
        # two keys before the layout
        [{"row": 0, "a": 1, "b": 2, "score": 0.5}],
    ],
)
def test_a_user_jsonl_is_not_taken_for_a_predict_output(
    tmp_path: Path, lines: list[dict[str, Any]]
) -> None:
    path = _written(tmp_path / "mine.jsonl", lines)
    assert not _predict_output(path)


def _a_data_file(tmp_path: Path) -> str:
    data = tmp_path / "x.jsonl"
    data.write_text('{"text": "w1 w2"}\n')
    return str(data)


def test_a_file_memfit_cannot_recognize_is_never_called_not_memfits(tmp_path: Path) -> None:
    """An older memfit's Parquet has no mark: memfit cannot tell it wrote it, which is what the
    line says (never "it is not a memfit embed output"); so for the other kinds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    older = tmp_path / "e.parquet"
    pq.write_table(pa.table({"row": [0], "embedding": [[1.0, 2.0]]}), older)
    theirs = _written(tmp_path / "p.jsonl", [{"row": 0, "label": "pos"}])
    log = tmp_path / "ev.jsonl"
    log.write_text('{"note": 1}\n')
    matrix = tmp_path / "e.npy"
    np.save(matrix, np.ones(2, dtype=np.float32))
    data = _a_data_file(tmp_path)

    def problems(output: Path, events: Path | None = None) -> list[str]:
        return output_destination_problems(
            output=str(output), events=events and str(events), file=data, model=None,
            overwrite=False,
        )  # fmt: skip

    tail = "; add --overwrite to replace it, or give another"
    assert problems(older) == [
        f"--output: {older} exists and memfit cannot tell whether it wrote it (nothing in it "
        f"marks it as a memfit embed output){tail} --output"
    ]
    assert problems(theirs) == [
        f"--output: {theirs} exists and memfit cannot tell whether it wrote it (nothing in it "
        f"marks it as a memfit predict output){tail} --output"
    ]
    assert problems(tmp_path / "new.jsonl", log) == [
        f"--events: {log} exists and memfit cannot tell whether it wrote it (nothing in it "
        f"marks it as a memfit predict or embed --events log){tail} --events"
    ]
    assert problems(matrix) == [
        f"--output: {matrix} exists and memfit cannot tell whether it wrote it (a .npy file "
        f"carries no mark){tail} --output"
    ]


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "--overwrite"])
def test_nothing_is_written_inside_the_model_folder(tmp_path: Path, overwrite: bool) -> None:
    """Not over a file of it, not a new file in it, and not over memfit's own output there (a
    run's model/ is replaced whole when published again): the line says so, whatever the file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ours = _written(model / "p.jsonl", _predict_records("single_label", None))
    assert _predict_output(ours)  # memfit's own: outside the model folder, a rerun replaces it
    data = _a_data_file(tmp_path)
    for output, events in [
        (ours, None),
        (model / "new.jsonl", None),
        (tmp_path / "p.jsonl", model / "config.json"),
        (tmp_path / "p.jsonl", model / "ev.jsonl"),
    ]:
        flag, path = ("--events", events) if events is not None else ("--output", output)
        assert output_destination_problems(
            output=str(output), events=events and str(events), file=data, model=model,
            overwrite=overwrite,
        ) == [
            f"{flag}: {path} is inside the model folder {model} (MODEL_DIR): memfit never "
            f"writes in what it loads; give another {flag}"
        ]  # fmt: skip


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
