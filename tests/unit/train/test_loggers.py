"""--report-to: metrics.jsonl and events.jsonl lines as tracker scalars, through the libraries' own
writers. wandb is not installed here (and is too heavy for the 'all' extra): its reporter runs
against a stand-in module in ``sys.modules`` that records what it was given; a run with the real
package in offline mode is below, skipped where wandb is missing."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main
from memfit.train import TrainConfig, loggers, train
from memfit.train.loggers import parse_report_to, report_problems, scalars

STEP = {
    "step": 3,
    "epoch": 0,
    "loss": 0.5,
    "samples_seen": 24,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "max_tokens_per_micro_batch": None,
    "peak_bytes": 1000,
    "forward_peak_bytes": 900,
    "reserved_bytes": 2048,
    "lr": 1e-4,
    "grad_norm": None,
    "samples_per_second": 12.5,
    "world_size": 2,
    "rank_peak_bytes": [1000, 800],
}


def test_step_lines_become_train_and_memory_scalars() -> None:
    assert scalars(STEP) == {
        "train/epoch": 0.0,
        "train/loss": 0.5,
        "train/samples_seen": 24.0,
        "train/micro_batch_size": 4.0,
        "train/gradient_accumulation_steps": 2.0,
        "memory/peak_bytes": 1000.0,
        "memory/forward_peak_bytes": 900.0,
        "memory/reserved_bytes": 2048.0,
        "train/lr": 1e-4,
        "train/samples_per_second": 12.5,
        "train/world_size": 2.0,
        "memory/rank0_peak_bytes": 1000.0,
        "memory/rank1_peak_bytes": 800.0,
    }
    assert scalars({"step": 3, "samples_seen": 24, "eval_accuracy": 0.75, "eval_loss": 0.4}) == {
        "train/samples_seen": 24.0,
        "eval/accuracy": 0.75,
        "eval/loss": 0.4,
    }


def test_parse_and_check_report_to(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("TensorBoard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert report_problems("none") == []
    assert report_problems("comet") == [
        "--report-to: unknown value 'comet'; tensorboard, wandb or none"
    ]
    monkeypatch.setattr(loggers, "_installed", lambda name: False)
    assert report_problems("wandb") == [
        "--report-to: wandb is not installed; pip install 'memfit[wandb]' (or pip install wandb)"
    ]


def test_cli_a_reporter_that_is_not_installed_exits_2_writing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(loggers, "_installed", lambda name: name != "wandb")
    data = tmp_path / "train.csv"
    data.write_text("text,label\na,1\nb,0\n")
    out = tmp_path / "out"
    args = ["train", "--task", "classification", "--model", str(tmp_path), "--train-file"]
    with pytest.raises(SystemExit) as done:
        main([*args, str(data), "--output-dir", str(out), "--report-to", "wandb"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "pip install 'memfit[wandb]'" in err
    assert not out.exists()


class _FakeRun:
    def __init__(self, calls: dict[str, Any]) -> None:
        self.calls = calls
        self.summary: dict[str, Any] = {}

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls["log"].append((step, values))

    def finish(self) -> None:
        self.calls["finished"] = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {"log": [], "finished": False}
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> _FakeRun:
        calls["init"] = kwargs
        calls["run"] = _FakeRun(calls)
        return calls["run"]

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setattr(loggers, "_installed", lambda name: True)
    return calls


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"the cat sat {i},{i % 2}\n" for i in range(8)))
    return path


def test_wandb_gets_the_steps_with_memory_and_finishes(
    tmp_path: Path, bert_dir: str, fake_wandb: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "memfit-tests")
    out = tmp_path / "run"
    train(
        TrainConfig(
            task="classification",
            model=bert_dir,
            train_file=str(_data(tmp_path)),
            eval_file=str(_data(tmp_path)),
            output_dir=str(out),
            effective_batch_size=4,
            max_steps=2,
            device="cpu",
            quiet=True,
            report_to="wandb",
        )
    )
    assert fake_wandb["init"]["project"] == "memfit-tests"
    assert fake_wandb["init"]["dir"] == str(out)
    assert fake_wandb["init"]["config"]["effective_batch_size"] == 4
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = fake_wandb["log"]
    steps = [(step, values) for step, values in logged if "train/loss" in values]
    assert [s for s, _ in steps] == [m["step"] for m in metrics if "loss" in m]
    for (_, values), line in zip(steps, [m for m in metrics if "loss" in m], strict=True):
        assert values["memory/peak_bytes"] == line["peak_bytes"] > 0
    assert any("eval/accuracy" in values for _, values in logged)
    assert fake_wandb["finished"] is True


def test_tensorboard_reporter_writes_events_that_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = loggers.TensorBoardReporter(tmp_path)
    reporter.log_metrics(STEP)
    reporter.log_event({"type": "oom", "step": 4, "micro_batch_size": 4, "error": "cap"})
    reporter.log_event({"type": "backoff", "step": 4, "from": 4, "to": 2})
    reporter.log_event({"type": "checkpoint", "step": 4, "path": "x"})  # not a chart mark
    reporter.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("memory/peak_bytes")] == [(3, 1000.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars("guard/oom_count")] == [(4, 1.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars("guard/micro_batch_size")] == [(4, 2.0)]
    assert not any(t.startswith("guard/checkpoint") for t in accumulator.Tags()["tensors"])


def test_real_wandb_offline(tmp_path: Path, bert_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(
        TrainConfig(
            task="classification",
            model=bert_dir,
            train_file=str(_data(tmp_path)),
            output_dir=str(out),
            effective_batch_size=4,
            max_steps=2,
            device="cpu",
            quiet=True,
            report_to="wandb",
        )
    )
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_tensorboard_after_resume_hides_the_redone_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from memfit.train.loggers import open_reporters

    class Log:
        def write(self, record: dict[str, Any]) -> None: ...

        def close(self) -> None: ...

    # the killed run logged steps 1-3; its last checkpoint is step 2
    metrics, _ = open_reporters("tensorboard", tmp_path, {"resume": False}, Log(), Log())
    for step in (1, 2, 3):
        metrics.write({"step": step, "loss": float(step)})
    metrics.close()
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    metrics, _ = open_reporters("tensorboard", tmp_path, {"resume": True}, Log(), Log())
    for step in (3, 4):
        metrics.write({"step": step, "loss": 10.0 + step})
    metrics.close()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    losses = [(e.step, e.value) for e in accumulator.Scalars("train/loss")]
    assert losses == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
