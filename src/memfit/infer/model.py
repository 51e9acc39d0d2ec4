"""MODEL_DIR: which folder holds the model, which task it was trained for, and loading it.

MODEL_DIR is a run folder ``memfit train`` wrote (its ``model/`` is used) or any folder that
loads with transformers' ``AutoModelForSequenceClassification`` / ``AutoModelForCausalLM`` or with
``SentenceTransformer``. The task is read from the folder, never guessed from its name:

- ``modules.json`` (a sentence-transformers folder): ``sentence-embedding``;
- ``config.json``'s ``architectures``: ``…ForSequenceClassification`` is ``classification``,
  ``…ForCausalLM`` / ``…LMHeadModel`` is ``causal-lm``;
- anything else (a bare encoder such as ``BertModel``): ``memfit predict`` needs ``--task``;
  ``memfit embed`` wraps it with mean pooling, as sentence-transformers does.

Loading never runs code from the folder (``trust_remote_code=False``) and never downloads
(``local_files_only=True``). A head the folder does not hold (``--task classification`` on a bare
encoder) would be initialized at random and give random answers: that is refused, not warned about.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from memfit.errors import UsageError
from memfit.job import TASKS
from memfit.models.folder import check_for_loader, load_checked

T = TypeVar("T")

# memfit predict runs the tasks with a head; sentence embeddings are memfit embed's
PREDICT_TASKS = tuple(t for t in TASKS if t != "sentence-embedding")


def model_folder(path: str | Path) -> Path:
    """The folder that holds the model: ``path``, or the ``model/`` of a ``memfit train`` run."""
    folder = Path(path).expanduser()
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
    return (folder / "config.json").is_file() or (folder / "modules.json").is_file()


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


def load_predict_model(folder: Path, task: str) -> Any:
    """The classification or causal-LM model in ``folder``, in eval mode, on the CPU; a head
    that the folder lacks (it would be random) is refused."""
    auto: Any = (
        AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    )
    model, info = load(auto.from_pretrained, folder, output_loading_info=True)
    # (the body is whole, load() checked it: what is missing is the task's head)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise UsageError(
            f"MODEL_DIR: {folder} has no trained {task} weights for {shown}: they would be "
            f"random (train the head first, e.g. memfit train --task {task})"
        )
    # eval(): dropout off, so a row's output does not depend on the batch it ran in
    return model.eval()


def load_tokenizer(folder: Path) -> Any:
    return load(AutoTokenizer.from_pretrained, folder)


def load_sentence_transformer(folder: Path) -> Any:
    """A SentenceTransformer from ``folder`` (a plain transformers folder gets mean pooling),
    in eval mode, on the CPU (the caller moves it)."""
    # optional: sentence-transformers (memfit[sentence-transformers])
    from sentence_transformers import SentenceTransformer

    # device="cpu": sentence-transformers would otherwise pick a GPU on its own
    return load(SentenceTransformer, folder, device="cpu").eval()
