"""An unknown model's line suggests registry entries of its family, nearest first to its size."""

from __future__ import annotations

import re

import pytest

from memfit.errors import UsageError
from memfit.models import resolve_model
from memfit.models.catalog import stored_rows


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _suggested(model: str) -> list[str]:
    """The names the unknown-model line offers after "Did you mean:", in its order."""
    with pytest.raises(UsageError) as info:
        resolve_model(model)
    found = re.search(r"Did you mean: (.*?)\?", str(info.value))
    assert found, str(info.value)
    return [re.sub(r" \(.*\)$", "", part) for part in found.group(1).split(", ")]


@pytest.mark.parametrize(
    ("model", "offered"),
    [
        # nearest size first, on a log scale: 3B is nearer 1.5B than 7B
        ("Qwen/Qwen2.5-3B", ["Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-0.5B"]),
        ("Qwen/Qwen3-0.6B", ["Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B"]),
        ("Qwen/Qwen2.5-14B-Instruct", ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-1.5B"]),
        # the family word of another owner's id, wherever it stands in the name
        ("unsloth/Llama-3.2-1B-Instruct", ["meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B"]),
        ("NousResearch/Meta-Llama-3-70B", ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-3B"]),
        ("EleutherAI/gpt-neo-1.3B", ["gpt2-xl", "gpt2-large"]),
    ],
)
def test_same_family_nearest_size_first(model: str, offered: list[str]) -> None:
    said = _suggested(model)
    assert said[: len(offered)] == offered, said


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("distilbert/distilbert-base-cased", "distil"),
        ("answerdotai/ModernBERT-large-v2", "answerdotai/ModernBERT-"),
    ],
)
def test_only_the_family_is_offered(model: str, family: str) -> None:
    # no size in the id: the family's entries, not names merely spelled alike
    assert all(name.startswith(family) for name in _suggested(model))


def test_each_suggestion_shows_its_parameter_count_from_the_listing() -> None:
    # a 12B whose id names no size: the family's one entry, its size said, and the way out
    with pytest.raises(UsageError) as info:
        resolve_model("mistralai/Mistral-Nemo-Base-2407")
    line = str(info.value)
    count = stored_rows()["mistralai/Mistral-7B-v0.3"]["parameters"]
    assert f"Did you mean: mistralai/Mistral-7B-v0.3 ({count / 1e9:.1f}B)?" in line
    assert "a path to its config.json" in line
