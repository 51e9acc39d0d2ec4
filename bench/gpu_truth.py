"""Truth on a real GPU in one call: every check issue 35 asks for, most important first.

One entry point over the GPU scripts, each run in a process of its own with a share of one time
budget, so that a loan of GPU time (15 minutes, the machine's start included) needs one call:

1. ``guard``      the OOM guard under a real CUDA cap (``bench/gpu_train_check.py``): ``memfit
                  train`` capped between what micro-batch 1 and the whole batch need, against the
                  same run uncapped (BERT fp32, a Llama-shaped LoRA LM in bf16 and fp16 with the
                  scaler, ``examples/trainer_after.py`` under ``MEMFIT_MEMORY_CAP``);
   ``predict``    guarded inference backing off under a cap (``bench/infer_backoff.py``);
2. ``overhead``   the guard's cost against a plain PyTorch loop (``bench/guard_overhead.py``);
3. ``estimator``  memfit's estimates of what changed since the last GPU run (QLoRA, paged and 8-bit
                  optimizers, 16-bit bases, fused-linear cross-entropy, activation and optimizer
                  offloading) against real steps, one fresh process per case
                  (``bench/gpu_validate.py --new-knobs``);
4. ``plans``      three plans run under a hard cap (``bench/gpu_validate.py --plans-only``).

Every part writes its JSON into ``--out`` as soon as it has a result (and after each case), and
this script rewrites ``--out/gpu_truth.json`` (versions, each part's status, seconds and summary)
after every part, so an interrupted call still brings back what it measured.

The first seconds check what the parts import (torch and CUDA, transformers, peft, accelerate,
datasets, bitsandbytes, liger-kernel, trl, torchao) and print their versions; a part whose library is
missing still runs and says so in its rows.

Usage::

    python bench/gpu_truth.py --out OUT                  # on a GPU machine: about 7.5 minutes
    python bench/gpu_truth.py --smoke --out /tmp/truth   # the CPU self-test of every part (CI runs it)
    python bench/gpu_truth.py --parts estimator,plans --budget 300 --out OUT

On the device machine (Python 3.12, torch with CUDA, transformers, peft, accelerate), with the
wheels it lacks carried in ``.whl`` (the first run's: bitsandbytes 0.50.2, liger-kernel 0.8.5,
datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, trl 1.16.0, torchao 0.18.0: about 47 MB, fetched
here with ``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 ...``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site python3 bench/gpu_truth.py --out $OUT --commit SHA

The first run (one H200, 2026-11-27) took 7.8 minutes and is in
``bench/results/gpu_truth_20261127_H200/``; the parts' shares below come from its timings. The
second (one H200, 2026-11-28) ran all four parts in 437 s: ``bench/results/gpu_truth_20261128_H200/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _gpu_report import nvidia_smi, write_json  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SUMMARY_NAME = "gpu_truth.json"
# the libraries the parts import; distributions whose import name differs are mapped
LIBRARIES: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("accelerate", "accelerate"),
    ("datasets", "datasets"),
    ("bitsandbytes", "bitsandbytes"),
    ("liger-kernel", "liger_kernel"),
    ("trl", "trl"),
    ("torchao", "torchao"),
    ("sentence-transformers", "sentence_transformers"),
    ("typer", "typer"),
    ("rich", "rich"),
)
# seconds each part is given on an H100 (the default budget is their sum); a part that starts
# late gets what is left, less the reserve the later parts need to at least start
DEFAULT_BUDGET_S = 455.0
GRACE_S = 25.0  # a part may overrun its --time-budget by one case; past this it is killed


@dataclass(frozen=True)
class Part:
    """One check: a bench script and its arguments, its share of the budget, its output."""

    name: str
    issue_item: int  # the issue's numbered list
    script: str
    args: tuple[str, ...]
    seconds: float  # its share on an H100
    output: str  # a file (name.json) or a folder (name/) under --out
    smoke_args: tuple[str, ...] = ("--smoke",)

    def command(self, out: Path, budget: float, smoke: bool) -> list[str]:
        target = out / self.output
        if self.script == "pytest":
            # the tests marked gpu (they skip on the CPU); the repo's addopts are left out: the
            # device machine's pytest-xdist may not know their options
            return [
                sys.executable,
                "-m",
                "pytest",
                "-o",
                "addopts=",
                "-q",
                "-rs",
                "-m",
                "gpu",
                *self.args,
                f"--junitxml={target}",
            ]
        flag = "--out" if self.output.endswith("/") else "--json"
        argv = [sys.executable, str(BENCH / self.script), *self.args, flag, str(target)]
        argv += ["--time-budget", f"{budget:.0f}"]
        if smoke:
            argv += list(self.smoke_args)
        return argv


PARTS: tuple[Part, ...] = (
    Part("guard", 1, "gpu_train_check.py", (), 135, "part1_guard_train.json"),
    Part("predict", 1, "infer_backoff.py", ("--device", "cuda"), 45, "part1_predict.json"),
    Part(
        "gpu-tests", 1, "pytest", ("tests/unit/guard/test_cap.py",), 10, "part1_gpu_tests.xml", ()
    ),
    Part("overhead", 2, "guard_overhead.py", ("--device", "cuda"), 40, "part2_overhead.json"),
    Part("estimator", 3, "gpu_validate.py", ("--new-knobs",), 160, "part3_estimator/"),
    Part("plans", 4, "gpu_validate.py", ("--plans-only",), 65, "part4_plans/"),
)


def _smoke_command(part: Part, command: list[str]) -> list[str]:
    # the CPU self-test runs each script's own --smoke on the CPU: drop the CUDA device argument
    out: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg == "--device":
            skip = True
            continue
        out.append(arg)
    return out


def library_versions() -> dict[str, dict[str, Any]]:
    """Each library's installed version and whether it imports (its error's first line if not)."""
    found: dict[str, dict[str, Any]] = {}
    for dist, module in LIBRARIES:
        row: dict[str, Any] = {"version": None, "imports": False}
        try:
            row["version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            row["error"] = "not installed"
            found[dist] = row
            continue
        try:
            importlib.import_module(module)
            row["imports"] = True
        except Exception as exc:  # a library broken on this machine is a finding, not a crash
            row["error"] = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            )
        found[dist] = row
    return found


def gpu_facts() -> dict[str, Any]:
    """The GPU, driver and CUDA as torch and nvidia-smi see them (None where there is no GPU)."""
    import torch

    facts: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            total_memory_bytes=int(props.total_memory),
            multi_processor_count=int(props.multi_processor_count),
            cudnn=torch.backends.cudnn.version(),
        )
    facts.update(nvidia_smi())
    return facts


class Summary:
    """``gpu_truth.json``: the header and each part's outcome, rewritten after every change."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"header": header, "parts": {}}
        self.write()

    def part(self, name: str, row: dict[str, Any]) -> None:
        self.data["parts"][name] = row
        self.write()

    def write(self) -> None:
        write_json(self.path, self.data)


def _part_json(out: Path, part: Part) -> tuple[Path | None, dict[str, Any] | None]:
    """The part's result file and its content (the newest JSON in its folder), if it wrote one."""
    target = out / part.output
    if part.output.endswith("/"):
        files = sorted(target.glob("*.json"), key=lambda p: p.stat().st_mtime)
        target = files[-1] if files else target / "missing.json"
    if not target.is_file():
        return None, None
    if target.suffix == ".xml":
        return target, _junit(target)
    try:
        return target, json.loads(target.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return target, None


def _junit(path: Path) -> dict[str, Any] | None:
    """A pytest JUnit XML file as {"summary": counts, "tests": [name, outcome]}."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = f"{tag}: {(found.get('message') or '')[:200]}"
        tests.append({"name": case.get("name"), "outcome": outcome})
    counts = {
        "tests": len(tests),
        "passed": sum(t["outcome"] == "passed" for t in tests),
        "failed": sum(t["outcome"].startswith(("failure", "error")) for t in tests),
        "skipped": sum(t["outcome"].startswith("skipped") for t in tests),
    }
    return {"summary": counts, "tests": tests}


def _plan_brief(check: dict[str, Any]) -> dict[str, Any]:
    """One plan check in a line: the job, the budget, what the plan changed and whether it fit."""
    measured = check.get("measured") or {}
    return {
        "model": Path(str(check.get("model"))).name,
        "budget_gib": round(float(check.get("budget_bytes") or 0) / 2**30, 2),
        "status": check.get("status"),
        "plan_changed": check.get("plan_changed"),
        "within_budget": measured.get("within_budget"),
        "fraction_of_budget": measured.get("fraction_of_budget"),
        "predicted_error_pct": measured.get("predicted_error_pct"),
        "error": check.get("error"),
    }


def _stream(process: subprocess.Popen[str], prefix: str, tail: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        print(f"{prefix} {line.rstrip()}", flush=True)
        tail.append(line.rstrip())
        del tail[:-40]


def run_part(
    part: Part, out: Path, budget: float, smoke: bool, env: dict[str, str]
) -> dict[str, Any]:
    """Run one part in its own process; its outcome as a row of ``gpu_truth.json`` (never raises)."""
    command = part.command(out, budget, smoke)
    if smoke:
        command = _smoke_command(part, command)
    if part.output.endswith("/"):
        (out / part.output).mkdir(parents=True, exist_ok=True)
    print(f"[{part.name}] {shlex.join(command[1:])}  (budget {budget:.0f} s)", flush=True)
    started = time.perf_counter()
    tail: list[str] = []
    status = "ok"
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(ROOT),
            env=env,
        )
    except OSError as exc:
        return {"status": "error", "error": str(exc), "seconds": 0.0}
    reader = threading.Thread(target=_stream, args=(process, f"[{part.name}]", tail), daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=budget + GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = process.wait()
        status = "killed: over its time budget"
    reader.join(timeout=5)
    seconds = round(time.perf_counter() - started, 1)
    if status == "ok" and returncode != 0:
        status = f"error: exit code {returncode}"
    path, data = _part_json(out, part)
    row: dict[str, Any] = {
        "issue_item": part.issue_item,
        "status": status,
        "seconds": seconds,
        "budget_s": round(budget),
        "command": shlex.join(command[1:]),
        "result_file": None if path is None else str(path.relative_to(out)),
        "summary": None if data is None else data.get("summary"),
    }
    if data is not None and data.get("plan_checks"):
        row["plans"] = [_plan_brief(check) for check in data["plan_checks"]]
    if status != "ok" or data is None:
        row["output_tail"] = tail[-25:]
    print(f"[{part.name}] {status} in {seconds:.0f} s", flush=True)
    return row


def part_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    # the parts import memfit from this checkout (the device machine has it only as files)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def select_parts(names: str | None) -> list[Part]:
    if not names:
        return list(PARTS)
    known = {p.name: p for p in PARTS}
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return [p for p in PARTS if p.name in chosen]


def budgets(parts: Sequence[Part], total: float) -> list[float]:
    """Each part's share of ``total``, in proportion to its H100 seconds."""
    weight = sum(p.seconds for p in parts) or 1.0
    return [total * p.seconds / weight for p in parts]


def print_summary(summary: dict[str, Any], path: Path) -> None:
    print("\n== gpu_truth summary ==", flush=True)
    header = summary["header"]
    gpu = header["gpu"]
    print(
        f"device: {gpu.get('name') or 'no GPU'}  driver {gpu.get('driver')}  "
        f"CUDA {gpu.get('torch_cuda')}  torch {header['libraries']['torch']['version']}  "
        f"transformers {header['libraries']['transformers']['version']}"
    )
    for name, row in summary["parts"].items():
        brief = json.dumps(row.get("summary"), default=str)
        if len(brief) > 400:
            brief = brief[:400] + "…"
        print(
            f"- {name} (item {row['issue_item']}): {row['status']}, {row['seconds']:.0f} s: {brief}"
        )
        for plan in row.get("plans") or []:
            print(f"    plan: {json.dumps(plan, default=str)}")
    print(f"total: {summary['total_seconds']:.0f} s; results: {path}")
    print(f"reproduce: {header['reproduce']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for every result (e.g. $OUT)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all parts together (default {DEFAULT_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--parts", default=None, help="comma-separated: " + ",".join(p.name for p in PARTS)
    )
    parser.add_argument("--smoke", action="store_true", help="the CPU self-test of every part")
    parser.add_argument("--commit", default=None, help="the commit being measured (for the record)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    parts = select_parts(args.parts)
    print("gpu_truth: checking the libraries…", flush=True)
    libraries = library_versions()
    for dist, row in libraries.items():
        state = "ok" if row["imports"] else row.get("error", "?")
        print(f"  {dist:<22} {row['version'] or '-':<14} {state}", flush=True)
    gpu = gpu_facts()
    if not gpu["cuda_available"] and not args.smoke:
        print("gpu_truth: no CUDA GPU here; run with --smoke for the CPU self-test", flush=True)
        return 2
    header = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "gpu": gpu,
        "libraries": libraries,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": args.commit or os.environ.get("MEMFIT_COMMIT"),
        "budget_s": args.budget,
        "parts_planned": [p.name for p in parts],
        "reproduce": f"python bench/gpu_truth.py {shlex.join(list(argv or sys.argv[1:]))}",
        "not_measurable_here": (
            "T4-class (sm_75) kernels and their workspaces: an H100/H200 runs other SDPA and "
            "cuBLAS kernels, so estimates for T4 targets are not checked by this run"
        ),
    }
    summary_path = out / SUMMARY_NAME
    summary = Summary(summary_path, header)
    env = part_env()
    if header["commit"]:
        env["MEMFIT_COMMIT"] = str(header["commit"])  # the parts' headers record it too
    shares = budgets(parts, args.budget)
    for i, (part, share) in enumerate(zip(parts, shares, strict=True)):
        left = args.budget - (time.perf_counter() - started)
        # the later parts keep a floor of 20 s each so that each at least starts
        reserve = 20.0 * (len(parts) - i - 1)
        budget = max(0.0, min(share + max(0.0, left - sum(shares[i:])), left - reserve))
        if budget < min(15.0, share):
            summary.part(
                part.name,
                {"issue_item": part.issue_item, "status": "skipped: no time left", "seconds": 0.0},
            )
            continue
        summary.part(part.name, run_part(part, out, budget, args.smoke, env))
    summary.data["total_seconds"] = round(time.perf_counter() - started, 1)
    summary.write()
    print_summary(summary.data, summary_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
