"""MODEL_DIR: which folder holds the model, which task it was trained for, and loading it.

MODEL_DIR is a run folder ``memfit train`` wrote (its ``model/`` is used) or any folder that
loads with transformers' ``AutoModelForSequenceClassification`` / ``AutoModelForCausalLM`` or with
``SentenceTransformer``, or a peft LoRA adapter folder (``adapter_config.json``: what ``memfit train
--lora-rank`` saves without ``--merge-lora``). The task is read from the folder, never guessed from
its name:

- ``modules.json`` (a sentence-transformers folder): ``sentence-embedding``;
- ``config.json``'s ``architectures``: ``…ForSequenceClassification`` is ``classification``,
  ``…ForCausalLM`` / ``…LMHeadModel`` is ``causal-lm``; an adapter folder's ``task_type``
  (``SEQ_CLS``, ``CAUSAL_LM``) says the same;
- anything else (a bare encoder such as ``BertModel``): ``memfit predict`` needs ``--task``;
  ``memfit embed`` wraps it with mean pooling, as sentence-transformers does.

An adapter folder runs on its base model (:func:`adapter_base`): ``--base-model``, else the
folder or cached Hub id its ``adapter_config.json`` names (``base_model_name_or_path``; memfit
train writes the absolute path of ``--model``). peft puts the adapters on it and merges them
(``merge_and_unload``: the same outputs as the model ``--merge-lora`` saves, and a plain model to
run); a classifier's head, which the adapter folder holds whole, comes with them. The base of a
QLoRA run is loaded unquantized: the adapters' update on the original weights, as ``--merge-lora``
deploys it. A base that is neither there nor given is one line that says what to do.

Loading never runs code from the folder (``trust_remote_code=False``) and never downloads
(``local_files_only=True``). A head the folder does not hold (``--task classification`` on a bare
encoder) would be initialized at random and give random answers: that is refused, not warned about.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)
from transformers.utils import logging as hf_logging

from memfit import progress
from memfit.errors import UsageError
from memfit.job import TASKS
from memfit.models.folder import (
    ADAPTER_CONFIG,
    TOKENIZER_FILES,
    by_name_problem,
    check_for_loader,
    hub_ids,
    hub_off,
    is_hub_id,
    load_checked,
    weights_cached,
)

T = TypeVar("T")

# memfit predict runs the tasks with a head; sentence embeddings are memfit embed's
PREDICT_TASKS = tuple(t for t in TASKS if t != "sentence-embedding")


# what memfit predict/embed fetch of a Hub repository: the model, its tokenizer and the
# sentence-transformers modules, not the other frameworks' copies of the weights
_SNAPSHOT_IGNORED = ["*.onnx", "onnx/*", "openvino/*", "*.h5", "*.msgpack", "*.ot", "*.tflite"]


def _snapshot(model: str) -> Path:
    """The local folder of Hub id ``model``: its snapshot in the Hugging Face cache, else
    downloaded where the Hub answers (huggingface_hub's ``snapshot_download``: the cache, the
    user's token and ``HF_ENDPOINT`` as everywhere else); one line when neither can be had."""
    # optional: huggingface_hub (transformers installs it)
    from huggingface_hub import snapshot_download

    for repo in hub_ids(model):
        try:
            with hub_off():
                return Path(snapshot_download(repo, local_files_only=True))
        except Exception:  # not in the cache (or an unreadable one): the next name, the Hub
            continue
    problem = by_name_problem(model, "MODEL_DIR", "memfit predict or embed")
    if problem:
        raise UsageError(problem)
    repo = hub_ids(model)[-1]
    progress.report(f"downloading {repo} from the Hugging Face Hub")
    try:
        return Path(snapshot_download(repo, ignore_patterns=_SNAPSHOT_IGNORED))
    except Exception as exc:  # the Hub answered, and said no (gated, missing, a network drop)
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"MODEL_DIR: cannot download {repo!r} from the Hub: {line}") from None


def model_folder(path: str | Path) -> Path:
    """The folder that holds the model: ``path``, or the ``model/`` of a ``memfit train`` run."""
    folder = Path(path).expanduser()
    if not folder.exists() and is_hub_id(str(path)):
        folder = _snapshot(str(path))
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise UsageError(f"MODEL_DIR: {folder} {what} (give a model folder or a memfit train run)")
    if _holds_model(folder):
        return folder
    if _holds_model(folder / "model"):
        return folder / "model"  # a run folder: DIR/model is what memfit train saved
    raise UsageError(
        f"MODEL_DIR: {folder} holds no model (no config.json or modules.json, and no model/ "
        "folder of a memfit train run)"
    )


def _holds_model(folder: Path) -> bool:
    return any(
        (folder / name).is_file() for name in ("config.json", "modules.json", ADAPTER_CONFIG)
    )


# peft's task types -> memfit's tasks
ADAPTER_TASKS = {"SEQ_CLS": "classification", "CAUSAL_LM": "causal-lm"}
# the flag that names an adapter folder's base
BASE_FLAG = "--base-model"


def adapter_settings(folder: Path) -> dict[str, Any] | None:
    """The ``adapter_config.json`` of a LoRA adapter folder (one that holds no whole model: no
    ``config.json``); None for any other folder."""
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        settings = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"MODEL_DIR: {folder / ADAPTER_CONFIG} is not JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise UsageError(f"MODEL_DIR: {folder / ADAPTER_CONFIG} is not a JSON object")
    return settings


def adapter_base(folder: Path, given: str | None = None) -> str:
    """The base model the LoRA adapters in ``folder`` run on: ``given`` (``--base-model``, a
    folder), else what ``adapter_config.json`` names, where it is a folder here or a Hub id in
    the Hugging Face cache (memfit predict and embed never download). A UsageError that says
    what to do where it is neither."""
    if given is not None:
        base = Path(given).expanduser()
        if not (base / "config.json").is_file() and not (base / "modules.json").is_file():
            what = "does not exist" if not base.exists() else "holds no config.json"
            raise UsageError(
                f"{BASE_FLAG}: {base} {what}: give the folder of the model the adapters in "
                f"{folder} were trained on"
            )
        return str(base)
    settings = adapter_settings(folder) or {}
    named = settings.get("base_model_name_or_path")
    named = named if isinstance(named, str) and named.strip() else None
    if named is not None:
        path = Path(named).expanduser()
        if path.is_dir():
            return str(path)
        if not path.is_absolute() and weights_cached(named):
            return named
        where = (
            "a folder that is not on this machine"
            if path.is_absolute() or named.startswith(".")
            else "neither a folder here nor in the Hugging Face cache"
        )
        _no_base(folder, f"the base {named!r}, {where}")
    _no_base(folder, "no base model (adapter_config.json names none)")


def adapter_problems(folder: Path | None, base: str | None) -> list[str]:
    """What keeps the adapters in ``folder`` from running (their base, not found), or
    ``--base-model`` given for a folder that holds a whole model; checked with the flags, before
    any row is read."""
    if folder is None:
        return []
    try:
        if adapter_settings(folder) is None:
            if base is not None:
                return [
                    f"{BASE_FLAG}: {folder} holds a whole model, not LoRA adapters: drop "
                    f"{BASE_FLAG}"
                ]
            return []
        adapter_base(folder, base)
    except UsageError as exc:
        return [str(exc)]
    return []


def plan_folder(folder: Path, base: str | None = None) -> Path:
    """The folder whose architecture the batch is planned for: an adapter folder's base once
    the adapters are merged in (a Hub id's cached folder is read by name)."""
    if adapter_settings(folder) is None:
        return folder
    return Path(adapter_base(folder, base))


def _no_base(folder: Path, base: str) -> NoReturn:
    raise UsageError(
        f"MODEL_DIR: {folder} holds LoRA adapters (adapter_config.json), not a whole model, for "
        f"{base}: give the base model's folder with {BASE_FLAG} FOLDER, or train with "
        "--merge-lora to save a model that runs alone"
    )


def architectures(folder: Path) -> list[str]:
    """``config.json``'s ``architectures`` (empty where there is none)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = config.get("architectures") if isinstance(config, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


def detect_task(folder: Path) -> str | None:
    """The task the folder's model was saved for, or None when the folder does not say."""
    if (folder / "modules.json").is_file():
        return "sentence-embedding"
    settings = adapter_settings(folder)
    if settings is not None:
        return ADAPTER_TASKS.get(str(settings.get("task_type")))
    names = architectures(folder)
    if any(n.endswith("ForSequenceClassification") for n in names):
        return "classification"
    if any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
        return "causal-lm"
    return None


def predict_task(folder: Path, task: str | None) -> str:
    """The task ``memfit predict`` runs: ``--task``, else the folder's; a UsageError naming the
    fix when the folder is a sentence-transformers model or does not say."""
    found = detect_task(folder)
    if task is not None:
        if task not in PREDICT_TASKS:
            raise UsageError(
                f"--task: unknown value {task!r}; memfit predict runs "
                f"{' or '.join(PREDICT_TASKS)} (sentence embeddings: memfit embed)"
            )
        return task
    if found == "sentence-embedding":
        raise UsageError(
            f"MODEL_DIR: {folder} is a sentence-transformers model (modules.json): use "
            "memfit embed for its embeddings"
        )
    if found is None and adapter_settings(folder) is not None:
        task_type = (adapter_settings(folder) or {}).get("task_type")
        raise UsageError(
            f"MODEL_DIR: cannot tell the task of the LoRA adapters in {folder} from their "
            f"adapter_config.json (task_type: {task_type}); give --task classification or "
            "--task causal-lm"
        )
    if found is None:
        names = ", ".join(architectures(folder)) or "none"
        raise UsageError(
            f"MODEL_DIR: cannot tell the task of {folder} from its config.json (architectures: "
            f"{names}); give --task classification or --task causal-lm"
        )
    return found


def quiet_transformers() -> None:
    """Loading logs progress bars and a page of hints; memfit prints one summary line."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load(loader: Callable[..., T], folder: Path, **kwargs: Any) -> T:
    """``loader(folder, **kwargs)`` with no remote code and no download; a load that fails, or
    leaves part of the model's body to random weights, is one line naming MODEL_DIR (the checks
    and the lines are memfit train's: :mod:`memfit.models.folder`)."""
    quiet_transformers()
    # the config, tokenizer files and weights' headers first (the checks memfit train makes)
    check_for_loader(loader, folder, "MODEL_DIR", without="the outputs would be random")
    # a head the folder lacks passes here: load_predict_model refuses it (it names the task)
    return load_checked(
        lambda: loader(str(folder), trust_remote_code=False, local_files_only=True, **kwargs),
        str(folder),
        "MODEL_DIR",
        without="the outputs would be random",
    )


def load_predict_model(folder: Path, task: str, base: str | None = None) -> Any:
    """The classification or causal-LM model in ``folder``, in eval mode, on the CPU; a head
    that the folder lacks (it would be random) is refused. An adapter folder's model is its base
    (``base``: ``--base-model``) with the adapters merged in."""
    auto: Any = (
        AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    )
    if adapter_settings(folder) is not None:
        return _load_adapted(auto, folder, task, adapter_base(folder, base))
    model, info = load(auto.from_pretrained, folder, output_loading_info=True)
    # (the body is whole, load() checked it: what is missing is the task's head)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        _no_head(folder, task, missing)
    # eval(): dropout off, so a row's output does not depend on the batch it ran in
    return model.eval()


def _no_head(folder: Path, task: str, missing: list[str]) -> None:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise UsageError(
        f"MODEL_DIR: {folder} has no trained {task} weights for {shown}: they would be "
        f"random (train the head first, e.g. memfit train --task {task})"
    )


def _load_base(loader: Callable[..., T], base: str, **kwargs: Any) -> T:
    """``loader`` on an adapter folder's base: a folder (checked, as MODEL_DIR is), or a Hub id
    from the Hugging Face cache, with the Hub off (no request, no retry)."""
    if Path(base).is_dir():
        return load(loader, Path(base), **kwargs)
    quiet_transformers()
    with hub_off():
        return load_checked(
            lambda: loader(base, trust_remote_code=False, local_files_only=True, **kwargs),
            base,
            "MODEL_DIR",
            without="the outputs would be random",
        )


def _saved_head_rows(folder: Path) -> int | None:
    """How many labels the classifier head saved with the adapters has (peft saves the head
    whole, under ``modules_to_save``); None where the adapters hold no head."""
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    with safe_open(str(weights), framework="pt") as saved:
        for key in saved.keys():  # noqa: SIM118 (safe_open is no mapping: keys() only)
            parts = key.split(".")
            if "lora_" in key or parts[-1] != "weight" or len(parts) < 2:
                continue
            if parts[-2] in ("classifier", "score", "out_proj"):
                return int(saved.get_slice(key).get_shape()[0])
    return None


def _load_adapted(auto: Any, folder: Path, task: str, base: str) -> Any:
    """``base`` loaded with ``auto``, the adapters of ``folder`` put on it and merged in."""
    # optional: peft (memfit[lora]); a run that saved adapters had it
    from peft import PeftModel

    kwargs: dict[str, Any] = {}
    head_rows = _saved_head_rows(folder) if task == "classification" else None
    if head_rows is not None:
        config = _load_base(AutoConfig.from_pretrained, base)
        if int(config.num_labels) != head_rows:
            # the run trained a head of its own size: it comes with the adapters
            kwargs.update(num_labels=head_rows, ignore_mismatched_sizes=True)
    model, info = _load_base(auto.from_pretrained, base, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    if missing and head_rows is None:
        _no_head(folder, task, missing)
    try:
        with hub_off(), warnings.catch_warnings():
            # peft asks transformers' deprecated is_gradient_checkpointing (a FutureWarning
            # that says nothing to the user)
            warnings.simplefilter("ignore", FutureWarning)
            adapted = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise UsageError(
            f"MODEL_DIR: the LoRA adapters in {folder} do not load onto {base}: {first} (is "
            f"{base} the model they were trained on? {BASE_FLAG} FOLDER names another)"
        ) from None
    merged = adapted.merge_and_unload()
    if task == "classification":
        names = _run_labels(folder)
        if names is not None and len(names) == int(merged.config.num_labels):
            # the run's label names: the adapter folder keeps no config.json of its own
            merged.config.id2label = dict(enumerate(names))
            merged.config.label2id = {name: i for i, name in enumerate(names)}
    # eval(): dropout off, so a row's output does not depend on the batch it ran in
    return merged.eval()


def _run_labels(folder: Path) -> list[str] | None:
    """The label names, in id order, that the memfit train run whose ``model/`` is ``folder``
    recorded (``run.json``'s ``resolved.labels``); None where it recorded none."""
    if folder.name != "model":
        return None
    try:
        run = json.loads((folder.parent / "run.json").read_text(encoding="utf-8"))
        labels = run["resolved"]["labels"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(labels, list) or not labels:
        return None
    return [str(label) for label in labels]


def load_tokenizer(folder: Path, base: str | None = None) -> Any:
    """The tokenizer of ``folder``; an adapter folder's own (memfit train saves it beside the
    adapters), else its base's."""
    if adapter_settings(folder) is None:
        return load(AutoTokenizer.from_pretrained, folder)
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        quiet_transformers()
        return load_checked(
            lambda: AutoTokenizer.from_pretrained(
                str(folder), trust_remote_code=False, local_files_only=True
            ),
            str(folder),
            "MODEL_DIR",
            without="the outputs would be random",
        )
    return _load_base(AutoTokenizer.from_pretrained, adapter_base(folder, base))


def load_sentence_transformer(folder: Path, base: str | None = None) -> Any:
    """A SentenceTransformer from ``folder`` (a plain transformers folder gets mean pooling),
    in eval mode, on the CPU (the caller moves it). A folder of LoRA adapters (memfit train
    --lora-rank on a sentence-transformers model) loads through sentence-transformers, onto its
    base (:func:`adapter_base`)."""
    # optional: sentence-transformers (memfit[sentence-transformers])
    from sentence_transformers import SentenceTransformer

    if adapter_settings(folder) is None:
        # device="cpu": sentence-transformers would otherwise pick a GPU on its own
        return load(SentenceTransformer, folder, device="cpu").eval()
    base_model = adapter_base(folder, base)
    quiet_transformers()
    with _adapters_on(folder, base_model) as adapters, hub_off():
        return load_checked(
            lambda: SentenceTransformer(
                str(adapters), device="cpu", trust_remote_code=False, local_files_only=True
            ),
            str(folder),
            "MODEL_DIR",
            without="the outputs would be random",
        ).eval()


@contextlib.contextmanager
def _adapters_on(folder: Path, base: str) -> Iterator[Path]:
    """``folder``, or where its ``adapter_config.json`` names another base than ``base``, a
    copy of it that names ``base`` (sentence-transformers reads the base from that file only)."""
    settings = adapter_settings(folder) or {}
    if settings.get("base_model_name_or_path") == base:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="memfit-adapters-") as tmp:
        copy = Path(tmp) / folder.name
        shutil.copytree(folder, copy)
        settings["base_model_name_or_path"] = base
        (copy / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2), encoding="utf-8")
        yield copy
