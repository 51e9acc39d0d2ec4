"""Depth extrapolation loses nothing: every published case, estimated both ways.

Every case of the GPU validation matrix (``bench/gpu_validate.py``, device cuda) and of the CPU
truth bench (``bench/estimate_cpu_truth.py``, device cpu) is estimated with ``trace_depth="auto"``
(two shallow traces, written out) and ``"full"`` (every layer traced), in one process with the
disk cache off. The two must agree to the byte: total, breakdown, phase peaks, allocated and
reserved peaks. Their measured errors against the GPU and the CPU truth are therefore those
committed before. Also prints how long each way traced (the first estimate of each model and
set of knobs) and which cases fell back to a full trace, and why.

    python bench/depth_check.py                   # every case (about 10 minutes on 2 cores)
    python bench/depth_check.py --only gpt2       # cases whose model contains the text
    python bench/depth_check.py --json bench/results/depth_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["MEMFIT_NO_CACHE"] = "1"  # every trace is made here, both ways


def _cases(only: str | None) -> list[tuple[str, str, dict[str, Any], str | None]]:
    """(source, model, estimate kwargs, custom config name) for every case."""
    import estimate_cpu_truth as cpu_truth
    import gpu_validate

    out: list[tuple[str, str, dict[str, Any], str | None]] = []
    for case in gpu_validate.build_cases():
        kwargs = case.estimate_kwargs() | {"device": "cuda"}
        out.append(("gpu_validate", case.model, kwargs, None))
    for case in cpu_truth.MATRIX:
        kwargs = dict(
            task=case.task, batch_size=case.batch_size, seq_len=case.seq_len, device="cpu"
        )
        kwargs |= case.knobs
        custom = case.model[1:] if case.model.startswith("@") else None
        out.append(("estimate_cpu_truth", case.model, kwargs, custom))
    return [c for c in out if only is None or only in c[1]]


def _summary(est: Any) -> dict[str, Any]:
    details = est.details
    return {
        "total_bytes": est.total_bytes,
        "breakdown": est.breakdown,
        "peak_phase": est.peak_phase,
        "phase_peak_bytes": details.get("phase_peak_bytes"),
        "allocated_peak_bytes": details.get("allocated_peak_bytes"),
        "reserved_peak_bytes": details.get("reserved_peak_bytes"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only cases whose model name contains this text")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    print("$ python bench/depth_check.py " + " ".join(sys.argv[1:]), flush=True)

    import torch
    import transformers

    import estimate_cpu_truth as cpu_truth
    from memfit.estimate import estimate

    cases = _cases(args.only)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        customs = {c for _, _, _, c in cases if c}
        paths = cpu_truth.write_custom_configs(Path(tmp), customs)
        for source, model, kwargs, custom in cases:
            path = paths[custom] if custom else model
            row: dict[str, Any] = {"source": source, "model": model, "knobs": kwargs}
            for mode in ("auto", "full"):
                started = time.perf_counter()
                est = estimate(path, trace_depth=mode, **kwargs)
                row[mode] = _summary(est)
                row[f"{mode}_seconds"] = round(time.perf_counter() - started, 3)
                row[f"{mode}_trace_depth"] = est.details["trace_depth"]
            row["equal"] = row["auto"] == row["full"]
            rows.append(row)
            depth = row["auto_trace_depth"]
            how = (
                f"traced {depth['traced_depths']} of {depth['depth']} layers"
                if depth["mode"] == "extrapolated"
                else f"full: {depth.get('reason')}"
            )
            knobs = ",".join(
                f"{k}={v}" for k, v in kwargs.items() if k not in ("task", "device") and v
            )
            print(
                f"{'EQUAL' if row['equal'] else 'DIFFER'}  {source:<18} {model:<40} {knobs:<70} "
                f"auto {row['auto_seconds']:6.2f} s  full {row['full_seconds']:6.2f} s  {how}",
                flush=True,
            )
    equal = sum(r["equal"] for r in rows)
    extrapolated = sum(r["auto_trace_depth"]["mode"] == "extrapolated" for r in rows)
    print(
        f"\n{equal} of {len(rows)} cases equal to the byte (auto vs full); {extrapolated} of them "
        f"extrapolated, {len(rows) - extrapolated} traced whole (too few layers, or not repeating)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": "python bench/depth_check.py " + " ".join(sys.argv[1:]),
                    "environment": {
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "cpus": os.cpu_count(),
                    },
                    "summary": {
                        "cases": len(rows),
                        "equal": equal,
                        "extrapolated": extrapolated,
                    },
                    "rows": rows,
                },
                indent=1,
            )
        )
        print(f"wrote {args.json}")
    return 0 if equal == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
