"""ZeRO-Offload in `memfit train`: the offload_optimizer section it runs (from --optimizer-offload
cpu or a --deepspeed file), what it still refuses, and the optimizer it steps with."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memfit.train.optim import make_optimizer, offload_implementation
from memfit.train.zero import (
    build_config,
    config_problems,
    optimizer_offload_of,
    resolve_optimizer_offload,
)


def _cfg(**knobs: object) -> SimpleNamespace:
    base = {"deepspeed": None, "sharding": "zero2", "max_grad_norm": 1.0}
    return SimpleNamespace(**(base | knobs))


def _write(tmp_path: Path, config: object) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_the_flag_adds_deepspeeds_offload_section() -> None:
    config, _ = build_config(
        _cfg(optimizer_offload="cpu"), stage=2, hidden_size=64, precision="bf16", micro=1
    )
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    plain, _ = build_config(_cfg(), stage=2, hidden_size=64, precision="bf16", micro=1)
    assert "offload_optimizer" not in plain["zero_optimization"]


def test_a_file_that_offloads_the_optimizer_runs_it_and_keeps_its_section(tmp_path: Path) -> None:
    section = {"device": "cpu", "pin_memory": False}
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": section}})
    assert config_problems(path, "zero2") == []
    cfg = _cfg(deepspeed=path, optimizer_offload=None)
    assert optimizer_offload_of(cfg) == "cpu"
    config, _ = build_config(
        _cfg(deepspeed=path, optimizer_offload="cpu"),
        stage=2,
        hidden_size=64,
        precision="fp32",
        micro=1,
    )
    assert config["zero_optimization"]["offload_optimizer"] == section
    # "device": "none" offloads nothing
    off = _write(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    )
    assert optimizer_offload_of(_cfg(deepspeed=off, optimizer_offload=None)) is None


@pytest.mark.parametrize(
    ("zero", "says"),
    [
        (
            {"stage": 3, "offload_param": {"device": "cpu"}},
            "zero_optimization.offload_param (ZeRO-3 parameter offload) is not run",
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
            'offload_optimizer.device is "nvme"; memfit train offloads the optimizer to "cpu"',
        ),
    ],
)
def test_what_memfit_does_not_run_is_one_line(tmp_path: Path, zero: dict, says: str) -> None:
    problems = config_problems(_write(tmp_path, {"zero_optimization": zero}), "none")
    assert len(problems) == 1 and says in problems[0], problems


def test_on_the_cpu_device_the_offloaded_step_is_torchs_fused_cpu_adamw() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = make_optimizer(
        "adamw", model, 1e-3, 0.01, offload="cpu", device=torch.device("cpu")
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(group["fused"] for group in optimizer.param_groups)
    plain = make_optimizer("adamw", model, 1e-3, 0.01)
    assert not any(group.get("fused") for group in plain.param_groups)
    said = offload_implementation("cpu", zero=False, device=torch.device("cpu"))
    assert said is not None and said.startswith("none: on the CPU device")
    assert "torchao" in str(offload_implementation("cpu", zero=False, device=torch.device("cuda")))
    assert "DeepSpeedCPUAdam" in str(
        offload_implementation("cpu", zero=True, device=torch.device("cpu"))
    )
    assert offload_implementation(None, zero=False, device=torch.device("cpu")) is None


def _offloading(tmp_path: Path, device: str = "cpu") -> str:
    return _write(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": device}}}
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-8bit", "paged-adamw-32bit", "adafactor"])
def test_a_file_that_offloads_refuses_what_zero_offload_does_not_step(
    tmp_path: Path, optimizer: str
) -> None:
    # DeepSpeedCPUAdam would run in their place, silently
    path = _offloading(tmp_path)
    cfg = _cfg(deepspeed=path, optimizer_offload=None, optimizer=optimizer)
    (line,) = resolve_optimizer_offload(cfg)
    assert line.startswith(f"--deepspeed {path}: zero_optimization.offload_optimizer cpu:")
    assert f"--optimizer {optimizer}" in line


def test_a_file_that_offloads_makes_the_run_offloaded(tmp_path: Path) -> None:
    # the plan and the estimate inside train price cfg.optimizer_offload: the file's
    cfg = _cfg(deepspeed=_offloading(tmp_path), optimizer_offload=None, optimizer="adamw")
    assert resolve_optimizer_offload(cfg) == []
    assert cfg.optimizer_offload == "cpu"
    off = _cfg(deepspeed=_offloading(tmp_path, "none"), optimizer_offload=None, optimizer="adamw")
    assert resolve_optimizer_offload(off) == []
    assert off.optimizer_offload == "none"
    plain = _cfg(deepspeed=_write(tmp_path, {"zero_optimization": {"stage": 2}}), optimizer="sgd")
    plain.optimizer_offload = None
    assert resolve_optimizer_offload(plain) == []
    assert plain.optimizer_offload is None


@pytest.mark.parametrize(("flag", "device"), [("cpu", "none"), ("none", "cpu")])
def test_the_flag_and_the_file_disagreeing_is_one_line(
    tmp_path: Path, flag: str, device: str
) -> None:
    path = _offloading(tmp_path, device)
    cfg = _cfg(deepspeed=path, optimizer_offload=flag, optimizer="adamw")
    assert resolve_optimizer_offload(cfg) == [
        f"--optimizer-offload {flag} but --deepspeed {path}: "
        f'zero_optimization.offload_optimizer.device is "{device}"; make them agree (or leave '
        "--optimizer-offload out)"
    ]
    assert cfg.optimizer_offload == flag


def test_train_config_problems_say_the_files_offload(tmp_path: Path) -> None:
    from memfit.train.config import TrainConfig
    from memfit.train.config import config_problems as train_problems

    path = _offloading(tmp_path, "none")
    cfg = TrainConfig(
        model="m",
        task="causal-lm",
        train_file=str(tmp_path / "t.jsonl"),
        deepspeed=path,
        optimizer_offload="cpu",
        output_dir=str(tmp_path / "out"),
    )
    assert any(x.startswith("--optimizer-offload cpu but --deepspeed") for x in train_problems(cfg))
