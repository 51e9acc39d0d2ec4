"""How long can a sequence be on a card: `memfit limits` with the job as given and with the levers.

    python bench/longest_context.py                       # every job below, one process
    python bench/longest_context.py --jobs llama8b-qlora-24gib --json bench/results/longest_context_cpu.json

For each job (a published-config decoder fine-tuned the way people run it today; offline, from
memfit's embedded configs) the longest sequence at micro-batch 1 that fits the budget less plan's
5 % margin, twice in the same run: the job as given, and with `--levers` (the exact levers a plan
may use: checkpointing, a fused-linear cross-entropy, activation offloading, the optimizer's state
in host memory; only those the answer needs are named). Printed side by side with their ratio,
what bounds each answer, the host memory the levers hold and the seconds each call took (a cold
trace cache: a new MEMFIT_CACHE_DIR per job). The host budget is fixed (`--host-memory`, 64 GiB by
default) so that the figures do not depend on the machine that runs the benchmark. These are
estimates: the GPU issue measures them.
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

QLORA = {
    "precision": "bf16",
    "quantization": "nf4",
    "lora_rank": 32,
    "lora_target_modules": ["all-linear"],
    "gradient_checkpointing": True,
    "attn_implementation": "flash_attention_2",
}
LORA = {key: value for key, value in QLORA.items() if key != "quantization"}
FULL = {"precision": "bf16", "gradient_checkpointing": True, "attn_implementation": "sdpa"}

JOBS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # the job: Llama-3.1-8B QLoRA r32 on every linear layer, batch 1, bf16, checkpointing
    "llama8b-qlora-24gib": ("meta-llama/Llama-3.1-8B", "24GiB", QLORA),
    "qwen7b-qlora-24gib": ("Qwen/Qwen2.5-7B", "24GiB", QLORA),
    "llama3b-lora-16gib": ("meta-llama/Llama-3.2-3B", "16GiB", LORA),
    "llama1b-full-24gib": ("meta-llama/Llama-3.2-1B", "24GiB", FULL),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated: " + ",".join(JOBS))
    parser.add_argument("--host-memory", default="64GiB", help="the host budget of every job")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = [name.strip() for name in args.jobs.split(",") if name.strip()]
    unknown = [name for name in names if name not in JOBS]
    if unknown:
        parser.error(f"--jobs: unknown {', '.join(unknown)}; choose from {', '.join(JOBS)}")

    import memfit

    rows = []
    header = f"{'job':<22} {'as given':>9} {'levers':>9} {'ratio':>6} {'host GiB':>9} {'s':>6}  levers named"
    print(header)
    for name in names:
        model, budget, knobs = JOBS[name]
        with tempfile.TemporaryDirectory(prefix="memfit-bench-cache-") as cache:
            os.environ["MEMFIT_CACHE_DIR"] = cache
            start = time.monotonic()
            result = memfit.limits(
                model,
                task="causal-lm",
                gpu_memory=budget,
                host_memory=args.host_memory,
                levers=True,
                **knobs,
            )
            seconds = time.monotonic() - start
        given = result.max_seq_len
        best = (result.levers or {}).get("max_seq_len")
        row: dict[str, Any] = {
            "job": name,
            "model": model,
            "budget": budget,
            "knobs": knobs,
            "as_given": {"value": given.value, "bound": given.bound},
            "levers": None
            if best is None
            else {
                "value": best.value,
                "bound": best.bound,
                "host_bytes": best.host_bytes,
                "settings": best.settings,
            },
            "seconds": round(seconds, 2),
        }
        rows.append(row)
        # None: not even the shortest length fits (as given, or with every lever)
        mine = best.value if best is not None else None
        ratio = f"{mine / given.value:.2f}x" if mine and given.value else "-"
        host = (best.host_bytes or 0) / 2**30 if best is not None else 0.0
        named = " ".join(f"{k}={v}" for k, v in (best.settings if best is not None else {}).items())
        print(
            f"{name:<22} {given.value or 'none':>9} {mine or 'none':>9} {ratio:>6} "
            f"{host:>9.2f} {seconds:>6.1f}  {named}"
        )
    print(
        "\nreproduce: python bench/longest_context.py --jobs "
        + ",".join(names)
        + f" --host-memory {args.host_memory}"
    )
    if args.json:
        args.json.write_text(json.dumps({"host_memory": args.host_memory, "rows": rows}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
