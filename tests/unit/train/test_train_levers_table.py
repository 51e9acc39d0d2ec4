"""memfit train consults the levers' one table (issue 31): what its runner cannot run (DeepSpeed
ZeRO or FSDP with LoRA, ...) is :meth:`memfit.levers.base.Lever.run_problems`, which the plan
and the doctor consult too; train keeps only the checks about its environment (the ranks
launched, the packages, the DeepSpeed file). The quantized base's BitsAndBytesConfig is the
lever's too, for the traced and the trained model alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.job import Job
from memfit.levers import sharding
from memfit.train import zero
from memfit.train.config import TrainConfig, config_problems

LAUNCH = "launch them: torchrun"


def _config(tmp_path: Path, **knobs: Any) -> TrainConfig:
    data = tmp_path / "train.csv"
    data.write_text("text,label\nhello there,1\ngood bye,0\n")
    settings: dict[str, Any] = dict(
        model="gpt2",
        task="classification",
        train_file=str(data),
        output_dir=str(tmp_path / "out"),
        device="cpu",
        effective_batch_size=8,
    )
    return TrainConfig(**(settings | knobs))


def test_train_refuses_what_the_levers_table_says_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row added to the table is refused by train with no change to train."""

    def run_problems(self: Any, job: Job) -> list[str]:
        return ["--sharding: a new row of the table"] if job.sharding == "fsdp" else []

    monkeypatch.setattr(sharding.Sharding, "run_problems", run_problems)
    assert "--sharding: a new row of the table" in config_problems(
        _config(tmp_path, sharding="fsdp")
    )
    assert "--sharding: a new row of the table" not in config_problems(_config(tmp_path))


def test_zero_and_fsdp_refusals_are_the_tables_in_the_order_they_were(tmp_path: Path) -> None:
    """Each refusal is the table's line, once, after the launch lines (as before issue 31)."""
    cfg = _config(
        tmp_path,
        sharding="zero2",
        task="sentence-embedding",
        optimizer="adafactor",
        lora_rank=8,
        world_size=2,
    )
    table = sharding.LEVER.run_problems(cfg)
    assert len(table) == 3  # sentence-embedding, the optimizer, LoRA
    problems = config_problems(cfg)
    assert [problems.count(line) for line in table] == [1, 1, 1]
    at = [problems.index(line) for line in table]
    assert at == sorted(at) and at == list(range(at[0], at[0] + 3))
    launch = [i for i, line in enumerate(problems) if LAUNCH in line]
    assert len(launch) == 2 and max(launch) < at[0]  # --world-size's and ZeRO's
    fsdp = _config(tmp_path, sharding="fsdp", lora_rank=8)
    assert sharding.LEVER.run_problems(fsdp) == [
        "--sharding: fsdp with --lora-rank is not supported; use --sharding none"
    ]
    assert config_problems(fsdp).count(sharding.LEVER.run_problems(fsdp)[0]) == 1


def test_a_deepspeed_file_gets_the_tables_zero_rows_whatever_sharding_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--deepspeed FILE without --sharding runs ZeRO (the file's stage): LoRA is refused as with
    --sharding zero2."""
    monkeypatch.setattr(zero, "deepspeed_verdict", lambda *args: None)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    line = (
        "--sharding: DeepSpeed ZeRO with --lora-rank/--quantization is not supported; use "
        "--sharding none"
    )
    problems = config_problems(_config(tmp_path, deepspeed=str(path), lora_rank=8))
    assert problems.count(line) == 1
    assert problems.index(line) > min(i for i, x in enumerate(problems) if LAUNCH in x)
    assert line not in config_problems(_config(tmp_path, lora_rank=8))


@pytest.mark.parametrize(
    ("quantization", "double_quant", "task", "precision"),
    [
        ("nf4", True, "causal-lm", "bf16"),
        ("fp4", None, "classification", None),
        ("int8", None, "classification", "fp16"),
        ("int8", None, "causal-lm", None),
    ],
)
def test_the_traced_and_the_trained_base_load_with_the_same_settings(
    tmp_path: Path, quantization: str, double_quant: bool | None, task: str, precision: str | None
) -> None:
    """train's BitsAndBytesConfig and the estimator's differ only in the modules they keep (the
    estimator lists transformers' defaults; train leaves a causal LM's to transformers)."""
    import torch

    from memfit.estimate.quantized import bitsandbytes_config
    from memfit.estimate.workload import StepSpec
    from memfit.train.quantization import load_options

    cfg = _config(
        tmp_path,
        task=task,
        lora_rank=8,
        quantization=quantization,
        double_quant=double_quant,
        precision=precision,
    )
    trained = load_options(cfg, torch.device("cpu"))["quantization_config"].to_dict()
    spec = StepSpec(
        task=task,
        quantization=quantization,
        double_quant=bool(double_quant),
        precision=precision or "fp32",
    )
    kept = trained["llm_int8_skip_modules"] or []
    traced = bitsandbytes_config(spec, kept).to_dict()
    assert traced | {"llm_int8_skip_modules": None} == trained | {"llm_int8_skip_modules": None}
    assert trained["llm_int8_threshold"] == 6.0
    assert trained["bnb_4bit_use_double_quant"] is bool(double_quant)
