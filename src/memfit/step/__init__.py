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

from memfit.step.linear_ce import linear_cross_entropy

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
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    units: int,
    *,
    cross_entropy: str = "standard",
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token prediction: the summed cross-entropy of the target tokens, over ``units``.

    Packed rows (padding-free packing): ``position_ids`` restarting at each row and no
    ``attention_mask``; transformers then keeps the rows apart (``masking_utils``' packed
    sequences; flash attention's variable-length path for a single flattened row).

    ``labels`` are per position as the input (not shifted), :data:`IGNORE_INDEX` where a token
    is no target (padding, a prompt: the completion-only mask); position t predicts token t+1.
    ``cross_entropy``: ``"standard"`` (the model's logits, then :func:`token_loss`) or
    ``"fused-linear"`` (the decoder's last hidden states and the head's weight, chunk by chunk:
    :func:`fused_linear_loss`); the same loss and gradients either way.
    """
    if cross_entropy == "fused-linear":
        return fused_linear_loss(
            model, input_ids, attention_mask, labels, units, position_ids=position_ids
        )
    if cross_entropy != "standard":
        raise ValueError(f"unknown cross-entropy {cross_entropy!r}: standard or fused-linear")
    positions = {} if position_ids is None else {"position_ids": position_ids}
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, **positions, **no_cache(model)
    ).logits
    return token_loss(logits, labels, units)


# config fields of heads that scale the logits, which the fused-linear loss does not model
# (transformers 5: Cohere's logit_scale multiplies them, Granite's logits_scaling divides them and
# HyperCLOVA X's multiplies them, Falcon-H1's lm_head_multiplier and some multimodal text
# configs' output_multiplier multiply them); any value but 1 is refused
_HEAD_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def fused_linear_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    units: int,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`causal_lm_loss` with ``--cross-entropy fused-linear``: the decoder body runs
    without its head, and :func:`memfit.step.linear_ce.linear_cross_entropy` takes the last
    hidden states with the head's weight (and Gemma 2's ``final_logit_softcapping``); the
    labels are shifted as :func:`token_loss` shifts them. ValueError for a model whose head it
    cannot compute (a transform it does not model, a quantized or adapted head)."""
    parts = _fused_parts(model)
    if isinstance(parts, str):
        raise ValueError(parts)
    body, head, text_config = parts
    positions = {} if position_ids is None else {"position_ids": position_ids}
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, **positions, **no_cache(body))
    hidden = hidden.last_hidden_state
    weight, bias = head.weight, head.bias
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        # what a forward pre-hook casting the head's inputs (a head held in another dtype than
        # the body) would do; the head's own forward does not run here
        hidden = hidden.to(weight.dtype)
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    summed = linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        bias,
        targets.view(-1),
        ignore_index=IGNORE_INDEX,
        softcap=softcap,
    )
    return summed / units


def fused_linear_problem(model: nn.Module) -> str | None:
    """Why ``--cross-entropy fused-linear`` cannot compute ``model``'s loss (one line naming the
    flag), or None: memfit train asks before it writes anything, the estimator once it has
    built the model. :func:`fused_linear_config_problem`'s, or what only the built model shows
    (a quantized or adapted head, no decoder body)."""
    parts = _fused_parts(model)
    return parts if isinstance(parts, str) else None


def fused_linear_config_problem(config: Any) -> str | None:
    """Why ``--cross-entropy fused-linear`` cannot compute the loss of a model of ``config``
    (one line naming the flag), or None: what the config alone shows, a head that transforms
    its logits (:data:`_HEAD_TRANSFORMS`). The estimator and the planner ask it before they
    build anything, the doctor before it offers the fused loss as a cure."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in _HEAD_TRANSFORMS:
        value = getattr(text_config, field, None)
        if value is not None and value != 1:
            return (
                f"--cross-entropy fused-linear cannot compute this model's loss: its head "
                f"scales the logits ({field}={value}); use --cross-entropy standard"
            )
    return None


def _fused_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear, Any] | str:
    """(body, head, text config) of a causal LM for the fused-linear loss, or the problem."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: the transformers model
    base: Any = get_base() if callable(get_base) else model
    config = base.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    problem = fused_linear_config_problem(config)
    if problem is not None:
        return problem
    head = _plain_head(base.get_output_embeddings())
    body = getattr(base, base.base_model_prefix, None)
    if head is None or body is None or body is base:
        return (
            f"--cross-entropy fused-linear cannot compute the loss of {type(base).__name__}: "
            "it needs a decoder body and a plain linear head; use --cross-entropy standard"
        )
    return body, head, text_config


def _plain_head(head: Any) -> nn.Linear | None:
    """The head as a plain linear layer with a floating-point weight (peft's
    ``modules_to_save`` copy when the head is trained that way), or None: a quantized head, a
    head with adapters, or none."""
    to_save = getattr(head, "modules_to_save", None)  # peft's ModulesToSaveWrapper
    if isinstance(to_save, nn.ModuleDict):
        active = getattr(head, "active_adapter", None)
        names = [active] if isinstance(active, str) else list(active or [])
        head = (
            to_save[names[0]]
            if names and names[0] in to_save
            else getattr(head, "original_module", None)
        )
    if type(head) is not nn.Linear or not head.weight.is_floating_point():
        return None
    return head


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
    "fused_linear_config_problem",
    "fused_linear_loss",
    "fused_linear_problem",
    "no_cache",
    "sentence_embedding_loss",
    "sentence_loss_module",
    "sentence_losses",
    "target_count",
    "token_loss",
]
