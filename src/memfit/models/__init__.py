"""Model resolution: names, folders and config files to architecture configs, offline.

The names below come from :mod:`memfit.models.registry` (which imports transformers) when first
used: ``memfit models`` reads the registry's listing (:mod:`memfit.models.catalog`) without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.models.registry import (
        NO_POSITION_LIMIT,
        ModelSpec,
        parameter_count,
        registry_names,
        resolve_model,
        usable_positions,
    )

__all__ = [
    "NO_POSITION_LIMIT",
    "ModelSpec",
    "parameter_count",
    "registry_names",
    "resolve_model",
    "usable_positions",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("memfit.models.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
