"""What the end-to-end tests that run ``python -m memfit train`` in subprocesses share: the command
line of a case and an offline environment several runs can share the CPU in."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
