"""How long `memfit.plan` takes: cold (traces), then warm for budgets never asked (target ≤ 1 s).

Prints the reproducing command, the cold time, and the median and max time of warm plans for new
budgets on the same model, in one process, with no training step run (offline, on the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# the cold plan is what this measures first: never read traces from the disk cache
os.environ["MEMFIT_NO_CACHE"] = "1"

from memfit.plan import plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="bert-base-uncased")
    parser.add_argument("--task", default="classification")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--effective-batch-size", type=int, default=64)
    parser.add_argument("--gpu", default="a100-40gb")
    args = parser.parse_args()
    print("$ python bench/plan_speed.py " + " ".join(sys.argv[1:]))
    job = dict(
        task=args.task,
        seq_len=args.seq_len,
        effective_batch_size=args.effective_batch_size,
        gpu=args.gpu,
    )
    started = time.perf_counter()
    first = plan(args.model, gpu_memory="12GiB", **job)
    cold = time.perf_counter() - started
    print(f"cold plan (traces) of {args.model} at 12 GiB: {cold:.1f} s -> {first.plan}")
    # new budgets, between 3.1 and 11.9 GiB: every one a different search outcome or bound
    budgets = [f"{g / 10:.1f}GiB" for g in range(31, 120, 7)]
    times = []
    for budget in budgets:
        t = time.perf_counter()
        p = plan(args.model, gpu_memory=budget, **job)
        times.append(time.perf_counter() - t)
        s = p.plan or {}
        print(
            f"  {budget:>8}: {times[-1]:.3f} s  micro {s.get('micro_batch_size')} × "
            f"{s.get('gradient_accumulation_steps')}, {s.get('precision')}, "
            f"checkpointing {s.get('gradient_checkpointing')}"
        )
    print(
        f"{len(budgets)} warm plans for new budgets: median {statistics.median(times):.3f} s, "
        f"max {max(times):.3f} s (target ≤ 1 s); cold/warm ratio {cold / statistics.median(times):.0f}×"
    )


if __name__ == "__main__":
    main()
