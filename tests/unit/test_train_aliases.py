"""`memfit train` takes the Hugging Face TrainingArguments spellings as aliases of its flags: the
same settings, the effective batch from the per-device batch × accumulation × ranks as in HF, a
disagreement between an alias and its flag refused in one line, and the alias named once in the
help, on its flag's line."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memfit.cli import main


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """The TrainConfig each `memfit train` builds; the run itself is not started."""
    import memfit.train.run

    configs: list[Any] = []

    def fake_train(cfg: Any) -> Any:
        configs.append(cfg)
        return SimpleNamespace(
            stopped="done", output_dir=tmp_path, steps=0, samples_seen=0, eval_metrics={}
        )

    monkeypatch.setattr(memfit.train.run, "train", fake_train)
    # "m" names no model: the check of a model by name before torch loads is
    # tests/unit/train/test_model_by_name.py's; here only the flags are read
    monkeypatch.setattr("memfit.commands.train.by_name_problem", lambda *_: None)
    monkeypatch.delenv("SM_MODEL_DIR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return configs


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    base = ["train", "--task", "classification", "--model", "m", "--train-file", "t.csv"]
    try:
        main([*base, "--output-dir", "out", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


HF = [
    "--learning-rate", "1e-4", "--num-train-epochs", "3", "--per-device-train-batch-size", "4",
    "--gradient-accumulation-steps", "2", "--save-steps", "10", "--eval-steps", "5", "--bf16",
]  # fmt: skip
MEMFIT = [
    "--lr", "1e-4", "--epochs", "3", "--micro-batch-size", "4",
    "--gradient-accumulation-steps", "2", "--save-every", "10", "--eval-every", "5",
    "--precision", "bf16",
]  # fmt: skip


def test_hf_spellings_give_the_same_run(
    capsys: pytest.CaptureFixture[str], captured: list[Any]
) -> None:
    assert _train(capsys, *HF)[0] == 0
    assert _train(capsys, *MEMFIT)[0] == 0
    hf, ours = (dataclasses.asdict(cfg) for cfg in captured)
    assert hf == ours
    assert (hf["lr"], hf["epochs"], hf["save_every"], hf["eval_every"]) == (1e-4, 3, 10, 5)
    assert hf["precision"] == "bf16" and hf["micro_batch_size"] == 4
    # as in HF: the effective batch is the per-device batch × accumulation × ranks
    assert hf["effective_batch_size"] == 4 * 2


@pytest.mark.parametrize(
    ("argv", "world", "effective"),
    [
        (["--per-device-train-batch-size", "8"], 1, 8),
        (["--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "4"], 1, 32),
        (["--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "3"], 2, 12),
        (["--micro-batch-size", "2", "--gradient-accumulation-steps", "3"], 2, 12),
    ],
)
def test_effective_batch_follows_from_per_device_batch(
    capsys: pytest.CaptureFixture[str],
    captured: list[Any],
    argv: list[str],
    world: int,
    effective: int,
) -> None:
    assert _train(capsys, *argv, "--world-size", str(world))[0] == 0
    assert captured[-1].effective_batch_size == effective


def test_agreeing_alias_and_flag_are_one_setting(
    capsys: pytest.CaptureFixture[str], captured: list[Any]
) -> None:
    assert _train(capsys, "--lr", "2e-5", "--learning-rate", "2e-5", "--fp16")[0] == 0
    assert captured[-1].lr == 2e-5 and captured[-1].precision == "fp16"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--lr", "1e-4", "--learning-rate", "2e-4"], ("--lr", "--learning-rate")),
        (["--epochs", "1", "--num-train-epochs", "2"], ("--epochs", "--num-train-epochs")),
        (
            ["--micro-batch-size", "4", "--per-device-train-batch-size", "8"],
            ("--micro-batch-size", "--per-device-train-batch-size"),
        ),
        (["--save-every", "5", "--save-steps", "6"], ("--save-every", "--save-steps")),
        (["--eval-every", "5", "--eval-steps", "6"], ("--eval-every", "--eval-steps")),
        (["--bf16", "--fp16"], ("--bf16", "--fp16")),
        (["--precision", "fp32", "--bf16"], ("--precision", "--bf16")),
    ],
)
def test_disagreeing_alias_and_flag_are_refused(
    capsys: pytest.CaptureFixture[str],
    captured: list[Any],
    argv: list[str],
    named: tuple[str, ...],
) -> None:
    code, err = _train(capsys, *argv)
    assert code == 2 and not captured
    assert err.startswith("memfit: error:") and err.count("\n") == 1
    assert all(flag in err for flag in named), err


def test_aliases_are_named_once_on_their_flags_line(capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.commands.train import HF_ALIASES, PRECISION_SWITCHES

    try:
        main(["train", "--help"])
    except SystemExit as exc:
        assert not exc.code
    # without whitespace: the words however the help wrapped them
    text = "".join(capsys.readouterr().out.split())
    for alias in (*HF_ALIASES, *PRECISION_SWITCHES):
        assert text.count(alias) == 1, alias
        assert re.search(rf"Alias(es)?:[^.]*{re.escape(alias)}[,.]", text), alias
        assert f"{alias}<" not in text  # not listed as a flag of its own
