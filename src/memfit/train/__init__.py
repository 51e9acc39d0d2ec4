"""``memfit train``: fine-tuning under the memory guard (the settings in ``config``, the loop in
``loop``, the tasks in ``recipes``).

The package is callable: ``memfit.train(task=..., model=..., train_file=..., output_dir=...)`` is
:func:`memfit.train.run.train`.
"""

from typing import TYPE_CHECKING, Any

from memfit._callable_module import make_callable
from memfit.train.config import (
    SCHEDULERS,
    TrainConfig,
    TrainResult,
    check_config,
    config_problems,
)

if TYPE_CHECKING:
    from memfit.train.run import train


def __getattr__(name: str) -> Any:
    # ``memfit train --help`` and the config checks need only TrainConfig: the run (torch,
    # transformers) loads on first use
    if name == "train":
        from memfit.train.run import train  # start-up time: torch and transformers

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCHEDULERS",
    "TrainConfig",
    "TrainResult",
    "check_config",
    "config_problems",
    "train",
]

make_callable(__name__, "train")
