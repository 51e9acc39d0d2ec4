"""The run folder: a symbolic link in it is named (memfit never writes through one)."""

from __future__ import annotations

import pytest

from memfit.errors import UsageError
from memfit.train.runfolder import RunLock, folder_problems, link_problems


def test_a_link_in_a_run_folder_is_refused_before_the_lock_is_opened(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("mine\n")
    assert link_problems(run) == []
    (run / "checkpoints" / "step-2").symlink_to(tmp_path)
    (run / "run.lock").symlink_to(outside)
    problems = link_problems(run)
    assert [p.split(" is a symbolic link")[0] for p in problems] == [
        f"--output-dir: {run / 'run.lock'}",
        f"--output-dir: {run / 'checkpoints' / 'step-2'}",
    ]
    assert folder_problems(run, resume=True)[0] == problems[0]
    with pytest.raises(UsageError, match=r"run\.lock is a symbolic link"):
        RunLock(run).acquire(resume=True)
    assert outside.read_text() == "mine\n"
