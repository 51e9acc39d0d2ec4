"""How long the first estimate of a model takes (the trace) and every later one (the replay).

Prints the reproducing command, the first-trace time, and the median and max time of estimates
for batch sizes and sequence lengths never traced, in one process, on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# the first trace is what this measures: never read it from the disk cache
os.environ["MEMFIT_NO_CACHE"] = "1"

from memfit.estimate import clear_cache, estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="bert-base-uncased")
    parser.add_argument("--task", default="classification")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    print("$ python bench/estimate_speed.py " + " ".join(sys.argv[1:]))
    clear_cache()
    knobs = dict(task=args.task, device=args.device, precision=args.precision)
    started = time.perf_counter()
    estimate(args.model, batch_size=8, seq_len=128, **knobs)
    first = time.perf_counter() - started
    print(f"first estimate (trace + fit) of {args.model}: {first:.2f} s")
    # shapes never traced: batch sizes 2..64, aligned lengths (misaligned and single-sample
    # lengths have their own fit, traced once on first use)
    shapes = [(b, s) for b in (2, 3, 6, 12, 24, 48, 64) for s in (16, 64, 136, 200, 320, 512)]
    times = []
    for b, s in shapes:
        t = time.perf_counter()
        estimate(args.model, batch_size=b, seq_len=s, **knobs)
        times.append(time.perf_counter() - t)
    print(
        f"{len(shapes)} new shapes: median {statistics.median(times) * 1000:.1f} ms, "
        f"max {max(times) * 1000:.1f} ms (target ≤ 50 ms)"
    )
    started = time.perf_counter()
    estimate(args.model, batch_size=7, seq_len=123, **knobs)
    print(
        f"first misaligned length (its own fit, traced once): {time.perf_counter() - started:.2f} s"
    )
    t = time.perf_counter()
    estimate(args.model, batch_size=9, seq_len=77, **knobs)
    print(f"next misaligned length: {(time.perf_counter() - t) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
