"""Loading ``--model`` (a local folder or a Hub id) without ever training random weights.

Every recipe loads through :func:`load_pretrained`, so a model that cannot be found is one plain
line naming ``--model``, and ``HF_HUB_OFFLINE=1`` means the cache only (no network attempt).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memfit.errors import UsageError

T = TypeVar("T")


def offline() -> bool:
    """Whether the Hub is off limits (``HF_HUB_OFFLINE=1``): load from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def load_pretrained(loader: Callable[..., T], model: str, **kwargs: Any) -> T:
    """``loader(model, **kwargs)`` (a ``from_pretrained`` or ``SentenceTransformer``), with the
    not-found case turned into a UsageError instead of a traceback."""
    # transformers logs a page of hints before raising; the one line below says it all
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if offline():
        kwargs.setdefault("local_files_only", True)
    try:
        return loader(model, **kwargs)
    except OSError as exc:  # transformers/huggingface_hub raise OSError subclasses for "not found"
        if Path(model).is_dir():
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise UsageError(f"--model: cannot load {model!r}: {first}") from None
        raise UsageError(
            f"--model: cannot load {model!r}: not a local folder and not in the Hugging Face "
            "cache (offline?)"
        ) from None
