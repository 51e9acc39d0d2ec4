"""memfit's caching-allocator replay fed a GPU's own allocation history: does it reserve what the GPU did?

``bench/gpu_validate.py --memory-history DIR`` leaves, for each case, the CUDA caching allocator's
history of the whole run (``torch.cuda.memory._snapshot()``: every allocation, free and segment, on
every stream). This script feeds each history's allocations and frees, in their order, to
:class:`memfit.estimate.device.CachingAllocator` and sets its reserved peak beside the GPU's (the
sum of the segments the GPU held at once). Where the two agree, the allocator model is right and a
gap in an estimate comes from the step's sequence (the trace); where they differ, from the model.

Each history is replayed twice: in one pool, as memfit's replay does (one stream), and with one
pool per stream (blocks of a side stream, such as activation offloading's copies, are not reused
by the default stream's requests). Where the GPU returned its cached segments
(``torch.cuda.empty_cache()``: a burst of segment frees), the replay empties its cache there too.

    python bench/allocator_history.py                       # the committed H200 histories
    python bench/allocator_history.py DIR_OR_FILES... --json out.json

No GPU is needed: the histories are files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from memfit.estimate.device import CachingAllocator  # noqa: E402  (the checkout's memfit)

DEFAULT = ROOT / "bench" / "results" / "gpu_truth_20261128_H200" / "allocator_history"
MiB = 2**20


def load(path: Path) -> dict[str, Any]:
    """A pickled ``torch.cuda.memory._snapshot()`` (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        # pickle: the format torch.cuda.memory._dump_snapshot writes; only files a bench made
        return pickle.load(handle)


def replay(trace: list[dict[str, Any]], per_stream: bool) -> dict[str, int]:
    """The GPU's reserved peak and the replay's, over one device's history."""
    pools: dict[int, CachingAllocator] = {}
    handles: dict[int, tuple[int, int]] = {}
    reserved = peak = replayed_peak = 0
    previous = None
    for event in trace:
        action = event["action"]
        if action == "alloc":
            stream = event["stream"] if per_stream else 0
            pool = pools.setdefault(stream, CachingAllocator())
            handles[event["addr"]] = (stream, pool.malloc(event["size"]))
        elif action == "free_completed" and event["addr"] in handles:
            # (a block allocated before the recording began is not the replay's to free)
            stream, handle = handles.pop(event["addr"])
            pools[stream].free(handle)
        elif action == "segment_alloc":
            reserved += event["size"]
            peak = max(peak, reserved)
        elif action == "segment_free":
            reserved -= event["size"]
            if previous != "segment_free":
                for pool in pools.values():
                    pool.empty_cache()
        previous = action
        if action == "alloc":
            replayed_peak = max(replayed_peak, sum(p.reserved for p in pools.values()))
    return {
        "gpu_reserved_peak_bytes": peak,
        "replayed_reserved_peak_bytes": replayed_peak,
        "streams": len({e["stream"] for e in trace if e["action"] == "alloc"}),
        "emptied": sum(1 for e in trace if e["action"] == "segment_free"),
    }


def check(path: Path) -> dict[str, Any]:
    snapshot = load(path)
    trace = snapshot["device_traces"][0]
    one = replay(trace, per_stream=False)
    split = replay(trace, per_stream=True)
    return {
        "history": path.name,
        "events": len(trace),
        "streams": one["streams"],
        "segment_frees": one["emptied"],
        "gpu_reserved_peak_mib": one["gpu_reserved_peak_bytes"] / MiB,
        "one_pool_mib": one["replayed_reserved_peak_bytes"] / MiB,
        "per_stream_mib": split["replayed_reserved_peak_bytes"] / MiB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"default {DEFAULT.relative_to(ROOT)}")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for path in args.paths or [DEFAULT]:
        files += sorted(path.glob("*.pickle*")) if path.is_dir() else [path]
    if not files:
        parser.error(f"no allocator history (*.pickle, *.pickle.gz) in {args.paths or [DEFAULT]}")
    print(f"{'history':<62} {'streams':>7} {'GPU MiB':>9} {'one pool':>9} {'per stream':>10}")
    rows = []
    for path in files:
        row = check(path)
        rows.append(row)
        print(
            f"{row['history'][:62]:<62} {row['streams']:>7} {row['gpu_reserved_peak_mib']:>9.0f} "
            f"{row['one_pool_mib']:>9.0f} {row['per_stream_mib']:>10.0f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    shown = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"reproduce: python bench/allocator_history.py {shown}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
