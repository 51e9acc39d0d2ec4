"""``memfit train --packing`` end to end with a tiny Llama on the CPU: a packed instruction run
(padding-free, best fit decreasing) resumes exactly after
kill -9: the packing is a pure function of the data, so the resumed run's steps hold the
uninterrupted run's rows (a resume with another strategy is refused: test_resume_packing)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from memfit_runs import offline_environment, train_command
from safetensors.torch import load_file

from tiny_models import SENTENCES, save_tiny_llama, write_jsonl

PAIRS = [
    {"prompt": "what is two plus two", "completion": " it is four"},
    {"prompt": "name a colour", "completion": " blue"},
    {"prompt": "the cat", "completion": " sat on the mat"},
    {"prompt": "hello there how are you", "completion": " i am fine thank you"},
    {"prompt": "what is", "completion": " two"},
    {"prompt": "blue is a", "completion": " colour"},
    {"prompt": "the cat sat on the", "completion": " mat"},
    {"prompt": "i am", "completion": " fine thank you"},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, SENTENCES)
    return str(folder)


def packed_flags(model: str, data: Path) -> dict[str, str | None]:
    return {
        "--task": "causal-lm",
        "--model": model,
        "--train-file": str(data),
        "--prompt-column": "prompt",
        "--completion-column": "completion",
        "--packing": None,
        "--max-seq-len": "24",
        # packed sequences per step: 2 of the file's few, so an epoch is a few steps
        "--effective-batch-size": "2",
        "--micro-batch-size": "1",
        "--epochs": "12",
        "--lr": "0.05",
        "--optimizer": "adamw",
        "--save-every": "1",
        "--save-total-limit": "2",
    }


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.slow
def test_a_packed_instruction_run_resumes_exactly_after_kill_9(llama: str, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", PAIRS * 2)
    whole_folder, killed_folder = tmp_path / "whole", tmp_path / "killed"
    for folder in (whole_folder, killed_folder):
        folder.mkdir()
    flags = packed_flags(llama, data)
    done = subprocess.run(
        train_command(whole_folder, flags),
        env=offline_environment(whole_folder),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    whole = whole_folder / "out"
    steps = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m.get("loss") is not None]
    assert len(steps) >= 12
    run = json.loads((whole / "run.json").read_text())
    assert run["config"]["packing"] is True and run["config"]["packing_strategy"] == "bfd"

    proc = subprocess.Popen(
        train_command(killed_folder, flags),
        env={**offline_environment(killed_folder), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = killed_folder / "out" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= len(steps) // 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert any((killed_folder / "out" / "checkpoints").glob("step-*")), "no checkpoint yet"
    resumed = subprocess.run(
        [*train_command(killed_folder, flags), "--resume"],
        env=offline_environment(killed_folder),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = weights(whole), weights(killed_folder / "out")
    assert expected.keys() == got.keys()
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) <= 1e-6
    events = [json.loads(x)["type"] for x in (killed_folder / "out" / "events.jsonl").open()]
    assert "resume" in events
