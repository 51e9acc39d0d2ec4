"""Past GPU measurements against this checkout's estimates: how would the estimator do now?

``bench/gpu_validate.py`` writes, for each case, what the GPU measured and what memfit estimated
then. GPU time is scarce; a change to the estimator can still be checked against every measurement
already made, on the CPU: this script estimates each measured case again with this checkout (with
the measured GPU's profile: its compute capability and the torch version it ran, which sets the
cuBLAS workspaces) and prints the total's error then and now, case by case, with the medians.

    python bench/gpu_reestimate.py bench/results/gpu_truth_20261128_H200/part3_estimator/*.json
    python bench/gpu_reestimate.py FILE.json --only act-offload,paged --json out.json

The estimate here traces with the torch and transformers installed here, which may not be the ones
the GPU ran (the header of each file says which): a case whose estimate differs with nothing
changed in the estimator differs for that reason. No GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


def gpu_profile(header: dict[str, Any]) -> Any:
    """memfit's profile of the GPU a results file measured, with that run's torch version."""
    from memfit.devices import profiles

    capability = tuple(int(x) for x in str(header["gpu"]["compute_capability"]).split("."))
    torch_version = str(header["software"]["torch"])
    return profiles.cuda_profile(capability, torch_version)  # type: ignore[arg-type]


def use_profile(profile: Any) -> None:
    """Make memfit's estimates take ``profile`` as the GPU present (a wrapper in this bench:
    memfit itself detects the GPU it runs on, and there is none here)."""
    from memfit.devices import profiles
    from memfit.estimate import traces

    def fixed(capability: Any = None, torch_version: Any = None) -> Any:
        return profile

    profiles.cuda_profile = fixed  # type: ignore[assignment]
    traces.cuda_profile = fixed  # type: ignore[attr-defined]
    # traced afresh: a trace (in memory or on disk) keeps the profile it was traced with
    os.environ["MEMFIT_NO_CACHE"] = "1"
    traces._CACHE.clear()


def pct(estimated: float, measured: float) -> float:
    return 100.0 * (estimated / measured - 1.0)


def refuse(message: str) -> None:
    """Bad input: one line on stderr, exit 2."""
    print(f"gpu_reestimate: {message}", file=sys.stderr)
    raise SystemExit(2)


def rows_of(paths: list[Path], only: list[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    found = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            refuse(f"{path}: not a results file ({exc.__class__.__name__}: {exc})")
        if not isinstance(doc, dict) or "rows" not in doc or "header" not in doc:
            refuse(f"{path}: no 'rows' and 'header': not a bench/gpu_validate.py results file")
        for row in doc["rows"]:
            measured = (row.get("measured") or {}).get("total_bytes")
            if row.get("status") != "ok" or not measured:
                continue
            if only and not any(part in row["id"] for part in only):
                continue
            found.append((doc["header"], row))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="gpu_validate.py results (JSON)")
    parser.add_argument("--only", default="", help="comma-separated parts of the case ids to keep")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    only = [part for part in args.only.split(",") if part]
    found = rows_of(args.files, only)
    if not found:
        parser.error("no measured case in the files (or none matches --only)")
    from memfit.estimate import estimate

    print(f"{'case':<62} {'meas GiB':>8} {'then %':>7} {'now %':>7}", flush=True)
    out = []
    current = None
    for header, row in found:
        profile = gpu_profile(header)
        if profile != current:
            use_profile(profile)
            current = profile
        knobs = dict(row["case"])
        model = knobs.pop("model")
        measured = row["measured"]["total_bytes"]
        then = row["estimated"]["total_bytes"]
        try:
            now = estimate(model, **knobs).total_bytes
        except Exception as exc:  # one case's failure is its row's, not the run's
            print(f"{row['id'][:62]:<62} {exc.__class__.__name__}: {exc}", flush=True)
            continue
        item = {
            "id": row["id"],
            "measured_bytes": measured,
            "then_error_pct": round(pct(then, measured), 2),
            "now_error_pct": round(pct(now, measured), 2),
            "gpu": header["gpu"]["name"],
            "measured_with": {k: header["software"].get(k) for k in ("torch", "transformers")},
        }
        out.append(item)
        print(
            f"{row['id'][:62]:<62} {measured / GiB:>8.2f} {item['then_error_pct']:>+7.1f} "
            f"{item['now_error_pct']:>+7.1f}",
            flush=True,
        )
    if out:
        for when in ("then", "now"):
            errors = [abs(r[f"{when}_error_pct"]) for r in out]
            under = sum(1 for r in out if r[f"{when}_error_pct"] < -2.0)
            print(
                f"{when:>4}: median |error| {statistics.median(errors):.2f} %, max {max(errors):.2f} %, "
                f"{under} of {len(out)} more than 2 % under"
            )
    import torch
    import transformers

    print(f"estimated here with torch {torch.__version__}, transformers {transformers.__version__}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    shown = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"reproduce: python bench/gpu_reestimate.py {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
