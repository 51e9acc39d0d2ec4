"""The demo's data and the sentence-embedding eval it reports: a held-out set that is well posed,
retrieval metrics equal to sentence-transformers' InformationRetrievalEvaluator, and the short
last step of an epoch said, never dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.train.demo import BATCH, OBJECTS, TRAIN_KNOBS, VERBS, demo_pairs
from memfit.train.recipes.sentence_embedding import SentenceEmbeddingRecipe


def test_demo_data_is_well_posed() -> None:
    train, evaluation = demo_pairs()
    # every step full: no step of leftovers whose in-batch negatives are too few
    assert train and len(train) % BATCH == 0
    assert int(TRAIN_KNOBS["effective_batch_size"]) == BATCH
    # train: one pair per guide, so no pair's positive is another's negative in a step
    assert len({p["positive"] for p in train}) == len(train)
    # held out: no eval request (guide) or question is in the training split
    train_guides = {p["positive"] for p in train}
    assert not train_guides & {p["positive"] for p in evaluation}
    assert not {p["anchor"] for p in train} & {p["anchor"] for p in evaluation}
    # well posed: each eval question has exactly one relevant guide, and each guide is asked
    # several ways (the corpus is the distinct guides)
    relevant: dict[str, set[str]] = {}
    for p in evaluation:
        relevant.setdefault(p["anchor"], set()).add(p["positive"])
    assert all(len(guides) == 1 for guides in relevant.values())
    assert len(relevant) == len(evaluation)
    guides = {p["positive"] for p in evaluation}
    assert 1 < len(guides) < len(evaluation)
    # learnable: every word of a held-out request is in some training pair
    for words in (VERBS, OBJECTS):
        for spanish, english in words:
            if any(spanish in p["anchor"] for p in evaluation):
                assert any(spanish in p["anchor"] for p in train), spanish
                assert any(f" {english}" in p["positive"] for p in train), english
    # the same data every time (the demo's figures are reproducible)
    assert demo_pairs() == (train, evaluation)


def _pairs_with_shared_documents() -> list[dict[str, str]]:
    """The demo's held-out set (queries sharing a guide) plus queries with two relevant guides."""
    _, evaluation = demo_pairs()
    extra = [
        {"anchor": "¿Cómo limpio y pinto la mesa?", "positive": "How to clean a table"},
        {"anchor": "¿Cómo limpio y pinto la mesa?", "positive": "How to paint a table"},
        {"anchor": "Quiero vender o mover el sofá", "positive": "How to sell a sofa"},
        {"anchor": "Quiero vender o mover el sofá", "positive": "How to move a sofa"},
    ]
    return evaluation[:60] + extra + evaluation[60:]


@pytest.mark.slow
def test_retrieval_metrics_equal_sentence_transformers_evaluator(
    minilm_dir: str, tmp_path: Path
) -> None:
    from sentence_transformers.util import cos_sim

    from memfit.train.recipes.sentence_embedding import _ir_evaluator_class

    pairs = _pairs_with_shared_documents()
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    recipe = SentenceEmbeddingRecipe(minilm_dir, max_seq_len=32)
    rows = recipe.read(data, flag="--eval-file")
    recipe.build(rows)
    recipe.model.eval()
    with torch.no_grad():
        # in chunks, as the guard hands them over
        partials = [recipe.eval_partial(rows[i : i + 13]) for i in range(0, len(rows), 13)]
    ours = recipe.eval_reduce(partials)

    queries = {f"q{i}": a for i, a in enumerate(dict.fromkeys(p["anchor"] for p in pairs))}
    corpus = {f"d{i}": d for i, d in enumerate(dict.fromkeys(p["positive"] for p in pairs))}
    qid = {text: key for key, text in queries.items()}
    cid = {text: key for key, text in corpus.items()}
    relevant: dict[str, set[str]] = {}
    for p in pairs:
        relevant.setdefault(qid[p["anchor"]], set()).add(cid[p["positive"]])
    evaluator = _ir_evaluator_class()(
        queries, corpus, relevant, score_functions={"cosine": cos_sim}, write_csv=False
    )
    theirs = evaluator(recipe.model)
    for key in ("accuracy@1", "mrr@10", "ndcg@10"):
        assert ours[key] == pytest.approx(theirs[f"cosine_{key}"], abs=1e-6), key
    # the old key: the share of questions whose top guide is relevant
    assert ours["retrieval_accuracy"] == ours["accuracy@1"]
    # not a degenerate case: the untrained model gets some, not all, right
    assert 0.0 < ours["accuracy@1"] < 1.0


@pytest.mark.parametrize(
    ("rows", "per_step", "expected"),
    [
        (36, 32, ["4 of 32 pairs (36 rows)", "3 in-batch negatives instead of 31", "36"]),
        (33, 32, ["1 of 32 pairs", "no in-batch negative", "its loss is 0", "33"]),
        (97, 8, ["1 of 8 pairs", "a multiple of 8 rows"]),
    ],
)
def test_short_last_step_is_said(rows: int, per_step: int, expected: list[str]) -> None:
    recipe = SentenceEmbeddingRecipe("unused", loss="mnrl")
    note = recipe.short_step_note(rows, per_step)
    assert note is not None
    for text in expected:
        assert text in note, (text, note)
    # a suggested step size leaves no short step
    for word in note.split("--effective-batch-size ")[1:]:
        assert rows % int(word.split()[0]) == 0
    assert recipe.short_step_note(per_step * 3, per_step) is None


@pytest.mark.slow
def test_train_says_short_last_step_and_keeps_its_rows(
    bert_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.train import TrainConfig, train

    words = ["cat", "dog", "sat", "ran", "mat", "park", "movie", "film", "plot"]
    pairs = [{"anchor": f"the {w} {v}", "positive": f"a {v} {w}"} for w in words for v in words[:2]]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    knobs: dict[str, Any] = dict(
        task="sentence-embedding",
        model=bert_dir,
        train_file=str(data),
        effective_batch_size=8,
        epochs=2,
        max_seq_len=16,
        device="cpu",
    )
    result = train(TrainConfig(**knobs, output_dir=str(tmp_path / "run")))
    err = capsys.readouterr().err
    assert err.count("the last step of each epoch holds only 2 of 8 pairs (18 rows)") == 1
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["resolved"]["last_step_rows"] == 2
    # nothing dropped: both epochs' every row, the short steps included
    assert result.samples_seen == 2 * len(pairs) and result.steps == 6
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = [m["samples_seen"] for m in lines if "loss" in m]
    assert [b - a for a, b in zip([0, *seen], seen, strict=False)] == [8, 8, 2] * 2
    # a step size that divides the rows: no note
    train(TrainConfig(**{**knobs, "effective_batch_size": 9}, output_dir=str(tmp_path / "full")))
    assert "the last step of each epoch" not in capsys.readouterr().err
