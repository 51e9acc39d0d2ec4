"""The run configuration file: what ``memfit plan --write-config`` writes and ``memfit train``
reads, unchanged.

A flat YAML mapping: the job (model, task, data), then the plan's keys. Unknown keys are an error
naming the file and line (a typo must not be silently ignored).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UsageError

JOB_KEYS = (
    "model",
    "task",
    "num_labels",
    "loss",
    "seq_len",
    "effective_batch_size",
    "train_file",
    "text_column",
    "label_column",
    "tokenizer",
    "attn_implementation",
)
# the ``plan`` object of ``memfit plan --json`` (a contract), plus the LoRA rank
PLAN_KEYS = (
    "micro_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "sharding",
    "precision",
    "gradient_checkpointing",
    "optimizer",
    "max_seq_len",
    "loss",
    "mini_batch_size",
    "max_tokens_per_micro_batch",
)
RECORD_KEYS = ("gpu", "budget_bytes", "safety_margin", "predicted_peak_bytes")
# memfit train's LoRA and tracker settings, accepted in a config file as well as flags
TRAIN_KEYS = ("lora_target_modules", "merge_lora", "report_to")
KNOWN_KEYS = tuple(dict.fromkeys((*JOB_KEYS, *PLAN_KEYS, "lora_rank", *TRAIN_KEYS, *RECORD_KEYS)))
REQUIRED_KEYS = ("model", "task", "seq_len", "micro_batch_size", "gradient_accumulation_steps")


def write_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write ``config`` as YAML, atomically (a temporary file renamed into place)."""
    path = Path(path)
    unknown = [k for k in config if k not in KNOWN_KEYS]
    if unknown:
        raise ValueError(f"unknown config keys {unknown}")
    ordered = {k: config[k] for k in KNOWN_KEYS if k in config}
    text = "# memfit run configuration (memfit plan --write-config); memfit train reads it\n"
    text += yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"--write-config: {path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a run configuration; one-line errors with the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise UsageError(f"{path}{line}: {problem}") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{path}: not a YAML mapping of settings")
    lines = {
        line.split(":", 1)[0].strip(): n
        for n, line in enumerate(text.splitlines(), start=1)
        if ":" in line and not line.lstrip().startswith("#")
    }
    for key in loaded:
        if key not in KNOWN_KEYS:
            raise UsageError(f"{path}, line {lines.get(str(key), '?')}: unknown setting {key!r}")
    missing = [k for k in REQUIRED_KEYS if loaded.get(k) is None]
    if missing:
        raise UsageError(f"{path}: missing setting {missing[0]!r}")
    return loaded
