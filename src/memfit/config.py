"""The run configuration file: what ``memfit plan --write-config`` writes and ``memfit train``
reads, unchanged.

A flat YAML mapping: the job (model, task, data), then the plan's keys. Unknown keys are an error
naming the file and line (a typo must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UsageError
from memfit.job import JOB_FIELDS, Job
from memfit.paths import is_user_os_error

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
# memfit train's LoRA, tracker and instruction-data settings, accepted in a config file as well
# as flags
TRAIN_KEYS = (
    "lora_target_modules",
    "merge_lora",
    "report_to",
    "prompt_column",
    "completion_column",
    "messages_column",
)
# every knob of the job is a setting (a new knob of memfit.job is one with no change here)
KNOWN_KEYS = tuple(dict.fromkeys((*JOB_KEYS, *PLAN_KEYS, *JOB_FIELDS, *TRAIN_KEYS, *RECORD_KEYS)))
REQUIRED_KEYS = ("model", "task", "seq_len", "micro_batch_size", "gradient_accumulation_steps")


def write_config(path: str | Path, config: dict[str, Any], *, flag: str = "--write-config") -> Path:
    """Write ``config`` as YAML, atomically (a temporary file renamed into place): a full disk
    or a folder that cannot be written is a UsageError naming ``flag``, and leaves nothing."""
    path = Path(path)
    unknown = [k for k in config if k not in KNOWN_KEYS]
    if unknown:
        raise ValueError(f"unknown config keys {unknown}")
    ordered = {k: config[k] for k in KNOWN_KEYS if k in config}
    text = "# memfit run configuration (memfit plan --write-config); memfit train reads it\n"
    text += yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag}: {path}: folder {folder} does not exist")
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if not is_user_os_error(exc):
            raise
        raise UsageError(f"{flag}: {path}: {exc.strerror or exc}; nothing was written") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


# the type of each setting: what a config file may give (a null is "not set": the default); the
# job's knobs by their annotations in memfit.job
def _job_keys(kind: str) -> frozenset[str]:
    return frozenset(
        f.name for f in dataclasses.fields(Job) if str(f.type).replace(" | None", "") == kind
    )


_INT_KEYS = _job_keys("int") | {"budget_bytes", "predicted_peak_bytes"}
_BOOL_KEYS = _job_keys("bool") | {"merge_lora"}
_FLOAT_KEYS = _job_keys("float") | {"safety_margin"}
# a text, or a list of texts (several text columns; LoRA targets as a list)
_TEXT_OR_LIST_KEYS = _job_keys("list[str]") | {"text_column", "report_to"}


def _type_problem(key: str, value: Any) -> str | None:
    """What is wrong with the type of ``value`` for ``key`` (None: it is right)."""
    shown = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    if key in _INT_KEYS:
        if isinstance(value, int) and not isinstance(value, bool):
            return None
        return f"{key} must be a whole number (like 8), got {shown}"
    if key in _BOOL_KEYS:
        if isinstance(value, bool):
            return None
        return f"{key} must be true or false, got {shown}"
    if key in _FLOAT_KEYS:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return None
        return f"{key} must be a number, got {shown}"
    if isinstance(value, str):
        return None
    if key in _TEXT_OR_LIST_KEYS and isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return None
        return f"{key} must be a text or a list of texts, got {shown}"
    hint = " (quote it)" if isinstance(value, int | float | bool) else ""
    return f"{key} must be a text{hint}, got {shown}"


class _Problem(Exception):
    """A problem at a line of the config file (1-based)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def _bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    """true/false only: YAML 1.1's yes/no/on/off stay texts (``text_column: no`` is a name)."""
    value = loader.construct_scalar(node)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping whose keys are each given once: the second one is a problem at its line."""
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:
            raise _Problem(line, "a setting's name must be a plain word") from None
        if first is not None:
            raise _Problem(line, f"{key!r} is set twice (first at line {first}); keep one")
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with duplicate keys refused and only true/false as booleans."""


_Loader.add_constructor("tag:yaml.org,2002:map", _mapping)
_Loader.add_constructor("tag:yaml.org,2002:bool", _bool)


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; one line naming it (and the line of a bad byte) otherwise."""
    if path.is_dir():
        raise UsageError(f"{path}: is a folder, not a config file")
    if not path.is_file():
        raise UsageError(f"{path}: no such config file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file "
            "as UTF-8"
        ) from None


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a run configuration; one-line errors with the file and line.

    Every setting is known, given once and of its type (whole numbers for counts, true/false for
    switches, texts for names); a setting given as null is left out (its default applies).
    """
    path = Path(path)
    text = _read_text(path)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        loaded = loader.construct_document(node) if node is not None else None
    except _Problem as exc:
        raise UsageError(f"{path}, line {exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise UsageError(f"{path}{line}: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(loaded, dict):
        raise UsageError(f"{path}: not a YAML mapping of settings")
    assert isinstance(node, yaml.MappingNode)
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k.value, str)}
    for key, value in loaded.items():
        where = f"{path}, line {lines.get(str(key), '?')}"
        if key not in KNOWN_KEYS:
            raise UsageError(f"{where}: unknown setting {key!r}")
        if value is None:
            continue
        problem = _type_problem(key, value)
        if problem is not None:
            raise UsageError(f"{where}: {problem}")
    loaded = {k: v for k, v in loaded.items() if v is not None}
    missing = [k for k in REQUIRED_KEYS if loaded.get(k) is None]
    if missing:
        raise UsageError(f"{path}: missing setting {missing[0]!r}")
    return loaded
