"""Parameter counts from architecture alone (memfit.models.parameter_count), the registry's
current models against their published counts, and the `memfit models` listing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModel, BertConfig, BertModel

from memfit.cli import main
from memfit.models import parameter_count, registry_names, resolve_model, usable_positions


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# Parameters in each Hub checkpoint, as its model page shows them (read from the safetensors
# metadata). ModernBERT-large's page rounds to 396M; its checkpoint holds 395,881,664: the
# MLM head's decoder bias (50,368, one per token) included, as in ModernBERT-base's 149,655,232.
# deberta-v3-base: 183,831,552, the 98M embeddings and 86M backbone of its model card.
PUBLISHED = [
    ("meta-llama/Llama-3.2-1B", 1_235_814_400),
    ("meta-llama/Llama-3.2-3B", 3_212_749_824),
    ("meta-llama/Llama-3.1-8B", 8_030_261_248),
    ("Qwen/Qwen2.5-0.5B", 494_032_768),
    ("Qwen/Qwen2.5-1.5B", 1_543_714_304),
    ("Qwen/Qwen2.5-7B", 7_615_616_512),
    ("mistralai/Mistral-7B-v0.3", 7_248_023_552),
    ("google/gemma-2-2b", 2_614_341_888),
    ("microsoft/Phi-3.5-mini-instruct", 3_821_079_552),
    ("HuggingFaceTB/SmolLM2-135M", 134_515_008),
    ("HuggingFaceTB/SmolLM2-1.7B", 1_711_376_384),
    ("answerdotai/ModernBERT-base", 149_655_232),
    ("answerdotai/ModernBERT-large", 395_881_664),
    ("microsoft/deberta-v3-base", 183_831_552),
    ("BAAI/bge-small-en-v1.5", 33_360_000),
    ("BAAI/bge-base-en-v1.5", 109_482_240),
    ("intfloat/e5-base-v2", 109_482_240),
    ("sentence-transformers/all-MiniLM-L12-v2", 33_360_000),
    ("sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2", 117_653_760),
    # sentence-transformers saved the bare MPNet, under a config naming MPNetForMaskedLM
    ("sentence-transformers/all-mpnet-base-v2", 109_486_464),
]


@pytest.mark.parametrize(("name", "published"), PUBLISHED)
def test_published_parameter_counts(name: str, published: int) -> None:
    spec = resolve_model(name)
    assert spec.source == "registry" and spec.name == name
    assert parameter_count(spec) == published


@pytest.mark.parametrize(
    ("alias", "canonical", "positions"),
    [
        ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", 131_072),
        ("llama-3.2-3b", "meta-llama/Llama-3.2-3B", 131_072),
        ("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 131_072),
        ("Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", 32_768),
        ("qwen2.5-7b", "Qwen/Qwen2.5-7B", 131_072),
        ("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", 32_768),
        ("gemma-2-2b", "google/gemma-2-2b", 8_192),
        ("Phi-3.5-mini-instruct", "microsoft/Phi-3.5-mini-instruct", 131_072),
        ("SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", 8_192),
        ("ModernBERT-base", "answerdotai/ModernBERT-base", 8_192),
        ("modernbert-large", "answerdotai/ModernBERT-large", 8_192),
        ("deberta-v3-base", "microsoft/deberta-v3-base", 512),
        ("bge-small-en-v1.5", "BAAI/bge-small-en-v1.5", 512),
        ("e5-base-v2", "intfloat/e5-base-v2", 512),
        ("all-MiniLM-L12-v2", "sentence-transformers/all-MiniLM-L12-v2", 512),
    ],
)
def test_aliases_and_usable_positions(alias: str, canonical: str, positions: int) -> None:
    spec = resolve_model(alias)
    assert spec.name == canonical
    assert spec.max_positions == usable_positions(spec.config) == positions


def test_longrope_factors_cover_every_rotary_frequency() -> None:
    # LongRoPE scales each of the head's rotary frequencies: one factor per pair of dimensions
    checked = 0
    for name in registry_names():
        config = resolve_model(name).config
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        if not rope or rope.get("rope_type", rope.get("type")) != "longrope":
            continue
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        assert len(rope["long_factor"]) == len(rope["short_factor"]) == head_dim // 2
        checked += 1
    assert checked, "the registry holds a LongRoPE model (Phi-3.5-mini)"


def _checkpoint_parameters(folder: Path) -> int:
    """Elements of every tensor a saved checkpoint holds: what the Hub's count reads."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                total += math.prod(weights.get_slice(key).get_shape())
    assert total > 0
    return total


def _tiny_llama(tie: bool) -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        architectures=["LlamaForCausalLM"],
    )


def _tiny_modernbert() -> Any:
    return transformers.ModernBertConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        architectures=["ModernBertForMaskedLM"],
    )


@pytest.mark.parametrize(
    "config",
    [_tiny_llama(tie=True), _tiny_llama(tie=False), _tiny_modernbert()],
    ids=["llama-tied", "llama-untied", "modernbert-mlm"],
)
def test_count_equals_a_saved_checkpoint(config: Any, tmp_path: Path) -> None:
    getattr(transformers, config.architectures[0])(config).save_pretrained(tmp_path)
    assert parameter_count(resolve_model(str(tmp_path))) == _checkpoint_parameters(tmp_path)


def test_tied_embeddings_are_counted_once() -> None:
    config = _tiny_llama(tie=False)
    untied = parameter_count(config)
    assert untied - parameter_count(_tiny_llama(tie=True)) == config.vocab_size * config.hidden_size


def test_sentence_transformers_folder_counts_the_bare_model(tmp_path: Path) -> None:
    # sentence-transformers saves the bare transformer, keeping the config of the model it
    # was tuned from: architectures still names the masked-LM class
    encoder = tmp_path / "0_Transformer"
    BertModel(BertConfig(vocab_size=96, hidden_size=32, num_attention_heads=2)).save_pretrained(
        encoder
    )
    config = json.loads((encoder / "config.json").read_text())
    (encoder / "config.json").write_text(
        json.dumps({**config, "architectures": ["BertForMaskedLM"]})
    )
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    spec = resolve_model(str(tmp_path))
    assert parameter_count(spec) == _checkpoint_parameters(encoder)
    # the config alone says masked LM, a bigger model
    assert parameter_count(spec.config) > parameter_count(spec)


def test_unknown_architecture_falls_back_to_the_bare_model() -> None:
    config = BertConfig(vocab_size=96, hidden_size=32, num_attention_heads=2)
    config.architectures = ["BertForSomethingTransformersLacks"]
    with torch.device("meta"):
        bare = sum(p.numel() for p in AutoModel.from_config(config).parameters())
    assert parameter_count(config) == bare


def test_counting_leaves_the_config_as_it_was() -> None:
    spec = resolve_model("SmolLM2-135M")
    before = spec.config.to_dict()
    parameter_count(spec)
    assert spec.config.to_dict() == before


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    try:
        main(["models", *argv])
    except SystemExit as exc:
        assert not exc.code
    return capsys.readouterr().out


def test_models_command_lists_every_entry_with_its_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = json.loads(_run(capsys, "--json"))
    assert [row["name"] for row in rows] == registry_names()
    by_name = {row["name"]: row for row in rows}
    for name, published in PUBLISHED:
        assert by_name[name]["parameters"] == published
    llama = by_name["meta-llama/Llama-3.1-8B"]
    assert (llama["model_type"], llama["max_positions"]) == ("llama", 131_072)

    lines = _run(capsys).splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "TYPE", "MAX", "POSITIONS", "PARAMETERS"]
    assert len(lines) == 1 + len(rows)
    assert lines[1 + registry_names().index("google/gemma-2-2b")].split() == [
        "google/gemma-2-2b",
        "gemma2",
        "8192",
        "2,614,341,888",
    ]
