"""Estimate the peak memory of a fine-tuning step, offline: trace on fake tensors, model the device.

The package is callable: ``memfit.estimate(...)`` is :func:`memfit.estimate.api.estimate`.
"""

from memfit._callable_module import make_callable
from memfit.estimate.api import BREAKDOWN_KEYS, Estimate, estimate, validate
from memfit.estimate.traces import clear_cache

__all__ = ["BREAKDOWN_KEYS", "Estimate", "clear_cache", "estimate", "validate"]

make_callable(__name__, "estimate")
