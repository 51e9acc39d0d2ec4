"""``memfit predict`` / ``memfit embed`` on the run folder of ``memfit train --lora-rank`` (its
``model/`` holds peft adapters, no ``config.json``): the base with the adapters merged in, the
same outputs as the merged model, every row once, in order; a base that is gone is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_run import run_cli, run_ok
from tiny_models import (
    SENTENCES,
    save_bert,
    save_sentence_transformer,
    save_tiny_llama,
    write_jsonl,
)

pytestmark = pytest.mark.slow

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "mat",
    "park",
    "good",
    "bad",
    "movie",
    "film",
    "great",
    "awful",
]
CLASSES = [
    ("the cat sat", "neg"),
    ("a good movie", "pos"),
    ("bad film", "mid"),
    ("great park", "pos"),
]
PAIRS = [("the cat sat", "a cat on mat"), ("good movie", "great film"), ("dog ran", "dog park")]


def _train(base: Path, task: str, data: Path, out: Path) -> Path:
    run_ok(
        "train", "--task", task, "--model", str(base), "--train-file", str(data),
        "--output-dir", str(out), "--max-steps", "1", "--lora-rank", "4", "--lora-dropout", "0",
        "--effective-batch-size", "4", "--device", "cpu", "--lr", "1e-2",
    )  # fmt: skip
    assert (out / "model" / "adapter_config.json").is_file()
    assert not (out / "model" / "config.json").exists()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LoRA runs of one step each: a causal LM (tiny Llama), a classifier with a new 3-label head
    on a bare BERT, and a sentence-transformers model."""
    root = tmp_path_factory.mktemp("lora-runs")
    llama, bert, st = root / "llama", root / "bert", root / "st"
    save_tiny_llama(llama, SENTENCES)
    bert.mkdir()
    save_bert(bert, WORDS).save_pretrained(bert)
    save_sentence_transformer(st, bert, max_seq_length=32)
    lm_rows = write_jsonl(root / "lm.jsonl", [{"text": s} for s in SENTENCES])
    cls_rows = write_jsonl(root / "cls.jsonl", [{"text": t, "label": y} for t, y in CLASSES])
    pairs = write_jsonl(root / "pairs.jsonl", [{"anchor": a, "positive": p} for a, p in PAIRS])
    return {
        "root": root,
        "causal-lm": (_train(llama, "causal-lm", lm_rows, root / "run-lm"), llama, lm_rows),
        "classification": (
            _train(bert, "classification", cls_rows, root / "run-cls"),
            bert,
            cls_rows,
        ),
        "sentence-embedding": (
            _train(st, "sentence-embedding", pairs, root / "run-st"),
            st,
            lm_rows,
        ),
    }


def _merged_by_hand(run: Path, base: Path, task: str, folder: Path) -> Path:
    """The base with the run's adapters merged in by peft, saved as a plain model folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if task == "causal-lm":
        model = AutoModelForCausalLM.from_pretrained(base)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            base, num_labels=3, ignore_mismatched_sizes=True
        )
    merged = PeftModel.from_pretrained(model, run / "model").merge_and_unload()
    merged.save_pretrained(folder)
    AutoTokenizer.from_pretrained(run / "model").save_pretrained(folder)
    return folder


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_predict_on_a_lora_run_gives_the_merged_models_outputs(
    task: str, runs: dict[str, Any], tmp_path: Path
) -> None:
    run, base, rows = runs[task]
    merged = _merged_by_hand(run, base, task, tmp_path / "merged")
    run_ok("predict", str(run), "--file", str(rows), "--output", str(tmp_path / "run.jsonl"))
    run_ok("predict", str(merged), "--file", str(rows), "--output", str(tmp_path / "m.jsonl"))
    got, want = _rows(tmp_path / "run.jsonl"), _rows(tmp_path / "m.jsonl")
    assert [r["row"] for r in got] == list(range(len(rows.read_text().splitlines())))
    key = "loss" if task == "causal-lm" else "probabilities"
    for a, b in zip(got, want, strict=True):
        values = a[key].values() if isinstance(a[key], dict) else [a[key]]
        expected = b[key].values() if isinstance(b[key], dict) else [b[key]]
        assert np.allclose(list(values), list(expected), atol=1e-5, rtol=0), (a, b)
    if task == "causal-lm":
        # the adapters count: the base alone scores the rows otherwise
        run_ok("predict", str(base), "--file", str(rows), "--output", str(tmp_path / "b.jsonl"))
        plain = [r["loss"] for r in _rows(tmp_path / "b.jsonl")]
        assert not np.allclose([r["loss"] for r in got], plain, atol=1e-4, rtol=0)
    else:
        # the trained 3-label head came with the adapters (the bare base has none)
        assert all(len(r["probabilities"]) == 3 for r in got)


def test_embed_on_a_lora_run_gives_sentence_transformers_embeddings(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    run, _, rows = runs["sentence-embedding"]
    run_ok("embed", str(run), "--file", str(rows), "--output", str(tmp_path / "e.npy"))
    by_hand = SentenceTransformer(str(run / "model"), device="cpu").encode(SENTENCES)
    got = np.load(tmp_path / "e.npy")
    assert got.shape == by_hand.shape
    assert np.allclose(got, by_hand, atol=1e-5, rtol=0)
    # the adapters count: the base alone embeds otherwise
    plain = SentenceTransformer(str(runs["sentence-embedding"][1]), device="cpu").encode(SENTENCES)
    assert not np.allclose(got, plain, atol=1e-4, rtol=0)


def test_a_lora_run_whose_base_is_gone_says_what_to_do_and_base_model_runs_it(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, base, rows = runs["causal-lm"]
    moved = tmp_path / "llama-elsewhere"
    out = tmp_path / "out.jsonl"
    shutil.move(base, moved)
    try:
        code, _, err = run_cli(
            capsys, "predict", str(run), "--file", str(rows), "--output", str(out)
        )
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1, err
        assert f"for the base '{base}'" in lines[0], err
        assert "--base-model FOLDER" in lines[0] and "--merge-lora" in lines[0], err
        assert not out.exists()
        argv = ("predict", str(run), "--file", str(rows), "--output", str(out))
        code, _, err = run_cli(capsys, *argv, "--base-model", str(moved))
        assert code == 0, err
        assert len(_rows(out)) == len(SENTENCES)
    finally:
        shutil.move(moved, base)
