"""Managed training (SageMaker and services that copy its contract): the job's environment as the
defaults of ``memfit train``, so the same command runs there with no data or output flags.

What is read (each only where it is set; flags and the config file win over all of it):

- ``SM_CHANNEL_TRAIN`` → ``--train-file``, ``SM_CHANNEL_EVAL`` → ``--eval-file`` (channel
  folders: memfit reads every data file in them, in name order), ``SM_CHANNEL_MODEL`` →
  ``--model`` (a model handed in as a channel, for jobs without network access);
- ``--output-dir`` (metrics, events, checkpoints, run.json): ``/opt/ml/checkpoints`` where the
  job has one (SageMaker makes it when the estimator sets ``checkpoint_s3_uri`` and syncs it to
  S3; a restarted spot job finds its run there, so ``--resume`` is then the default), else
  ``SM_OUTPUT_DATA_DIR`` (uploaded as ``output.tar.gz`` when the job ends);
- hyperparameters: ``SM_HPS`` (a JSON object) and ``SM_HP_<NAME>`` variables, under
  ``memfit train``'s setting names (``effective_batch_size``, ``lr``, ``epochs``, ``lora_rank``;
  ``-`` may stand for ``_``; ``learning_rate``, ``num_train_epochs`` and ``model_name_or_path``
  are taken as the Trainer names they are). The SageMaker SDK sends every value as a JSON string
  (``"3"``, ``"\\"bert-base-uncased\\""``): each is decoded, then read as the setting's type. An
  unknown name, or a value that is not of its setting's type, is exit 2 naming it; SageMaker's
  own ``sagemaker_*`` entries are skipped.

When the run is done, rank 0 copies ``DIR/model`` into ``SM_MODEL_DIR`` (what SageMaker packs as
``model.tar.gz`` for deployment; hard links where the disk allows). Several GPUs or hosts: the
job's launcher (``torchrun``, the estimator's ``distribution={"torch_distributed": ...}``) sets
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``, which ``memfit train`` joins as under any launcher;
``SM_HOSTS``, ``SM_CURRENT_HOST`` and ``SM_NUM_GPUS`` are the launcher's business, not memfit's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.units import parse_size

CHANNELS = {
    "SM_CHANNEL_TRAIN": "train_file",
    "SM_CHANNEL_EVAL": "eval_file",
    "SM_CHANNEL_MODEL": "model",
}
# SageMaker's local path for checkpoint_s3_uri (the estimator's checkpoint_local_path default)
CHECKPOINT_DIR = Path("/opt/ml/checkpoints")
# the variables that say "this is a SageMaker-style job"
MARKERS = ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_HPS", "SM_TRAINING_ENV", *CHANNELS)
# Trainer-style names people already use in their estimators
ALIASES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "model_name_or_path": "model",
}
# sizes, read as memfit reads --gpu-memory and --memory-cap (16GiB, 16GB, bytes)
SIZES = ("gpu_memory", "memory_cap")


def on_managed_service(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name) for name in MARKERS) or any(
        name.startswith("SM_HP_") for name in environ
    )


def environment_settings(environ: Mapping[str, str], config_class: type) -> dict[str, Any]:
    """The settings the job's environment supplies (``config_class``'s field names: the
    :class:`~memfit.train.config.TrainConfig`); every problem with the hyperparameters at once."""
    if not on_managed_service(environ):
        return {}
    settings: dict[str, Any] = {}
    for variable, key in CHANNELS.items():
        if environ.get(variable):
            settings[key] = environ[variable]
    output = _output_dir(environ)
    if output is not None:
        settings["output_dir"] = str(output)
        if (output / "run.json").is_file():
            # the same job started again (a spot instance came back): go on from its checkpoint
            settings["resume"] = True
    settings.update(hyperparameters(environ, config_class))
    return settings


def _output_dir(environ: Mapping[str, str]) -> Path | None:
    if CHECKPOINT_DIR.is_dir():
        return CHECKPOINT_DIR
    if environ.get("SM_OUTPUT_DATA_DIR"):
        return Path(environ["SM_OUTPUT_DATA_DIR"])
    return None


def hyperparameters(environ: Mapping[str, str], config_class: type) -> dict[str, Any]:
    """``SM_HP_<NAME>`` variables, then ``SM_HPS`` over them, as settings of ``config_class``."""
    raw: dict[str, tuple[str, Any]] = {}  # setting name -> (where it came from, value)
    problems: list[str] = []
    for variable in sorted(environ):
        if variable.startswith("SM_HP_") and variable != "SM_HP_":
            raw[variable.removeprefix("SM_HP_").lower()] = (variable, environ[variable])
    if environ.get("SM_HPS"):
        try:
            loaded = json.loads(environ["SM_HPS"])
        except ValueError:
            loaded = None
        if not isinstance(loaded, dict):
            problems.append("SM_HPS: not a JSON object of hyperparameters")
        else:
            for name, value in loaded.items():
                raw[str(name)] = ("SM_HPS", value)
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    settings: dict[str, Any] = {}
    unknown: list[str] = []
    for name, (source, value) in raw.items():
        if name.lower().startswith("sagemaker_"):
            continue  # the SDK's own entries (program, submit directory, region, …)
        key = name.strip().replace("-", "_")
        key = ALIASES.get(key, key)
        if key not in fields:
            unknown.append(name)
            continue
        try:
            settings[key] = _coerce(_decode(value), str(fields[key].type), key)
        except ValueError as exc:
            problems.append(f"{source}: hyperparameter {name!r}: {exc}")
    if unknown:
        problems.insert(
            0,
            f"SM_HPS: hyperparameters memfit train does not take: {', '.join(sorted(unknown))} "
            "(it takes its flag names with _ for -, e.g. effective_batch_size, lr, epochs, "
            "lora_rank)",
        )
    if problems:
        raise UsageError("\n".join(problems))
    return settings


def _decode(value: Any) -> Any:
    """A hyperparameter as the SDK sent it: JSON text (``"3"``, ``"0.1"``, ``"true"``), a JSON
    string inside it (``"\\"3\\""``), or a plain word (``bert-base-uncased``)."""
    for _ in range(3):  # at most the SDK's encoding and the toolkit's again
        if not isinstance(value, str):
            return value
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        if decoded == value:
            return value
        value = decoded
    return value


def _coerce(value: Any, annotation: str, key: str) -> Any:
    """``value`` as a field annotated ``annotation`` (``int | None``, ``list[str] | None``…)."""
    optional = "None" in annotation
    base = annotation.replace("| None", "").replace("None |", "").strip()
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError("needs a value")
    if key in SIZES:
        try:
            return parse_size(value, name=key)
        except UsageError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None
    if base == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{value!r} is not true or false")
    if base == "int":
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a whole number")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number") from None
    if base == "float":
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a number") from None
    if base.startswith("list"):
        items = value if isinstance(value, list) else str(value).split(",")
        return [str(x).strip() for x in items if str(x).strip()]
    if isinstance(value, (dict, list)):
        raise ValueError(f"{value!r} is not a single value")
    return str(value)


def publish_model(output_dir: Path, environ: Mapping[str, str]) -> Path | None:
    """Copy the run's final model (``DIR/model``) into ``SM_MODEL_DIR``; the folder, or None
    where there is nothing to do (no ``SM_MODEL_DIR``, no model, or the run folder is in it)."""
    target = environ.get("SM_MODEL_DIR")
    model = Path(output_dir) / "model"
    if not target or not model.is_dir():
        return None
    destination = Path(target).resolve()
    if destination == Path(output_dir).resolve() or destination in model.resolve().parents:
        return None  # --output-dir inside SM_MODEL_DIR: the model is packed already
    _copy_folder(model, destination)
    return destination


def _copy_folder(source: Path, target: Path) -> None:
    """``source``'s files into ``target``: hard links where both are on one disk (a model is
    large, and on a managed service both folders are on the job's volume), copies otherwise."""

    def link_or_copy(src: str, dst: str) -> str:
        Path(dst).unlink(missing_ok=True)
        try:
            Path(dst).hardlink_to(src)
        except OSError:
            shutil.copy2(src, dst)
        return dst

    shutil.copytree(source, target, copy_function=link_or_copy, dirs_exist_ok=True)
