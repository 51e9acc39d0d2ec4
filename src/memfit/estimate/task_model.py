"""What the step (:mod:`memfit.estimate.workload`) and the quantizer
(:mod:`memfit.estimate.quantized`) both know of a task's model: the sentence-embedding
bi-encoder, a classifier's head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class BiEncoder(nn.Module):
    """A sentence-transformers bi-encoder: transformer, then mean pooling over real tokens.

    Mirrors ``sentence_transformers.models.Transformer`` + ``Pooling(pooling_mode="mean")``
    (sentence-transformers 6.2 ``Pooling._forward_padded``): the masked sum and the token count
    accumulate in float32 when the token embeddings are half precision, the mean is cast back to
    their dtype, and the modes' outputs are concatenated (a copy, even for one mode). Decoder
    LLMs embed the same way (every real token, not the last one).
    """

    def __init__(self, transformer: nn.Module, num_labels: int, with_classifier: bool) -> None:
        super().__init__()
        self.transformer = transformer
        config: Any = transformer.config
        hidden = int(config.get_text_config().hidden_size)
        # SoftmaxLoss trains a classifier on (u, v, |u - v|), as sentence-transformers does
        self.classifier = nn.Linear(3 * hidden, num_labels) if with_classifier else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self.embed(features)["sentence_embedding"]

    def embed(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``features`` with the token embeddings and the sentence embedding added, as a
        SentenceTransformer fills them in: the token embeddings live as long as the caller
        keeps the dict (a loss keeps each column's until it returns)."""
        token_embeddings = self.transformer(
            input_ids=features["input_ids"], attention_mask=features["attention_mask"]
        )[0]
        features["token_embeddings"] = token_embeddings
        pooled = _mean_pooled(token_embeddings, features["attention_mask"])
        features["sentence_embedding"] = torch.cat(pooled, dim=-1)
        return features


def _mean_pooled(
    token_embeddings: torch.Tensor, attention_mask: torch.Tensor
) -> list[torch.Tensor]:
    """``Pooling._forward_padded``'s mean mode: its temporaries are freed when it returns, before
    the modes' outputs are concatenated."""
    half = token_embeddings.dtype in (torch.float16, torch.bfloat16)
    accumulation = torch.float32 if half else token_embeddings.dtype
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
    summed = (token_embeddings * mask).sum(dim=1, dtype=accumulation)
    counts = torch.clamp(mask.sum(dim=1, dtype=accumulation), min=1e-9)
    return [(summed / counts).to(token_embeddings.dtype)]


def lora_head_modules(model: nn.Module) -> list[str]:
    """A sequence classifier's head: the children beside the pretrained base model that hold
    weights (BERT's ``classifier``, DistilBERT's ``pre_classifier`` and ``classifier``, GPT-2's
    ``score``). They start random, so they are trained whole and saved with the adapter."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        return []  # a bare backbone (no head around it)
    return [
        name
        for name, child in model.named_children()
        if name != prefix and any(True for _ in child.parameters())
    ]
