"""What a verified checkpoint costs: writing one, its manifest (SHA-256 of every file) and the
check a resume makes, for a bert-base-sized classifier with AdamW state, on this machine's disk.

    python bench/checkpoint_cost.py [--rounds 3] [--layers 12]

Prints one line per round and the medians; the manifest's share is the hashing part of the write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

from memfit.train import checkpoint as ck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=args.layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.ones(1, 8, dtype=torch.long), labels=torch.tensor([0])).loss.backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    hashing = 0.0
    real = ck._describe_file

    def timed(path: Path) -> dict[str, object]:
        nonlocal hashing
        t0 = time.perf_counter()
        out = real(path)
        hashing += time.perf_counter() - t0
        return out

    ck._describe_file = timed  # type: ignore[assignment]
    writes, manifests, verifies, sizes = [], [], [], []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for round_ in range(args.rounds):
            hashing = 0.0
            t0 = time.perf_counter()
            path = ck.write_checkpoint(
                Path(tmp), round_, model=model, optimizer=optimizer, scheduler=scheduler,
                scaler=None, state={}, keep=1,
            )  # fmt: skip
            write = time.perf_counter() - t0
            manifest = hashing
            t0 = time.perf_counter()
            assert ck.verify(path) is None
            verify = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in path.iterdir())
            writes.append(write)
            manifests.append(manifest)
            verifies.append(verify)
            sizes.append(size)
            print(
                f"round {round_ + 1}: {size / 2**20:.0f} MiB, write {write:.2f} s (of it the "
                f"manifest {manifest:.2f} s), verify {verify:.2f} s"
            )
    w, m, v = (statistics.median(x) for x in (writes, manifests, verifies))
    print(
        f"median: write {w:.2f} s, manifest {m:.2f} s = {m / w:.0%} of the write, resume check "
        f"{v:.2f} s; {sizes[0] / 2**20 / v:.0f} MiB/s verified"
    )


if __name__ == "__main__":
    main()
