"""Each task's loss, the part of a training step that is the recipe's: written once, run twice.

``memfit train`` calls these from its recipes (``memfit.train.recipes``) on real batches, one
micro-batch at a time under the guard; the estimator (``memfit.estimate.workload``) traces the same
functions on fake tensors, inside what the device adds (autocast, kernels, the caching allocator),
and the CPU truth and GPU validation benchmarks run them through the estimator's workload. The
backward (``loss.backward()``) and the optimizer step around them are the loop's and the
workload's, alike in both.

Every loss is a sum over the step's units divided by ``units`` (the whole step's count, not this
micro-batch's), so the micro-batches of a split step add up to the step's mean (the contract in
``memfit.train.recipes.base``): per sample for classification, per target token for causal LM.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# the label of a token that is no target (padding, prompt, a non-assistant turn): what
# transformers, TRL and torch's cross-entropy ignore
IGNORE_INDEX = -100


def classification_loss(
    model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, units: int
) -> torch.Tensor:
    """Sequence classification: the summed per-sample cross-entropy of ``labels``, over ``units``.

    ``inputs``: the model's keyword inputs (``input_ids``, ``attention_mask``, a pair's
    ``token_type_ids``), without the labels (the model computes no loss of its own).
    """
    # float(): under autocast the logits are half precision; the loss is summed in fp32
    logits = model(**inputs, **no_cache(model)).logits.float()
    # summed, not averaged: micro-batches of a step then add up to the step's mean
    return F.cross_entropy(logits, labels, reduction="sum") / units


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    units: int,
) -> torch.Tensor:
    """Next-token prediction: the summed cross-entropy of the target tokens, over ``units``.

    ``labels`` are per position as the input (not shifted), :data:`IGNORE_INDEX` where a token
    is no target (padding, a prompt: the completion-only mask); position t predicts token t+1.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **no_cache(model)).logits
    return token_loss(logits, labels, units)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, units: int) -> torch.Tensor:
    """The summed token cross-entropy of ``logits`` (batch, length, vocabulary) against the next
    token's label, over ``units``: transformers' ``ForCausalLMLoss`` with ``num_items_in_batch``.

    The labels are shifted (one ignored label appended, the first dropped), not the logits: the
    logits are then viewed whole, never copied. Slicing off their last position instead makes a
    non-contiguous view that ``reshape`` copies whole in fp32 (in 16 bits the fp32 upcast
    copies them anyway).
    """
    # float(): sum in fp32 under autocast (a no-op, no copy, for fp32 logits)
    logits = logits.float()
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    summed = F.cross_entropy(
        logits.view(-1, logits.size(-1)),
        targets.view(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return summed / units


# --loss -> the sentence-transformers loss class that computes it (``sentence_losses``)
SENTENCE_LOSSES = {
    "mnrl": "MultipleNegativesRankingLoss",
    "cosent": "CoSENTLoss",
    "cosine": "CosineSimilarityLoss",
}


def sentence_losses() -> Any:
    """sentence-transformers' losses module (an optional package): ``sentence_transformers.losses``
    in v3-5, moved under ``sentence_transformer`` in v6. ImportError without it."""
    try:
        return importlib.import_module("sentence_transformers.sentence_transformer.losses")
    except ImportError:
        return importlib.import_module("sentence_transformers.losses")


def sentence_loss_module(loss: str, model: nn.Module) -> nn.Module:
    """sentence-transformers' own module for ``--loss`` ``loss`` (:data:`SENTENCE_LOSSES`) around
    ``model``: a SentenceTransformer, or any module that maps a column's features to
    ``{"sentence_embedding": ...}``."""
    module: nn.Module = getattr(sentence_losses(), SENTENCE_LOSSES[loss])(model)
    return module


def sentence_embedding_loss(
    module: nn.Module,
    features: Sequence[dict[str, torch.Tensor]],
    labels: torch.Tensor | None,
    rows: int,
    units: int,
) -> torch.Tensor:
    """A sentence-transformers loss module's loss of these ``rows`` pairs (``features``: one
    dict per column, anchors first), over ``units``.

    sentence-transformers' losses average over the rows; times ``rows / units`` that is the sum
    over the step's units. A cached (GradCache) loss's backward hook receives this factor as its
    gradient, so it reaches every replay.
    """
    return module(list(features), labels) * (rows / units)


def no_cache(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` for a model whose forward takes it (decoders): a training step keeps
    no key/value cache. Left on (the config's default), a decoder's forward would concatenate
    every layer's keys and values into a cache that lives until the backward, memory the step
    does not need."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: its base model's forward
    base = get_base() if callable(get_base) else model
    forward = getattr(base, "forward", None)
    try:
        takes = forward is not None and "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read
        takes = False
    return {"use_cache": False} if takes else {}


def target_count(labels: torch.Tensor) -> int:
    """The target tokens of a batch's (unshifted) labels: those after the first position that
    are not :data:`IGNORE_INDEX` (a host sync; real tensors only)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


__all__ = [
    "IGNORE_INDEX",
    "SENTENCE_LOSSES",
    "causal_lm_loss",
    "classification_loss",
    "no_cache",
    "sentence_embedding_loss",
    "sentence_loss_module",
    "sentence_losses",
    "target_count",
    "token_loss",
]
