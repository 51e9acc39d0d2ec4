"""memfit's guard and plan inside the trainers people already use.

* :class:`GuardedTrainer`: a ``transformers.Trainer`` whose steps survive out-of-memory with the
  same gradient (a one-line change to a Trainer script).
* :class:`GuardedSentenceTransformerTrainer`: the same for sentence-transformers'
  ``SentenceTransformerTrainer`` (in-batch-negative losses switch to their GradCache variant).
* :class:`GuardedSFTTrainer`: the same for TRL's ``SFTTrainer`` (completion-only loss, packing
  and ``padding_free`` included).
* :func:`apply_plan`: memfit's plan written into a ``TrainingArguments`` (or TRL's ``SFTConfig``),
  effective batch kept.

The trainers import transformers (and sentence-transformers, TRL) when first used, not with
memfit.
"""

from __future__ import annotations

import importlib
from typing import Any

from memfit.errors import UsageError
from memfit.extras import missing_module_line

_LAZY = {
    "GuardedTrainer": "memfit.integrations.trainer",
    "GuardedSentenceTransformerTrainer": "memfit.integrations.sentence_transformers",
    "GuardedSFTTrainer": "memfit.integrations.trl",
    "PlannedArguments": "memfit.integrations.plan",
    "apply_plan": "memfit.integrations.plan",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit.integrations' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        # TRL or sentence-transformers not installed: the one line naming the extra
        line = missing_module_line(exc, f"memfit.integrations.{name}")
        if line is None:
            raise
        raise UsageError(line) from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
