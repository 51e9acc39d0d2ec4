"""memfit: estimate, plan and guard the memory of transformer fine-tuning."""

from __future__ import annotations

from typing import Any

from memfit import quiet

__version__ = "0.1.0"

# third-party lines that say nothing to the user (memfit.quiet), dropped before memfit, or a
# library memfit imports, can log them: bitsandbytes logs its line while it is imported
quiet.install()


def estimate(model: str, **kwargs: Any) -> Any:
    """Predict the peak memory of a training or eval step; see :func:`memfit.estimate.estimate`."""
    # start-up: `import memfit` stays light; the estimator loads torch and transformers
    from memfit.estimate import estimate as _estimate

    quiet.install()  # put back a warnings filter a reset since import removed
    return _estimate(model, **kwargs)


def plan(model: str, **kwargs: Any) -> Any:
    """Fit a fine-tuning job into a memory budget; see :func:`memfit.plan.plan`."""
    # start-up: the planner loads the estimator (torch, transformers)
    from memfit.plan import plan as _plan

    quiet.install()  # put back a warnings filter a reset since import removed
    return _plan(model, **kwargs)


def limits(model: str, **kwargs: Any) -> Any:
    """The longest sequence and largest micro-batch that fit a budget; see
    :func:`memfit.plan.limits.limits`."""
    # start-up: the solver loads the estimator (torch, transformers)
    from memfit.plan.limits import limits as _limits

    quiet.install()  # put back a warnings filter a reset since import removed
    return _limits(model, **kwargs)


def train(config: Any = None, /, **kwargs: Any) -> Any:
    """Fine-tune under the OOM guard; see :func:`memfit.train.run.train` (same knobs as the CLI)."""
    # start-up: a run loads torch, transformers and the training stack
    from memfit.train.run import train as _train

    quiet.install()  # put back a warnings filter a reset since import removed
    return _train(config, **kwargs)


__all__ = ["__version__", "estimate", "limits", "plan", "train"]
