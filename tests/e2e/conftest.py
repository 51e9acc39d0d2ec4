"""Shared by the end-to-end tests: a tiny BERT classifier folder, built offline once a session."""

from __future__ import annotations

from typing import Any

import pytest

# the vocabulary of the tiny classifier: the words w0 … w59 (the tests' data uses these)
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer: Any) -> str:
    """A 2-layer BERT (dropout off, seeded weights) with its own tiny vocabulary."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-classifier")
    tokenizer = bert_tokenizer(folder, WORDS)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return str(folder)
