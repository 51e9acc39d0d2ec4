"""`memfit train` refuses bad data before the first step (issue 5), through the real CLI.

Bad input is written to real files and handed to ``memfit train`` through the CLI's entry point
(``memfit.cli.main``): exit 2, one ``memfit: error:`` line per problem naming the file and (where
there is one) the 1-based line an editor shows, no traceback, nothing written to
``--output-dir``. Eight classes run alone (``ALONE``: exactly their line, nothing else); the other
classes are asserted one by one in two shared runs: a ``.txt`` train file with an eval folder
holding no data, and a run whose training folder and eval file hold many problems, every one of
which must be reported at once. ``--skip-bad-rows`` trains on the good rows and lists each skipped
row in ``skipped_rows.jsonl``.

The module fixture ``runs`` makes the runs the selected tests need, once, in this process: each
refusal comes before anything is loaded (the one run that trains is a tiny model's), and a
subprocess per input would pay the imports (torch, transformers, datasets: seconds of CPU each)
for a refusal that takes milliseconds. (Each verb as a program, its exit code and its one line on
a fresh interpreter, is ``test_core_install.py``'s.)
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from memfit_runs import offline_environment, train_command

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(60)]
ERROR = "memfit: error: "


def _good_csv(rows: int = 4) -> bytes:
    lines = ["text,label", *(f"w{i} w{i + 1},{i % 2}" for i in range(rows))]
    return ("\n".join(lines) + "\n").encode()


# --- the runs ------------------------------------------------------------------------------------
@dataclass
class Case:
    """One `memfit train` run: the files it gets (written under its own folder; None makes a
    folder), the flags, and the error lines it must print (regexes, {t}/{e}: the data paths)."""

    files: dict[str, bytes | None]
    train: str = "t.csv"
    eval: str | None = None
    flags: dict[str, str | None] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    folder: Path
    train: Path
    eval: Path | None

    @property
    def out(self) -> Path:
        return self.folder / "out"

    def error_lines(self) -> list[str]:
        return [x for x in self.stderr.splitlines() if x.startswith(ERROR)]


def _jsonl(*records: object) -> bytes:
    return "".join((json.dumps(r) if r is not None else "") + "\n" for r in records).encode()


# each class of bad input, alone in an otherwise good run: exactly these lines, nothing else
ALONE: dict[str, Case] = {
    "missing-file": Case(
        files={},
        train="missing.csv",
        errors=[r"--train-file: {t}: no such file or folder"],
    ),
    "empty-file": Case(
        files={"t.csv": b""},
        errors=[r"--train-file: {t}: the file is empty"],
    ),
    "missing-column": Case(
        files={"t.csv": b"sentence,label\nw1 w2,0\nw3,1\n"},
        errors=[
            r"--train-file: {t} line 1: no column 'text' in the header "
            r"\(columns: sentence, label\)"
        ],
    ),
    "jsonl-line-not-json": Case(
        # the blank line 2 counts: the broken record is on line 4 as an editor shows it
        files={
            "t.jsonl": _jsonl({"text": "w1", "label": 0}, None, {"text": "w2", "label": 1})
            + b'{"text": "w3", "label": 1\n'
            + _jsonl({"text": "w4", "label": 0})
        },
        train="t.jsonl",
        errors=[r"--train-file: {t} line 4: not JSON \(.+\)"],
    ),
    "label-outside---labels": Case(
        files={"t.csv": b"text,label\nw1,neg\nw2,pos\nw3,maybe\nw4,neg\n"},
        flags={"--labels": "neg,pos"},
        errors=[
            r"--train-file: {t} line 4: label 'maybe' is not one of the labels given by "
            r"--labels \(neg, pos\)"
        ],
    ),
    "eval-label-not-in-training": Case(
        files={"t.csv": _good_csv(), "e.csv": b"text,label\nw1,0\nw2,2\nw3,1\n"},
        eval="e.csv",
        errors=[
            r"--eval-file: {e} line 3: label '2' does not occur in the training data "
            r"\(labels: 0, 1\)"
        ],
    ),
    "undecodable-bytes": Case(
        files={"t.csv": b"text,label\nw1 w2,0\nw3 \xff\xfe w4,1\nw5,0\n"},
        errors=[r"--train-file: {t} line 3: undecodable bytes.*UTF-8.*"],
    ),
    "bad-flag-value": Case(
        files={"t.csv": _good_csv()},
        flags={"--effective-batch-size": "-4"},
        errors=[r"--effective-batch-size: must be ≥ 1, got -4"],
    ),
}

# two classes that end the reading of a whole input, one as --train-file, one as --eval-file
FORMATS = Case(
    files={"t.txt": b"text,label\nw1,0\n", "data": None, "data/_SUCCESS": b""},
    train="t.txt",
    eval="data",
)

# many problems in a training folder and an eval file: every one reported in one run
MANY_TRAIN = (
    b"text,label\n"  # 1
    b"w1 w2,0\n"  # 2 good
    b'"",1\n'  # 3 empty text
    b"w3,1,w4\n"  # 4 three fields
    b"w5 \xff,0\n"  # 5 undecodable
    b"w6,7\n"  # 6 label outside --labels
    b'"w7\nw8",1\n'  # 7-8 good (a quoted field spanning lines)
    b"w9,\n"  # 9 empty label
    b"w10,1\n"  # 10 good
)
MANY_EVAL = (
    _jsonl({"text": "w1", "label": 0}, None)  # 1 good, 2 blank
    + b'{"text": "w2", "label":\n'  # 3 not JSON
    + _jsonl(
        {"text": "w3", "label": 5},  # 4 label outside --labels
        {"txt": "w4", "label": 1},  # 5 no column 'text'
        ["w5", 1],  # 6 not a JSON object
        {"text": "w6", "label": 1},  # 7 good
    )
)
# (flag, file, where) -> the reason, or the start of it; where: "line N", "row N" or "" (a file)
MANY_EXPECTED = {
    ("--train-file", "train/h.csv", ""): "no rows",
    ("--train-file", "train/p.parquet", "row 2"): "column 'text' is empty",
    ("--train-file", "train/t.csv", "line 3"): "column 'text' is empty",
    ("--train-file", "train/t.csv", "line 4"): "3 fields, the header has 2",
    ("--train-file", "train/t.csv", "line 5"): "undecodable bytes",
    (
        "--train-file",
        "train/t.csv",
        "line 6",
    ): "label '7' is not one of the labels given by --labels",
    ("--train-file", "train/t.csv", "line 9"): "column 'label' is empty",
    ("--eval-file", "e.jsonl", "line 3"): "not JSON",
    ("--eval-file", "e.jsonl", "line 4"): "label 5 is not one of the labels given by --labels",
    ("--eval-file", "e.jsonl", "line 5"): "no column 'text'",
    ("--eval-file", "e.jsonl", "line 6"): "not a JSON object",
}

# --skip-bad-rows: 10 good training rows, 3 bad ones (lines 5, 6, 14), 1 bad eval row (line 2)
SKIP_TRAIN_LINES = [
    "text,label",
    *(f"w{i} w{i + 1},{i % 2}" for i in range(3)),  # lines 2-4
    ",1",  # 5 empty text
    "w3,1,w4",  # 6 three fields
    *(f"w{i} w{i + 1},{i % 2}" for i in range(3, 10)),  # lines 7-13
    "w9,7",  # 14 label outside --labels
]
SKIP_EVAL = _jsonl(
    {"text": "w1 w2", "label": 0}, {"text": "", "label": 1}, {"text": "w3", "label": 1}
)
SKIP_EXPECTED = [
    ("--train-file", "t.csv", 5, "column 'text' is empty"),
    ("--train-file", "t.csv", 6, "3 fields, the header has 2"),
    ("--train-file", "t.csv", 14, "label '7' is not one of the labels given by --labels"),
    ("--eval-file", "e.jsonl", 2, "column 'text' is empty"),
]
SKIP_GOOD_ROWS, SKIP_EPOCHS = 10, 2

CASES: dict[str, Case] = {
    **ALONE,
    "formats": FORMATS,
    "all-at-once": Case(
        files={
            "train": None,
            "train/t.csv": MANY_TRAIN,
            "train/h.csv": b"text,label\n",  # a header and no rows
            # train/p.parquet: written by _write_case (pyarrow)
            "e.jsonl": MANY_EVAL,
        },
        train="train",
        eval="e.jsonl",
        flags={"--labels": "0,1"},
    ),
    "skip-bad-rows": Case(
        files={
            "t.csv": ("\n".join(SKIP_TRAIN_LINES) + "\n").encode(),
            "e.jsonl": SKIP_EVAL,
        },
        eval="e.jsonl",
        flags={"--labels": "0,1", "--skip-bad-rows": None, "--epochs": str(SKIP_EPOCHS)},
    ),
}

# every class of bad input -> the run that shows it and its error lines ({t}: --train-file's
# path, {e}: --eval-file's); a class run alone prints exactly its lines, no other
CLASSES: dict[str, tuple[str, list[str]]] = {
    **{name: (name, case.errors) for name, case in ALONE.items()},
    "unknown-format": ("formats", [r"--train-file: {t}: unknown format '\.txt'.*"]),
    "folder-without-data": ("formats", [r"--eval-file: {e}: the folder holds no data files.*"]),
    "header-only-csv": ("all-at-once", [r"--train-file: {t}/h\.csv: no rows"]),
    "empty-text": ("all-at-once", [r"--train-file: {t}/t\.csv line 3: column 'text' is empty"]),
    "wrong-number-of-fields": (
        "all-at-once",
        [r"--train-file: {t}/t\.csv line 4: 3 fields, the header has 2"],
    ),
    "empty-label": ("all-at-once", [r"--train-file: {t}/t\.csv line 9: column 'label' is empty"]),
    "parquet-row": (
        "all-at-once",
        [r"--train-file: {t}/p\.parquet row 2: column 'text' is empty"],
    ),
    "jsonl-not-an-object": ("all-at-once", [r"--eval-file: {e} line 6: not a JSON object"]),
    "jsonl-missing-key": ("all-at-once", [r"--eval-file: {e} line 5: no column 'text' .*"]),
}


def _write_case(folder: Path, case: Case) -> None:
    folder.mkdir(parents=True)
    for relative, content in case.files.items():
        path = folder / relative
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    if case is CASES["all-at-once"]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"text": ["w1 w2", "", "w3"], "label": [0, 1, 1]})
        pq.write_table(table, folder / "train" / "p.parquet")


def _command(model: str, folder: Path, case: Case) -> list[str]:
    flags: dict[str, str | None] = {
        "--task": "classification",
        "--model": model,
        "--train-file": str(folder / case.train),
    }
    if case.eval is not None:
        flags["--eval-file"] = str(folder / case.eval)
    return train_command(folder, flags | case.flags)


def _needed(request: pytest.FixtureRequest) -> set[str]:
    """The runs the tests this session selected need (all of them in a plain run)."""
    needed: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "name" in callspec.params:
            needed.add(CLASSES[callspec.params["name"]][0])
        needed.update(RUNS_OF_TESTS.get(getattr(item, "originalname", ""), ()))
    return needed or set(CASES)


RUNS_OF_TESTS = {
    "test_every_problem_of_the_train_folder_and_eval_file_at_once": ("all-at-once",),
    "test_skip_bad_rows_trains_on_the_good_rows": ("skip-bad-rows",),
}


@pytest.fixture(scope="module")
def runs(
    tiny_classifier: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("bad-data")
    needed = _needed(request)
    runs: dict[str, Run] = {}
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in offline_environment(root).items():
            patch.setenv(variable, value)
        for name in (n for n in CASES if n in needed):
            case = CASES[name]
            folder = root / name
            _write_case(folder, case)
            patch.chdir(folder)
            code, out, err = _in_process(_command(tiny_classifier, folder, case)[3:])
            train = folder / case.train
            runs[name] = Run(
                code, out, err, folder, train, folder / case.eval if case.eval else None
            )
    return runs


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    """``memfit ARGV`` through the CLI's entry point in this process: (exit code, stdout, stderr);
    an exception that escapes it is written to stderr as a traceback, as Python would."""
    from memfit.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


def _assert_refused(run: Run) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "done:" not in run.stdout
    # nothing written: no model, no run folder (or an empty one)
    assert not (run.out / "model").exists()
    assert not run.out.exists() or list(run.out.iterdir()) == []


def _expanded(run: Run, patterns: list[str]) -> list[str]:
    paths = {"{t}": re.escape(str(run.train)), "{e}": re.escape(str(run.eval))}
    out = []
    for pattern in patterns:
        for key, path in paths.items():
            pattern = pattern.replace(key, path)
        out.append(re.escape(ERROR) + pattern)
    return out


# --- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CLASSES))
def test_bad_input_is_refused_with_exit_2_naming_file_and_line(
    runs: dict[str, Run], name: str
) -> None:
    run_name, patterns = CLASSES[name]
    run = runs[run_name]
    _assert_refused(run)
    lines = run.error_lines()
    for pattern in _expanded(run, patterns):
        hits = [line for line in lines if re.fullmatch(pattern, line)]
        assert len(hits) == 1, (pattern, run.stderr)
    if run_name == name:  # alone: one line per problem, and only the problems of this input
        assert len(lines) == len(patterns), run.stderr


def test_unknown_format_and_empty_folder_both_reported(runs: dict[str, Run]) -> None:
    # the --train-file problem does not hide the --eval-file one
    run = runs["formats"]
    _assert_refused(run)
    assert len(run.error_lines()) == 2, run.stderr


def test_every_problem_of_the_train_folder_and_eval_file_at_once(runs: dict[str, Run]) -> None:
    run = runs["all-at-once"]
    _assert_refused(run)
    files = {
        "--train-file": {str(run.train / n): f"train/{n}" for n in ("h.csv", "p.parquet", "t.csv")},
        "--eval-file": {str(run.eval): "e.jsonl"},
    }
    found: dict[tuple[str, str, str], str] = {}
    for line in run.error_lines():
        match = re.fullmatch(re.escape(ERROR) + r"(--train-file|--eval-file): (.+)", line)
        assert match, line
        flag, rest = match.groups()
        named = [(n, rest[len(p) :]) for p, n in files[flag].items() if rest.startswith(p)]
        assert len(named) == 1, line
        file, tail = named[0]
        at = re.fullmatch(r"(?: ((?:line|row) \d+))?: (.+)", tail)
        assert at, line
        key = (flag, file, at.group(1) or "")
        assert key not in found, f"reported twice: {line}"
        found[key] = at.group(2)
    assert sorted(found) == sorted(MANY_EXPECTED), run.stderr
    for key, reason in MANY_EXPECTED.items():
        assert found[key].startswith(reason), (key, found[key])
    assert len(run.error_lines()) == len(MANY_EXPECTED)


def test_skip_bad_rows_trains_on_the_good_rows(runs: dict[str, Run]) -> None:
    run = runs["skip-bad-rows"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert (run.out / "model" / "model.safetensors").is_file()
    assert (run.out / "model" / "config.json").is_file()
    assert f"skipped {len(SKIP_EXPECTED)} bad row(s)" in run.stdout + run.stderr
    assert run.eval is not None
    files = {str(run.train): "t.csv", str(run.eval): "e.jsonl"}

    records = [
        json.loads(x)
        for x in (run.out / "skipped_rows.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert len(records) == len(SKIP_EXPECTED)
    for record in records:
        assert {"file", "line", "reason"} <= set(record), record
    got = [(r["flag"], files[r["file"]], r["line"]) for r in records]
    assert got == [(flag, name, line) for flag, name, line, _ in SKIP_EXPECTED]
    for record, (*_, reason) in zip(records, SKIP_EXPECTED, strict=True):
        assert record["reason"].startswith(reason), record

    metrics = [
        json.loads(x) for x in (run.out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    steps = [m for m in metrics if "loss" in m]
    # every good row once per epoch, none of the bad ones: 10 rows in steps of 4, 4, 2
    assert metrics[-1]["samples_seen"] == SKIP_GOOD_ROWS * SKIP_EPOCHS
    assert steps[-1]["samples_seen"] == SKIP_GOOD_ROWS * SKIP_EPOCHS
    assert len(steps) == SKIP_EPOCHS * 3
    resolved = json.loads((run.out / "run.json").read_text(encoding="utf-8"))["resolved"]
    assert resolved["train_rows"] == SKIP_GOOD_ROWS
    assert resolved["eval_rows"] == 2
    assert resolved["skipped_rows"] == len(SKIP_EXPECTED)
