"""The run folder: a symbolic link memfit would write through is named (memfit never writes
through one); a link to a folder (checkpoints/ on a scratch disk) is followed."""

from __future__ import annotations

import pytest

from memfit.errors import UsageError
from memfit.train.runfolder import RunLock, folder_problems, link_problems, save_model_folder


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


def test_links_to_folders_are_followed_links_to_files_are_not(tmp_path) -> None:
    """checkpoints/ (or model/, best/) on another disk through a link is a user's choice: memfit
    writes only new files in it. A link to a file it appends to or replaces is refused, and so
    is one to nothing (an append would create its target); so are links inside a linked
    checkpoints/ (memfit renames and removes whole step folders there)."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    run.mkdir()
    (run / "run.json").write_text("{}")
    for name in ("checkpoints", "model", "best"):
        (scratch / name).mkdir(parents=True)
        (run / name).symlink_to(scratch / name)
    assert link_problems(run) == []
    assert folder_problems(run, resume=True) == []
    lock = RunLock(run)
    lock.acquire(resume=True)
    lock.release()
    # a link to a file, and one to nothing, at the top
    (tmp_path / "mine.jsonl").write_text("mine\n")
    (run / "events.jsonl").symlink_to(tmp_path / "mine.jsonl")
    (run / "metrics.jsonl").symlink_to(tmp_path / "nothing.jsonl")
    # a step folder linked inside the linked checkpoints/
    (scratch / "checkpoints" / "step-4").symlink_to(tmp_path)
    named = [p.split(" is a symbolic link")[0] for p in link_problems(run)]
    assert named == [
        f"--output-dir: {run / 'events.jsonl'}",
        f"--output-dir: {run / 'metrics.jsonl'}",
        f"--output-dir: {run / 'checkpoints' / 'step-4'}",
    ]
    assert (tmp_path / "mine.jsonl").read_text() == "mine\n"


def test_a_linked_model_folder_replaced_leaves_no_link_behind(tmp_path) -> None:
    """model/ linked to another disk and written again: the new model is in place, the link
    goes (rmtree refuses a link: it stayed as .old-model-PID), what it pointed to is kept."""
    run, scratch = tmp_path / "run", tmp_path / "scratch-model"
    run.mkdir()
    scratch.mkdir()
    (scratch / "model.safetensors").write_bytes(b"old")

    class Recipe:
        model = None

        def save(self, folder, state_dict=None) -> None:
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"new")

    (run / "model").symlink_to(scratch)
    save_model_folder(Recipe(), run / "model")
    assert (run / "model" / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in run.iterdir()) == ["model"]
    assert (scratch / "model.safetensors").read_bytes() == b"old"
