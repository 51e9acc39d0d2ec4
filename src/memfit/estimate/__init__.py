"""Estimate the peak memory of a fine-tuning step, offline: trace on fake tensors, model the device."""

from memfit.estimate.api import BREAKDOWN_KEYS, Estimate, clear_cache, estimate, validate

__all__ = ["BREAKDOWN_KEYS", "Estimate", "clear_cache", "estimate", "validate"]
