"""`memfit train` out of memory outside the guarded step (issue 30, item 7): one line, exit 3.

The guard survives an OOM inside a step's forward and backward, and the update stops with exit 3
on its own; an OOM anywhere else (a --memory-cap below the weights, an allocation between steps)
was a traceback. The OOMs here are real: the CPU memory cap raises them at the allocation that
crosses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_run import run_cli

ERROR = "memfit: error: "


def _argv(bert_dir: str, tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "train.csv"
    data.write_text("text,label\nthe cat sat,0\na good movie,1\nthe dog ran,0\ngreat film,1\n")
    return [
        "train", "--task", "classification", "--model", bert_dir, "--train-file", str(data),
        "--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
        "--device", "cpu", "--effective-batch-size", "2", "--optimizer", "sgd", *extra,
    ]  # fmt: skip


def _events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("probe", [["--no-probe"], []])
def test_a_memory_cap_below_the_weights_is_one_line_exit_3(
    bert_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], probe: list[str]
) -> None:
    """A bare number is bytes: 512 B holds no weights, so no step can run (the issue's case was
    a traceback from the first allocation after the cap began, with --no-probe)."""
    argv = _argv(bert_dir, tmp_path, "--memory-cap", "512", "--max-steps", "1", *probe)
    code, _, err = run_cli(capsys, *argv)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 3, err[-2000:]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(ERROR + "--memory-cap 512 B: the run holds "), (
        lines
    )
    assert "before its first step (the model's weights" in lines[0]
    assert _events(tmp_path / "out")[-1]["type"] == "stop"
    assert not (tmp_path / "out" / "model").exists()


def test_an_oom_between_steps_is_one_line_exit_3_naming_the_newest_checkpoint(
    bert_dir: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real OOM outside the guarded step, after two steps and their checkpoints: the order of
    the second epoch allocates past the cap (the steps themselves fit)."""
    from memfit.train.loop import TrainingRun

    order = TrainingRun.permutation

    def permutation(run: TrainingRun, epoch: int) -> list[int]:
        if epoch == 1:
            torch.ones(2**20)  # 4 MiB, past the 1 MiB cap: the cap raises OutOfMemoryError
        return order(run, epoch)

    monkeypatch.setattr(TrainingRun, "permutation", permutation)
    argv = _argv(
        bert_dir, tmp_path, "--memory-cap", "1MiB", "--no-probe", "--max-steps", "3",
        "--save-every", "1",
    )  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    lines = [x for x in err.splitlines() if x.startswith(ERROR)]
    assert code == 3, err[-2000:]
    assert "Traceback" not in err
    newest = tmp_path / "out" / "checkpoints" / "step-2"
    assert len(lines) == 1, lines
    assert lines[0].startswith(ERROR + "out of memory outside a training step (memfit memory cap")
    assert f"the newest checkpoint, {newest}, is whole" in lines[0]
    assert "--resume" in lines[0] and newest.is_dir()
