"""Model resolution: names, folders and config files to architecture configs, offline."""

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
