"""The run folder keeps what is in it (issue 16): a folder memfit did not write is refused, one run
at a time holds it, a checkpoint is verified before it is resumed (and a damaged one passed over),
a resume with other settings is refused, a step whose loss or gradient is not finite stops the run
before it writes NaN into the weights, and a full disk leaves the newest checkpoint resumable.

Each case runs a tiny BERT classifier through ``memfit.cli.main`` (the CLI path: exit code and the
one ``memfit: error:`` line) or ``memfit.train`` in this process, and then looks at the disk.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from memfit_runs import classification_csv as _data
from memfit_runs import events as _events
from memfit_runs import max_difference as _same
from memfit_runs import weights as _weights
from safetensors.torch import load_file

from memfit.cli import main
from memfit.errors import UsageError
from memfit.train import TrainConfig, train
from memfit.train.runfolder import LOCK_FILE, RunLock, lock_holder

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out


def _flags(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--task", "classification", "--model", model, "--train-file", str(data),
        "--output-dir", str(out), "--device", "cpu", "--optimizer", "sgd", "--lr", "0.5",
        "--effective-batch-size", "4", "--seed", "3", "--no-probe", *extra,
    ]  # fmt: skip


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
        raise SystemExit(0)
    captured = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), captured.out, captured.err


def _config(model: str, data: Path, out: Path, **knobs: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        task="classification",
        model=model,
        train_file=str(data),
        output_dir=str(out),
        effective_batch_size=4,
        epochs=2,
        optimizer="sgd",
        lr=0.5,
        seed=3,
        device="cpu",
        probe=False,
        save_every=2,
        lr_scheduler="constant",
        quiet=True,
    )
    return TrainConfig(**(settings | knobs))


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


# --- a folder memfit did not write ----------------------------------------------------------------
def _model_copy(tiny_classifier: str, folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copytree(tiny_classifier, folder / "model")
    return folder / "model"


@pytest.mark.parametrize(
    "layout",
    ["model-inside-output", "output-holds-a-model-folder", "output-holds-a-file"],
)
def test_an_output_dir_memfit_did_not_write_is_refused_untouched(
    layout: str, tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path / "train.csv")
    out = tmp_path / "work"
    model = tiny_classifier
    if layout == "model-inside-output":
        # the case: --model ../../model --output-dir ../../
        model = str(_model_copy(tiny_classifier, out))
    elif layout == "output-holds-a-model-folder":
        _model_copy(tiny_classifier, out)
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = _tree(out)
    code, _, err = _cli(_flags(model, data, out), capsys)
    assert code == 2
    assert err.count("memfit: error:") == 1, err
    assert f"--output-dir: {out} already holds files memfit did not write" in err
    assert "Traceback" not in err
    assert _tree(out) == before  # nothing replaced, nothing added (no run.lock either)


def test_an_empty_folder_and_a_folder_a_run_never_started_in_are_taken(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _data(tmp_path / "train.csv", rows=4)
    empty = tmp_path / "empty"
    empty.mkdir()
    started = tmp_path / "started"  # a run killed before it wrote run.json
    started.mkdir()
    (started / LOCK_FILE).write_text("{}")
    kept = tmp_path / "kept"  # made by the user for the run: hidden files and lost+found only
    (kept / "lost+found").mkdir(parents=True)
    (kept / ".gitkeep").write_text("")
    for out in (empty, started, kept):
        result = train(_config(tiny_classifier, data, out, epochs=1, save_every=None))
        assert result.stopped == "done" and (out / "model" / "model.safetensors").is_file()


# --- one run at a time ----------------------------------------------------------------------------
def test_a_second_run_on_a_locked_folder_is_refused(
    tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path / "train.csv", rows=4)
    out = tmp_path / "run"
    holder = RunLock(out)
    holder.acquire(resume=False)  # what a running `memfit train` holds
    try:
        code, _, err = _cli(_flags(tiny_classifier, data, out), capsys)
        assert code == 2
        assert err.strip() == (
            f"memfit: error: --output-dir: {out} is in use by another memfit train (process "
            f"{os.getpid()}); wait for it to end or choose another folder"
        )
        with pytest.raises(UsageError, match="is in use by another memfit train"):
            train(_config(tiny_classifier, data, out, resume=True))
    finally:
        holder.release()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    # the lock goes with its holder: the folder is free again
    assert train(_config(tiny_classifier, data, out, epochs=1)).stopped == "done"


def test_a_run_started_while_another_process_holds_the_folder_is_refused(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _data(tmp_path / "train.csv", rows=4)
    out = tmp_path / "run"
    # another process in the middle of its run (holding what `memfit train` holds)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from memfit.train.runfolder import RunLock; RunLock(Path(sys.argv[1]))"
         ".acquire(resume=False); print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        argv = [sys.executable, "-m", "memfit", *_flags(tiny_classifier, data, out)]
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            f"memfit: error: --output-dir: {out} is in use by another memfit train (process "
            f"{holder.pid}); wait for it to end or choose another folder"
        ]
    finally:
        holder.kill()  # kill -9: the kernel drops the lock, nothing is left to clean
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    assert lock_holder(out) is None  # nothing stale: the next run takes the folder


# --- hyperparameters that are not numbers ---------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("--lr", "nan", "--lr: must be a finite number, got nan"),
        ("--lr", "inf", "--lr: must be a finite number, got inf"),
        ("--weight-decay", "nan", "--weight-decay: must be a finite number, got nan"),
        ("--max-grad-norm", "nan", "--max-grad-norm: must be a finite number, got nan"),
        ("--max-grad-norm", "inf", "--max-grad-norm: must be a finite number, got inf"),
        (
            "--seed",
            "1" * 30,
            f"--seed: must be a whole number from 0 to {2**32 - 1}, got {'1' * 30}",
        ),
    ],
)
def test_hyperparameters_that_are_not_finite_are_refused(
    flag: str, value: str, line: str, tiny_classifier: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    data = _data(tmp_path / "train.csv", rows=4)
    out = tmp_path / "run"
    code, _, err = _cli([*_flags(tiny_classifier, data, out), flag, value], capsys)
    assert code == 2
    assert f"memfit: error: {line}" in err.splitlines(), err
    assert not out.exists()


def test_a_loss_that_goes_to_nan_stops_the_run_before_the_update(
    tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path / "train.csv", rows=16)
    out = tmp_path / "run"
    # a finite learning rate so large that the first update overflows what the next step computes
    code, _, err = _cli(
        [*_flags(tiny_classifier, data, out, "--epochs", "3"), "--lr", "1e30", "--max-grad-norm",
         "0", "--optimizer", "adamw"],
        capsys,
    )  # fmt: skip
    assert code == 4, err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("memfit: error:")]
    assert line.startswith("memfit: error: step ")
    assert "stopped before the update" in line and "--resume" in line
    stop = [e for e in _events(out) if e["type"] == "not_finite"]
    assert len(stop) == 1
    number = stop[0]["step"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, number))  # the bad step is not logged
    assert not (out / "model").exists()  # no model of NaNs
    for step_dir in (out / "checkpoints").glob("step-*"):
        weights = load_file(str(step_dir / "model.safetensors"))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values())


# --- verified checkpoints and resume --------------------------------------------------------------
def _damage(kind: str, step_dir: Path) -> None:
    if kind == "truncated-weights":
        path = step_dir / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "empty-weights":
        (step_dir / "model.safetensors").write_bytes(b"")
    elif kind == "truncated-optimizer":
        path = step_dir / "optimizer.pt"
        path.write_bytes(path.read_bytes()[:100])
    elif kind == "bad-state-json":
        (step_dir / "trainer_state.json").write_text('{"step": 6, "epo')
    elif kind == "flipped-byte":  # same size: only the checksum can tell
        path = step_dir / "model.safetensors"
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif kind == "legacy-truncated":  # a checkpoint of a memfit that wrote no manifest
        (step_dir / "manifest.json").unlink()
        path = step_dir / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _as_if_killed_after(out: Path, step: int) -> None:
    """The folder of a run killed just after its checkpoint of ``step``: later checkpoints,
    the model and the result in run.json are not there yet."""
    for step_dir in (out / "checkpoints").glob("step-*"):
        if int(step_dir.name.split("-")[1]) > step:
            shutil.rmtree(step_dir)
    shutil.rmtree(out / "model")
    run = json.loads((out / "run.json").read_text())
    del run["result"]
    (out / "run.json").write_text(json.dumps(run))


@pytest.fixture(scope="module")
def finished_run(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: 8 steps, checkpoints at 2, 4, 6 and 8."""
    folder = tmp_path_factory.mktemp("whole")
    data = _data(folder / "train.csv")
    result = train(_config(tiny_classifier, data, folder / "run"))
    assert result.steps == 8
    return folder


@pytest.mark.parametrize(
    "kind",
    [
        "truncated-weights", "empty-weights", "truncated-optimizer", "bad-state-json",
        "flipped-byte", "legacy-truncated",
    ],
)  # fmt: skip
def test_a_damaged_newest_checkpoint_is_passed_over(
    kind: str, finished_run: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    whole = finished_run / "run"
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    _as_if_killed_after(out, 6)
    _damage(kind, out / "checkpoints" / "step-6")
    # keep 1: the damaged checkpoint must not count as the newest and push the good ones out
    result = train(
        _config(tiny_classifier, finished_run / "train.csv", out, resume=True, save_total_limit=1)
    )
    assert result.stopped == "done" and result.steps == 8
    skipped = [e for e in _events(out) if e["type"] == "checkpoint_skipped"]
    assert [Path(e["checkpoint"]).name for e in skipped] == ["step-6"]
    assert Path(skipped[0]["moved_to"]).name == ".damaged-step-6"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".damaged-step-6", "step-8"]
    resumed = [e for e in _events(out) if e["type"] == "resume"]
    assert Path(resumed[-1]["checkpoint"]).name == "step-4"
    assert _same(_weights(whole / "model"), _weights(out / "model")) <= 1e-6
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"effective_batch_size": 8}, "--effective-batch-size 4 then, 8 now"),
        ({"seed": 4}, "--seed 3 then, 4 now"),
        ({"group_by_length": True}, "--group-by-length False then, True now"),
        ({"rows": 20}, "--train-file 16 rows then, 20 now"),
    ],
)
def test_a_resume_with_settings_that_move_the_samples_is_refused(
    change: dict[str, Any], named: str, finished_run: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_run / "run", out)
    _as_if_killed_after(out, 4)
    before = _tree(out)
    data = finished_run / "train.csv"
    if "rows" in change:
        data = _data(tmp_path / "more.csv", rows=change.pop("rows"))
    with pytest.raises(UsageError) as refused:
        train(_config(tiny_classifier, data, out, resume=True, **change))
    message = str(refused.value)
    assert message.startswith(f"--resume: {out / 'checkpoints' / 'step-4'} was written by a run")
    assert named in message
    assert _tree(out) == before  # metrics not cut, run.json not rewritten


def test_a_resume_of_a_finished_run_changes_nothing(
    finished_run: Path, tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_run / "run", out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    code, _stdout, err = _cli(
        _flags(tiny_classifier, finished_run / "train.csv", out, "--resume", "--epochs", "2",
               "--save-every", "2", "--lr-scheduler", "constant"),
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert f"the run in {out} already finished (8 steps" in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_a_finished_run_asked_for_other_settings_is_refused_and_for_more_epochs_trains_on(
    finished_run: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_run / "run", out)
    data = finished_run / "train.csv"
    with pytest.raises(UsageError, match=r"finished with other settings .*--seed 3 then, 4 now"):
        train(_config(tiny_classifier, data, out, resume=True, seed=4))
    result = train(_config(tiny_classifier, data, out, resume=True, epochs=3))
    assert result.stopped == "done" and result.steps == 12
    resumed = [e for e in _events(out) if e["type"] == "resume"]
    assert Path(resumed[-1]["checkpoint"]).name == "step-8"
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


def test_an_lr_given_to_a_resume_takes_effect(
    finished_run: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    """What the exit-4 line advises (lower --lr, --resume) must do what it says."""
    out = tmp_path / "run"
    shutil.copytree(finished_run / "run", out)
    _as_if_killed_after(out, 4)
    train(_config(tiny_classifier, finished_run / "train.csv", out, resume=True, lr=0.125))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["lr"] for m in lines] == [0.5] * 4 + [0.125] * 4
    changed = [e for e in _events(out) if e["type"] == "lr"]
    assert [(e["step"], e["from"], e["to"]) for e in changed] == [(4, 0.5, 0.125)]


# --- a full disk ----------------------------------------------------------------------------------
def test_a_full_disk_at_the_final_save_keeps_the_checkpoint_resumable(
    finished_run: Path, tiny_classifier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import PreTrainedModel

    out = tmp_path / "run"
    data = finished_run / "train.csv"
    real = PreTrainedModel.save_pretrained

    def full(self: Any, folder: Any, *args: Any, **kwargs: Any) -> None:
        # half the weights reach the disk, then it is full
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(UsageError) as refused:
        train(_config(tiny_classifier, data, out))
    message = str(refused.value)
    assert message.startswith(f"--output-dir: {out}/.tmp-model-")
    assert "No space left on device" in message
    assert f"the newest checkpoint, {out / 'checkpoints' / 'step-8'}, is whole" in message
    assert not list(out.glob(".tmp-*")) and not (out / "model").exists()
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    result = train(_config(tiny_classifier, data, out, resume=True))
    assert result.stopped == "done" and result.steps == 8
    assert _same(_weights(finished_run / "run" / "model"), _weights(out / "model")) <= 1e-6


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 256 KiB tmpfs (root only; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_is_one_line_and_leaves_no_temporary(
    small_disk: Path, tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path / "train.csv")
    out = small_disk / "run"
    filler = small_disk / "filler"  # leaves room for the logs, not for a checkpoint
    filler.write_bytes(b"\0" * (200 * 1024))
    code, _, err = _cli(_flags(tiny_classifier, data, out, "--save-every", "2"), capsys)
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("memfit: error:")]
    assert line.startswith(f"memfit: error: --output-dir: {out}")
    assert "No space left on device" in line
    assert "no checkpoint was written" in line
    assert not [p for p in out.rglob(".tmp-*")]
