"""The offline registry's names and its listing (``memfit models``), without transformers.

Each entry's config ships in ``configs/`` (the canonical name with ``/`` written as ``--``, the way
the Hugging Face cache names repos). What ``memfit models`` shows of an entry (model type, usable
positions, parameter count) is stored in ``configs/_listing.json``, beside the configs, with the
SHA-256 of the config file it was computed from: building 35 models on the meta device to count
their parameters takes seconds, and importing torch and transformers more. An entry whose config
is not the one its stored row was computed from, or that has no row, is computed live
(:func:`memfit.models.parameter_count`). ``tests/unit/models/test_catalog.py`` recomputes every
stored row, so the file cannot drift from the code. Regenerate it with::

    python -m memfit.models.catalog
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
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
# the stored listing, in configs/ (a leading underscore: no entry's config is named so)
LISTING_FILE = "_listing.json"
# what a listing row holds besides the config's digest, in the order memfit models shows them
COLUMNS = ("name", "model_type", "max_positions", "parameters")


def _configs() -> Traversable:
    return resources.files("memfit.models") / "configs"


def config_text(name: str) -> str:
    """The shipped config.json of registry entry ``name`` (its canonical name)."""
    return (_configs() / (name.replace("/", "--") + ".json")).read_text(encoding="utf-8")


def config_digest(name: str) -> str:
    """SHA-256 of registry entry ``name``'s config file, as its listing row records it."""
    return hashlib.sha256(config_text(name).encode("utf-8")).hexdigest()


def computed_row(name: str) -> dict[str, Any]:
    """Entry ``name``'s listing row, computed from its config (imports transformers and torch)."""
    from memfit.models.registry import parameter_count, resolve_model

    spec = resolve_model(name)
    return {
        "name": name,
        "model_type": spec.config.model_type,
        "max_positions": spec.max_positions,
        "parameters": parameter_count(spec),
    }


def stored_rows() -> dict[str, dict[str, Any]]:
    """The rows of ``configs/_listing.json`` by name, each with its ``config_sha256``."""
    try:
        data = json.loads((_configs() / LISTING_FILE).read_text(encoding="utf-8"))
        return {row["name"]: row for row in data["models"]}
    except (OSError, ValueError, KeyError, TypeError):  # no file, or not one this code wrote
        return {}


def listing(on_compute: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every registry entry's row (:data:`COLUMNS`), in registry order: the stored one where it
    was computed from the config shipped now, else computed live (``on_compute(name)`` first)."""
    stored = stored_rows()
    rows = []
    for name in REGISTRY:
        row = stored.get(name)
        if row is None or row.get("config_sha256") != config_digest(name):
            if on_compute is not None:
                on_compute(name)
            row = computed_row(name)
        rows.append({key: row[key] for key in COLUMNS})
    return rows


def generated_listing() -> str:
    """The text of ``configs/_listing.json``, every row computed from today's configs."""
    rows = [{**computed_row(name), "config_sha256": config_digest(name)} for name in REGISTRY]
    note = "generated by `python -m memfit.models.catalog` from the configs beside it; do not edit"
    return json.dumps({"note": note, "models": rows}, indent=1) + "\n"


if __name__ == "__main__":  # pragma: no cover - the generator, run by hand
    from pathlib import Path

    target = Path(__file__).with_name("configs") / LISTING_FILE
    target.write_text(generated_listing(), encoding="utf-8")
    print(f"wrote {target}")
