"""Guarded inference: ``memfit predict`` (classifier labels, causal-LM losses) and ``memfit embed``
(sentence embeddings), in the largest batch that fits and with the guard's OOM back-off; the
outputs hold every input row, in input order.

``memfit.infer.predict(model=..., file=..., output=...)`` and ``memfit.infer.embed(...)`` take the
CLI's flags as keywords (:class:`~memfit.infer.run.InferConfig`) and return an
:class:`~memfit.infer.run.InferResult`. The flow is in :mod:`memfit.infer.run`; the command
functions in :mod:`memfit.commands.predict` and :mod:`memfit.commands.embed` (this module stays
light: torch and transformers load on first use).
"""

from __future__ import annotations

from typing import Any


def predict(config: Any = None, /, **knobs: Any) -> Any:
    """Labels or per-row losses of every row; see :func:`memfit.infer.predict.predict`."""
    from memfit.infer.predict import predict as _predict  # start-up time: torch, transformers

    return _predict(config, **knobs)


def embed(config: Any = None, /, **knobs: Any) -> Any:
    """Sentence embeddings of every row; see :func:`memfit.infer.embed.embed`."""
    from memfit.infer.embed import embed as _embed  # start-up time: torch, transformers

    return _embed(config, **knobs)


__all__ = ["embed", "predict"]
