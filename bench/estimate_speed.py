"""How fast `memfit estimate` answers, against accelerate's estimator on the same config.json.

    python bench/estimate_speed.py                      # every job, 3 rounds
    python bench/estimate_speed.py --rounds 1 --jobs bert
    python bench/estimate_speed.py --label after --memfit-src before=/tmp/memfit-before \\
        --json bench/results/estimate_speed.json         # "before" and "after" in the same rounds
    python bench/estimate_speed.py --memfit-src before=/tmp/memfit-before \\
        --memfit-src after=/tmp/memfit-after --skip-this-checkout   # two frozen `git worktree`s

Jobs (`--jobs`): bert (bert-base-uncased, classification, 32 × 128), gpt2 and gpt2-medium
(causal-lm, 8 × 512), gpt2-xl (1 × 1024, bf16, gradient checkpointing), llama3-8b and llama3-70b
(bench/configs/, 1 × 2048, bf16, checkpointing, LoRA rank 16); llama3-70b is measured for peak
memory only. Every figure is a fresh process timed from outside (`bench/_speed_common.py`): the
wall clock from starting `python -m memfit estimate MODEL … --json` (or the peer's script) to its
exit, Python's start-up and imports included; the median and minimum over `--rounds`, the tools
interleaved in every round.

Columns of the table, per memfit checkout (this one, named by `--label`, and each
`--memfit-src LABEL=DIR`, which runs with PYTHONPATH=DIR/src):

- `LABEL cold`: a new empty MEMFIT_CACHE_DIR for every run: the model is traced.
- `LABEL warm`: a MEMFIT_CACHE_DIR filled by one earlier run of the same job (that priming run is
  not counted): the traces are read from the disk cache.
- `accelerate`: accelerate's `estimate-memory` command in a fresh process on the config.json
  memfit reads (the registry's shipped one, or bench/configs/…), offline. It times Python's
  start-up, `import accelerate.commands.estimate` (torch, transformers, huggingface_hub), and
  accelerate's own `estimate_command`: its parser, `create_empty_model` (AutoConfig from the
  folder, `init_empty_weights`, `AutoModel.from_config(config, torch_dtype=float32)`),
  `calculate_maximum_sizes`, `estimate_training_usage` for float32/float16/int8/int4 and its
  printed table. accelerate takes Hub ids only: the one Hub call in `create_empty_model`
  (`verify_on_hub`, the repo's metadata) is answered from the local config.json instead, so no
  network time is in accelerate's figure (`bench/_speed_child.py accelerate`).
- `deepspeed` (only where `deepspeed` imports): the same empty model on the meta device, then
  DeepSpeed's `estimate_zero2/3_model_states_mem_needs_all_live(model, num_gpus_per_node=1)`.

Then, in one process per checkout: one first estimate of the job (not in the figures; read from a
copy of the warm cache when that cell ran, so that it costs seconds), then 20 shapes never asked
(batch sizes 1 to 31, odd ones, sequence lengths 33 to 512, odd ones), each `memfit.estimate`
call timed: median and max against 50 ms, and every shape over 50 ms listed. And the estimator's
own peak memory for llama3-70b: a fresh `memfit estimate` with an empty cache, its `ru_maxrss`
(from os.wait4: its largest process) against 2 GiB, with the sampled sum over its process tree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _speed_common import (
    CHILD,
    GIB,
    JOBS,
    Cell,
    Checkout,
    Job,
    add_common_options,
    check_sources,
    checkouts,
    deepspeed_importable,
    measure,
    offline_env,
    pick,
    print_machine,
    print_table,
    ratio,
    ratio_line,
    reproduce_line,
    run_process,
    verdict,
    write_json,
)

TABLE_JOBS = ("bert", "gpt2", "gpt2-medium", "gpt2-xl", "llama3-8b")
# the targets: cold ≤ 1.5 × accelerate's time, disk-cache warm ≤ 1 ×, for these jobs
TARGET_JOBS = ("bert", "gpt2-xl", "llama3-8b")
COLD_LIMIT, WARM_LIMIT = 1.5, 1.0
SHAPE_LIMIT_S = 0.050
RSS_JOB, RSS_LIMIT = "llama3-70b", 2 * GIB
# 20 shapes no job asks first: batch sizes with 1 and odd ones, lengths with odd ones, ≤ 512
NEW_SHAPES = [
    (1, 77), (3, 123), (1, 301), (7, 64), (2, 128), (5, 333), (9, 77), (16, 256), (1, 511),
    (13, 97), (4, 384), (6, 123), (11, 45), (8, 512), (24, 160), (1, 33), (17, 250), (3, 509),
    (12, 301), (31, 64),
]  # fmt: skip


def memfit_estimate(job: Job) -> list[str]:
    return [sys.executable, "-m", "memfit", "estimate", *job.cli_args(), "--json"]


def process_cells(
    jobs: list[str], sides: list[Checkout], scratch: Path, with_deepspeed: bool
) -> list[Cell]:
    cells = []
    for name in jobs:
        job = JOBS[name]
        for side in sides:
            for cache in ("cold", "warm"):
                cells.append(
                    Cell(name, f"{side.label} {cache}", memfit_estimate(job), side.env(None), cache)
                )
        folder = str(job.config_folder(scratch))
        cells.append(
            Cell(
                name,
                "accelerate",
                [sys.executable, str(CHILD), "accelerate", folder],
                offline_env(),
            )
        )
        if with_deepspeed:
            cells.append(
                Cell(
                    name,
                    "deepspeed",
                    [sys.executable, str(CHILD), "deepspeed", folder],
                    offline_env(),
                )
            )
    return cells


def print_ratios(jobs: list[str], sides: list[Checkout], cells: list[Cell]) -> list[dict[str, Any]]:
    by_key = {(c.row, c.column): c for c in cells}
    print("\nmemfit's median time / accelerate's median time (same model, same rounds):")
    lines = []
    for name in jobs:
        peer = by_key.get((name, "accelerate"))
        for side in sides:
            for cache, limit in (("cold", COLD_LIMIT), ("warm", WARM_LIMIT)):
                value = ratio(by_key.get((name, f"{side.label} {cache}")), peer)
                line = ratio_line(
                    f"{name}: {side.label} {cache} / accelerate",
                    value,
                    limit if name in TARGET_JOBS else None,
                )
                lines.append(dict(line, job=name, checkout=side.label, cache=cache))
    return lines


def new_shapes(
    jobs: list[str], sides: list[Checkout], cells: list[Cell], scratch: Path, timeout_s: float
) -> list[dict[str, Any]]:
    by_key = {(c.row, c.column): c for c in cells}
    results: list[dict[str, Any]] = []
    for name in jobs:
        job = JOBS[name]
        for side in sides:
            warm = by_key.get((name, f"{side.label} warm"))
            cache = Path(tempfile.mkdtemp(prefix="shapes-cache-", dir=scratch))
            if warm is not None and warm.warm_dir is not None and warm.priming_seconds is not None:
                # the first estimate is not what this measures: let it read the job's traces
                shutil.copytree(warm.warm_dir, cache, dirs_exist_ok=True)
                first_from = "a copy of the warm disk cache"
            else:
                first_from = "an empty cache"
            request = {"model": job.model_arg(), "knobs": job.api_kwargs(), "shapes": NEW_SHAPES}
            command = [sys.executable, str(CHILD), "shapes", json.dumps(request)]
            run = run_process(command, side.env(cache), timeout_s=timeout_s)
            shutil.rmtree(cache, ignore_errors=True)
            head = f"  {name} ({side.label}):"
            if run.returncode != 0:
                tail = " | ".join(run.stderr.strip().splitlines()[-3:])
                print(f"{head} failed (exit {run.returncode}): {tail}")
                results.append({"job": name, "checkout": side.label, "failure": tail})
                continue
            answer = json.loads(run.stdout.strip().splitlines()[-1])
            times = [seconds for _, _, seconds in answer["shapes"]]
            median, worst = statistics.median(times), max(times)
            slow = [(b, s, t) for b, s, t in answer["shapes"] if t > SHAPE_LIMIT_S]
            print(
                f"{head} first estimate {answer['first_seconds']:.2f} s (from {first_from}); "
                f"{len(times)} new shapes: median {median * 1000:.1f} ms {verdict(median, SHAPE_LIMIT_S)}, "
                f"max {worst * 1000:.1f} ms {verdict(worst, SHAPE_LIMIT_S)} (target ≤ 50 ms)"
            )
            if slow:
                listed = ", ".join(f"{b} × {s}: {t * 1000:.0f} ms" for b, s, t in slow)
                print(f"      over 50 ms: {listed}")
            results.append(
                {
                    "job": name,
                    "checkout": side.label,
                    "first_seconds": answer["first_seconds"],
                    "first_from": first_from,
                    "shapes": answer["shapes"],
                    "median_s": median,
                    "max_s": worst,
                    "over_limit": slow,
                    "verdict_median": verdict(median, SHAPE_LIMIT_S),
                    "verdict_max": verdict(worst, SHAPE_LIMIT_S),
                    "memfit": answer["memfit"],
                }
            )
    return results


def peak_memory(sides: list[Checkout], scratch: Path, timeout_s: float) -> list[dict[str, Any]]:
    job = JOBS[RSS_JOB]
    print(
        f"\nPeak memory of one cold estimate of {job.model} ({job.batch_size} × {job.seq_len}, "
        "bf16, checkpointing, LoRA 16), a fresh process, empty cache:"
    )
    runs: list[tuple[str, list[str], dict[str, str]]] = []
    for side in sides:
        cache = Path(tempfile.mkdtemp(prefix="rss-cache-", dir=scratch))
        runs.append((side.label, memfit_estimate(job), side.env(cache)))
    folder = str(job.config_folder(scratch))
    runs.append(("accelerate", [sys.executable, str(CHILD), "accelerate", folder], offline_env()))
    results: list[dict[str, Any]] = []
    for label, command, env in runs:
        run = run_process(command, env, timeout_s=timeout_s, sample_tree=True)
        if run.returncode != 0:
            tail = " | ".join(run.stderr.strip().splitlines()[-3:])
            print(f"  {label}: failed (exit {run.returncode}) after {run.seconds:.1f} s: {tail}")
            results.append({"checkout": label, "failure": tail, "seconds": run.seconds})
            continue
        limit = RSS_LIMIT if label != "accelerate" else None
        tree = run.tree_rss_peak_bytes or 0
        print(
            f"  {label:<12} peak RSS {run.max_rss_bytes / GIB:5.2f} GiB "
            f"{'(target ≤ 2 GiB) ' + verdict(run.max_rss_bytes, limit) if limit else '(no target)'}; "
            f"process tree ≤ {tree / GIB:.2f} GiB; {run.seconds:.1f} s"
        )
        results.append(
            {
                "checkout": label,
                "max_rss_bytes": run.max_rss_bytes,
                "tree_rss_peak_bytes": run.tree_rss_peak_bytes,
                "seconds": run.seconds,
                "target_bytes": limit,
                "verdict": verdict(run.max_rss_bytes, limit) or None,
            }
        )
    print(
        "  (peak RSS: ru_maxrss of the process, i.e. its largest process; process tree: the RSS of"
        " it and its workers summed, sampled every 50 ms, shared pages counted in each)"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated: {','.join(JOBS)}")
    parser.add_argument(
        "--shape-jobs",
        default="bert,gpt2-xl",
        help="jobs (of --jobs) whose new shapes are timed in one process",
    )
    add_common_options(parser)
    args = parser.parse_args()
    jobs = pick(args.jobs, list(JOBS), "--jobs")
    shape_jobs = [j for j in pick(args.shape_jobs, TABLE_JOBS, "--shape-jobs") if j in jobs]
    sides = checkouts(args)
    table_jobs = [j for j in jobs if j in TABLE_JOBS]
    with_deepspeed = deepspeed_importable()

    digests = {side.label: side.source_digest() for side in sides}
    print(reproduce_line("estimate_speed.py"))
    info = print_machine(sides)
    if not with_deepspeed:
        print("# deepspeed does not import here: no DeepSpeed column")
    record: dict[str, Any] = {"machine": info, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="memfit-estimate-speed-") as tmp:
        scratch = Path(tmp)
        cells = process_cells(table_jobs, sides, scratch, with_deepspeed)
        if cells:
            measure(cells, args.rounds, scratch, args.timeout)
            print_table(
                cells,
                f"Seconds per run, fresh process: median (min) of {args.rounds} round(s)",
            )
            record["cells"] = [c.as_json() for c in cells]
            record["ratios"] = print_ratios(table_jobs, sides, cells)
        if shape_jobs:
            print(
                f"\nNew shapes in one process (each a `memfit.estimate` call; target ≤ 50 ms, "
                f"median and max over {len(NEW_SHAPES)} shapes):"
            )
            record["new_shapes"] = new_shapes(shape_jobs, sides, cells, scratch, args.timeout)
        if RSS_JOB in jobs:
            record["peak_memory"] = peak_memory(sides, scratch, args.timeout)
    record["sources_changed_during_run"] = check_sources(sides, digests)
    write_json(args.json, "estimate_speed.py", record)


if __name__ == "__main__":
    main()
