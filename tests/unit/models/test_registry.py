"""memfit's offline model registry: every entry builds, known parameter counts, name resolution."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
)

from memfit.errors import UsageError
from memfit.models import ModelSpec, registry_names, resolve_model, usable_positions


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _params(model: torch.nn.Module) -> int:
    # parameters() yields a tied weight once, so gpt2's lm_head is not counted twice
    return sum(p.numel() for p in model.parameters())


def _build(auto: type, spec: ModelSpec, **overrides: object) -> torch.nn.Module:
    config = spec.config
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return auto.from_config(config)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("name", registry_names())
def test_every_entry_builds_on_meta(name: str) -> None:
    spec = resolve_model(name)
    assert spec.source == "registry" and spec.path is None and spec.name == name
    # a published config names the class of its checkpoint when it names one (deberta-v3's does
    # not), and transformers has that class
    for architecture in spec.config.architectures or []:
        assert hasattr(transformers, architecture)
    assert _params(_build(AutoModel, spec)) > 1_000_000


@pytest.mark.parametrize(
    ("name", "auto", "overrides", "expected"),
    [
        ("bert-base-uncased", AutoModelForSequenceClassification, {"num_labels": 2}, 109_483_778),
        ("gpt2", AutoModelForCausalLM, {}, 124_439_808),
        ("bert-large-uncased", AutoModel, {}, 335_141_888),
        ("all-MiniLM-L6-v2", AutoModel, {}, 22_713_216),
        ("roberta-base", AutoModel, {}, 124_645_632),
        ("distilbert-base-uncased", AutoModel, {}, 66_362_880),
        ("gpt2-medium", AutoModel, {}, 354_823_168),
        ("gpt2-large", AutoModel, {}, 774_030_080),
        ("gpt2-xl", AutoModel, {}, 1_557_611_200),
        ("all-mpnet-base-v2", AutoModel, {}, 109_486_464),
        ("bert-base-multilingual-cased", AutoModel, {}, 177_853_440),
        ("distilroberta-base", AutoModel, {}, 82_118_400),
    ],
)
def test_known_parameter_counts(
    name: str, auto: type, overrides: dict[str, object], expected: int
) -> None:
    assert _params(_build(auto, resolve_model(name), **overrides)) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bert-base-uncased", 512),
        ("roberta-base", 512),  # 514 rows, positions start after pad_token_id 1
        ("all-mpnet-base-v2", 512),
        ("gpt2", 1024),
        ("distilbert-base-uncased", 512),
    ],
)
def test_max_positions(name: str, expected: int) -> None:
    spec = resolve_model(name)
    assert spec.max_positions == expected == usable_positions(spec.config)


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("google-bert/bert-base-uncased", "bert-base-uncased"),
        ("openai-community/gpt2-xl", "gpt2-xl"),
        ("FacebookAI/roberta-base", "roberta-base"),
        ("distilbert/distilgpt2", "distilgpt2"),
        ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        ("all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"),
        ("BERT-Base-Uncased", "bert-base-uncased"),
        ("facebookai/ROBERTA-BASE", "roberta-base"),
        ("Sentence-Transformers/ALL-minilm-l6-V2", "sentence-transformers/all-MiniLM-L6-v2"),
    ],
)
def test_aliases_and_case(alias: str, canonical: str) -> None:
    spec, ref = resolve_model(alias), resolve_model(canonical)
    assert spec.name == canonical
    assert spec.config.to_dict() == ref.config.to_dict()
    assert spec.cache_key() == ref.cache_key()


def test_registry_names_are_canonical() -> None:
    names = registry_names()
    assert "bert-base-uncased" in names and "google-bert/bert-base-uncased" not in names
    assert len(names) == len(set(names))


def test_each_resolve_returns_a_fresh_config() -> None:
    resolve_model("gpt2").config.n_layer = 1
    assert resolve_model("gpt2").config.n_layer == 12


def test_local_folder_and_config_file(tmp_path: Path) -> None:
    BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path)
    folder = resolve_model(str(tmp_path))
    assert (folder.source, folder.path, folder.name) == (
        "local-folder",
        str(tmp_path),
        str(tmp_path),
    )
    assert folder.config.hidden_size == 64 and folder.max_positions == 512
    file = resolve_model(str(tmp_path / "config.json"))
    assert file.source == "config-file" and file.path == str(tmp_path)
    assert file.cache_key() == folder.cache_key()
    assert _params(_build(AutoModel, file)) > 0


def test_sentence_transformers_folder_with_transformer_subfolder(tmp_path: Path) -> None:
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "0_Transformer",
            "type": "sentence_transformers.models.Transformer",
        },
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    BertConfig(hidden_size=32, num_attention_heads=4).save_pretrained(tmp_path / "0_Transformer")
    spec = resolve_model(str(tmp_path))
    assert spec.source == "local-folder" and spec.path == str(tmp_path / "0_Transformer")
    assert spec.config.hidden_size == 32


def test_same_config_gives_same_cache_key(tmp_path: Path) -> None:
    resolve_model("bert-base-uncased").config.save_pretrained(tmp_path)
    assert (
        resolve_model(str(tmp_path)).cache_key() == resolve_model("bert-base-uncased").cache_key()
    )
    assert (
        resolve_model("bert-base-cased").cache_key()
        != resolve_model("bert-base-uncased").cache_key()
    )


def test_hf_cache_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    repo = tmp_path / "models--someorg--tiny-bert"
    snapshot = repo / "snapshots" / ("a" * 40)
    BertConfig(hidden_size=48, num_attention_heads=4).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("someorg/tiny-bert")
    assert (spec.source, spec.name, spec.path) == ("hf-cache", "someorg/tiny-bert", str(snapshot))
    assert spec.config.hidden_size == 48


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "model_type": "bert",\n  "hidden_size": 768,,\n}\n')
    with pytest.raises(UsageError, match=r"config\.json.*line 3") as info:
        resolve_model(str(bad))
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="line 3"):
        resolve_model(str(tmp_path))  # the folder holding it


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"hidden_size": 8}', "no model_type"),
        ('{"model_type": "no-such-architecture"}', "no-such-architecture"),
    ],
)
def test_bad_config_contents(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=message) as info:
        resolve_model(str(path))
    assert str(path) in str(info.value)


def test_unknown_model_suggests_and_never_uses_network(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[object] = []

    class NetworkUsed(BaseException):  # not an Exception: nothing may swallow it
        pass

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise NetworkUsed(args)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for name in ("bert-bse-uncased", "someone/not-a-real-model-xyz"):
        with pytest.raises(UsageError) as info:
            resolve_model(name)
        assert f"unknown model '{name}'" in str(info.value)
    with pytest.raises(UsageError, match="Did you mean: bert-base-uncased"):
        resolve_model("bert-bse-uncased")
    assert attempts == []


def test_usage_error_exit_code() -> None:
    with pytest.raises(UsageError) as info:
        resolve_model("definitely-not-a-model")
    assert info.value.exit_code == 2
    assert "memfit models" in str(info.value)


def test_folder_without_config_falls_through_to_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gpt2").mkdir()  # e.g. an output folder named after the model
    monkeypatch.chdir(tmp_path)
    assert resolve_model("gpt2").source == "registry"
    (tmp_path / "bert-bse-uncased").mkdir()
    with pytest.raises(UsageError, match=r"a folder without config\.json"):
        resolve_model("bert-bse-uncased")
