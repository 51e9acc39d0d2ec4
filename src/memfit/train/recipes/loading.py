"""Loading ``--model`` (a local folder or a Hub id) without ever training random weights.

Every recipe loads through :func:`load_pretrained`, so a model that cannot be found is one plain
line naming ``--model``, and ``HF_HUB_OFFLINE=1`` means the cache only (no network attempt). A local
folder is checked first (:mod:`memfit.models.folder`): a config that is not JSON or names an
architecture transformers does not know, no weights (training would start from random weights),
weights cut short, no tokenizer files (transformers would fall back to an empty vocabulary), and
weights whose shapes no longer fit the config are each one line naming ``--model`` and the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memfit.errors import UsageError
from memfit.models.folder import check_for_loader, mismatch_message

T = TypeVar("T")

FLAG = "--model"


def offline() -> bool:
    """Whether the Hub is off limits (``HF_HUB_OFFLINE=1``): load from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_folder(loader: Callable[..., Any], folder: Path) -> None:
    """The checks of a local ``--model`` folder that ``loader`` is about to read."""
    check_for_loader(loader, folder, FLAG, without="training would start from random weights")


def load_pretrained(loader: Callable[..., T], model: str, **kwargs: Any) -> T:
    """``loader(model, **kwargs)`` (a ``from_pretrained`` or ``SentenceTransformer``), with a
    local folder checked first and the not-found case turned into a UsageError instead of a
    traceback."""
    # transformers logs a page of hints before raising; the one line below says it all
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if offline():
        kwargs.setdefault("local_files_only", True)
    local = Path(model).expanduser().is_dir()
    if local:
        check_folder(loader, Path(model).expanduser())
    try:
        return loader(model, **kwargs)
    except OSError as exc:  # transformers/huggingface_hub raise OSError subclasses for "not found"
        if local:
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise UsageError(f"{FLAG}: cannot load {model!r}: {first}") from None
        from memfit.models.registry import resolve_model

        try:
            in_registry = resolve_model(model).source == "registry"
        except UsageError:
            in_registry = False
        if in_registry:
            raise UsageError(
                f"{FLAG}: {model!r} is in memfit's registry of architectures (for estimate and "
                "plan), which holds no weights: memfit train needs a model folder, or a Hub id "
                "in the local Hugging Face cache"
            ) from None
        raise UsageError(
            f"{FLAG}: cannot load {model!r}: not a local folder and not in the Hugging Face "
            "cache (offline?)"
        ) from None
    except RuntimeError as exc:
        message = mismatch_message(exc, model, FLAG)
        if message is None:
            raise
        raise UsageError(message) from None
