"""``bench/gpu_truth.py`` must be ready when a GPU is lent: its CPU smoke run of every part.

The GPU run itself (7.8 minutes on the first H200 run) happens only on a device machine; here each part
runs its own ``--smoke`` on the CPU through the same entry point, and the summary must say what
each part measured.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_truth.py"


@pytest.fixture(scope="module")
def truth() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_truth", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_parts_cover_the_issue_in_priority_order(truth: ModuleType) -> None:
    items = [p.issue_item for p in truth.PARTS]
    assert items == sorted(items)
    assert set(items) == {1, 2, 3, 4}
    for part in truth.PARTS:
        if part.script == "pytest":  # the GPU-marked tests named in its arguments
            assert all((ROOT / arg).is_file() for arg in part.args), part.args
        else:
            assert (ROOT / "bench" / part.script).is_file(), part.script
    # the device machine brings back at most 8 files: the parts' files, the summary and a log
    assert len(truth.PARTS) + 2 <= 8


def test_budget_shares_add_up_and_follow_the_h100_seconds(truth: ModuleType) -> None:
    shares = truth.budgets(truth.PARTS, 300.0)
    assert sum(shares) == pytest.approx(300.0)
    seconds = [p.seconds for p in truth.PARTS]
    assert shares.index(max(shares)) == seconds.index(max(seconds))


def test_unknown_part_is_refused(truth: ModuleType) -> None:
    with pytest.raises(SystemExit, match="--parts: unknown nope"):
        truth.select_parts("guard,nope")


@pytest.mark.slow
def test_smoke_runs_every_part_and_writes_each_result(truth: ModuleType, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--budget", "600"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_truth.json").read_text(encoding="utf-8"))
    assert summary["header"]["smoke"] is True
    assert summary["header"]["libraries"]["torch"]["imports"] is True
    parts = summary["parts"]
    assert list(parts) == [p.name for p in truth.PARTS]
    for name, row in parts.items():
        assert row["status"] == "ok", (name, row)
        assert row["result_file"], name
        assert (tmp_path / row["result_file"]).is_file(), name
        assert row["summary"], (name, row)
    # at most 8 files come back from the device machine, two folders down
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 7, files  # and the log beside them
    assert all(len(p.relative_to(tmp_path).parts) <= 3 for p in files)
    assert "gpu_truth summary" in done.stdout
