"""Outputs never go over inputs, nor over files memfit cannot tell it wrote without
``--overwrite`` (issue 30, item 3): ``predict``/``embed`` ``--output`` and ``--events``,
``plan --write-config``, ``estimate --plot``. And a ``predict`` stopped by SIGTERM leaves no temporary file, and one under a
cap below its weights says so in memfit's own line (item 14).

An output that is an input (the same path, a symbolic or hard link to it, one file of an input
folder, a new file inside a data folder) is refused with ``--overwrite`` or without: exit 2, one
line naming the flag, the input byte for byte as it was and nothing new beside it. An existing
file memfit cannot tell it wrote is refused unless ``--overwrite``; one it knows as its own (a
rerun) is replaced. The refusals come before the model loads, so most cases take a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_run import run_cli
from tiny_models import save_bert, save_sentence_transformer

WORDS = [f"w{i}" for i in range(30)]
ROWS = 6
ERROR = "memfit: error: "


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-layer BERT classifier and a sentence-transformers folder over a BERT encoder."""
    root = tmp_path_factory.mktemp("outputs-models")
    classifier = root / "classifier"
    classifier.mkdir()
    save_bert(classifier, WORDS, num_labels=2, layers=1)
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, layers=1)
    save_sentence_transformer(root / "st", encoder, max_seq_length=32)
    return {"classifier": classifier, "st": root / "st"}


def _rows() -> list[dict[str, object]]:
    return [{"id": i, "text": " ".join(WORDS[i : i + 4])} for i in range(ROWS)]


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return path


def _parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows()), path)
    return path


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, *words: str) -> str:
    """memfit ARGV exits 2 with one line naming ``flag`` and holding ``words``; that line."""
    code, _out, err = run_cli(capsys, *argv)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{ERROR}{flag}: "), lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _unchanged(folder: Path, before: dict[str, bytes]) -> None:
    """Every file of ``folder`` is as it was, and there is no other (no temporary file)."""
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _predict(models: dict[str, Path], file: Path, out: Path, *extra: str) -> list[str]:
    model = str(models["classifier"])
    return ["predict", model, "--file", str(file), "--output", str(out), "--device", "cpu", *extra]


def _embed(models: dict[str, Path], file: Path, out: Path, *extra: str) -> list[str]:
    return ["embed", str(models["st"]), "--file", str(file), "--output", str(out), "--device", "cpu", *extra]  # fmt: skip


# --- an output that is an input: never, --overwrite or not -----------------------------------------
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "--overwrite"])
def test_predict_output_is_the_input(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], overwrite: bool
) -> None:
    data = _jsonl(tmp_path / "x.jsonl")
    before = _snapshot(tmp_path)
    extra = ["--overwrite"] if overwrite else []
    _refused(capsys, _predict(models, data, data, *extra), "--output", "is the input", "--file")
    _unchanged(tmp_path, before)


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_predict_output_is_a_link_to_the_input(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], link: str
) -> None:
    data = _jsonl(tmp_path / "x.jsonl")
    out = tmp_path / "out.jsonl"
    (os.symlink if link == "symbolic" else os.link)(data, out)
    before = _snapshot(tmp_path)
    line = _refused(
        capsys, _predict(models, data, out, "--overwrite"), "--output", "is the input", str(data)
    )
    assert "the same file under another name" in line
    _unchanged(tmp_path, before)
    assert out.is_symlink() == (link == "symbolic")


def test_predict_output_is_one_file_of_an_input_folder(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With several input files, each of them is an input (the second here)."""
    folder = tmp_path / "data"
    folder.mkdir()
    _jsonl(folder / "a.jsonl")
    second = _jsonl(folder / "b.jsonl")
    before = _snapshot(folder)
    _refused(capsys, _predict(models, folder, second, "--overwrite"), "--output", "data folder")
    _unchanged(folder, before)
    # a new file there too: the next read of the folder would take it as data
    _refused(capsys, _predict(models, folder, folder / "new.jsonl"), "--output", "data folder")
    _unchanged(folder, before)


def test_predict_output_links_to_a_file_a_folder_reads(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link in the data folder reads a file outside it: that file is an input as well."""
    outside = _jsonl(tmp_path / "outside.jsonl")
    folder = tmp_path / "data"
    folder.mkdir()
    os.symlink(outside, folder / "a.jsonl")
    before = _snapshot(tmp_path)
    _refused(capsys, _predict(models, folder, outside, "--overwrite"), "--output", "is the input")
    _unchanged(tmp_path, before)


def test_embed_parquet_output_is_the_input(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _parquet(tmp_path / "x.parquet")
    before = _snapshot(tmp_path)
    _refused(capsys, _embed(models, data, data), "--output", "is the input")
    _refused(capsys, _embed(models, data, data, "--overwrite"), "--output", "is the input")
    _unchanged(tmp_path, before)


def test_events_is_never_the_input_nor_the_output(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _jsonl(tmp_path / "x.jsonl")
    out = tmp_path / "p.jsonl"
    before = _snapshot(tmp_path)
    argv = _predict(models, data, out, "--events", str(data), "--overwrite")
    _refused(capsys, argv, "--events", "is the input")
    _refused(capsys, _predict(models, data, out, "--events", str(out)), "--events", "--output")
    _unchanged(tmp_path, before)


def test_nothing_is_written_inside_the_model_folder(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not over one of its files, and not a new file there (memfit's own output neither: a
    run's model/ is replaced whole when it is published again), --overwrite or not."""
    data = _jsonl(tmp_path / "x.jsonl")
    folder = models["classifier"]
    before = _snapshot(folder)
    argv = _predict(models, data, tmp_path / "p.jsonl", "--events", str(folder / "config.json"))
    _refused(capsys, [*argv, "--overwrite"], "--events", "inside the model folder")
    for extra in ([], ["--overwrite"]):
        argv = _predict(models, data, folder / "p.jsonl", *extra)
        _refused(capsys, argv, "--output", "inside the model folder", "never writes in")
    _unchanged(folder, before)


def test_write_config_over_the_training_data(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = tmp_path / "train.csv"
    train.write_text("text,label\nw1 w2,0\nw3 w4,1\n")
    before = _snapshot(tmp_path)
    plan = ["plan", str(models["classifier"]), "--task", "classification"]
    plan += ["--effective-batch-size", "4", "--gpu-memory", "1GiB", "--train-file", str(train)]
    for extra in ([], ["--overwrite"]):
        argv = [*plan, "--write-config", str(train), *extra]
        _refused(capsys, argv, "--write-config", "is the input", "--train-file")
    _unchanged(tmp_path, before)
    config = models["classifier"] / "config.json"
    text = config.read_bytes()
    argv = [*plan, "--write-config", str(config), "--overwrite"]
    _refused(capsys, argv, "--write-config", "model folder")
    assert config.read_bytes() == text


def test_output_over_a_fifo_is_refused_and_events_write_through_a_device(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The output is renamed into place: over a FIFO (or a device) it would replace it, even with
    --overwrite. --events is opened and written through: /dev/null takes it."""
    data = _jsonl(tmp_path / "x.jsonl")
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for extra in ([], ["--overwrite"]):
        _refused(capsys, _predict(models, data, fifo, *extra), "--output", "is not a regular file")
        assert fifo.is_fifo()
    out = tmp_path / "p.jsonl"
    code, _, err = run_cli(capsys, *_predict(models, data, out, "--events", os.devnull))
    assert code == 0, err
    assert out.is_file()


# --- an existing file memfit cannot tell it wrote: only with --overwrite; its own: replaced ----
def test_predict_over_another_file_needs_overwrite_and_a_rerun_does_not(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _jsonl(tmp_path / "x.jsonl")
    out = tmp_path / "notes.jsonl"
    out.write_text('{"note": "mine"}\n')
    before = _snapshot(tmp_path)
    _refused(capsys, _predict(models, data, out), "--output", "--overwrite", "exists")
    _unchanged(tmp_path, before)
    code, _, err = run_cli(capsys, *_predict(models, data, out, "--overwrite"))
    assert code == 0, err
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in records] == list(range(ROWS))
    # memfit's own output: the same command again replaces it, no --overwrite needed
    code, _, err = run_cli(capsys, *_predict(models, data, out))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl", "x.jsonl"]


def test_embed_npy_and_parquet_over_existing_files(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    data = _jsonl(tmp_path / "x.jsonl")
    matrix = tmp_path / "e.npy"
    np.save(matrix, np.arange(6, dtype=np.float32))
    before = _snapshot(tmp_path)
    _refused(capsys, _embed(models, data, matrix), "--output", "--overwrite", "no mark")
    _unchanged(tmp_path, before)
    code, _, err = run_cli(capsys, *_embed(models, data, matrix, "--overwrite"))
    assert code == 0, err
    assert np.load(matrix).shape == (ROWS, 32)
    # memfit's own .npy too: a rerun needs --overwrite (docs/predict.md's example says so)
    before = _snapshot(tmp_path)
    _refused(capsys, _embed(models, data, matrix), "--output", "--overwrite", "cannot tell")
    _unchanged(tmp_path, before)
    table = _parquet(tmp_path / "theirs.parquet")
    before = _snapshot(tmp_path)
    _refused(capsys, _embed(models, data, table), "--output", "cannot tell", "memfit embed output")
    _unchanged(tmp_path, before)
    ours = tmp_path / "e.parquet"
    for _ in range(2):  # the second run replaces the first's file, marked as memfit's
        code, _, err = run_cli(capsys, *_embed(models, data, ours))
        assert code == 0, err


def test_events_over_another_file_needs_overwrite(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _jsonl(tmp_path / "x.jsonl")
    events = tmp_path / "log.txt"
    events.write_text("my notes\n")
    before = _snapshot(tmp_path)
    argv = _predict(models, data, tmp_path / "p.jsonl", "--events", str(events))
    _refused(capsys, argv, "--events", "--overwrite", "memfit cannot tell whether it wrote it")
    _unchanged(tmp_path, before)


def test_write_config_over_another_file_needs_overwrite(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "run.yaml"
    mine.write_text("model: mine\n")
    plan = ["plan", str(models["classifier"]), "--task", "classification", "--seq-len", "16"]
    plan += ["--effective-batch-size", "4", "--gpu-memory", "1GiB", "--json"]
    _refused(capsys, [*plan, "--write-config", str(mine)], "--write-config", "--overwrite",
             "memfit cannot tell whether it wrote it")  # fmt: skip
    assert mine.read_text() == "model: mine\n"
    code, _, err = run_cli(capsys, *plan, "--write-config", str(mine), "--overwrite")
    assert code == 0, err
    assert mine.read_text().startswith("# memfit run configuration")
    # a run config memfit wrote is replaced without --overwrite
    code, _, err = run_cli(capsys, *plan, "--write-config", str(mine))
    assert code == 0, err


def test_estimate_plot_over_another_picture_needs_overwrite(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "holiday.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n not memfit's")
    estimate = ["estimate", str(models["classifier"]), "--task", "classification"]
    estimate += ["--batch-size", "2", "--seq-len", "16", "--device", "cpu", "--json"]
    _refused(capsys, [*estimate, "--plot", str(picture)], "--plot", "--overwrite",
             "memfit cannot tell whether it wrote it")  # fmt: skip
    assert picture.read_bytes() == b"\x89PNG\r\n\x1a\n not memfit's"
    code, _, err = run_cli(capsys, *estimate, "--plot", str(picture), "--overwrite")
    assert code == 0, err
    # memfit's own picture: drawn again without --overwrite
    code, _, err = run_cli(capsys, *estimate, "--plot", str(picture))
    assert code == 0, err


# --- SIGTERM mid-run (item 14): the output is whole or absent, no temporary file -------------------
@pytest.mark.slow
def test_sigterm_mid_predict_leaves_no_temporary_file(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A real `python -m memfit predict` gets SIGTERM once its temporary output exists (rows at
    batch 1: seconds of work left): exit 143 with one line, no output and no temporary file."""
    from memfit_runs import offline_environment

    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(WORDS[i % 20 : i % 20 + 8])}) + "\n"
                            for i in range(20_000)))  # fmt: skip
    out = tmp_path / "p.jsonl"
    argv = _predict(models, data, out, "--batch-size", "1")
    process = subprocess.Popen(
        [sys.executable, "-m", "memfit", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=offline_environment(tmp_path),
    )
    temporary = tmp_path / f".p.jsonl.{process.pid}.tmp"
    deadline = time.monotonic() + 240
    while not temporary.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert temporary.exists(), process.communicate(timeout=60)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    lines = [x for x in err.splitlines() if x.startswith(ERROR)]
    assert process.returncode == 128 + signal.SIGTERM, err
    assert lines == [
        f"{ERROR}stopped by SIGTERM: --output {out} was not written (the partial file was removed)"
    ], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["many.jsonl"]


# --- a --memory-cap below the weights (item 14): memfit's one line, exit 3 --------------------------
def test_predict_under_a_cap_below_the_weights_is_one_line_exit_3(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first allocation under such a cap is the tokenizer's tensor, whose OOM transformers
    rewords as a truncation problem: the message is memfit's, about the weights."""
    data = _jsonl(tmp_path / "x.jsonl")
    out = tmp_path / "p.jsonl"
    code, _, err = run_cli(capsys, *_predict(models, data, out, "--memory-cap", "512"))
    lines = err.splitlines()
    assert code == 3, err
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{ERROR}--memory-cap: the model's weights alone hold "), lines
    assert "and the cap is 512 B: no row can run" in lines[0]
    assert "truncation" not in err and "tensor" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]
