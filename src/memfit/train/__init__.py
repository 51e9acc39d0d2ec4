"""``memfit train``: fine-tuning under the memory guard (the loop in ``run``, the tasks in ``recipes``).

The package is callable: ``memfit.train(task=..., model=..., train_file=..., output_dir=...)`` is
:func:`memfit.train.run.train`.
"""

from memfit._callable_module import make_callable
from memfit.train.run import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]

make_callable(__name__, "train")
