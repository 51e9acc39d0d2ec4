"""The three recipes of ``memfit train`` on tiny models: data checks, the exactness contract of
``loss(rows, total_units)``, eval metrics and saved folders that load."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.data.rows import WHERE, Column, read_rows
from memfit.errors import UsageError
from memfit.metrics import perplexity
from memfit.train.recipes import (
    RECIPES,
    CausalLMRecipe,
    ClassificationRecipe,
    SentenceEmbeddingRecipe,
    make_recipe,
)
from memfit.train.recipes.base import Recipe
from memfit.train.recipes.classification import accuracy, macro_f1
from memfit.train.recipes.sentence_embedding import retrieval_accuracy

TEXTS = [
    "the cat sat on the mat",
    "a good movie",
    "the dog ran in the park and the cat sat on the mat",
    "awful film",
    "great acting fine plot",
    "the dog sat",
    "a bad movie with awful acting",
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def chunked_vs_whole(recipe: Recipe, rows: list[dict[str, Any]]) -> None:
    """Chunks of 4 + 3 rows, each over the step's units, give the whole step's gradient."""
    recipe.model.eval()  # dropout off: both passes see the same function
    total = recipe.units(rows)
    recipe.model.zero_grad()
    recipe.loss(rows, total).backward()
    whole = gradients(recipe.model)
    recipe.model.zero_grad()
    recipe.loss(rows[:4], total).backward()
    recipe.loss(rows[4:], total).backward()
    chunked = gradients(recipe.model)
    assert whole.keys() == chunked.keys() and whole
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)


# --- data --------------------------------------------------------------------------------------
def test_read_rows_reads_every_format_with_line_numbers(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text('text,label\nhello,1\n"two\nlines",0\n')
    (tmp_path / "d.tsv").write_text("text\tlabel\nhello\t1\nbye\t0\n")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "hello", "label": 1}, {"text": "bye", "label": 0}])
    (tmp_path / "d.json").write_text(
        '[\n  {"text": "hello", "label": 1},\n\n  {"text": "bye",\n "label": 0}\n]\n'
    )
    csv_rows = read_rows(tmp_path / "d.csv", ["text"], flag="--train-file")
    assert [r["text"] for r in csv_rows] == ["hello", "two\nlines"]
    assert csv_rows[0][WHERE] == f"--train-file: {tmp_path / 'd.csv'} line 2"
    tsv_rows = read_rows(tmp_path / "d.tsv", ["text", "label"], flag="--eval-file")
    assert tsv_rows[1]["label"] == "0" and tsv_rows[1][WHERE].endswith("d.tsv line 3")
    assert tsv_rows[1][WHERE].startswith("--eval-file: ")
    jsonl_rows = read_rows(
        tmp_path / "d.jsonl", ["text", Column("label", "label")], flag="--train-file"
    )
    # a label is kept as its canonical text: 0, 0.0 and "0" are one label
    assert jsonl_rows[1]["label"] == "0" and jsonl_rows[1][WHERE].endswith("line 2")
    json_rows = read_rows(tmp_path / "d.json", ["text"], flag="--train-file")
    assert [r[WHERE].rsplit(" ", 1)[1] for r in json_rows] == ["2", "4"]


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.csv", "", r"empty\.csv: the file is empty"),
        ("header.csv", "text,label\n", r"header\.csv: no rows"),
        ("nocol.csv", "words,label\nhi,1\n", r"nocol\.csv line 1: no column 'text'"),
        (
            "blank.csv",
            "text,label\nhi,1\nok,0\n  ,1\n",
            r"blank\.csv line 4: column 'text' is empty",
        ),
        ("fields.csv", "text,label\nhi,1\nhi,1,2\n", r"fields\.csv line 3: 3 fields"),
        (
            "nocol.jsonl",
            '{"text": "a"}\n\n{"txt": "b"}\n',
            r"nocol\.jsonl line 3: no column 'text'",
        ),
        ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad\.jsonl line 2: not JSON"),
        ("list.jsonl", '{"text": "a"}\n["a"]\n', r"list\.jsonl line 2: not a JSON object"),
        (
            "null.json",
            '[{"text": "a"},\n {"text": null}]',
            r"null\.json line 2: column 'text' is empty",
        ),
        ("bad.json", '[{"text": "a"},\n {"text": }]', r"bad\.json line 2: not JSON"),
        ("data.txt", "text\nhi\n", r"unknown format '\.txt'"),
    ],
)
def test_read_rows_rejects_bad_files_at_their_line(
    tmp_path: Path, name: str, content: str, match: str
) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(UsageError, match=r"^--train-file: .*" + match):
        read_rows(tmp_path / name, ["text"], flag="--train-file")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--eval-file: .*nope\.csv: no such file"):
        read_rows(tmp_path / "nope.csv", ["text"], flag="--eval-file")


def test_registry() -> None:
    assert set(RECIPES) == {"classification", "causal-lm", "sentence-embedding"}
    recipe = make_recipe("causal-lm", model="x", max_seq_len=16, packing=True)
    assert isinstance(recipe, CausalLMRecipe) and recipe.packing
    with pytest.raises(UsageError, match="--task: unknown value 'nope'"):
        make_recipe("nope", model="x")


def test_missing_model_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = ClassificationRecipe("no-such-org/no-such-model")
    data = [{"text": "a", "label": 1}, {"text": "b", "label": 0}]
    rows = recipe.read(write_jsonl(tmp_path / "t.jsonl", data))
    with pytest.raises(
        UsageError, match=r"^--model: cannot load 'no-such-org/no-such-model': not a local folder"
    ):
        recipe.build(rows)


# --- classification ----------------------------------------------------------------------------
def test_metric_helpers_by_hand() -> None:
    predictions, labels = [0, 0, 1, 2, 1], [0, 1, 1, 2, 2]
    assert accuracy(predictions, labels) == pytest.approx(3 / 5)
    # per class F1: 0 -> 2/3, 1 -> 1/2, 2 -> 2/3
    assert macro_f1(predictions, labels) == pytest.approx((2 / 3 + 1 / 2 + 2 / 3) / 3)
    assert macro_f1([1, 1], [0, 0]) == 0.0
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e4) == math.inf


def test_classification_labels_exactness_eval_and_save(bert_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    names = ["pos", "neg", "pos", "neg", "pos", "meh", "neg"]
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [{"text": t, "label": n} for t, n in zip(TEXTS, names, strict=True)],
    )
    recipe = ClassificationRecipe(bert_dir, max_seq_len=8)
    rows = recipe.read(train)
    recipe.build(rows)
    assert recipe.labels == ["meh", "neg", "pos"]
    assert recipe.model.config.id2label == {0: "meh", 1: "neg", 2: "pos"}
    assert recipe.units(rows) == 7
    chunked_vs_whole(recipe, rows)

    # dynamic padding: a chunk is as wide as its longest text (truncated to max_seq_len)
    short = recipe.tokenizer([TEXTS[1], TEXTS[3]], padding="longest", return_tensors="pt")
    assert short["input_ids"].shape[1] < 8

    with torch.no_grad():
        partials = [recipe.eval_partial(rows[:3]), recipe.eval_partial(rows[3:])]
        logits = recipe._logits(rows)
    metrics = recipe.eval_reduce(partials)
    targets = torch.tensor([recipe.label_ids[n] for n in names])
    expected_loss = float(torch.nn.functional.cross_entropy(logits, targets))
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(
        accuracy(logits.argmax(-1).tolist(), targets.tolist())
    )
    assert 0.0 <= metrics["macro_f1"] <= 1.0

    recipe.save(tmp_path / "out")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert loaded.config.label2id == {"meh": 0, "neg": 1, "pos": 2}
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_classification_integer_labels_from_csv(bert_dir: str, tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("sentence,label\nthe cat,10\nthe dog,2\na movie,2\n")
    recipe = ClassificationRecipe(bert_dir, text_column="sentence", max_seq_len=8)
    rows = recipe.read(tmp_path / "t.csv")
    recipe.build(rows)
    assert recipe.labels == [2, 10]  # numeric order, not text order
    assert recipe.model.config.num_labels == 2


def test_classification_unknown_eval_label(bert_dir: str, tmp_path: Path) -> None:
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1}]
    )
    evaluation = write_jsonl(
        tmp_path / "eval.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": 7}]
    )
    # the training file fixes the labels when it is read: the eval file is checked as it is read,
    # before any model is loaded
    recipe = ClassificationRecipe(bert_dir)
    recipe.read(train)
    with pytest.raises(
        UsageError, match=r"^--eval-file: .*eval\.jsonl line 2: label 7 does not occur"
    ):
        recipe.read(evaluation, "--eval-file")
    # --labels / --num-labels fix the set before any file is read
    fixed = ClassificationRecipe(bert_dir, labels=["0", "1"])
    with pytest.raises(
        UsageError, match=r"line 2: label 7 is not one of the labels given by --labels"
    ):
        fixed.read(evaluation, "--eval-file")
    counted = ClassificationRecipe(bert_dir, num_labels=3)
    counted.read(train)
    assert counted.labels == [0, 1, 2]  # a label the data never shows still has its id


def test_classification_bad_rows(bert_dir: str, tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("text,label\nok,1\n,0\n")
    with pytest.raises(UsageError, match=r"^--train-file: .*t\.csv line 3: column 'text' is empty"):
        ClassificationRecipe(bert_dir).read(tmp_path / "t.csv")
    (tmp_path / "u.csv").write_text("text,tag\nok,1\n")
    with pytest.raises(UsageError, match=r"u\.csv line 1: no column 'label'"):
        ClassificationRecipe(bert_dir).read(tmp_path / "u.csv")
    write_jsonl(tmp_path / "v.jsonl", [{"text": "ok", "label": 1}, {"text": "ok", "label": 0.5}])
    with pytest.raises(UsageError, match=r"v\.jsonl line 2: column 'label'"):
        ClassificationRecipe(bert_dir).read(tmp_path / "v.jsonl")


# --- causal LM ---------------------------------------------------------------------------------
def test_causal_lm_units_exactness_eval_and_save(gpt2_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in TEXTS])
    recipe = CausalLMRecipe(gpt2_dir, max_seq_len=12)
    rows = recipe.read(train)
    recipe.build(rows)
    lengths = [len(recipe.tokenizer(t, truncation=True, max_length=12)["input_ids"]) for t in TEXTS]
    assert len(set(lengths)) > 2 and max(lengths) == 12  # lengths differ; one is truncated
    assert recipe.units(rows) == sum(n - 1 for n in lengths)
    chunked_vs_whole(recipe, rows)

    # the loss is the mean over target tokens: the same as the rows one at a time, token-weighted
    with torch.no_grad():
        whole = float(recipe.loss(rows, recipe.units(rows)))
        one_by_one = sum(float(recipe.loss([r], recipe.units(rows))) for r in rows)
        partials = [recipe.eval_partial(rows[:2]), recipe.eval_partial(rows[2:])]
    assert whole == pytest.approx(one_by_one, rel=1e-5)
    metrics = recipe.eval_reduce(partials)
    assert metrics["loss"] == pytest.approx(whole, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(whole), rel=1e-5)

    recipe.save(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.n_layer == 2
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_causal_lm_packing(gpt2_dir: str, tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in TEXTS])
    recipe = CausalLMRecipe(gpt2_dir, max_seq_len=10, packing=True, packing_strategy="wrapped")
    blocks = recipe.read(train)
    tokenizer = recipe.tokenizer
    stream: list[int] = []
    for text in TEXTS:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert [t for b in blocks for t in b["input_ids"]] == stream[: len(blocks) * 10][
        : sum(len(b["input_ids"]) for b in blocks)
    ]
    assert all(len(b["input_ids"]) == 10 for b in blocks[:-1])
    assert blocks[0][WHERE].endswith("train.jsonl line 1") or "line 1 to" in blocks[0][WHERE]
    recipe.build(blocks)
    assert recipe.units(blocks) == sum(len(b["input_ids"]) - 1 for b in blocks)
    chunked_vs_whole(recipe, (blocks * 4)[:7])


def test_causal_lm_rejects_a_single_token_text(gpt2_dir: str, tmp_path: Path) -> None:
    recipe = CausalLMRecipe(gpt2_dir)
    single = recipe._load_tokenizer().convert_ids_to_tokens(5)
    assert len(recipe.tokenizer(single)["input_ids"]) == 1
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "the cat sat"}, {"text": single}])
    with pytest.raises(
        UsageError, match=r"^--train-file: .*t\.jsonl line 2: column 'text' is a single token"
    ):
        recipe.read(train)
    write_jsonl(tmp_path / "e.jsonl", [{"text": "the cat sat"}, {"text": ""}])
    with pytest.raises(UsageError, match=r"e\.jsonl line 2: column 'text' is empty"):
        recipe.read(tmp_path / "e.jsonl")


# --- sentence embedding ------------------------------------------------------------------------
PAIRS = [
    {"anchor": "How do I reset my password?", "positive": "Steps to reset your password"},
    {"anchor": "How do I update my phone?", "positive": "Guide to update a phone"},
    {"anchor": "How do I cancel my order?", "positive": "Cancel an order yourself"},
    {"anchor": "How do I water a cactus?", "positive": "Watering a cactus"},
    {"anchor": "How do I tune a guitar?", "positive": "Tuning your guitar"},
    {"anchor": "How do I paint a fence?", "positive": "Painting the fence"},
    {"anchor": "How do I bake bread?", "positive": "Baking a sourdough loaf"},
]


@pytest.mark.slow
def test_sentence_embedding_gradcache_matches_whole_batch(minilm_dir: str, tmp_path: Path) -> None:
    recipe = SentenceEmbeddingRecipe(minilm_dir, max_seq_len=16)
    assert not recipe.splittable
    rows = recipe.read(write_jsonl(tmp_path / "pairs.jsonl", PAIRS))
    recipe.build(rows)
    recipe.model.eval()
    assert recipe.units(rows) == 7
    recipe.model.zero_grad()
    plain = recipe.loss(rows, 7)
    plain.backward()
    whole = gradients(recipe.model)
    recipe.model.zero_grad()
    cached = recipe.loss(rows, 7, mini_batch_size=2)
    assert type(recipe._loss_module(2, 7)).__name__ == "AutocastCachedMNRL"
    cached.backward()  # the GradCache replay runs here, from outside the recipe
    assert float(cached.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    chunked = gradients(recipe.model)
    assert whole.keys() == chunked.keys() and whole
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)
    # the contract's weighting reaches the replayed gradients: over twice the units, half of it
    recipe.model.zero_grad()
    recipe.loss(rows, 14, mini_batch_size=2).backward()
    for name, grad in gradients(recipe.model).items():
        torch.testing.assert_close(grad, whole[name] / 2, atol=1e-5, rtol=1e-4, msg=name)


def test_sentence_embedding_eval_and_save(minilm_dir: str, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    recipe = SentenceEmbeddingRecipe(minilm_dir, loss="cached-mnrl", max_seq_len=16)
    rows = recipe.read(write_jsonl(tmp_path / "pairs.jsonl", PAIRS))
    recipe.build(rows)
    assert recipe.model.max_seq_length == 16
    recipe.model.eval()
    with torch.no_grad():
        partials = [recipe.eval_partial(rows[:3]), recipe.eval_partial(rows[3:])]
    anchors = torch.cat([p[2] for p in partials])
    assert anchors.device.type == "cpu" and anchors.shape[0] == 7
    metrics = recipe.eval_reduce(partials)
    assert metrics["retrieval_accuracy"] == pytest.approx(
        retrieval_accuracy(anchors, torch.cat([p[3] for p in partials]))
    )
    assert metrics["retrieval_accuracy"] >= 5 / 7  # a trained model gets these paraphrases right

    recipe.save(tmp_path / "out")
    loaded = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert loaded.max_seq_length == 16


def test_retrieval_accuracy_by_hand() -> None:
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    positives = torch.tensor([[1.0, 0.0], [1.0, 0.2], [1.0, 1.0]])
    # anchor 0 -> positive 0 (own); anchor 1 -> positive 2 (not own); anchor 2 -> positive 2 (own)
    assert retrieval_accuracy(anchors, positives) == pytest.approx(2 / 3)


def test_sentence_embedding_bad_rows_and_loss(minilm_dir: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--loss: unknown value 'nope'"):
        SentenceEmbeddingRecipe(minilm_dir, loss="nope")
    write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], {"anchor": "hi"}])
    with pytest.raises(UsageError, match=r"p\.jsonl line 2: no column 'positive'"):
        SentenceEmbeddingRecipe(minilm_dir).read(tmp_path / "p.jsonl")


def test_eval_labels_are_checked_even_when_the_training_file_has_bad_rows(
    bert_dir: str, tmp_path: Path
) -> None:
    (tmp_path / "t.csv").write_text("text,label\nw1,0\n,1\nw2,1\n")
    (tmp_path / "e.csv").write_text("text,label\nw1,0\nw2,5\n")
    recipe = ClassificationRecipe(bert_dir)
    with pytest.raises(UsageError, match=r"t\.csv line 3: column 'text' is empty"):
        recipe.read(tmp_path / "t.csv")
    # the good rows' labels (0, 1) are the set the eval file is checked against, in the same report
    with pytest.raises(UsageError, match=r"e\.csv line 3: label '5' does not occur"):
        recipe.read(tmp_path / "e.csv", "--eval-file")
