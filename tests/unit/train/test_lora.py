"""LoRA targets: one table (``memfit.estimate.workload``) for estimate, plan and train; names are
checked against the model; a classifier's head trains whole and is saved with the adapter."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memfit.cli import main
from memfit.errors import UsageError
from memfit.estimate.workload import (
    LORA_TARGETS,
    StepSpec,
    _adaptable_modules,
    _lora_name_matches,
    build_model,
    lora_config,
    lora_target_modules,
)
from memfit.job import parse_target_modules
from memfit.train import TrainConfig
from memfit.train.lora import lora_problems

LAYERS = 2
_COMMON = dict(
    hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64
)
# the kwargs that make a 2-layer model of each architecture (names differ between them)
TINY: dict[str, dict[str, Any]] = {
    "distilbert": dict(dim=32, n_layers=LAYERS, n_heads=2, hidden_dim=64),
    "gpt2": dict(n_embd=32, n_layer=LAYERS, n_head=2),
    "opt": dict(_COMMON, ffn_dim=64, word_embed_proj_dim=32),
    "bloom": dict(hidden_size=32, n_layer=LAYERS, n_head=2),
    "falcon": dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2),
    # their default pad ids lie beyond a 128-token vocabulary
    "phi3": dict(_COMMON, pad_token_id=0),
    "modernbert": dict(_COMMON, pad_token_id=0),
    **{
        name: dict(_COMMON, num_key_value_heads=2, head_dim=16)
        for name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
    },
}


def _tiny(model_type: str, auto: str = "AutoModel", **extra: Any) -> nn.Module:
    import transformers

    kwargs = dict(TINY.get(model_type, _COMMON), vocab_size=128, **extra)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, auto).from_config(config)


@pytest.mark.parametrize("model_type", sorted(LORA_TARGETS))
def test_every_table_row_names_the_layers_of_its_architecture(model_type: str) -> None:
    # a transformers release that renames a module would silently shrink the adapters: every
    # name of both groups must be found, the attention ones once per layer
    model = _tiny(model_type)
    paths = _adaptable_modules(model)
    for group, names in LORA_TARGETS[model_type].items():
        assert lora_target_modules(model, "causal-lm", [group]) == list(names)
        for name in names:
            found = sum(_lora_name_matches(path, name) for path in paths)
            if group == "attention":
                assert found == LAYERS, (name, found)
            else:
                assert found >= LAYERS, (name, found)


def test_default_is_the_attention_group_and_groups_combine() -> None:
    model = _tiny("bert")
    assert lora_target_modules(model, "classification") == [
        "query",
        "key",
        "value",
        "attention.output.dense",
    ]
    both = lora_target_modules(model, "classification", ["attention", "mlp", "query"])
    attention = ["query", "key", "value", "attention.output.dense"]
    assert both == [*attention, "intermediate.dense", "output.dense"]
    assert lora_target_modules(model, "classification", ["all-linear"]) == "all-linear"


def test_a_name_the_model_lacks_is_a_usage_error_listing_its_layers() -> None:
    model = _tiny("distilbert")
    with pytest.raises(UsageError, match=r"--lora-target-modules: no layer .* 'query'") as caught:
        lora_target_modules(model, "classification", ["q_lin", "query"])
    message = str(caught.value)
    assert "q_lin" in message and "lin1" in message and "attention, mlp" in message
    with pytest.raises(UsageError, match="all-linear takes no other names"):
        lora_target_modules(model, "classification", ["all-linear", "q_lin"])


class _Mystery(nn.Module):
    """An architecture neither memfit's table nor peft knows."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": "mystery"})()
        self.mix = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)


def test_an_unknown_architecture_needs_names_and_takes_them() -> None:
    with pytest.raises(UsageError, match=r"memfit knows no attention modules of mystery.*mix"):
        lora_target_modules(_Mystery(), "causal-lm")
    assert lora_target_modules(_Mystery(), "causal-lm", ["mix"]) == ["mix"]


def test_an_architecture_missing_from_the_table_falls_back_to_peft_defaults() -> None:
    # peft knows gptj's query and value; memfit's table does not list gptj
    assert "gptj" not in LORA_TARGETS
    model = _tiny("gptj", n_embd=32, n_layer=2, n_head=2, rotary_dim=8)
    assert lora_target_modules(model, "causal-lm") == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("model_type", "head"),
    [("distilbert", {"pre_classifier", "classifier"}), ("gpt2", {"score"})],
)
def test_a_classifier_head_is_trained_whole_and_never_adapted(
    model_type: str, head: set[str]
) -> None:
    from peft import get_peft_model

    extra = {"pad_token_id": 0} if model_type == "gpt2" else {}
    model = _tiny(model_type, "AutoModelForSequenceClassification", num_labels=3, **extra)
    config = lora_config(model, "classification", 4)
    peft_model = get_peft_model(model, config)
    trainable = {
        name.removeprefix("base_model.model.").split(".")[0]
        for name, p in peft_model.named_parameters()
        if p.requires_grad and "lora_" not in name
    }
    assert trainable == head
    # nothing inside the head is a LoRA target (it is saved whole instead)
    assert not any(
        "lora_" in n and n.split(".")[2] in head for n, _ in peft_model.named_parameters()
    )


def test_the_estimator_builds_the_adapters_train_builds(tiny_bert: str) -> None:
    import transformers

    from memfit.train.lora import add_lora

    config = transformers.AutoConfig.from_pretrained(tiny_bert)
    spec = StepSpec(task="classification", lora_rank=4, lora_targets=("attention", "mlp"))
    estimated = build_model(config, spec)

    class Recipe:
        model = transformers.AutoModelForSequenceClassification.from_config(config)

    recipe = Recipe()
    cfg = TrainConfig(
        task="classification",
        model=tiny_bert,
        train_file="-",
        output_dir="-",
        lora_rank=4,
        lora_target_modules=["attention", "mlp"],
    )
    add_lora(recipe, cfg)

    def adapters(model: nn.Module) -> dict[str, torch.Size]:
        return {n: p.shape for n, p in model.named_parameters() if p.requires_grad}

    assert adapters(recipe.model) == adapters(estimated)
    assert len(adapters(estimated)) == 2 * LAYERS * 6 + 2  # A and B of 6 targets, the head
    # the base path that adapter_config.json will hold is absolute
    entry = recipe.model.peft_config["default"]
    assert entry.base_model_name_or_path == str(Path(tiny_bert).resolve())


def test_estimate_with_lora_on_distilbert_counts_the_adapters(tmp_path: Path) -> None:
    # peft has no default targets for DistilBERT: without the table this raised from peft
    import memfit

    _tiny("distilbert").config.save_pretrained(tmp_path)
    est = memfit.estimate(
        str(tmp_path), task="classification", batch_size=2, seq_len=16, device="cpu", lora_rank=4
    )
    dim, labels = 32, 2
    adapters = LAYERS * 4 * (dim * 4 + 4 * dim)
    head = (dim * dim + dim) + (dim * labels + labels)  # pre_classifier and classifier
    assert est.details["trainable_parameters"] == adapters + head


def test_parse_target_modules() -> None:
    assert parse_target_modules(None) is None
    assert parse_target_modules(" attention, mlp ,") == ["attention", "mlp"]
    assert parse_target_modules(["q_lin"]) == ["q_lin"]
    assert parse_target_modules(",") is None


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"merge_lora": True}, "--merge-lora: only with --lora-rank"),
        ({"lora_target_modules": ["query"]}, "--lora-target-modules: only with --lora-rank"),
        ({"lora_rank": -1}, "--lora-rank: must be a whole number ≥ 0"),
    ],
)
def test_lora_flag_problems(knobs: dict[str, Any], message: str) -> None:
    cfg = TrainConfig(task="classification", model="m", train_file="-", output_dir="-", **knobs)
    assert any(message in p for p in lora_problems(cfg))


def _train(tmp_path: Path, model: str, *extra: str) -> tuple[int, Path]:
    data = tmp_path / "train.csv"
    data.write_text("text,label\nthe cat sat,1\nthe dog ran,0\n")
    out = tmp_path / "out"
    args = ["train", "--task", "classification", "--model", model, "--train-file", str(data)]
    args += ["--output-dir", str(out), "--device", "cpu", *extra]
    with pytest.raises(SystemExit) as done:
        main(args)
    return int(done.value.code or 0), out


def test_cli_merge_lora_without_a_rank_exits_2(
    tmp_path: Path, bert_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _train(tmp_path, bert_dir, "--merge-lora")
    err = capsys.readouterr().err
    assert code == 2 and "--merge-lora: only with --lora-rank" in err
    assert not out.exists()


def test_cli_unknown_target_exits_2_naming_the_layers_and_writes_nothing(
    tmp_path: Path, bert_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _train(tmp_path, bert_dir, "--lora-rank", "4", "--lora-target-modules", "q_proj")
    err = capsys.readouterr().err
    assert code == 2
    assert "--lora-target-modules: no layer of this model is named 'q_proj'" in err
    assert "query" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_peft_older_than_transformers_integration_wants_is_one_line_before_anything(
    tmp_path: Path,
    bert_dir: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LoRA on a sentence-transformers model goes through transformers' PEFT integration, which
    raises a bare ValueError for a peft older than its MIN_PEFT_VERSION (transformers 5.24 with
    peft 0.21): memfit names the flag and the versions before anything is written."""
    import importlib.metadata

    import transformers.integrations.peft as integration

    installed = importlib.metadata.version("peft")
    cfg = TrainConfig(
        task="sentence-embedding", model="m", train_file="-", output_dir="-", lora_rank=4
    )
    monkeypatch.setattr(integration, "MIN_PEFT_VERSION", installed, raising=False)
    assert not any("PEFT integration" in p for p in lora_problems(cfg))
    monkeypatch.setattr(integration, "MIN_PEFT_VERSION", "999.0", raising=False)
    # the other tasks load peft's own PeftModel: no such check
    assert lora_problems(TrainConfig(**{**cfg.__dict__, "task": "classification"})) == []
    data = tmp_path / "pairs.csv"
    data.write_text("anchor,positive\nthe cat sat,a cat\nthe dog ran,a dog\n")
    out = tmp_path / "out"
    args = ["train", "--task", "sentence-embedding", "--model", bert_dir, "--train-file", str(data)]
    with pytest.raises(SystemExit) as done:
        main([*args, "--output-dir", str(out), "--device", "cpu", "--lora-rank", "4"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.strip().splitlines() == [
        "memfit: error: --lora-rank: LoRA on a sentence-transformers model goes through "
        f"transformers' PEFT integration, and transformers {transformers_version()} accepts peft "
        f"999.0 or newer, not the installed {installed}: pip install -U 'peft>=999.0', or a "
        f"transformers release that accepts peft {installed}"
    ]
    assert not out.exists()


def transformers_version() -> str:
    import transformers

    return transformers.__version__
