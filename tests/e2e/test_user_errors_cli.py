"""Paths, disks, config files and batch flags a user gets wrong (issue 16): exit 2, exactly one
``memfit: error:`` line naming the flag or file (and the line, in a config file), no traceback,
nothing left half-written, and checked before the long work (planning, loading the model).

- destinations: ``plan --write-config``, ``predict``/``embed --output``, ``train``/``predict
  --cache-dir`` that are read-only, missing, a file where a folder should be or a folder where a
  file should be; a disk that fills up while the output is written (the temporary file is gone,
  an existing output untouched);
- config files: a value of the wrong type at its line, a key given twice, bytes that are not
  UTF-8, a folder given as the file;
- ``--seed`` out of range; ``--gradient-accumulation-steps`` 0 or disagreeing with the micro-batch
  and the effective batch.

Read-only and full disks are real: small tmpfs mounts (``mount -o remount,ro``; a full one filled
by a file). Tests run as root here, where permission bits stop no write; where mounting is not
allowed (not root, no CAP_SYS_ADMIN) those cases are skipped. The cases run in this process
through ``memfit.cli.main`` (a UsageError becomes the line and ``SystemExit(2)``; any other
exception escapes, as a traceback would).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from memfit import cli
from memfit.cli import main
from tiny_models import save_bert, save_sentence_transformer

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

ERROR = "memfit: error: "
WORDS = [f"w{i}" for i in range(40)]
ROWS = 200


# --- the places -----------------------------------------------------------------------------------
@dataclass
class Places:
    """Everything a case names: models, data, a read-only and full disks, a file, a folder."""

    root: Path
    classifier: Path
    encoder: Path
    rows: Path
    train: Path
    readonly: Path | None
    full: Path | None  # no byte free
    small: Path | None  # a few pages free: smaller than an embedding matrix of ROWS rows

    def need(self, what: Path | None) -> Path:
        if what is None:
            pytest.skip("tmpfs mounts are not allowed here (needs root with CAP_SYS_ADMIN)")
        return what


def _mount(folder: Path, size: str) -> bool:
    folder.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            check=False,
        )
    except OSError:  # no mount program
        return False
    return done.returncode == 0


def _fill(folder: Path, leave: int) -> None:
    """Fill the tmpfs ``folder`` until ``leave`` bytes (rounded to pages) are free."""
    with open(folder / "filler", "wb") as handle:  # emptied first: it is counted free
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        try:
            handle.write(b"\0" * max(0, free - leave))
            handle.flush()
        except OSError as exc:  # the page rounding of the last block
            assert exc.errno == errno.ENOSPC


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Places]:
    import torch

    root = tmp_path_factory.mktemp("user-errors")
    # one layer, dropout on (the configs' default): weights drawn one model after the other
    torch.manual_seed(0)
    classifier = root / "classifier"
    classifier.mkdir()
    save_bert(classifier, WORDS, num_labels=2, seed=None, layers=1, dropout=True)
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, seed=None, layers=1, dropout=True)
    st = root / "st"
    save_sentence_transformer(st, encoder, max_seq_length=32)
    rows = root / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"id": i, "text": " ".join(WORDS[i % 30 : i % 30 + 5])}) + "\n"
                for i in range(ROWS))
    )  # fmt: skip
    train = root / "train.csv"
    train.write_text("text,label\n" + "".join(f"w{i} w{i + 1},{i % 2}\n" for i in range(8)))
    mounts = []
    readonly = full = small = None
    if _mount(root / "ro", "64k"):
        mounts.append(root / "ro")
        if subprocess.run(["mount", "-o", "remount,ro", str(root / "ro")], check=False).returncode:
            readonly = None
        else:
            readonly = root / "ro"
        # (never filled unless mounted: a plain folder would fill the real disk)
        if _mount(root / "full", "256k"):
            mounts.append(root / "full")
            full = root / "full"
            _fill(full, 0)
        if _mount(root / "small", "256k"):
            mounts.append(root / "small")
            small = root / "small"
            _fill(small, 4096)  # one page: the .npy of ROWS × 32 float32 needs 25 KiB
    try:
        yield Places(root, classifier, st, rows, train, readonly, full, small)
    finally:
        for folder in mounts:
            subprocess.run(["umount", str(folder)], check=False)


# --- running memfit ---------------------------------------------------------------------------------
def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """memfit's exit code and its stderr lines, run in this process."""
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.splitlines()


def _listing(folder: Path) -> list[str]:
    """What is in ``folder`` (hidden files too), the filler of a full disk left out."""
    return sorted(p.name for p in folder.iterdir() if p.name != "filler")


@dataclass
class Case:
    name: str
    argv: Callable[[Places], list[str]]
    line: str  # a regex the one error line matches (after "memfit: error: "); {root} is filled
    after: Callable[[Places], Path] | None = None  # a folder that must hold nothing afterwards


PLAN = ["plan", "--task", "classification", "--effective-batch-size", "8", "--seq-len", "16"]
PLAN += ["--gpu-memory", "1GiB"]


def _plan(p: Places, out: Path) -> list[str]:
    return [PLAN[0], str(p.classifier), *PLAN[1:], "--write-config", str(out)]


def _predict(p: Places, out: Path, *extra: str) -> list[str]:
    argv = ["predict", str(p.classifier), "--file", str(p.rows), "--device", "cpu"]
    return [*argv, "--output", str(out), *extra]


def _embed(p: Places, out: Path) -> list[str]:
    return ["embed", str(p.encoder), "--file", str(p.rows), "--device", "cpu", "--output", str(out)]


def _train(p: Places, *extra: str) -> list[str]:
    argv = ["train", "--task", "classification", "--model", str(p.classifier), "--device", "cpu"]
    out = p.root / "run-not-made"
    return [
        *argv,
        "--train-file",
        str(p.train),
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        *extra,
    ]


def _config_file(p: Places, name: str, tail: bytes) -> list[str]:
    head = (
        f"model: {p.classifier}\ntask: classification\nseq_len: 16\n"
        f"train_file: {p.train}\ngradient_accumulation_steps: 1\n"
    ).encode()
    path = p.root / name
    path.write_bytes(head + tail)
    out = str(p.root / "run-not-made")
    return ["train", str(path), "--output-dir", out, "--device", "cpu", "--max-steps", "1"]


CASES = [
    # plan --write-config: refused before the plan runs; a full disk leaves no half file
    Case(
        "write-config read-only folder",
        lambda p: _plan(p, p.need(p.readonly) / "run.yaml"),
        r"--write-config: {root}/ro/run\.yaml: cannot write in {root}/ro \(Read-only file system\)",
    ),
    Case(
        "write-config missing folder",
        lambda p: _plan(p, p.root / "no-such" / "run.yaml"),
        r"--write-config: the folder {root}/no-such does not exist",
    ),
    Case(
        "write-config under a file",
        lambda p: _plan(p, p.train / "run.yaml"),
        r"--write-config: {root}/train\.csv/run\.yaml: {root}/train\.csv is a file, not a folder",
    ),
    Case(
        "write-config is a folder",
        lambda p: _plan(p, p.root),
        r"--write-config: {root} is a folder; give a file name",
    ),
    # predict/embed --output
    Case(
        "predict read-only folder",
        lambda p: _predict(p, p.need(p.readonly) / "out.jsonl"),
        r"--output: {root}/ro/out\.jsonl: cannot write in {root}/ro \(Read-only file system\)",
    ),
    Case(
        "predict output is a folder",
        lambda p: _predict(p, p.root / "a-folder.jsonl"),
        r"--output: {root}/a-folder\.jsonl is a folder; give a file name",
    ),
    Case(
        "predict missing folder",
        lambda p: _predict(p, p.root / "no-such" / "out.jsonl"),
        r"--output: the folder {root}/no-such does not exist",
    ),
    Case(
        "predict under a file",
        lambda p: _predict(p, p.train / "out.jsonl"),
        r"--output: {root}/train\.csv/out\.jsonl: {root}/train\.csv is a file, not a folder",
    ),
    Case(
        "predict full disk",
        lambda p: _predict(p, p.need(p.full) / "out.jsonl"),
        r"--output: {root}/full/out\.jsonl: No space left on device; nothing was written "
        r"\(the partial file was removed\)",
        after=lambda p: p.need(p.full),
    ),
    Case(
        "predict --cache-dir is a file",
        lambda p: _predict(p, p.root / "o.jsonl", "--cache-dir", str(p.train)),
        r"--cache-dir: {root}/train\.csv is a file, not a folder",
    ),
    Case(
        "embed read-only folder",
        lambda p: _embed(p, p.need(p.readonly) / "e.npy"),
        r"--output: {root}/ro/e\.npy: cannot write in {root}/ro \(Read-only file system\)",
    ),
    Case(
        # the .npy is a memory map: without its blocks reserved, a disk too small is a SIGBUS
        "embed npy disk too small",
        lambda p: _embed(p, p.need(p.small) / "e.npy"),
        r"--output: {root}/small/e\.npy: No space left on device; nothing was written "
        r"\(the partial file was removed\)",
        after=lambda p: p.need(p.small),
    ),
    Case(
        "embed parquet full disk",
        lambda p: _embed(p, p.need(p.full) / "e.parquet"),
        r"--output: {root}/full/e\.parquet: .*No space left on device; nothing was written "
        r"\(the partial file was removed\)",
        after=lambda p: p.need(p.full),
    ),
    # train --cache-dir: before the model loads
    Case(
        "train --cache-dir is a file",
        lambda p: _train(p, "--cache-dir", str(p.train)),
        r"--cache-dir: {root}/train\.csv is a file, not a folder",
    ),
    Case(
        "train --cache-dir read-only",
        lambda p: _train(p, "--cache-dir", str(p.need(p.readonly) / "cache")),
        r"--cache-dir: {root}/ro/cache: cannot write in {root}/ro \(Read-only file system\)",
    ),
    # train's config file: types at their line, keys once, UTF-8, a file
    Case(
        "config int given 4.7",
        lambda p: _config_file(p, "float.yaml", b"micro_batch_size: 4.7\n"),
        r"{root}/float\.yaml, line 6: micro_batch_size must be a whole number \(like 8\), got 4\.7",
    ),
    Case(
        "config int given 4.0",
        lambda p: _config_file(p, "float0.yaml", b"micro_batch_size: 4.0\n"),
        r"{root}/float0\.yaml, line 6: micro_batch_size must be a whole number \(like 8\), got 4\.0",
    ),
    Case(
        "config bool given a text",
        lambda p: _config_file(
            p, "bool.yaml", b'micro_batch_size: 2\ngradient_checkpointing: "yes please"\n'
        ),
        r"{root}/bool\.yaml, line 7: gradient_checkpointing must be true or false, got 'yes please'",
    ),
    Case(
        "config bool given yes",
        lambda p: _config_file(p, "yes.yaml", b"micro_batch_size: 2\nmerge_lora: yes\n"),
        r"{root}/yes\.yaml, line 7: merge_lora must be true or false, got 'yes'",
    ),
    Case(
        "config int given a text",
        lambda p: _config_file(p, "str.yaml", b"micro_batch_size: 2\nmax_seq_len: abc\n"),
        r"{root}/str\.yaml, line 7: max_seq_len must be a whole number \(like 8\), got 'abc'",
    ),
    Case(
        "config int given a list",
        lambda p: _config_file(p, "list.yaml", b"micro_batch_size: [1, 2]\n"),
        r"{root}/list\.yaml, line 6: micro_batch_size must be a whole number \(like 8\), got \[1, 2\]",
    ),
    Case(
        "config text given a number",
        lambda p: _config_file(p, "num.yaml", b"micro_batch_size: 2\noptimizer: 7\n"),
        r"{root}/num\.yaml, line 7: optimizer must be a text \(quote it\), got 7",
    ),
    Case(
        "config key twice",
        lambda p: _config_file(p, "dup.yaml", b"micro_batch_size: 2\nmicro_batch_size: 4\n"),
        r"{root}/dup\.yaml, line 7: 'micro_batch_size' is set twice \(first at line 6\); keep one",
    ),
    Case(
        "config not UTF-8",
        lambda p: _config_file(p, "latin1.yaml", b"micro_batch_size: 2\nloss: caf\xe9\n"),
        r"{root}/latin1\.yaml, line 7: not UTF-8 text \(byte 0xe9\); save the file as UTF-8",
    ),
    Case(
        "config is a folder",
        lambda p: ["train", str(p.root), "--output-dir", str(p.root / "run-not-made")],
        r"{root}: is a folder, not a config file",
    ),
    # --seed and the batch flags
    Case(
        "seed of 30 digits",
        lambda p: _train(p, "--seed", "123456789012345678901234567890"),
        r"--seed: must be a whole number from 0 to 4294967295, got 123456789012345678901234567890",
    ),
    Case(
        "seed negative",
        lambda p: _train(p, "--seed", "-1"),
        r"--seed: must be a whole number from 0 to 4294967295, got -1",
    ),
    Case(
        "accumulation 0",
        lambda p: _train(p, "--gradient-accumulation-steps", "0"),
        r"--gradient-accumulation-steps: must be ≥ 1, got 0",
    ),
    Case(
        "micro × accumulation ≠ effective",
        lambda p: _train(
            p,
            "--micro-batch-size",
            "2",
            "--gradient-accumulation-steps",
            "2",
            "--effective-batch-size",
            "8",
        ),
        r"--micro-batch-size 2 × --gradient-accumulation-steps 2 = 4, but --effective-batch-size "
        r"is 8; make them agree, or leave one of the three out \(it follows from the other two\)",
    ),
    Case(
        "config batch keys disagree",
        lambda p: _config_file(
            p, "conflict.yaml", b"micro_batch_size: 2\neffective_batch_size: 4\n"
        ),
        r"--micro-batch-size 2 × --gradient-accumulation-steps 1 = 2, but --effective-batch-size "
        r"is 4; .*",
    ),
    Case(
        "accumulation does not divide",
        lambda p: _train(p, "--gradient-accumulation-steps", "3", "--effective-batch-size", "8"),
        r"--gradient-accumulation-steps 3 does not divide --effective-batch-size 8; .*",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_user_error(case: Case, places: Places, capsys: pytest.CaptureFixture[str]) -> None:
    (places.root / "a-folder.jsonl").mkdir(exist_ok=True)
    before = sorted(p.name for p in places.root.iterdir())
    argv = case.argv(places)
    code, lines = _run(argv, capsys)
    expected = case.line.format(root=re.escape(str(places.root)))
    assert code == 2, lines
    assert len(lines) == 1 and re.fullmatch(ERROR + expected, lines[0]), lines
    # nothing half-written: no run folder, no output, no temporary file beside it
    assert not (places.root / "run-not-made").exists()
    assert sorted(p.name for p in places.root.iterdir() if p.suffix != ".yaml") == sorted(
        x for x in before if not x.endswith(".yaml")
    )
    if case.after is not None:
        assert _listing(case.after(places)) == []


def test_a_full_disk_keeps_an_existing_output(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that cannot finish its output replaces nothing: the old file stays whole."""
    full = places.need(places.full)
    old = full / "keep.jsonl"
    # room for the old file: write it before the disk is full again
    (full / "filler").unlink()
    # an earlier memfit predict output: replaced without --overwrite, when the new one is whole
    record = '{"row": 0, "label": "1", "label_id": 1, "probabilities": {"0": 0.4, "1": 0.6}}\n'
    old.write_text(record)
    _fill(full, 0)
    code, lines = _run(_predict(places, old), capsys)
    assert code == 2 and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert old.read_text() == record
    assert _listing(full) == ["keep.jsonl"]
    old.unlink()
    _fill(full, 0)


def test_write_config_on_a_full_disk_leaves_nothing(places: Places) -> None:
    """What ``memfit plan --write-config`` does once the plan is made (the plan itself takes
    seconds, and is not what fails): a full disk is one line naming the flag, no half file."""
    from memfit.config import write_config
    from memfit.errors import UsageError

    full = places.need(places.full)
    config = {"model": "m", "task": "classification", "seq_len": 16, "micro_batch_size": 2}
    with pytest.raises(UsageError) as caught:
        write_config(full / "run.yaml", config | {"gradient_accumulation_steps": 4})
    assert str(caught.value) == (
        f"--write-config: {full}/run.yaml: No space left on device; nothing was written"
    )
    assert _listing(full) == []


def test_config_types_that_are_right_pass(places: Places) -> None:
    """Whole numbers, true/false, texts, a list of text columns and nulls (left out) load."""
    from memfit.config import load_config

    path = places.root / "good.yaml"
    path.write_text(
        f"model: {places.classifier}\ntask: classification\nseq_len: 16\nmicro_batch_size: 2\n"
        "gradient_accumulation_steps: 1\ngradient_checkpointing: false\nmerge_lora: True\n"
        "text_column: [a, b]\nsafety_margin: 0\nmax_seq_len: null\nloss: no\n"
    )
    assert load_config(path) == {
        "model": str(places.classifier),
        "task": "classification",
        "seq_len": 16,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "merge_lora": True,
        "text_column": ["a", "b"],
        "safety_margin": 0,
        "loss": "no",  # YAML 1.1's no is a text here: only true/false are switches
    }


def test_a_user_os_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last resort: an OSError of the user's disk or path that no command checked is one
    line with the file, exit 2; any other OSError is a bug and escapes (a traceback, exit 1)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/some/file")

    monkeypatch.setattr(cli.typer, "echo", refuse)
    code, lines = _run(["gpus", "--json"], capsys)
    assert (code, lines) == (2, [ERROR + "/some/file: No space left on device"])

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(cli.typer, "echo", broken)
    with pytest.raises(OSError, match="Input/output error"):
        main(["gpus", "--json"])


def test_the_program_exits_2_without_a_traceback(places: Places) -> None:
    """The real program (not main() in this process): exit 2 and the one line, before torch."""
    done = subprocess.run(
        [sys.executable, "-m", "memfit", *_plan(places, places.train / "run.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"{ERROR}--write-config: {places.train}/run.yaml: {places.train} is a file, not a folder"
    ]


def test_a_batch_flag_overrides_a_planned_config(
    places: Places, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A planned config names micro 8 × accumulation 1 = effective 8: --micro-batch-size 2 (or
    --effective-batch-size 4) on the command line re-derives the accumulation steps, as before;
    only accumulation steps given as a flag must agree with the batch."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {places.classifier}\ntask: classification\nseq_len: 16\n"
        f"train_file: {places.train}\nmicro_batch_size: 8\ngradient_accumulation_steps: 1\n"
        "effective_batch_size: 8\n"
    )
    common = ["train", str(path), "--device", "cpu", "--max-steps", "1", "--no-probe"]
    for flags, micro, effective in (
        (["--micro-batch-size", "2"], 2, 8),
        (["--effective-batch-size", "4"], 8, 4),
    ):
        out = tmp_path / f"run-{flags[0]}"
        code, lines = _run([*common, "--output-dir", str(out), *flags], capsys)
        assert code == 0, lines
        run = json.loads((out / "run.json").read_text())
        assert run["config"]["effective_batch_size"] == effective
        assert run["resolved"]["micro_batch_size"] == min(micro, effective)
    out = tmp_path / "run-conflict"
    code, lines = _run(
        [*common, "--output-dir", str(out), "--micro-batch-size", "2",
         "--gradient-accumulation-steps", "2"],
        capsys,
    )  # fmt: skip
    assert code == 2
    assert lines == [
        "memfit: error: --micro-batch-size 2 × --gradient-accumulation-steps 2 = 4, but "
        "--effective-batch-size is 8; make them agree, or leave one of the three out (it follows "
        "from the other two)"
    ]
    assert not out.exists()
