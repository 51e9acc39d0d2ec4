"""SageMaker-style jobs: the environment as memfit train's defaults, hyperparameters as JSON strings
decoded and checked, explicit flags winning, the final model copied into SM_MODEL_DIR."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main
from memfit.errors import UsageError
from memfit.train import TrainConfig, sagemaker
from memfit.train.sagemaker import environment_settings, hyperparameters, publish_model


@pytest.fixture(autouse=True)
def _no_checkpoint_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # this machine's /opt/ml/checkpoints (if any) must not leak into the tests
    monkeypatch.setattr(sagemaker, "CHECKPOINT_DIR", tmp_path / "no-checkpoints")


def test_nothing_without_a_managed_environment() -> None:
    assert environment_settings({"HOME": "/root"}, TrainConfig) == {}


def test_channels_and_folders_are_the_defaults(tmp_path: Path) -> None:
    env = {
        "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
        "SM_CHANNEL_EVAL": "/opt/ml/input/data/eval",
        "SM_CHANNEL_MODEL": "/opt/ml/input/data/model",
        "SM_MODEL_DIR": "/opt/ml/model",
        "SM_OUTPUT_DATA_DIR": str(tmp_path / "output"),
    }
    assert environment_settings(env, TrainConfig) == {
        "train_file": "/opt/ml/input/data/train",
        "eval_file": "/opt/ml/input/data/eval",
        "model": "/opt/ml/input/data/model",
        "output_dir": str(tmp_path / "output"),
    }


def test_the_checkpoint_folder_wins_and_a_restarted_job_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    monkeypatch.setattr(sagemaker, "CHECKPOINT_DIR", checkpoints)
    env = {"SM_OUTPUT_DATA_DIR": str(tmp_path / "output")}
    assert environment_settings(env, TrainConfig) == {"output_dir": str(checkpoints)}
    (checkpoints / "run.json").write_text("{}")  # the job ran here before a spot interruption
    assert environment_settings(env, TrainConfig)["resume"] is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('"3"', 3),  # a JSON string holding the number, as the SDK double-encodes
        ("3", 3),
        (3, 3),
        ("3.0", 3),
    ],
)
def test_whole_numbers_arrive_in_every_encoding(value: Any, expected: int) -> None:
    env = {"SM_HPS": json.dumps({"epochs": value})}
    assert hyperparameters(env, TrainConfig) == {"epochs": expected}


def test_hyperparameters_take_each_settings_type() -> None:
    hps = {
        "model": json.dumps("bert-base-uncased"),
        "task": "classification",  # a plain word, not JSON
        "lr": "0.1",
        "warmup-ratio": '"0.25"',
        "group_by_length": "true",
        "probe": "False",
        "max_grad_norm": "null",
        "labels": "neg,pos",
        "lora_target_modules": json.dumps(["attention", "mlp"]),
        "gpu_memory": json.dumps("16GiB"),
        "num_train_epochs": "2",
        "sagemaker_program": json.dumps("train_entry.py"),
        "sagemaker_region": json.dumps("eu-west-1"),
    }
    assert hyperparameters({"SM_HPS": json.dumps(hps)}, TrainConfig) == {
        "model": "bert-base-uncased",
        "task": "classification",
        "lr": 0.1,
        "warmup_ratio": 0.25,
        "group_by_length": True,
        "probe": False,
        "max_grad_norm": None,
        "labels": ["neg", "pos"],
        "lora_target_modules": ["attention", "mlp"],
        "gpu_memory": 16 * 2**30,
        "epochs": 2,
    }


def test_sm_hp_variables_and_sm_hps_over_them() -> None:
    env = {"SM_HP_SEED": "7", "SM_HP_LR": "0.5", "SM_HPS": json.dumps({"lr": "0.01"})}
    assert hyperparameters(env, TrainConfig) == {"seed": 7, "lr": 0.01}


def test_unknown_and_bad_hyperparameters_are_named_all_at_once() -> None:
    hps = {"epochs": '"three"', "lr": "fast", "warmup_steps": "10", "dropout": "0.1"}
    with pytest.raises(UsageError) as caught:
        hyperparameters({"SM_HPS": json.dumps(hps)}, TrainConfig)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(
        "SM_HPS: hyperparameters memfit train does not take: dropout, warmup_steps"
    )
    assert "SM_HPS: hyperparameter 'epochs': 'three' is not a whole number" in lines
    assert "SM_HPS: hyperparameter 'lr': 'fast' is not a number" in lines


def test_a_bad_size_and_a_broken_sm_hps_are_named() -> None:
    with pytest.raises(
        UsageError, match=r"SM_HP_MEMORY_CAP: hyperparameter 'memory_cap': .*16 gigs"
    ):
        hyperparameters({"SM_HP_MEMORY_CAP": "16 gigs"}, TrainConfig)
    with pytest.raises(UsageError, match="SM_HPS: not a JSON object"):
        hyperparameters({"SM_HPS": "[1, 2]"}, TrainConfig)


def test_publish_copies_the_model_into_sm_model_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "model" / "sub").mkdir(parents=True)
    (run / "model" / "model.safetensors").write_bytes(b"weights")
    (run / "model" / "sub" / "x.json").write_text("{}")
    target = tmp_path / "sm-model"
    target.mkdir()
    assert publish_model(run, {"SM_MODEL_DIR": str(target)}) == target.resolve()
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert (target / "sub" / "x.json").is_file()
    assert publish_model(run, {}) is None
    # the run folder inside SM_MODEL_DIR: packed with it already, nothing to copy
    assert publish_model(run, {"SM_MODEL_DIR": str(run)}) is None


def _write_data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text(
        "text,label\n" + "".join(f"the cat sat {i},{i % 2}\n" for i in range(8))
    )
    return data


def test_memfit_train_runs_with_no_data_flags_and_flags_win(
    tmp_path: Path, bert_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _write_data(tmp_path)
    output, model_dir = tmp_path / "output", tmp_path / "sm-model"
    model_dir.mkdir()
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(data))
    monkeypatch.setenv("SM_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(output))
    hps = {"task": '"classification"', "max_steps": "1", "lr": "0.5", "device": '"cpu"'}
    monkeypatch.setenv("SM_HPS", json.dumps(hps))
    main(["train", "--model", bert_dir, "--lr", "0.01", "--effective-batch-size", "4"])
    run = json.loads((output / "run.json").read_text())
    assert run["config"]["lr"] == 0.01  # the flag, not the hyperparameter
    assert run["config"]["max_steps"] == 1 and run["config"]["train_file"] == str(data)
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def test_a_bad_hyperparameter_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "output"
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(output))
    monkeypatch.setenv("SM_HP_EFFECTIVE_BATCH_SIZE", "lots")
    with pytest.raises(SystemExit) as done:
        main(["train"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert "SM_HP_EFFECTIVE_BATCH_SIZE: hyperparameter 'effective_batch_size'" in err
    assert not output.exists()


def test_the_readme_estimator_hyperparameters_are_all_taken() -> None:
    # the shipped example: its hyperparameters, encoded as the SDK sends them, read cleanly
    import ast
    import re

    readme = Path(__file__).resolve().parents[3] / "examples" / "sagemaker" / "README.md"
    block = re.search(r"hyperparameters=(\{.*?\n    \})", readme.read_text(), re.S)
    assert block is not None
    source = re.sub(r"#[^\n]*", "", block.group(1))
    given = ast.literal_eval(source)
    sent = {name: json.dumps(value) for name, value in given.items()}
    assert hyperparameters({"SM_HPS": json.dumps(sent)}, TrainConfig) == given
