"""Shared by the end-to-end tests: a tiny BERT classifier folder, built offline once a session."""

from __future__ import annotations

import pytest

from tiny_models import save_bert

# the vocabulary of the tiny classifier: the words w0 … w59 (the tests' data uses these)
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT (dropout off, seeded weights) with its own tiny vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-classifier")
    save_bert(folder, WORDS, positions=256)
    return str(folder)
