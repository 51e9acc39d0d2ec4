"""Adversarial data and labels through the real `memfit train` CLI (issue 16).

Each case of ``CASES`` is a set of input files and flags with what must come of it: the exit code,
the one ``memfit: error:`` line (a regex; ``{t}``/``{e}``/``{m}``: the train, eval and model paths)
and what is on disk afterwards. Refused cases: exit 2, exactly that line, no traceback, nothing in
``--output-dir``. Deeply nested JSON, corrupt gzip, odd entries in a data folder (links to folders,
broken or looping links, FIFOs), a CSV header naming a column twice, label values that are no
labels (negative, NaN, infinite, huge, fractions, integers mixed with names), a fine-tuned
classifier whose head does not fit the data's labels, and MNRL with a batch of one pair.

A program pays the imports (seconds of CPU), so most cases run through ``memfit.cli.main`` in the
test's process: the same path from argv to the error lines and the exit code. Four run as
programs, in the background while the others run: the two that train (``--skip-bad-rows`` over
every class of bad row, whose ``skipped_rows.jsonl`` must list each; a fine-tuned head replaced)
and the two FIFOs (a wrong fix would block on them: a program has a timeout). The head kept or
replaced is also checked on the recipe itself, without training.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import os
import re
import subprocess
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from memfit_runs import offline_environment, train_command

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

ERROR = "memfit: error: "
DEEP = 100_000


@dataclass(frozen=True)
class Link:
    """A symbolic link to ``target`` (relative to the link's folder, as ``ln -s`` takes it)."""

    target: str


@dataclass(frozen=True)
class Fifo:
    """A named pipe: opening it would block until a writer comes."""


Content = bytes | None | Link | Fifo  # None: a folder


def _csv(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _jsonl(*records: object) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


GOOD = [f"w{i} w{i + 1},{i % 2}" for i in range(4)]  # four good CSV rows, labels 0 and 1
GOOD_JSON = [{"text": f"w{i} w{i + 1}", "label": i % 2} for i in range(4)]
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
DEEP_VALUE = '{"text": ' + DEEP_ARRAY + ', "label": 0}'


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _corrupt_gz() -> bytes:
    # a real gzip stream with bytes in the middle of the deflate data overwritten
    data = bytearray(_gz(_csv("text,label", *(f"w{i % 50} w{i % 7},{i % 2}" for i in range(400)))))
    data[40:60] = b"\xff" * 20
    return bytes(data)


def _truncated_gz() -> bytes:
    data = _gz(_jsonl(*(GOOD_JSON * 50)))
    return data[: len(data) // 2]


@dataclass
class Case:
    """One `memfit train` run: the files it gets, the flags, what it must end in."""

    files: dict[str, Content]
    train: str = "t.csv"
    eval: str | None = None
    flags: dict[str, str | None] = field(default_factory=dict)
    task: str = "classification"
    model: str = "base"  # "base": a BertModel folder; "head": a fine-tuned neg/pos classifier
    returncode: int = 2
    errors: list[str] = field(default_factory=list)  # exactly these error lines
    notes: list[str] = field(default_factory=list)  # other stderr lines that must be there
    # run as a program (else through memfit.cli.main in the test's process): the cases that
    # train, and those a wrong fix would block for ever (FIFOs)
    process: bool = False


CASES: dict[str, Case] = {
    # --- 1. deeply nested JSON: a bad row at its line -------------------------------------------
    "deep-jsonl-array": Case(
        files={"t.jsonl": _jsonl(GOOD_JSON[0], DEEP_ARRAY, *GOOD_JSON[1:])},
        train="t.jsonl",
        errors=[r"--train-file: {t} line 2: nested too deeply to read as JSON"],
    ),
    "deep-jsonl-in-a-value": Case(
        files={"t.jsonl": _jsonl(*GOOD_JSON[:2], DEEP_VALUE, *GOOD_JSON[2:])},
        train="t.jsonl",
        errors=[r"--train-file: {t} line 3: nested too deeply to read as JSON"],
    ),
    "deep-json-list-item": Case(
        files={
            "t.json": (
                "[\n"
                + ",\n".join([json.dumps(GOOD_JSON[0]), DEEP_VALUE, *map(json.dumps, GOOD_JSON)])
                + "\n]\n"
            ).encode()
        },
        train="t.json",
        errors=[r"--train-file: {t} line 3: nested too deeply to read as JSON"],
    ),
    # --- 2. corrupt or truncated compressed files: the file, exit 2 --------------------------------
    "gz-corrupt": Case(
        files={"t.csv.gz": _corrupt_gz()},
        train="t.csv.gz",
        errors=[r"--train-file: {t}: not a readable gzip file \(corrupt or truncated: .+\)"],
    ),
    "gz-truncated": Case(
        files={"t.jsonl.gz": _truncated_gz()},
        train="t.jsonl.gz",
        errors=[r"--train-file: {t}: not a readable gzip file \(corrupt or truncated: .+\)"],
    ),
    "gz-truncated-with-skip-bad-rows": Case(
        # a lost tail is no bad row: never skipped
        files={"t.jsonl.gz": _truncated_gz()},
        train="t.jsonl.gz",
        flags={"--skip-bad-rows": None},
        errors=[r"--train-file: {t}: not a readable gzip file \(corrupt or truncated: .+\)"],
    ),
    "gz-not-gzip": Case(
        files={"t.csv.gz": _csv("text,label", *GOOD)},
        train="t.csv.gz",
        errors=[r"--train-file: {t}: not a readable gzip file \(corrupt or truncated: .+\)"],
    ),
    "bz2-is-no-format": Case(
        files={"t.csv.bz2": bz2.compress(_csv("text,label", *GOOD))},
        train="t.csv.bz2",
        errors=[r"--train-file: {t}: unknown format '\.bz2'; use .+"],
    ),
    # --- 3. folder inputs: entries that are not regular files, refused by name --------------------
    "folder-link-to-a-folder": Case(
        files={
            "d": None,
            "d/a.csv": _csv("text,label", *GOOD),
            "o/b.csv": _csv("text,label", *GOOD),
            "d/sub": Link("../o"),
        },
        train="d",
        errors=[
            r"--train-file: {t}: the folder holds entries memfit does not read: "
            r"sub \(a link to a folder\) \(.+\)"
        ],
    ),
    "folder-broken-link": Case(
        files={"d/a.csv": _csv("text,label", *GOOD), "d/gone.csv": Link("missing.csv")},
        train="d",
        errors=[
            r"--train-file: {t}: the folder holds entries memfit does not read: "
            r"gone\.csv \(a broken link\) \(.+\)"
        ],
    ),
    "folder-link-loop": Case(
        files={"d/a.csv": _csv("text,label", *GOOD), "d/loop.csv": Link("loop.csv")},
        train="d",
        errors=[
            r"--train-file: {t}: the folder holds entries memfit does not read: "
            r"loop\.csv \(a link that loops\) \(.+\)"
        ],
    ),
    "folder-fifo": Case(
        process=True,
        files={"d/a.csv": _csv("text,label", *GOOD), "d/pipe.csv": Fifo()},
        train="d",
        errors=[
            r"--train-file: {t}: the folder holds entries memfit does not read: "
            r"pipe\.csv \(a FIFO\) \(.+\)"
        ],
    ),
    "folder-link-to-a-file-is-read": Case(
        # followed: its bad row is reported at its line under the link's name
        files={
            "d/a.csv": _csv("text,label", *GOOD),
            "o/b.csv": _csv("text,label", GOOD[0], ",1"),
            "d/b.csv": Link("../o/b.csv"),
        },
        train="d",
        errors=[r"--train-file: {t}/b\.csv line 3: column 'text' is empty"],
    ),
    "train-file-is-a-fifo": Case(
        process=True,
        files={"pipe.csv": Fifo()},
        train="pipe.csv",
        errors=[r"--train-file: {t}: a FIFO, not a file or folder \(.+\)"],
    ),
    # --- 4. a CSV header naming a column twice ------------------------------------------------------
    "csv-duplicate-header": Case(
        files={"t.csv": _csv("text,text,label", *(f"w{i},w{i + 1},{i % 2}" for i in range(4)))},
        errors=[
            r"--train-file: {t} line 1: the header names column 'text' twice "
            r"\(columns: text, text, label\)"
        ],
    ),
    # --- 5. labels that are no labels -----------------------------------------------------------
    "label-negative": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,-1")},
        errors=[
            r"--train-file: {t} line 6: label '-1' is negative: integer labels count from 0 "
            r"\(name every label with --labels to use it\)"
        ],
    ),
    "label-nan-csv": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,NaN", "w8,nan")},
        errors=[
            r"--train-file: {t} line 6: column 'label': a label is an integer or a name, got "
            r"'NaN' \(not a number\)",
            r"--train-file: {t} line 7: column 'label': a label is an integer or a name, got "
            r"'nan' \(not a number\)",
        ],
    ),
    "label-nan-inf-json": Case(
        files={
            "t.jsonl": _jsonl(
                *GOOD_JSON, '{"text": "w9", "label": NaN}', '{"text": "w9", "label": Infinity}'
            )
        },
        train="t.jsonl",
        errors=[
            r"--train-file: {t} line 5: column 'label': a label is an integer or a name, got "
            r"nan \(not a number\)",
            r"--train-file: {t} line 6: column 'label': a label is an integer or a name, got "
            r"inf \(infinite\)",
        ],
    ),
    "label-inf-csv": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,inf")},
        errors=[
            r"--train-file: {t} line 6: column 'label': a label is an integer or a name, got "
            r"'inf' \(infinite\)"
        ],
    ),
    "label-huge": Case(
        files={
            "t.jsonl": _jsonl(
                *GOOD_JSON,
                {"text": "w9", "label": 1e30},
                '{"text": "w9", "label": 99999999999999999999}',
            )
        },
        train="t.jsonl",
        errors=[
            r"--train-file: {t} line 5: label 1e\+30 is too large for an integer label "
            r"\(at most 2147483647; name every label with --labels to use it\)",
            r"--train-file: {t} line 6: label 99999999999999999999 is too large for an integer "
            r"label \(at most 2147483647; name every label with --labels to use it\)",
        ],
    ),
    "label-fraction": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,1.5")},
        errors=[
            r"--train-file: {t} line 6: column 'label': a label is an integer or a name, got "
            r"'1\.5' \(a fraction\)"
        ],
    ),
    "label-mixed-integers-and-names": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,pos")},
        errors=[
            r"--train-file: {t} line 6: label 'pos' is a name, but the other labels are "
            r"integers \(4 rows\): labels are all integers or all names "
            r"\(give --labels to name every label\)"
        ],
    ),
    "label-over---num-labels": Case(
        files={"t.csv": _csv("text,label", *GOOD, "w9,2", "w8,-1")},
        flags={"--num-labels": "2"},
        errors=[
            r"--train-file: {t} line 6: label '2' is not one of the labels given by "
            r"--num-labels 2 \(0, 1\)",
            r"--train-file: {t} line 7: label '-1' is not one of the labels given by "
            r"--num-labels 2 \(0, 1\)",
        ],
    ),
    # --- one label: a one-class classifier learns nothing (its loss is 0), issue 30 ---------------
    "one-label-in-the-data": Case(
        files={
            "t.csv": _csv("text,label", *(f"w{i} w{i + 1},pos" for i in range(4))),
            # the eval file's labels: no bad rows for want of the training data's other label
            "e.csv": _csv("text,label", "w1,neg", "w2,pos"),
        },
        eval="e.csv",
        errors=[
            r"--train-file: {t}: every row has the label 'pos' \(4 rows\); a classifier needs "
            r"rows of at least two labels"
        ],
    ),
    "one-integer-label-left-after-skipping": Case(
        files={"t.csv": _csv("text,label", "w1,3", "w2,3", "w3,1.5")},
        flags={"--skip-bad-rows": None},
        errors=[
            r"--train-file: {t}: every row has the label 3 \(2 rows, after 1 bad rows skipped\); "
            r"a classifier needs rows of at least two labels"
        ],
    ),
    "one-label-in-the-data-beside---labels": Case(
        files={"t.csv": _csv("text,label", *(f"w{i} w{i + 1},pos" for i in range(4)))},
        flags={"--labels": "neg,pos"},
        errors=[
            r"--train-file: {t}: every row has the label 'pos' \(4 rows\); a classifier needs "
            r"rows of at least two labels"
        ],
    ),
    "one-label-by---labels": Case(
        files={"t.csv": _csv("text,label", *(f"w{i} w{i + 1},pos" for i in range(4)))},
        flags={"--labels": "pos"},
        errors=[
            r"--labels: names one label \(pos\); a classifier needs at least two \(--labels neg,pos\)"
        ],
    ),
    "one-label-by---num-labels": Case(
        files={"t.csv": _csv("text,label", *GOOD)},
        flags={"--num-labels": "1"},
        errors=[r"--num-labels: a classifier needs at least two labels, got 1"],
    ),
    "eval-label-not-in-train": Case(
        files={
            "t.csv": _csv("text,label", *GOOD),
            "e.csv": _csv("text,label", "w1,0", "w2,7"),
        },
        eval="e.csv",
        errors=[
            r"--eval-file: {e} line 3: label '7' does not occur in the training data "
            r"\(labels: 0, 1\)"
        ],
    ),
    # --- 7. MNRL with one pair per step: no in-batch negatives ------------------------------------
    "mnrl-effective-batch-1": Case(
        files={
            "p.jsonl": _jsonl(*({"anchor": f"w{i}", "positive": f"w{i + 1}"} for i in range(4)))
        },
        train="p.jsonl",
        task="sentence-embedding",
        flags={"--effective-batch-size": "1", "--micro-batch-size": "1"},
        errors=[
            r"--effective-batch-size: 1 pair per step leaves --loss mnrl no in-batch "
            r"negatives \(its loss is 0\); use 2 or more"
        ],
    ),
    "mnrl-one-pair": Case(
        files={"p.jsonl": _jsonl({"anchor": "w1", "positive": "w2"})},
        train="p.jsonl",
        task="sentence-embedding",
        errors=[
            r"--train-file: {t}: 1 pair: --loss mnrl needs 2 or more \(the other pairs of "
            r"a step are its negatives\)"
        ],
    ),
    # --- runs that train ---------------------------------------------------------------------------
    "skip-bad-rows": Case(
        process=True,
        files={
            "t.jsonl": _jsonl(
                *GOOD_JSON,  # 1-4
                DEEP_ARRAY,  # 5
                DEEP_VALUE,  # 6
                {"text": "w9", "label": -1},  # 7
                '{"text": "w9", "label": NaN}',  # 8
                {"text": "w9", "label": 1.5},  # 9
                {"text": "w9", "label": 1e30},  # 10
                {"text": "w9", "label": "pos"},  # 11: a name among integers
                *GOOD_JSON,  # 12-15
            )
        },
        train="t.jsonl",
        flags={"--skip-bad-rows": None},
        returncode=0,
        notes=[r"memfit: skipped 7 bad row\(s\); each is listed in .+"],
    ),
    # --- 6. a fine-tuned classifier whose head does not fit the data --------------------------
    "head-of-another-size": Case(
        process=True,
        files={
            "t.csv": _csv(
                "text,label", *(f"w{i},{n}" for i, n in enumerate(["neg", "neutral", "pos"] * 2))
            )
        },
        model="head",
        returncode=0,
        notes=[
            r"memfit: the classifier head of {m} has 2 labels \(neg, pos\); the data has 3 "
            r"\(neg, neutral, pos\): a new 3-label head is trained \(the body's weights are "
            r"kept\)"
        ],
    ),
}

# what the skip-bad-rows run must list in skipped_rows.jsonl: (line, start of the reason)
SKIP: list[tuple[int, str]] = [
    (5, "nested too deeply to read as JSON"),
    (6, "nested too deeply to read as JSON"),
    (7, "label -1 is negative"),
    (8, "column 'label': a label is an integer or a name, got nan"),
    (9, "column 'label': a label is an integer or a name, got 1.5"),
    (10, "label 1e+30 is too large for an integer label"),
    (11, "label 'pos' is a name, but the other labels are integers"),
]
SKIP_GOOD_ROWS = 8


# --- the runs ------------------------------------------------------------------------------------
@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    folder: Path
    case: Case
    model: str

    @property
    def out(self) -> Path:
        return self.folder / "out"

    def error_lines(self) -> list[str]:
        return [x for x in self.stderr.splitlines() if x.startswith(ERROR)]

    def pattern(self, text: str) -> str:
        paths = {
            "{t}": self.folder / self.case.train,
            "{e}": self.folder / (self.case.eval or ""),
            "{m}": Path(self.model),
        }
        for key, path in paths.items():
            text = text.replace(key, re.escape(str(path)))
        return text


def write_case(folder: Path, case: Case) -> None:
    folder.mkdir(parents=True)
    for relative, content in case.files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir(exist_ok=True)
        elif isinstance(content, Link):
            path.symlink_to(content.target)
        elif isinstance(content, Fifo):
            os.mkfifo(path)
        else:
            path.write_bytes(content)


def command(case: Case, folder: Path, model: str) -> list[str]:
    flags: dict[str, str | None] = {
        "--task": case.task,
        "--model": model,
        "--train-file": str(folder / case.train),
        "--no-probe": None,
    }
    if case.eval is not None:
        flags["--eval-file"] = str(folder / case.eval)
    return train_command(folder, flags | case.flags)


def build_head_model(base: str, folder: Path) -> str:
    """``base``'s BERT with a trained-looking neg/pos head (BertForSequenceClassification)."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_pretrained(base)
    config.num_labels = 2
    config.id2label = {0: "neg", 1: "pos"}
    config.label2id = {"neg": 0, "pos": 1}
    torch.manual_seed(1)
    model = BertForSequenceClassification.from_pretrained(base, config=config)
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 1.0)
        model.classifier.bias.fill_(0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in Path(base).iterdir():
        if name.name not in ("config.json", "model.safetensors"):
            shutil.copy(name, folder / name.name)
    return str(folder)


def run_in_process(case: Case, folder: Path, model: str) -> Run:
    """``memfit train`` through ``memfit.cli.main`` in this process: the same path as the program
    (errors become lines on stderr and an exit code), without paying the imports again."""
    from memfit.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(command(case, folder, model)[3:])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:  # what the program would print as a traceback (exit 1)
            stderr.write(traceback.format_exc())
            code = 1
    return Run(code, stdout.getvalue(), stderr.getvalue(), folder, case, model)


def run_cases(
    names: list[str], root: Path, models: dict[str, str], workers: int = 3
) -> dict[str, Run]:
    """Every case of ``names``: the ``process`` ones as programs, a few at a time in the
    background, the others meanwhile in this process."""
    env = offline_environment(root)
    for name in names:
        write_case(root / name, CASES[name])

    def one(name: str) -> Run:
        case, folder = CASES[name], root / name
        model = models[case.model]
        done = subprocess.run(
            command(case, folder, model),
            env=env,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=300,  # a FIFO opened by mistake blocks: the run fails, the session goes on
        )
        return Run(done.returncode, done.stdout, done.stderr, folder, case, model)

    # the runs that train are the longest: they start first
    programs = sorted(
        (n for n in names if CASES[n].process), key=lambda n: CASES[n].returncode == 2
    )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        started = pool.map(one, programs)
        done = {
            n: run_in_process(CASES[n], root / n, models[CASES[n].model])
            for n in names
            if not CASES[n].process
        }
        done.update(zip(programs, started, strict=True))
    return done


@pytest.fixture(scope="module")
def runs(
    tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("user-errors-data")
    needed: set[str] = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None:
            needed.add(callspec.params.get("name", ""))
    names = [n for n in CASES if n in needed] or list(CASES)
    models = {"base": tiny_classifier}
    if any(CASES[n].model == "head" for n in names):
        models["head"] = build_head_model(tiny_classifier, root / "head-model")
    return run_cases(names, root, models, workers=min(3, os.cpu_count() or 1))


# --- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [n for n in CASES if CASES[n].returncode == 2],
)
def test_refused_with_exit_2_and_exactly_its_lines(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    # nothing written: no model, no run folder (or an empty one)
    assert not run.out.exists() or list(run.out.iterdir()) == [], list(run.out.iterdir())
    lines = run.error_lines()
    patterns = [re.escape(ERROR) + run.pattern(p) for p in run.case.errors]
    for pattern in patterns:
        assert len([x for x in lines if re.fullmatch(pattern, x)]) == 1, (pattern, run.stderr)
    assert len(lines) == len(patterns), run.stderr


@pytest.mark.parametrize("name", ["skip-bad-rows"])
def test_skip_bad_rows_skips_and_lists_every_bad_row(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    for note in run.case.notes:
        assert any(re.fullmatch(run.pattern(note), x) for x in run.stderr.splitlines()), note
    records = [
        json.loads(x)
        for x in (run.out / "skipped_rows.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    train = str(run.folder / run.case.train)
    assert [(r["flag"], r["file"], r["line"]) for r in records] == [
        ("--train-file", train, line) for line, _ in SKIP
    ]
    for record, (_, reason) in zip(records, SKIP, strict=True):
        assert record["reason"].startswith(reason), record
    resolved = json.loads((run.out / "run.json").read_text(encoding="utf-8"))["resolved"]
    assert resolved["train_rows"] == SKIP_GOOD_ROWS
    assert resolved["skipped_rows"] == len(SKIP)
    config = json.loads((run.out / "model" / "config.json").read_text(encoding="utf-8"))
    assert config["id2label"] == {"0": "0", "1": "1"}


@pytest.mark.parametrize("name", ["head-of-another-size"])
def test_a_head_of_another_size_is_replaced_and_said(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    for note in run.case.notes:
        assert len([x for x in lines if re.fullmatch(run.pattern(note), x)]) == 1, run.stderr
    config = json.loads((run.out / "model" / "config.json").read_text(encoding="utf-8"))
    assert config["id2label"] == {"0": "neg", "1": "neutral", "2": "pos"}
    from safetensors.torch import load_file

    weights = load_file(str(run.out / "model" / "model.safetensors"))
    assert tuple(weights["classifier.weight"].shape) == (3, 32)


# --- 6. the head of a fine-tuned classifier, in this process (no training needed) ---------------
@pytest.fixture(scope="module")
def head_model(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_head_model(tiny_classifier, tmp_path_factory.mktemp("head") / "model")


def _built(model: str, folder: Path, values: list[str], **options: Any) -> Any:
    from memfit.data.rows import DataOptions
    from memfit.train.recipes.classification import ClassificationRecipe

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "t.csv"
    data.write_text("text,label\n" + "".join(f"w{i},{x}\n" for i, x in enumerate(values)))
    recipe = ClassificationRecipe(model, **options)
    recipe.data_options = DataOptions(cache_dir=str(folder / "cache"))
    recipe.read(data)
    recipe.build([])
    return recipe


def _head_weights(model: str) -> Any:
    from safetensors.torch import load_file

    return load_file(str(Path(model) / "model.safetensors"))["classifier.weight"]


def test_a_head_with_the_data_s_label_names_is_kept_with_its_ids(
    head_model: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    # --labels in the other order: the names take the head's ids (neg 0, pos 1)
    recipe = _built(head_model, tmp_path, ["pos", "neg", "pos"], labels=["pos", "neg"])
    assert recipe.labels == ["neg", "pos"]
    assert recipe.label_ids == {"neg": 0, "pos": 1}
    assert recipe.model.config.id2label == {0: "neg", 1: "pos"}
    assert torch.equal(recipe.model.classifier.weight.detach(), _head_weights(head_model))
    assert recipe.head_note is not None and "it is kept" in recipe.head_note
    assert "memfit:" not in capfd.readouterr().err  # nothing to warn about


def test_a_head_of_the_same_size_with_other_names_is_replaced_and_said(
    head_model: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    recipe = _built(head_model, tmp_path, ["bad", "good"])
    assert recipe.model.config.id2label == {0: "bad", 1: "good"}
    weight = recipe.model.classifier.weight.detach()
    assert not torch.equal(weight, _head_weights(head_model))
    assert float(weight.std()) < 0.1  # freshly initialised (std 0.02), not the old head (std 1)
    assert torch.equal(recipe.model.classifier.bias.detach(), torch.zeros(2))
    note = (
        f"the classifier head of {head_model} has 2 labels (neg, pos); the data has 2 (bad, "
        "good): a new 2-label head is trained (the body's weights are kept)"
    )
    assert recipe.head_note == note
    assert f"memfit: {note}" in capfd.readouterr().err.splitlines()


def test_a_base_model_gets_its_head_without_a_note(
    tiny_classifier: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    recipe = _built(tiny_classifier, tmp_path, ["0", "1", "2"])
    assert recipe.model.config.num_labels == 3
    assert recipe.head_note is None
    assert "memfit:" not in capfd.readouterr().err
