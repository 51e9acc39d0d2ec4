"""How fast `memfit plan` answers, against the cold `memfit estimate` of the same model.

    python bench/plan_speed.py                          # every job, 3 rounds
    python bench/plan_speed.py --rounds 1 --jobs bert-t4
    python bench/plan_speed.py --label after --memfit-src before=/tmp/memfit-before \\
        --json bench/results/plan_speed.json             # "before" and "after" in the same rounds
    python bench/plan_speed.py --memfit-src before=/tmp/memfit-before \\
        --memfit-src after=/tmp/memfit-after --skip-this-checkout   # two frozen `git worktree`s

Jobs (`--jobs`): bert-t4 (`memfit plan bert-base-uncased --task classification --seq-len 128
--effective-batch-size 32 --gpu t4`), gpt2-medium-a10g (`memfit plan gpt2-medium --task causal-lm
--seq-len 512 --effective-batch-size 8 --gpu a10g`) and gpt2-medium-16gib (the same with
`--gpu-memory 16GiB`), each with `--json`. Every figure is a fresh process timed from outside
(`bench/_speed_common.py`: wall clock from start to exit, Python's start-up and imports included),
the median and minimum over `--rounds`, all cells interleaved in every round. Per memfit checkout
(this one, named by `--label`, and each `--memfit-src LABEL=DIR`, run with PYTHONPATH=DIR/src):

- `plan JOB` / `LABEL cold`: a new empty MEMFIT_CACHE_DIR for every run (the plan traces its
  knob sets, in worker processes beside each other).
- `plan JOB` / `LABEL warm`: a MEMFIT_CACHE_DIR filled by one earlier run of the same plan (not
  counted): the traces are read from the disk cache.
- `estimate MODEL` / `LABEL cold`: the cold `memfit estimate` of the same model and shape
  (bert-base-uncased classification 32 × 128; gpt2-medium causal-lm 8 × 512, as in
  `bench/estimate_speed.py`), with an empty cache: the ratio plan/estimate has the target ≤ 3×.

Then, in one process per checkout (`--budget-jobs`), the plan's answer to budgets never asked: a
first plan (read from a copy of the warm cache when that cell ran), then 13 budgets from 3.1 to
11.9 GiB, each `memfit.plan` call timed: median and max against 1 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _speed_common import (
    CHILD,
    JOBS,
    PLAN_OK,
    Cell,
    Checkout,
    Job,
    add_common_options,
    check_sources,
    checkouts,
    measure,
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

PLAN_LIMIT = 3.0  # cold plan ≤ 3 × the cold estimate of the same model
BUDGET_LIMIT_S = 1.0
BUDGETS = [f"{g / 10:.1f}GiB" for g in range(31, 120, 7)]  # 3.1 … 11.9 GiB, 13 budgets


@dataclass(frozen=True)
class PlanJob:
    """One `memfit plan` workload on the model and shape of an estimate job."""

    name: str
    estimate_job: str  # a key of JOBS: model, task and seq-len come from it
    effective_batch_size: int
    budget: tuple[str, str]  # ("--gpu", NAME) or ("--gpu-memory", SIZE)
    target: bool  # the issue names it in the ≤ 3× target

    @property
    def job(self) -> Job:
        return JOBS[self.estimate_job]

    def cli_args(self) -> list[str]:
        job = self.job
        return [
            job.model_arg(),
            "--task",
            job.task,
            "--seq-len",
            str(job.seq_len),
            "--effective-batch-size",
            str(self.effective_batch_size),
            *self.budget,
            "--json",
        ]

    def api_kwargs(self) -> dict[str, Any]:
        """`memfit.plan`'s keyword arguments but the budget (the catalog GPU's speed kept)."""
        gpu = self.budget[1] if self.budget[0] == "--gpu" else None
        job = self.job
        return dict(
            task=job.task,
            seq_len=job.seq_len,
            effective_batch_size=self.effective_batch_size,
            gpu=gpu,
        )


PLAN_JOBS: dict[str, PlanJob] = {
    p.name: p
    for p in (
        PlanJob("bert-t4", "bert", 32, ("--gpu", "t4"), target=True),
        PlanJob("gpt2-medium-a10g", "gpt2-medium", 8, ("--gpu", "a10g"), target=True),
        PlanJob("gpt2-medium-16gib", "gpt2-medium", 8, ("--gpu-memory", "16GiB"), target=False),
    )
}


def process_cells(plan_jobs: list[PlanJob], sides: list[Checkout]) -> list[Cell]:
    cells = []
    for plan_job in plan_jobs:
        command = [sys.executable, "-m", "memfit", "plan", *plan_job.cli_args()]
        for side in sides:
            for cache in ("cold", "warm"):
                cells.append(
                    Cell(
                        f"plan {plan_job.name}",
                        f"{side.label} {cache}",
                        command,
                        side.env(None),
                        cache,
                        PLAN_OK,
                    )
                )
    # one cold estimate per model, shared by the plans of that model
    for name in dict.fromkeys(p.estimate_job for p in plan_jobs):
        job = JOBS[name]
        command = [sys.executable, "-m", "memfit", "estimate", *job.cli_args(), "--json"]
        for side in sides:
            cells.append(
                Cell(f"estimate {name}", f"{side.label} cold", command, side.env(None), "cold")
            )
    return cells


def print_ratios(
    plan_jobs: list[PlanJob], sides: list[Checkout], cells: list[Cell]
) -> list[dict[str, Any]]:
    by_key = {(c.row, c.column): c for c in cells}
    print("\nplan's median time / the cold estimate's median time (same model, same checkout):")
    lines = []
    for plan_job in plan_jobs:
        for side in sides:
            estimate = by_key.get((f"estimate {plan_job.estimate_job}", f"{side.label} cold"))
            for cache in ("cold", "warm"):
                value = ratio(
                    by_key.get((f"plan {plan_job.name}", f"{side.label} {cache}")), estimate
                )
                limit = PLAN_LIMIT if plan_job.target and cache == "cold" else None
                line = ratio_line(
                    f"{plan_job.name}: {side.label} plan {cache} / estimate cold", value, limit
                )
                lines.append(dict(line, job=plan_job.name, checkout=side.label, cache=cache))
    return lines


def new_budgets(
    plan_jobs: list[PlanJob],
    sides: list[Checkout],
    cells: list[Cell],
    scratch: Path,
    timeout_s: float,
) -> list[dict[str, Any]]:
    by_key = {(c.row, c.column): c for c in cells}
    results: list[dict[str, Any]] = []
    for plan_job in plan_jobs:
        for side in sides:
            warm = by_key.get((f"plan {plan_job.name}", f"{side.label} warm"))
            cache = Path(tempfile.mkdtemp(prefix="budgets-cache-", dir=scratch))
            if warm is not None and warm.warm_dir is not None and warm.priming_seconds is not None:
                # the first plan is not what this measures: let it read the job's traces
                shutil.copytree(warm.warm_dir, cache, dirs_exist_ok=True)
                first_from = "a copy of the warm disk cache"
            else:
                first_from = "an empty cache"
            request = {
                "model": plan_job.job.model_arg(),
                "job": plan_job.api_kwargs(),
                "first_budget": "12GiB",
                "budgets": BUDGETS,
            }
            command = [sys.executable, str(CHILD), "budgets", json.dumps(request)]
            run = run_process(command, side.env(cache), timeout_s=timeout_s)
            shutil.rmtree(cache, ignore_errors=True)
            head = f"  {plan_job.name} ({side.label}):"
            if run.returncode != 0:
                tail = " | ".join(run.stderr.strip().splitlines()[-3:])
                print(f"{head} failed (exit {run.returncode}): {tail}")
                results.append({"job": plan_job.name, "checkout": side.label, "failure": tail})
                continue
            answer = json.loads(run.stdout.strip().splitlines()[-1])
            times = [seconds for _, seconds, _ in answer["budgets"]]
            median, worst = statistics.median(times), max(times)
            print(
                f"{head} first plan at 12 GiB {answer['first_seconds']:.2f} s (from {first_from}); "
                f"{len(times)} new budgets: median {median:.3f} s {verdict(median, BUDGET_LIMIT_S)}, "
                f"max {worst:.3f} s {verdict(worst, BUDGET_LIMIT_S)} (target ≤ 1 s)"
            )
            for budget, seconds, outcome in answer["budgets"]:
                chose = (
                    "nothing fits"
                    if outcome is None
                    else f"micro {outcome['micro_batch_size']} × "
                    f"{outcome['gradient_accumulation_steps']}, {outcome['precision']}, "
                    f"checkpointing {outcome['gradient_checkpointing']}"
                )
                print(f"      {budget:>8}: {seconds:.3f} s  {chose}")
            results.append(
                {
                    "job": plan_job.name,
                    "checkout": side.label,
                    "first_seconds": answer["first_seconds"],
                    "first_from": first_from,
                    "budgets": answer["budgets"],
                    "median_s": median,
                    "max_s": worst,
                    "memfit": answer["memfit"],
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--jobs", default=",".join(PLAN_JOBS), help=f"comma-separated: {','.join(PLAN_JOBS)}"
    )
    parser.add_argument(
        "--budget-jobs",
        default="bert-t4",
        help="jobs (of --jobs) whose new budgets are timed in one process ('' for none)",
    )
    add_common_options(parser)
    args = parser.parse_args()
    plan_jobs = [PLAN_JOBS[n] for n in pick(args.jobs, list(PLAN_JOBS), "--jobs")]
    budget_jobs = [
        PLAN_JOBS[n]
        for n in pick(args.budget_jobs, list(PLAN_JOBS), "--budget-jobs")
        if PLAN_JOBS[n] in plan_jobs
    ]
    sides = checkouts(args)

    digests = {side.label: side.source_digest() for side in sides}
    print(reproduce_line("plan_speed.py"))
    record: dict[str, Any] = {"machine": print_machine(sides), "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="memfit-plan-speed-") as tmp:
        scratch = Path(tmp)
        cells = process_cells(plan_jobs, sides)
        measure(cells, args.rounds, scratch, args.timeout)
        print_table(
            cells, f"Seconds per run, fresh process: median (min) of {args.rounds} round(s)"
        )
        record["cells"] = [c.as_json() for c in cells]
        record["ratios"] = print_ratios(plan_jobs, sides, cells)
        if budget_jobs:
            print("\nNew budgets in one process (each a `memfit.plan` call; target ≤ 1 s):")
            record["new_budgets"] = new_budgets(budget_jobs, sides, cells, scratch, args.timeout)
    record["sources_changed_during_run"] = check_sources(sides, digests)
    write_json(args.json, "plan_speed.py", record)


if __name__ == "__main__":
    main()
