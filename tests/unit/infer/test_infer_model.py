"""MODEL_DIR: the task read from the folder (never guessed), run folders, and heads that the
folder lacks refused instead of answering at random."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memfit.errors import UsageError
from memfit.infer.model import detect_task, load_predict_model, model_folder, predict_task


def folder_with(
    tmp_path: Path, name: str, *, architectures: list[str] | None = None, modules: bool = False
) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    config: dict[str, object] = {"model_type": "bert"}
    if architectures is not None:
        config["architectures"] = architectures
    (folder / "config.json").write_text(json.dumps(config))
    if modules:
        (folder / "modules.json").write_text("[]")
    return folder


@pytest.mark.parametrize(
    ("architectures", "modules", "task"),
    [
        (["BertForSequenceClassification"], False, "classification"),
        (["GPT2LMHeadModel"], False, "causal-lm"),
        (["LlamaForCausalLM"], False, "causal-lm"),
        (["BertModel"], True, "sentence-embedding"),
        (["BertModel"], False, None),
        (None, False, None),
    ],
)
def test_the_task_comes_from_the_folder(
    tmp_path: Path, architectures: list[str] | None, modules: bool, task: str | None
) -> None:
    folder = folder_with(tmp_path, "m", architectures=architectures, modules=modules)
    assert detect_task(folder) == task


def test_a_run_folder_means_its_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model = folder_with(run, "model", architectures=["BertForSequenceClassification"])
    (run / "run.json").write_text("{}")
    assert model_folder(run) == model
    assert model_folder(model) == model


def test_a_folder_without_a_model_names_model_dir(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"MODEL_DIR: .* holds no model"):
        model_folder(tmp_path)
    with pytest.raises(UsageError, match=r"MODEL_DIR: .* does not exist"):
        model_folder(tmp_path / "nowhere")


def test_predict_asks_for_task_or_embed_where_the_folder_does_not_say(tmp_path: Path) -> None:
    bare = folder_with(tmp_path, "bare", architectures=["BertModel"])
    with pytest.raises(UsageError, match=r"architectures: BertModel\); give --task"):
        predict_task(bare, None)
    assert predict_task(bare, "causal-lm") == "causal-lm"
    st = folder_with(tmp_path, "st", architectures=["BertModel"], modules=True)
    with pytest.raises(UsageError, match="use memfit embed"):
        predict_task(st, None)
    with pytest.raises(UsageError, match="--task: unknown value 'sentence-embedding'"):
        predict_task(st, "sentence-embedding")


def test_a_head_the_folder_lacks_is_refused(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    folder = tmp_path / "encoder"
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    BertModel(config).save_pretrained(folder)
    with pytest.raises(UsageError, match=r"no trained classification weights for classifier\.bias"):
        load_predict_model(folder, "classification")


@pytest.mark.parametrize(
    ("run_json", "kind"),
    [
        ({"config": {"task": "classification"}}, "single_label"),  # memfit trained a classifier
        (None, "regression"),  # a folder of its own: one label reads as regression
        ({"config": {"task": "causal-lm"}}, "regression"),
    ],
)
def test_a_one_label_head_of_a_classification_run_is_no_regression(
    tmp_path: Path, run_json: dict[str, object] | None, kind: str
) -> None:
    """A memfit classification run with one label (issue 30: it trained) is a classifier, not
    a regression head: the run folder says what it is."""
    from memfit.infer.predict import Classifier
    from memfit.infer.run import InferConfig
    from tiny_models import save_bert

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    save_bert(run / "model", ["w1", "w2"], num_labels=1)
    if run_json is not None:
        (run / "run.json").write_text(json.dumps(run_json))
    classifier = Classifier(run / "model", InferConfig(str(run), "rows.jsonl", "out.jsonl"))
    assert classifier.kind == kind
    record = classifier.record(np.array([0.5]))
    if kind == "regression":
        assert record == {"score": 0.5}
    else:
        assert record == {"label": "LABEL_0", "label_id": 0, "probabilities": {"LABEL_0": 0.5}}
