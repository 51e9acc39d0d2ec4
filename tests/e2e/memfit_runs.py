"""What the end-to-end tests that run ``python -m memfit train`` in subprocesses share: the command
line of a case and an offline environment several runs can share the CPU in."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def train_command(folder: Path, flags: dict[str, str | None]) -> list[str]:
    """``python -m memfit train`` with the tests' defaults (data under ``folder``), then ``flags``
    (a None value: a switch); a case's flags win over the defaults."""
    defaults: dict[str, str | None] = {
        "--output-dir": str(folder / "out"),
        "--cache-dir": str(folder / "cache"),
        "--device": "cpu",
        "--effective-batch-size": "4",
        "--micro-batch-size": "4",
        "--optimizer": "sgd",
        "--seed": "3",
    }
    command = [sys.executable, "-m", "memfit", "train"]
    for flag, value in (defaults | flags).items():
        command += [flag] if value is None else [flag, value]
    return command


def offline_environment(root: Path) -> dict[str, str]:
    """No network, a datasets cache of its own, one thread each (several runs share the CPU)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(root / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    return env


WORDS = [f"w{i}" for i in range(60)]


def classification_csv(path: Path, rows: int = 16) -> Path:
    """A classification CSV of ``rows`` rows: texts of 4 to 8 words, labels 0 and 1 in turn."""
    lines = ["text,label"]
    for i in range(rows):
        words = [WORDS[(i * 7 + k * 3) % 60] for k in range(4 + i % 5)]
        lines.append(f"{' '.join(words)},{i % 2}")
    path.write_text("\n".join(lines) + "\n")
    return path


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``folder``'s model.safetensors."""
    return load_file(str(folder / "model.safetensors"))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same tensors."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def events(out: Path) -> list[dict[str, Any]]:
    """A run folder's events.jsonl, one dict a line."""
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
