"""``memfit train --lora-dropout``: the adapters' dropout reaches peft's LoraConfig (and the adapter
folder), as the estimator builds it; 0 is peft's nn.Identity (no dropped copy of the input kept
for backward, and a LoRA run whose weights a capped and an uncapped run can compare). Refused
outside [0, 1) and without --lora-rank, in one line, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from memfit.cli import main
from memfit.estimate.workload import StepSpec, build_model
from memfit.train import TrainConfig
from memfit.train.config import config_problems
from memfit.train.lora import add_lora


def _dropouts(model: nn.Module) -> list[nn.Module]:
    """The dropout module of every LoRA layer (peft's ``lora_dropout`` ModuleDict)."""
    return [
        m["default"]
        for name, m in model.named_modules()
        if name.endswith("lora_dropout") and isinstance(m, nn.ModuleDict)
    ]


@pytest.mark.parametrize(("given", "expected"), [(None, 0.1), (0.0, 0.0), (0.05, 0.05)])
def test_the_flag_reaches_peft_s_lora_config_as_the_estimator_builds_it(
    tiny_bert: str, given: float | None, expected: float
) -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_bert)

    class Recipe:
        model = transformers.AutoModelForSequenceClassification.from_config(config)

    recipe = Recipe()
    cfg = TrainConfig(
        task="classification",
        model=tiny_bert,
        train_file="-",
        output_dir="-",
        lora_rank=4,
        lora_dropout=given,
    )
    add_lora(recipe, cfg)
    assert recipe.model.peft_config["default"].lora_dropout == expected
    trained = _dropouts(recipe.model)
    assert trained
    if expected == 0:
        assert all(type(m) is nn.Identity for m in trained)
    else:
        assert all(type(m) is nn.Dropout and m.p == expected for m in trained)
    # the estimator's model of the same job: the same modules in the same places
    spec = StepSpec(task="classification", lora_rank=4, lora_dropout=expected)
    estimated = build_model(config, spec)
    assert [(type(m), getattr(m, "p", None)) for m in _dropouts(estimated)] == [
        (type(m), getattr(m, "p", None)) for m in trained
    ]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"lora_rank": 4, "lora_dropout": 1.5}, "--lora-dropout: must be a number in [0, 1)"),
        ({"lora_rank": 4, "lora_dropout": float("nan")}, "--lora-dropout: must be a number"),
        ({"lora_dropout": 0.05}, "--lora-dropout: only with --lora-rank R"),
        ({"lora_rank": 0, "lora_dropout": 0.0}, "--lora-dropout: only with --lora-rank R"),
    ],
)
def test_config_problems_name_the_flag(tmp_path: Path, knobs: dict[str, Any], message: str) -> None:
    data = tmp_path / "train.csv"
    data.write_text("text,label\na,1\nb,0\n")
    cfg = TrainConfig(
        task="classification",
        model="m",
        train_file=str(data),
        output_dir=str(tmp_path / "out"),
        device="cpu",
        **knobs,
    )
    found = [p for p in config_problems(cfg) if p.startswith("--lora-dropout")]
    assert len(found) == 1 and message in found[0]


def _train(tmp_path: Path, model: str, *extra: str) -> tuple[int, Path]:
    data = tmp_path / "train.csv"
    data.write_text("text,label\nthe cat sat,1\nthe dog ran,0\n")
    out = tmp_path / "out"
    args = ["train", "--task", "classification", "--model", model, "--train-file", str(data)]
    args += ["--output-dir", str(out), "--device", "cpu", *extra]
    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0), out
    return 0, out


def test_cli_dropout_of_1_5_exits_2_in_one_line_and_writes_nothing(
    tmp_path: Path, bert_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _train(tmp_path, bert_dir, "--lora-rank", "4", "--lora-dropout", "1.5")
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "memfit: error: --lora-dropout: must be a number in [0, 1), got 1.5"
    assert not out.exists()


def test_train_help_shows_the_flag_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        main(["train", "--help"])
    except SystemExit as exc:
        assert not exc.code
    text = " ".join(capsys.readouterr().out.split())
    assert "--lora-dropout" in text
    # its own help: up to the next option (its help names --lora-rank, which is no option start)
    after = text.split("--lora-dropout", 1)[1].split(" --", 2)
    own = " --".join(after[:2])
    assert "[0, 1)" in own and "[default: 0.1]" in own and "Only with --lora-rank" in own


def test_a_lora_run_without_dropout_saves_it_in_the_adapter_folder(
    tmp_path: Path, bert_dir: str
) -> None:
    code, out = _train(
        tmp_path, bert_dir, "--lora-rank", "2", "--lora-dropout", "0", "--max-steps", "1"
    )
    assert code == 0
    saved = json.loads((out / "model" / "adapter_config.json").read_text())
    assert saved["lora_dropout"] == 0.0
    assert json.loads((out / "run.json").read_text())["config"]["lora_dropout"] == 0.0
