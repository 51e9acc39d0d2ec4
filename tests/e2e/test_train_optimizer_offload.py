"""`memfit train --optimizer-offload cpu` on the CPU device: host and device are the same memory,
so what runs is the update torchao's CPUOffloadOptimizer runs on its host copies (torch's fused
CPU AdamW; torchao itself needs CUDA or XPU), run.json says so, and the weights equal a run
without it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli_run import run_ok

pytestmark = pytest.mark.slow  # two training runs

WORDS = [f"w{i}" for i in range(60)]


def _data(path: Path) -> Path:
    rng = random.Random(1)
    lines = ["text,label"]
    for _ in range(24):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        lines.append(f"{' '.join(words)},{int('w7' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_optimizer_offload_on_the_cpu_ends_with_the_weights_of_a_run_without(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _data(tmp_path / "train.csv")
    args = ["train", "--task", "classification", "--model", tiny_classifier]
    args += ["--train-file", str(data), "--effective-batch-size", "8", "--micro-batch-size", "4"]
    args += ["--optimizer", "adamw", "--lr", "0.001", "--seed", "3", "--device", "cpu"]
    args += ["--epochs", "2", "--weight-decay", "0.01"]
    run_ok(*args, "--output-dir", str(tmp_path / "plain"))
    run_ok(*args, "--output-dir", str(tmp_path / "offload"), "--optimizer-offload", "cpu")
    a = load_file(str(tmp_path / "plain" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "offload" / "model" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    resolved = json.loads((tmp_path / "offload" / "run.json").read_text())["resolved"]
    assert resolved["optimizer_offload"].startswith("none: on the CPU device")
    assert "fused" in resolved["optimizer_offload"]
    plain = json.loads((tmp_path / "plain" / "run.json").read_text())["resolved"]
    assert plain["optimizer_offload"] is None
