"""A resume loses nothing (issue 30): a checkpoint that does not fit --model is a refusal, not
damage; a full disk under torch.save is one line; a trainer state edited to impossible counts is
passed over; a link in the run folder is never written through; a finished run whose model/ is
gone gets it back; the advice after a step that is not finite does not loop.

Each case copies one finished run of a tiny BERT classifier (8 steps, a checkpoint every 2), makes
it what the case needs, and runs ``memfit train`` on it (``memfit.cli.main`` in this process for
the exit code and the one line, or ``memfit.train``); then it looks at the disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from memfit_runs import WORDS
from memfit_runs import classification_csv as _data
from memfit_runs import events as _events
from memfit_runs import max_difference as _same
from memfit_runs import weights as _weights
from safetensors.torch import save_file

from memfit.cli import main
from memfit.train import TrainConfig, train
from memfit.train import checkpoint as ck
from tiny_models import save_bert

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out


def _config(model: str, data: Path, out: Path, **knobs: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        task="classification", model=model, train_file=str(data), output_dir=str(out),
        effective_batch_size=4, epochs=2, optimizer="sgd", lr=0.5, seed=3, device="cpu",
        probe=False, save_every=2, lr_scheduler="constant", quiet=True,
    )  # fmt: skip
    return TrainConfig(**(settings | knobs))


def _flags(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    """The finished run's settings as flags (a resume must give them again)."""
    return [
        "train", "--task", "classification", "--model", model, "--train-file", str(data),
        "--output-dir", str(out), "--device", "cpu", "--optimizer", "sgd", "--lr", "0.5",
        "--effective-batch-size", "4", "--seed", "3", "--no-probe", "--epochs", "2",
        "--save-every", "2", "--lr-scheduler", "constant", *extra,
    ]  # fmt: skip


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``memfit ARGV`` in this process: (exit code, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("memfit: error:")]
    return line


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and p.name != "run.lock"
    }


def _as_if_killed_after(out: Path, step: int) -> None:
    """The folder of a run killed just after its checkpoint of ``step``."""
    for step_dir in (out / "checkpoints").glob("step-*"):
        if int(step_dir.name.split("-")[1]) > step:
            shutil.rmtree(step_dir)
    shutil.rmtree(out / "model")
    run = json.loads((out / "run.json").read_text())
    del run["result"]
    (out / "run.json").write_text(json.dumps(run))


def _rewrite_manifest(step_dir: Path) -> None:
    """A hand edit that also regenerates the manifest: the checkpoint verifies."""
    files = {
        p.name: ck._describe_file(p)
        for p in sorted(step_dir.iterdir())
        if p.name != ck.MANIFEST_FILE
    }
    (step_dir / ck.MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def _edit_state(step_dir: Path, **changes: Any) -> None:
    path = step_dir / ck.STATE_FILE
    state = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    path.write_text(json.dumps(state))
    _rewrite_manifest(step_dir)


@pytest.fixture(scope="module")
def whole(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: 8 steps, checkpoints at 2, 4, 6 and 8 (folder/run, folder/train.csv)."""
    folder = tmp_path_factory.mktemp("whole")
    data = _data(folder / "train.csv")
    result = train(_config(tiny_classifier, data, folder / "run"))
    assert result.steps == 8
    return folder


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another architecture with the same tokenizer: a 3-layer BERT."""
    folder = tmp_path_factory.mktemp("three-layers")
    save_bert(folder, WORDS, positions=256, layers=3)
    return str(folder)


def _copy(whole: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(whole / "run", out)
    return out


# --- 1. another --model is a refusal, not damage ----------------------------------------------------
@pytest.mark.parametrize("recorded", [True, False], ids=["model-recorded", "older-checkpoints"])
def test_a_killed_run_resumed_with_another_model_is_refused_untouched(
    recorded: bool, whole: Path, other_model: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    if not recorded:  # checkpoints of a memfit that recorded no model: their loading says it
        for step_dir in (out / "checkpoints").glob("step-*"):
            _edit_state(step_dir, model=None)
    before = _tree(out)
    code, err = _cli(_flags(other_model, whole / "train.csv", out, "--resume"), capsys)
    assert code == 2, err
    line = _error_line(err)
    assert line.startswith(f"memfit: error: --resume: {out / 'checkpoints' / 'step-6'} holds ")
    assert f"another model than --model {other_model}" in line
    assert _tree(out) == before  # nothing set aside, no log line, no model
    assert not list((out / "checkpoints").glob(".damaged-*"))


def test_a_finished_run_resumed_with_another_model_is_refused_not_finished(
    whole: Path, other_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(whole, tmp_path)
    before = _tree(out)
    code, err = _cli(_flags(other_model, whole / "train.csv", out, "--resume"), capsys)
    assert code == 2, err
    line = _error_line(err)
    assert line.startswith(f"memfit: error: --resume: the run in {out} finished training --model ")
    assert f"not --model {other_model}" in line and "already finished" not in err
    assert _tree(out) == before
    # asked to train longer (from its checkpoints): their recorded model refuses it too
    code, err = _cli(_flags(other_model, whole / "train.csv", out, "--resume", "--epochs", "3"),
                     capsys)  # fmt: skip
    assert code == 2, err
    assert f"another model than --model {other_model}" in _error_line(err)
    assert _tree(out) == before


@pytest.mark.parametrize("recorded", [True, False], ids=["optimizer-recorded", "older-checkpoints"])
def test_a_resume_with_another_optimizer_is_refused_untouched(
    recorded: bool,
    whole: Path,
    tiny_classifier: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checkpoints of a memfit that recorded no optimizer: run.json says which it was (their
    state would not load: KeyError 'betas', then taken for damage)."""
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 4)
    if not recorded:
        for step_dir in (out / "checkpoints").glob("step-*"):
            _edit_state(step_dir, optimizer=None)
    before = _tree(out)
    flags = _flags(tiny_classifier, whole / "train.csv", out, "--resume", "--optimizer", "adamw")
    code, err = _cli(flags, capsys)
    assert code == 2, err
    assert _error_line(err) == (
        f"memfit: error: --resume: {out / 'checkpoints' / 'step-4'} holds the state of "
        "--optimizer sgd, not of --optimizer adamw: resume with --optimizer sgd, or start a new "
        "run in another folder"
    )
    assert _tree(out) == before


def test_older_checkpoints_without_a_recorded_model_still_resume(
    whole: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 4)
    for step_dir in (out / "checkpoints").glob("step-*"):
        _edit_state(step_dir, model=None, optimizer=None)
    result = train(_config(tiny_classifier, whole / "train.csv", out, resume=True))
    assert result.stopped == "done" and result.steps == 8
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6


# --- 4. a full disk under torch.save ---------------------------------------------------------------
@pytest.mark.parametrize("free", [0, None], ids=["disk-full", "disk-not-full"])
def test_a_short_write_of_torch_save_is_one_line_and_keeps_the_checkpoint(
    free: int | None, whole: Path, tiny_classifier: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from memfit.train import runfolder

    out = tmp_path / "run"
    real = torch.save

    def short_write(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # the second checkpoint's scheduler.pt (its optimizer.pt is written)
        if Path(f).name != "scheduler.pt" or ".tmp-step-4-" not in str(f):
            real(obj, f, *args, **kwargs)
            return
        Path(f).write_bytes(b"PK\x03\x04" + b"\0" * 60)  # what reached the disk
        # what torch's writer says on a full disk (caffe2's inline_container.cc: no errno)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:626] . unexpected pos 1216 vs 1114"
        )

    monkeypatch.setattr(torch, "save", short_write)
    if free is not None:
        monkeypatch.setattr(runfolder, "free_bytes", lambda path: free, raising=False)
    code, err = _cli(_flags(tiny_classifier, whole / "train.csv", out), capsys)
    assert code == 2, err
    line = _error_line(err)
    assert line.startswith(f"memfit: error: --output-dir: {out / 'checkpoints'}/.tmp-step-4-")
    if free is not None:
        assert "No space left on device" in line
    else:
        assert "the write failed (torch: unexpected pos 1216)" in line
        assert "the disk may be full" in line
    assert f"the newest checkpoint, {out / 'checkpoints' / 'step-2'}, is whole" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert ck.verify(out / "checkpoints" / "step-2") is None
    assert not list(out.rglob(".tmp-*"))


# --- 9c. a trainer state edited to counts memfit never writes --------------------------------------
@pytest.mark.parametrize(
    "edit",
    [{"step": -5}, {"position": 10**9}, {"samples_seen": 10**9 + 24}, {"epoch": "1"},
     {"step": 4}, {"best": "0.5"}],
    ids=["step-negative", "position-past-the-rows", "samples", "epoch-text", "step-of-another",
         "best-text"],
)  # fmt: skip
def test_a_trainer_state_that_verifies_but_cannot_be_is_passed_over(
    edit: dict[str, Any], whole: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    _edit_state(out / "checkpoints" / "step-6", **edit)
    assert ck.verify(out / "checkpoints" / "step-6") is None
    result = train(_config(tiny_classifier, whole / "train.csv", out, resume=True))
    assert result.stopped == "done" and result.steps == 8 and result.samples_seen == 32
    skipped = [e for e in _events(out) if e["type"] == "checkpoint_skipped"]
    assert [Path(e["checkpoint"]).name for e in skipped] == ["step-6"]
    assert "trainer_state.json" in skipped[0]["reason"]
    resumed = [e for e in _events(out) if e["type"] == "resume"]
    assert Path(resumed[-1]["checkpoint"]).name == "step-4"
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6


@pytest.mark.parametrize("best", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_checkpoint_whose_best_is_not_finite_is_resumed_from(
    best: float, whole: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    """An older memfit kept a first eval's NaN as the best, in every checkpoint after it: they
    are whole (no best yet), not damaged."""
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    for step_dir in (out / "checkpoints").glob("step-*"):
        _edit_state(step_dir, best=best)
    result = train(_config(tiny_classifier, whole / "train.csv", out, resume=True))
    assert result.stopped == "done" and result.steps == 8
    assert not [e for e in _events(out) if e["type"] == "checkpoint_skipped"]
    resumed = [e for e in _events(out) if e["type"] == "resume"]
    assert Path(resumed[-1]["checkpoint"]).name == "step-6"
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6


def test_an_eval_that_is_not_finite_leaves_the_checkpoints_resumable(
    whole: Path, tiny_classifier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first eval whose metric is NaN is no best: kept as one, every checkpoint after it wrote
    "best": NaN, and a resume set them all aside and started over."""
    from memfit.guard import Guard

    real, calls = Guard.evaluate, [0]

    def nan_first(guard: Guard, *args: Any, **kwargs: Any) -> dict[str, float]:
        result: dict[str, float] = real(guard, *args, **kwargs)
        calls[0] += 1
        return {k: float("nan") for k in result} if calls[0] == 1 else result

    monkeypatch.setattr(Guard, "evaluate", nan_first)
    out, data = tmp_path / "run", whole / "train.csv"
    train(_config(tiny_classifier, data, out, eval_file=str(data), eval_every=2))
    monkeypatch.undo()
    states = {n: ck.read_state(out / "checkpoints" / f"step-{n}") for n in (2, 4, 6)}
    assert states[2]["best"] is None  # the NaN eval of step 2
    assert all(isinstance(states[n]["best"], float) for n in (4, 6))
    _as_if_killed_after(out, 6)
    result = train(_config(tiny_classifier, data, out, eval_file=str(data), eval_every=2,
                           resume=True))  # fmt: skip
    assert result.stopped == "done" and result.steps == 8
    assert not [e for e in _events(out) if e["type"] == "checkpoint_skipped"]
    assert Path(_events_of(out, "resume")[-1]["checkpoint"]).name == "step-6"


def _events_of(out: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in _events(out) if e["type"] == kind]


# --- 11. a link in the run folder ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl", "run.lock"])
def test_a_link_in_the_run_folder_is_refused_and_its_target_untouched(
    name: str, whole: Path, tiny_classifier: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    outside = tmp_path / f"outside-{name}"
    if (out / name).exists():
        shutil.move(out / name, outside)
    else:
        outside.write_text("a user's file\n")
    (out / name).symlink_to(outside)
    kept = {p: p.read_bytes() for p in ([outside] if outside.is_file() else outside.rglob("*"))
            if p.is_file()}  # fmt: skip
    code, err = _cli(_flags(tiny_classifier, whole / "train.csv", out, "--resume"), capsys)
    assert code == 2, err
    line = _error_line(err)
    assert line.startswith(f"memfit: error: --output-dir: {out / name} is a symbolic link")
    assert {p: p.read_bytes() for p in kept} == kept
    assert not (out / "model").exists()


def test_a_linked_checkpoints_folder_is_written_and_resumed_through(
    whole: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    """checkpoints/ on a scratch disk through a link (a user's choice): a resume reads and
    writes the checkpoints there, as without the link."""
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    scratch = tmp_path / "scratch" / "checkpoints"
    scratch.parent.mkdir()
    shutil.move(out / "checkpoints", scratch)
    (out / "checkpoints").symlink_to(scratch)
    result = train(_config(tiny_classifier, whole / "train.csv", out, resume=True))
    assert result.stopped == "done" and result.steps == 8
    assert Path(_events_of(out, "resume")[-1]["checkpoint"]).name == "step-6"
    assert (out / "checkpoints").is_symlink()
    assert ck.completed_steps(scratch) == [2, 4, 6, 8]
    assert ck.verify(scratch / "step-8") is None
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6


# --- 1b. a finished run resumed with its --model spelled otherwise -----------------------------------
@pytest.mark.parametrize("spelling", ["relative-from-elsewhere", "a-copy"])
def test_a_finished_run_resumed_with_its_model_spelled_otherwise_is_finished(
    spelling: str, whole: Path, tiny_classifier: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The same folder spelled relative to the folder the run was started in, resumed from
    another folder (the absolute path recorded at the start tells), or a copy of it (a Hub id's
    local snapshot: its signature tells): "already finished", never "another model"."""
    out = _copy(whole, tmp_path)
    model = tiny_classifier
    if spelling == "a-copy":
        model = str(tmp_path / "snapshot")
        shutil.copytree(tiny_classifier, model)
    else:
        # as if started as `--model ./tiny-classifier0` from the model's parent folder
        run = json.loads((out / "run.json").read_text())
        assert run["resolved"]["model_path"] == tiny_classifier
        run["config"]["model"] = f"./{Path(tiny_classifier).name}"
        (out / "run.json").write_text(json.dumps(run))
        monkeypatch.chdir(tmp_path)
    before = _tree(out)
    code, err = _cli(_flags(model, whole / "train.csv", out, "--resume"), capsys)
    assert code == 0, err
    assert "already finished (8 steps" in err and "another model" not in err
    assert _tree(out) == before


# --- 12. a finished run whose model/ is gone --------------------------------------------------------
@pytest.mark.parametrize("final_checkpoint", [True, False])
def test_a_finished_run_whose_model_is_gone_gets_it_back(
    final_checkpoint: bool, whole: Path, tiny_classifier: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = _copy(whole, tmp_path)
    shutil.rmtree(out / "model")
    if not final_checkpoint:
        shutil.rmtree(out / "checkpoints" / "step-8")
    code, err = _cli(_flags(tiny_classifier, whole / "train.csv", out, "--resume"), capsys)
    assert code == 0, err
    assert "already finished" not in err  # its model was not in model/
    assert f"finished (8 steps) but {out / 'model'} is missing" in err
    if final_checkpoint:
        assert f"written again from {out / 'checkpoints' / 'step-8'}" in err
    else:
        assert f"newest checkpoint is {out / 'checkpoints' / 'step-6'}" in err
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6
    assert json.loads((out / "run.json").read_text())["result"]["steps"] == 8
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    # now it is whole: the next resume says so, truthfully
    code, err = _cli(_flags(tiny_classifier, whole / "train.csv", out, "--resume"), capsys)
    assert code == 0 and "already finished (8 steps" in err


# --- 14b. not finite: the advice holds -------------------------------------------------------------
def test_a_checkpoint_with_weights_that_are_not_finite_is_passed_over(
    whole: Path, tiny_classifier: str, tmp_path: Path
) -> None:
    out = _copy(whole, tmp_path)
    _as_if_killed_after(out, 6)
    step_dir = out / "checkpoints" / "step-6"
    weights = _weights(step_dir)
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(step_dir / "model.safetensors"))
    _rewrite_manifest(step_dir)
    result = train(_config(tiny_classifier, whole / "train.csv", out, resume=True))
    assert result.stopped == "done" and result.steps == 8
    skipped = [e for e in _events(out) if e["type"] == "checkpoint_skipped"]
    assert [Path(e["checkpoint"]).name for e in skipped] == ["step-6"]
    assert "not finite" in skipped[0]["reason"]
    assert _same(_weights(whole / "run" / "model"), _weights(out / "model")) <= 1e-6


def test_the_advice_after_a_loss_that_is_not_finite_does_not_loop(
    whole: Path, tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    data = whole / "train.csv"
    flags = ["--epochs", "3", "--max-grad-norm", "0", "--optimizer", "adamw", "--save-every", "1"]
    # a finite learning rate so large that an update overflows what the next step computes
    code, err = _cli([*_flags(tiny_classifier, data, out, *flags), "--lr", "1e30"], capsys)
    assert code == 4, err
    line = _error_line(err)
    (stop,) = [e for e in _events(out) if e["type"] == "not_finite"]
    number = stop["step"]
    # the weights of the step before compute the same step again: they are no resume point
    assert not (out / "checkpoints" / f"step-{number - 1}").exists()
    kept = ck.completed_steps(out / "checkpoints")
    said = f"a resume goes on from {out / 'checkpoints' / f'step-{kept[-1]}'}" if kept else (
        "a resume starts from step 0")  # fmt: skip
    assert said in line and "Lower --lr" in line
    # what it advises: a lower --lr, --resume
    code, err = _cli([*_flags(tiny_classifier, data, out, *flags), "--lr", "1e-3", "--resume"],
                     capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["result"]["steps"] == 12
