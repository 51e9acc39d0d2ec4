"""The DeepSpeed config `memfit train --sharding zeroN` runs, and the checks on `--deepspeed FILE`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from memfit.errors import UsageError
from memfit.estimate.sharding import deepspeed_zero_config
from memfit.train.zero import build_config, config_problems, read_config, stage_of


def _cfg(**knobs: object) -> SimpleNamespace:
    base = {"deepspeed": None, "sharding": "zero2", "max_grad_norm": 1.0}
    return SimpleNamespace(**(base | knobs))


def _write(tmp_path: Path, config: object) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config, indent=2))
    return str(path)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_without_a_file_the_zero_section_is_the_one_the_estimate_assumes(stage: int) -> None:
    config, notes = build_config(
        _cfg(sharding=f"zero{stage}"), stage=stage, hidden_size=384, precision="fp32", micro=4
    )
    assert notes == []
    assert config["zero_optimization"] == deepspeed_zero_config(f"zero{stage}", 384)
    # the guard owns the boundary and the batch: one backward per micro-batch, step() ends it
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_accumulation_steps"] == 1
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False


def test_precision_switches_deepspeeds_own_16_bit_mode() -> None:
    config, _ = build_config(_cfg(), stage=2, hidden_size=64, precision="bf16", micro=1)
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False


def test_a_users_file_has_its_auto_values_filled_and_memfits_keys_taken_back(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": 1000,
            },
            "train_batch_size": 64,
            "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR"},
        },
    )
    cfg = _cfg(deepspeed=path, sharding="none")
    assert stage_of(cfg) == 3
    config, notes = build_config(cfg, stage=3, hidden_size=100, precision="fp32", micro=2)
    zero = config["zero_optimization"]
    assumed = deepspeed_zero_config("zero3", 100)
    assert zero["reduce_bucket_size"] == assumed["reduce_bucket_size"] == 100 * 100
    assert zero["stage3_prefetch_bucket_size"] == assumed["stage3_prefetch_bucket_size"]
    assert zero["stage3_param_persistence_threshold"] == 1000  # the user's own value kept
    assert "optimizer" not in config and "scheduler" not in config
    assert "train_batch_size" not in config and config["gradient_accumulation_steps"] == 1
    assert any("optimizer and scheduler sections are left out" in n for n in notes)
    assert any("train_batch_size" in n for n in notes)


def test_a_file_that_enables_another_precision_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    with pytest.raises(UsageError, match=r"enables fp16 but the run.s precision is fp32"):
        build_config(_cfg(deepspeed=path), stage=2, hidden_size=64, precision="fp32", micro=1)


def test_a_file_that_is_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2},\n  oops\n}\n')
    with pytest.raises(UsageError, match=r"--deepspeed: .*ds.json: line 3: not valid JSON"):
        read_config(str(path))
    assert config_problems(str(path), "none")[0].startswith("--deepspeed: ")


@pytest.mark.parametrize(
    ("config", "sharding", "says"),
    [
        ({"zero_optimization": {"stage": 3}}, "zero2", "says ZeRO stage 3 but --sharding is zero2"),
        ({"zero_optimization": {"stage": 0}}, "none", "runs ZeRO stage 1, 2 or 3"),
        ({"zero_optimization": {"stage": "auto"}}, "none", 'stage is "auto"; name the stage'),
        ([1, 2], "zero2", "a DeepSpeed config is a JSON object"),
        ({"zero_optimization": {"stage": True}}, "none", "stage is true; memfit train runs"),
        ({"bf16": {"enabled": True}}, "none", "no zero_optimization.stage; name the stage"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            "none",
            "offload_param (ZeRO-3 parameter offload) is not run by memfit train",
        ),
    ],
)
def test_file_problems_are_one_line_each(
    tmp_path: Path, config: object, sharding: str, says: str
) -> None:
    problems = config_problems(_write(tmp_path, config), sharding)
    assert len(problems) == 1 and says in problems[0], problems


def test_a_missing_file_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    problems = config_problems(str(tmp_path / "absent.json"), "zero2")
    assert len(problems) == 1 and problems[0].startswith("--deepspeed: ")
    assert "absent.json" in problems[0]


def test_agreeing_file_and_flag_and_auto_with_a_flag_are_fine(tmp_path: Path) -> None:
    assert config_problems(_write(tmp_path, {"zero_optimization": {"stage": 2}}), "zero2") == []
    path = _write(tmp_path, {"zero_optimization": {"stage": "auto"}})
    assert config_problems(path, "zero3") == []
    assert stage_of(_cfg(deepspeed=path, sharding="zero3")) == 3


def test_a_stage_named_by_the_flag_needs_none_in_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {"bf16": {"enabled": "auto"}})
    assert config_problems(path, "zero2") == []
    assert stage_of(_cfg(deepspeed=path, sharding="zero2")) == 2


def test_the_files_precision_against_the_flag_is_checked_before_anything_starts(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    problems = config_problems(path, "none", "fp16")
    assert len(problems) == 1 and "enables bf16 but the run's precision is fp16" in problems[0]
    assert config_problems(path, "none", "bf16") == []


# --- issue 30: what DeepSpeed's own config model rejects, before anything starts -----------------
@pytest.mark.parametrize(
    ("config", "field", "says"),
    [
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
            "zero_optimization.reduce_bucket_size",
            "Input should be greater than 0, got -5",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "many"}},
            "zero_optimization.stage3_max_live_parameters",
            "Input should be a valid integer",
        ),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}},
            "zero_optimization.reduce_bucket_sise",
            "Extra inputs are not permitted",
        ),
        (
            {"zero_optimization": {"stage": 1}, "bf16": {"enabled": False, "bogus": 1}},
            "bf16.bogus",
            "Extra inputs are not permitted",
        ),
        (
            {"zero_optimization": {"stage": 1}, "comms_logger": {"enabled": "x"}},
            "comms_logger.enabled",
            "Input should be a valid boolean",
        ),
    ],
)
def test_what_deepspeeds_config_model_rejects_is_one_line_naming_the_field(
    tmp_path: Path, config: dict[str, object], field: str, says: str
) -> None:
    pytest.importorskip("deepspeed")
    path = _write(tmp_path, config)
    problems = config_problems(path, "none")
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"--deepspeed: {path}: {field}: "), problems
    assert says in problems[0] and "\n" not in problems[0]


def test_a_file_deepspeed_accepts_passes_its_auto_values_included(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    path = _write(
        tmp_path,
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "overlap_comm": True,
            },
            "bf16": {"enabled": "auto"},
            "train_batch_size": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        },
    )
    assert config_problems(path, "none") == []
    assert config_problems(path, "none", "bf16") == []
    # a 16-bit mode the file turns on, with the precision left to the plan
    path = _write(tmp_path, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert config_problems(path, "none") == []


def test_without_torchrun_a_bad_file_is_said_first_not_only_the_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One process: the file's problem is the first line (it was the launch line alone), the
    launch line after it; exit 2, no traceback, nothing written."""
    pytest.importorskip("deepspeed")
    from cli_run import run_cli

    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}})
    data = tmp_path / "train.csv"
    data.write_text("text,label\nhello there,1\ngood bye,0\n")
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "train", "--task", "classification", "--model", str(tmp_path / "no-model"),
        "--train-file", str(data), "--output-dir", str(out), "--deepspeed", path,
    )  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and not out.exists()
    assert lines[0] == (
        f"memfit: error: --deepspeed: {path}: zero_optimization.reduce_bucket_size: Input should "
        "be greater than 0, got -5 (DeepSpeed's config check)"
    )
    assert any("launch them: torchrun" in x for x in lines[1:])
