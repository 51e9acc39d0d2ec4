"""The offline registry's names and the configs it ships, with no import of transformers.

Each entry's config ships in ``configs/`` (the canonical name with ``/`` written as ``--``, the way
the Hugging Face cache names repos). :mod:`memfit.models.registry` resolves the names to configs
(with transformers); :mod:`memfit.models.catalog` lists them for ``memfit models`` (without it).
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

# canonical name -> other names it answers to (current Hub ids, short names)
REGISTRY: dict[str, tuple[str, ...]] = {
    "bert-base-uncased": ("google-bert/bert-base-uncased",),
    "bert-base-cased": ("google-bert/bert-base-cased",),
    "bert-large-uncased": ("google-bert/bert-large-uncased",),
    "bert-base-multilingual-cased": ("google-bert/bert-base-multilingual-cased",),
    "distilbert-base-uncased": ("distilbert/distilbert-base-uncased",),
    "roberta-base": ("FacebookAI/roberta-base",),
    "roberta-large": ("FacebookAI/roberta-large",),
    "distilroberta-base": ("distilbert/distilroberta-base",),
    "gpt2": ("openai-community/gpt2",),
    "gpt2-medium": ("openai-community/gpt2-medium",),
    "gpt2-large": ("openai-community/gpt2-large",),
    "gpt2-xl": ("openai-community/gpt2-xl",),
    "distilgpt2": ("distilbert/distilgpt2",),
    "sentence-transformers/all-MiniLM-L6-v2": ("all-MiniLM-L6-v2",),
    "sentence-transformers/all-mpnet-base-v2": ("all-mpnet-base-v2",),
    "sentence-transformers/paraphrase-MiniLM-L6-v2": ("paraphrase-MiniLM-L6-v2",),
    "sentence-transformers/all-MiniLM-L12-v2": ("all-MiniLM-L12-v2",),
    "sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2": (
        "paraphrase-multilingual-MiniLM-L12-v2",
    ),
    "meta-llama/Llama-3.2-1B": ("Llama-3.2-1B",),
    "meta-llama/Llama-3.2-3B": ("Llama-3.2-3B",),
    # the Hub repo was meta-llama/Meta-Llama-3.1-8B until its rename
    "meta-llama/Llama-3.1-8B": ("Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B"),
    "Qwen/Qwen2.5-0.5B": ("Qwen2.5-0.5B",),
    "Qwen/Qwen2.5-1.5B": ("Qwen2.5-1.5B",),
    "Qwen/Qwen2.5-7B": ("Qwen2.5-7B",),
    "mistralai/Mistral-7B-v0.3": ("Mistral-7B-v0.3",),
    "google/gemma-2-2b": ("gemma-2-2b",),
    "microsoft/Phi-3.5-mini-instruct": ("Phi-3.5-mini-instruct",),
    "HuggingFaceTB/SmolLM2-135M": ("SmolLM2-135M",),
    "HuggingFaceTB/SmolLM2-1.7B": ("SmolLM2-1.7B",),
    "answerdotai/ModernBERT-base": ("ModernBERT-base",),
    "answerdotai/ModernBERT-large": ("ModernBERT-large",),
    "microsoft/deberta-v3-base": ("deberta-v3-base",),
    "BAAI/bge-small-en-v1.5": ("bge-small-en-v1.5",),
    "BAAI/bge-base-en-v1.5": ("bge-base-en-v1.5",),
    "intfloat/e5-base-v2": ("e5-base-v2",),
}


def configs_folder() -> Traversable:
    """The shipped configs (and the listing beside them)."""
    return resources.files("memfit.models") / "configs"


def config_text(name: str) -> str:
    """The shipped config.json of registry entry ``name`` (its canonical name)."""
    return (configs_folder() / (name.replace("/", "--") + ".json")).read_text(encoding="utf-8")


# the stored listing, in configs/ (a leading underscore: no entry's config is named so); written
# by :mod:`memfit.models.catalog`, read here too: the registry's suggestions for an unknown model
# name entries by their parameter counts without building a model
LISTING_FILE = "_listing.json"


def stored_rows() -> dict[str, dict[str, Any]]:
    """The rows of ``configs/_listing.json`` by name, each with its ``config_sha256``."""
    try:
        data = json.loads((configs_folder() / LISTING_FILE).read_text(encoding="utf-8"))
        return {row["name"]: row for row in data["models"]}
    except (OSError, ValueError, KeyError, TypeError):  # no file, or not one this code wrote
        return {}
