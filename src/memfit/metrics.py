"""Metrics that training and inference both report (so neither imports the other for them)."""

from __future__ import annotations

import math


def perplexity(loss: float) -> float:
    """``exp(loss)``, ``inf`` where it overflows a float."""
    return math.exp(loss) if loss < 709.0 else math.inf
