"""memfit's guard and plan inside the trainers people already use.

* :class:`GuardedTrainer`: a ``transformers.Trainer`` whose steps survive out-of-memory with the
  same gradient (a one-line change to a Trainer script).
* :class:`GuardedSentenceTransformerTrainer`: the same for sentence-transformers'
  ``SentenceTransformerTrainer`` (in-batch-negative losses switch to their GradCache variant).
* :func:`apply_plan`: memfit's plan written into a ``TrainingArguments``, effective batch kept.

The trainers import transformers (and sentence-transformers) when first used, not with memfit.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GuardedTrainer": "memfit.integrations.trainer",
    "GuardedSentenceTransformerTrainer": "memfit.integrations.sentence_transformers",
    "PlannedArguments": "memfit.integrations.plan",
    "apply_plan": "memfit.integrations.plan",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
