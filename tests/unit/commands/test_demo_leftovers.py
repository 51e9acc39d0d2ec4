"""``memfit demo`` leaves its logs, the pairs it trained on and its report page, not the weights it
wrote (a copy of all-MiniLM-L6-v2 per probe, model and checkpoint: 350 MiB a run), and nothing at
all when it is interrupted or fails. The training is stood in for by a folder laid out as the real
run writes it (the real run: tests/e2e/test_demo.py)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from memfit.commands import demo
from memfit.units import format_bytes

WEIGHTS = 1000  # bytes of one stand-in model.safetensors
LOGS = ("metrics.jsonl", "events.jsonl", "run.json", "run.lock")


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def _run_layout(folder: Path) -> Path:
    """What the demo's probes and run write in ``folder``: the run's folder."""
    _write(folder / "train.jsonl", 10)
    _write(folder / "eval.jsonl", 10)
    for name in ("probe-32", "probe-4", "run"):
        for log in LOGS:
            _write(folder / name / log, 5)
        _write(folder / name / "model" / "model.safetensors", WEIGHTS)
        _write(folder / name / "model" / "tokenizer.json", 7)
    _write(folder / "run" / "best" / "model.safetensors", WEIGHTS)
    return folder / "run"


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the demo makes its temporary folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _left(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_the_demo_keeps_its_logs_and_pairs_and_deletes_the_weights(
    temp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "_train_under_cap", _run_layout)
    out = demo.demo_training()
    folder = out.parent
    assert folder.parent == temp and folder.name.startswith("memfit-demo-")
    assert _left(folder) == {"train.jsonl", "eval.jsonl", *(f"run/{log}" for log in LOGS)}
    # the printed sentence: where the run folder is, what was deleted and how much
    printed = capsys.readouterr().out
    line = re.search(
        r"run folder: (\S+) \(metrics\.jsonl, events\.jsonl, run\.json\); (.*)", printed
    )
    assert line and Path(line.group(1)) == out, printed
    deleted = (3 * (WEIGHTS + 7) + WEIGHTS) + 2 * len(LOGS) * 5
    assert line.group(2) == (
        "deleted the probe runs and the saved models (probe-32/, probe-4/, run/best/, run/model/: "
        f"{format_bytes(deleted)}): the report needs the logs only"
    )


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_demo_stopped_in_its_training_leaves_nothing(
    temp: Path, monkeypatch: pytest.MonkeyPatch, stop: type[BaseException]
) -> None:
    def stopped(folder: Path) -> Path:
        _run_layout(folder)
        raise stop()

    monkeypatch.setattr(demo, "_train_under_cap", stopped)
    with pytest.raises(stop):
        demo.demo_training()
    assert list(temp.iterdir()) == []


def test_the_report_page_stays_and_a_stopped_report_leaves_nothing(
    temp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "_train_under_cap", _run_layout)

    def report(out: Path) -> Path:
        for name in ("memory.png", "breakdown.png", "training.png", "report.html"):
            _write(out / name, 3)
        return out / "report.html"

    monkeypatch.setattr(demo, "write_report", report)
    out = demo.demo_training()
    demo.demo_report(out)
    assert {"run/report.html", "run/memory.png"} <= _left(out.parent)
    assert f"wrote {out / 'report.html'}:" in capsys.readouterr().out

    def interrupted(out: Path) -> Path:
        report(out)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "write_report", interrupted)
    out = demo.demo_training()
    with pytest.raises(KeyboardInterrupt):
        demo.demo_report(out)
    assert not out.parent.exists()
