"""The guard's cost when no OOM happens, against a plain PyTorch training loop on the same model.

Both loops run the same steps on the same batches: forward, loss, backward, optimizer step. The
plain loop does it directly; the guarded one goes through ``memfit.guard.Guard.step`` with a recipe
(the micro-batch is the whole step, as when the plan fits). Steps alternate between the two
(interleaved, so drift in the machine's speed hits both alike); the figure is the ratio of the
medians. Target: guard overhead ≤ 1 % of step time.

Usage::

    python bench/guard_overhead.py                  # BERT 4 layers × 256 hidden, batch 16 × 128
    python bench/guard_overhead.py --steps 60 --layers 6 --hidden 384
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


class _Recipe:
    """A minimal splittable recipe over pre-tokenized rows (per-sample cross-entropy)."""

    splittable = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def units(self, rows: list[dict[str, Any]]) -> int:
        return len(rows)

    def loss(
        self, rows: list[dict[str, Any]], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["label"] for r in rows])
        logits = self.model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / total_units

    def eval_partial(self, rows: list[dict[str, Any]]) -> Any:  # pragma: no cover - unused
        raise NotImplementedError

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per loop")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    print(
        "reproduce: python "
        + " ".join(shlex.quote(a) for a in ["bench/guard_overhead.py", *sys.argv[1:]])
    )

    from transformers import BertConfig, BertForSequenceClassification

    from memfit.guard import Guard

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    recipe = _Recipe(model)
    guard = Guard(args.batch)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)

    def batch() -> list[dict[str, Any]]:
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=gen)
        labels = torch.randint(0, 2, (args.batch,), generator=gen)
        return [{"input_ids": ids[i], "label": labels[i]} for i in range(args.batch)]

    def plain(rows: list[dict[str, Any]]) -> None:
        loss = recipe.loss(rows, len(rows))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def guarded(rows: list[dict[str, Any]]) -> None:
        guard.step(rows, recipe, params=params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "guard": []}
    for i in range(args.warmup + args.steps):
        order = [("plain", plain), ("guard", guarded)]
        if i % 2:
            order.reverse()
        for name, fn in order:
            rows = batch()
            t0 = time.perf_counter()
            fn(rows)
            elapsed = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(elapsed)
    p, g = statistics.median(times["plain"]), statistics.median(times["guard"])
    print(
        f"model: BERT {args.layers} layers × {args.hidden} hidden, {n_params / 1e6:.1f} M parameters; "
        f"batch {args.batch} × {args.seq_len} tokens; AdamW; CPU, {torch.get_num_threads()} threads"
    )
    print(f"plain PyTorch step: median {p * 1000:.1f} ms over {len(times['plain'])} steps")
    print(f"guarded step:       median {g * 1000:.1f} ms over {len(times['guard'])} steps")
    print(f"guard overhead: {(g / p - 1) * 100:+.2f} % of step time (target ≤ 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
