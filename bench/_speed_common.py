"""What `bench/estimate_speed.py` and `bench/plan_speed.py` share: jobs, checkouts, timed runs.

Every measured run is a fresh process started from here and timed from outside: the wall clock
(`time.perf_counter`) from just before the process is started until `os.wait4` has reaped it, so
Python's start-up, the imports, the work and the exit are all in the figure. `os.wait4` also
gives that process's own resource usage: `ru_maxrss`, the largest peak resident set of the process
and of the children it waited for (the largest single process, not their sum).

Runs are done in rounds; each round runs every cell once, the cells of one job back to back in an
order rotated from round to round, so that the machine's noise falls on all of them alike. A cell
reports the median and the minimum of its runs. Two checks say when a figure is not what it
claims: a warm run that writes to its cache (it missed, and traced) is flagged, and so is a
checkout whose src/memfit changed during the measurement (measure frozen worktrees instead).

Every figure is printed with what reproduces it: the bench's own command line (and, per job, the
same line narrowed to that job), and each row's exact child command with the environment it ran
in (`print_commands`). Bad arguments exit 2 with one line naming the flag, as memfit's own do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CHILD = BENCH / "_speed_child.py"
BENCH_CONFIGS = BENCH / "configs"
GIB = 1 << 30
# what exits 0 for `memfit estimate`; `memfit plan` also exits 3 when nothing fits (a real answer)
ESTIMATE_OK = (0,)
PLAN_OK = (0, 3)


# --- jobs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One `memfit estimate` workload; `knobs` are `memfit.estimate`'s keyword arguments."""

    name: str
    model: str  # a registry name, or a folder under bench/configs/
    task: str
    batch_size: int
    seq_len: int
    knobs: tuple[tuple[str, Any], ...] = ()

    def model_arg(self) -> str:
        """What memfit is given as MODEL: the registry name, or the config folder's path."""
        local = BENCH_CONFIGS / self.model
        return str(local) if local.is_dir() else self.model

    def cli_args(self) -> list[str]:
        """`memfit estimate`'s arguments for this job."""
        return [
            self.model_arg(),
            "--task",
            self.task,
            "--batch-size",
            str(self.batch_size),
            "--seq-len",
            str(self.seq_len),
            *knob_flags(dict(self.knobs)),
        ]

    def api_kwargs(self) -> dict[str, Any]:
        """`memfit.estimate`'s keyword arguments for this job."""
        return dict(
            task=self.task, batch_size=self.batch_size, seq_len=self.seq_len, **dict(self.knobs)
        )

    def config_folder(self, scratch: Path) -> Path:
        """A folder with the very config.json memfit reads for this model, for the peer tools."""
        local = BENCH_CONFIGS / self.model
        if local.is_dir():
            return local
        # registry models: the config.json this checkout ships (src/memfit/models/configs/)
        shipped = (
            REPO / "src" / "memfit" / "models" / "configs" / f"{self.model.replace('/', '--')}.json"
        )
        folder = scratch / "configs" / self.model.replace("/", "--")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shipped, folder / "config.json")
        return folder


def knob_flags(knobs: dict[str, Any]) -> list[str]:
    """The CLI flags of API keyword arguments: `lora_rank=16` → `--lora-rank 16`."""
    flags: list[str] = []
    for key, value in knobs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


_BF16_CHECKPOINTING = (("precision", "bf16"), ("gradient_checkpointing", True))
_LORA_16 = (*_BF16_CHECKPOINTING, ("lora_rank", 16))
JOBS: dict[str, Job] = {
    job.name: job
    for job in (
        Job("bert", "bert-base-uncased", "classification", 32, 128),
        Job("gpt2", "gpt2", "causal-lm", 8, 512),
        Job("gpt2-medium", "gpt2-medium", "causal-lm", 8, 512),
        Job("gpt2-xl", "gpt2-xl", "causal-lm", 1, 1024, _BF16_CHECKPOINTING),
        Job("llama3-8b", "llama-3-8b", "causal-lm", 1, 2048, _LORA_16),
        Job("llama3-70b", "llama-3-70b", "causal-lm", 1, 2048, _LORA_16),
        # the cold estimate `bench/plan_speed.py` holds the Llama-3.1-8B plans against: the plan's
        # own job (16 × 2048, full fine-tuning, nothing pinned), not one of the plan's answers
        Job("llama31-8b", "meta-llama/Llama-3.1-8B", "causal-lm", 16, 2048),
    )
}


def die(message: str) -> None:
    """Bad arguments: the lines naming the flags on stderr, exit 2 (memfit's convention)."""
    print(message, file=sys.stderr)
    sys.exit(2)


def pick(names: str, known: Sequence[str], flag: str) -> list[str]:
    """The comma-separated names of `flag`, in the order given; unknown names exit 2."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        die(f"{flag}: unknown {', '.join(unknown)}; choose from {','.join(known)}")
    return chosen


# --- checkouts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkout:
    """A memfit source tree whose `src/` the child processes import (PYTHONPATH)."""

    label: str
    root: Path

    def env(self, cache_dir: Path | None) -> dict[str, str]:
        """A child's environment: this checkout first on the path, offline, its own trace cache."""
        env = offline_env()
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.root / "src"), os.environ.get("PYTHONPATH", "")) if p
        )
        if cache_dir is not None:
            env["MEMFIT_CACHE_DIR"] = str(cache_dir)
        return env

    def source_digest(self) -> str:
        """A hash of every file under src/memfit: tells whether the code changed mid-measurement."""
        h = hashlib.sha256()
        for path in sorted((self.root / "src" / "memfit").rglob("*.py")):
            h.update(str(path).encode())
            with contextlib.suppress(OSError):  # removed while we read
                h.update(path.read_bytes())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        def git(*args: str) -> str:
            done = subprocess.run(
                ["git", "-C", str(self.root), *args], capture_output=True, text=True, check=False
            )
            return done.stdout.strip()

        return {
            "label": self.label,
            "root": str(self.root),
            "commit": git("rev-parse", "HEAD") or None,
            "src_modified": bool(git("status", "--porcelain", "--", "src")),
        }


def offline_env() -> dict[str, str]:
    """The environment of every child: no network, no memfit setting inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFIT_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def add_common_options(parser: argparse.ArgumentParser, rounds: int = 3) -> None:
    parser.add_argument(
        "--rounds", type=int, default=rounds, help="runs of every cell (median and min reported)"
    )
    parser.add_argument(
        "--label", default="memfit", help="column name of this checkout's memfit (e.g. after)"
    )
    parser.add_argument(
        "--memfit-src",
        "--compare",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="also time the memfit of checkout DIR (imports DIR/src) in the same rounds, "
        "e.g. before=/tmp/memfit-before from `git worktree add /tmp/memfit-before COMMIT`",
    )
    parser.add_argument(
        "--skip-this-checkout",
        action="store_true",
        help="time only the --memfit-src checkouts (e.g. two frozen worktrees while others edit "
        "this one)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds one run may take before it is killed"
    )
    parser.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")


def checkouts(args: argparse.Namespace) -> list[Checkout]:
    """Every `--memfit-src` ("before"), then this checkout ("after"); errors name the flag and the fix."""
    found = [Checkout(args.label, REPO)]
    problems = []
    for given in args.memfit_src:
        label, _, path = given.rpartition("=")
        root = Path(path).expanduser().resolve()
        label = label or root.name
        if not (root / "src" / "memfit" / "__init__.py").is_file():
            problems.append(
                f"--memfit-src {given}: {root}/src/memfit is not there; give a memfit checkout, "
                f"e.g. `git worktree add /tmp/memfit-before COMMIT` then --memfit-src before=/tmp/memfit-before"
            )
        if label in {c.label for c in found}:
            problems.append(f"--memfit-src {given}: the label {label!r} is taken; write LABEL=DIR")
        found.append(Checkout(label, root))
    if args.rounds < 1:
        problems.append("--rounds: at least 1")
    if args.skip_this_checkout and len(found) == 1:
        problems.append("--skip-this-checkout: give at least one --memfit-src LABEL=DIR to time")
    if problems:
        die("\n".join(problems))
    # columns read left to right: the compared checkouts, then this one
    return found[1:] + ([] if args.skip_this_checkout else found[:1])


def check_sources(sides: list[Checkout], digests: dict[str, str]) -> list[str]:
    """The checkouts whose src/memfit changed since `digests` were taken, each with a warning."""
    changed = [side.label for side in sides if side.source_digest() != digests[side.label]]
    for label in changed:
        print(
            f"\n! {label}: src/memfit changed while it was measured (someone editing it?): its "
            "figures mix versions and its warm caches may have missed. Measure a frozen copy: "
            "`git worktree add /tmp/memfit-after HEAD`, then --memfit-src after=/tmp/memfit-after "
            "--skip-this-checkout."
        )
    return changed


def reproduce_line(script: str) -> str:
    return f"$ python bench/{script} " + shlex.join(sys.argv[1:])


def rerun_line(script: str, **replace: str) -> str:
    """This run's command line with some flags replaced (`jobs="bert"` → `--jobs bert`), to
    reproduce one figure alone; every other flag (rounds, checkouts) kept as given but --json
    (the rerun would overwrite this run's record)."""
    flags = {"--" + name.replace("_", "-"): value for name, value in replace.items()}
    kept: list[str] = []
    argv = sys.argv[1:]
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in flags or name == "--json":
            i += 1 if "=" in argv[i] else 2  # the flag and its value
            continue
        kept.append(argv[i])
        i += 1
    for flag, value in flags.items():
        kept += [flag, value]
    return f"python bench/{script} " + shlex.join(kept)


# --- one timed process ---------------------------------------------------------------------------
@dataclass
class Run:
    seconds: float
    returncode: int | None  # None: killed at --timeout
    max_rss_bytes: int  # ru_maxrss of the process (and the children it waited for)
    tree_rss_peak_bytes: int | None  # sampled sum over the process and its descendants
    stdout: str
    stderr: str


def run_process(
    command: list[str],
    env: dict[str, str],
    *,
    timeout_s: float,
    sample_tree: bool = False,
) -> Run:
    """Run `command` in a fresh process (its own session) and time it from outside."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryDirectory(prefix="memfit-bench-cwd-") as cwd,
    ):
        sampler = None
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True
        )
        if sample_tree:
            sampler = _TreeSampler(process.pid)
        killed = threading.Event()

        def on_timeout() -> None:
            killed.set()
            _kill_group(process.pid)

        timer = threading.Timer(timeout_s, on_timeout)
        timer.start()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
        # whatever the child left behind in its session (stray workers) goes with it
        _kill_group(process.pid)
        tree_peak = sampler.stop() if sampler else None
        out.seek(0)
        err.seek(0)
        return Run(
            seconds=seconds,
            returncode=None if killed.is_set() else process.returncode,
            max_rss_bytes=usage.ru_maxrss * 1024,  # Linux reports KiB
            tree_rss_peak_bytes=tree_peak,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _TreeSampler:
    """Samples, every 50 ms, the summed RSS of every process in the child's session.

    Shared pages (the libraries each worker maps) count once per process, so the sum is an upper
    bound of what the tree holds; the child's `ru_maxrss` is the lower bound (its largest process).
    """

    def __init__(self, session: int) -> None:
        self.session = session
        self.peak = 0
        self._done = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._sample())
            self._done.wait(0.05)

    def _sample(self) -> int:
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                # fields after the command name: state ppid pgrp session ...
                if int(stat.rsplit(")", 1)[1].split()[3]) != self.session:
                    continue
                total += int(Path(entry.path, "statm").read_text().split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                continue  # the process ended between listing and reading
        return total

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


# --- cells and rounds ----------------------------------------------------------------------------
@dataclass
class Cell:
    """One figure of a table: a command run once per round.

    `cache`: "cold" gives every run a new empty MEMFIT_CACHE_DIR; "warm" a cache dir filled by
    one priming run of the same command before the rounds (not counted); "none" sets none (peers).
    """

    row: str
    column: str
    command: list[str]
    env: dict[str, str]
    cache: str = "none"
    ok_codes: tuple[int, ...] = ESTIMATE_OK
    warm_dir: Path | None = None
    times: list[float] = field(default_factory=list)
    max_rss: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    priming_seconds: float | None = None
    cache_misses: int = 0  # warm runs that wrote to their cache: they traced after all
    last_stdout: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def minimum(self) -> float | None:
        return min(self.times) if self.times else None

    def as_json(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "column": self.column,
            "command": shlex.join(self.command),
            "cache": self.cache,
            "seconds": self.times,
            "median_s": self.median,
            "min_s": self.minimum,
            "max_rss_bytes": self.max_rss,
            "priming_s": self.priming_seconds,
            "warm_cache_misses": self.cache_misses,
            "failures": self.failures,
        }


def command_text(command: list[str], env: dict[str, str], cache: str) -> str:
    """`command` as a shell line, with the environment it runs in (what differs from this
    process's, and the cache dir as `Cell.cache` sets it); run from an empty folder."""
    changed = {
        k: v
        for k, v in env.items()
        if (os.environ.get(k) != v or k.startswith("MEMFIT_")) and k != "MEMFIT_CACHE_DIR"
    }
    cache_dir = {
        "cold": "$(mktemp -d)",
        "warm": "DIR",  # see the note print_commands adds
        "none": env.get("MEMFIT_CACHE_DIR"),
    }[cache]
    if cache_dir:
        changed["MEMFIT_CACHE_DIR"] = cache_dir
    # offline_env drops the caller's MEMFIT_ settings
    unset = sorted(k for k in os.environ if k.startswith("MEMFIT_") and k not in changed)
    words = [*(f"-u {k}" for k in unset)]
    assignments = " ".join(
        f"{k}={v if v.startswith('$(') else shlex.quote(v)}" for k, v in sorted(changed.items())
    )
    prefix = "env " + " ".join(words) + " " if words else ""
    return f"{prefix}{assignments} {shlex.join(command)}".strip()


def print_commands(cells: list[Cell]) -> None:
    """Each row's command, once per checkout and cache setting (what reproduces its figure)."""
    print("\nEach figure's command (run in a fresh process from an empty folder):")
    seen: set[str] = set()
    for cell in cells:
        text = command_text(cell.command, cell.env, cell.cache)
        if text in seen:
            continue
        seen.add(text)
        print(f"  {cell.row} / {cell.column}:\n    $ {text}")
    if any(c.cache == "warm" for c in cells):
        print(
            "  (warm: DIR is a MEMFIT_CACHE_DIR filled by one earlier run of the same command, "
            "not counted; cold: a new empty dir for every run)"
        )


def run_cell(cell: Cell, scratch: Path, timeout_s: float) -> Run | None:
    """One run of `cell`, its figure recorded; None when it failed (the reason recorded)."""
    env = dict(cell.env)
    cold_dir = None
    if cell.cache == "cold":
        cold_dir = Path(tempfile.mkdtemp(prefix="cold-cache-", dir=scratch))
        env["MEMFIT_CACHE_DIR"] = str(cold_dir)
    elif cell.cache == "warm":
        env["MEMFIT_CACHE_DIR"] = str(cell.warm_dir)
    cache_before = _cache_files(cell.warm_dir) if cell.cache == "warm" else None
    try:
        run = run_process(cell.command, env, timeout_s=timeout_s)
    finally:
        if cold_dir is not None:
            shutil.rmtree(cold_dir, ignore_errors=True)
    # the same command as the priming run wrote traces: it did not find them (a miss)
    primed = cache_before is not None and cell.priming_seconds is not None
    if primed and _cache_files(cell.warm_dir) != cache_before:
        cell.cache_misses += 1
    if run.returncode not in cell.ok_codes:
        why = "killed at --timeout" if run.returncode is None else f"exit {run.returncode}"
        tail = run.stderr.strip().splitlines()[-3:]
        cell.failures.append(f"{why}: {' | '.join(tail)}")
        return None
    cell.times.append(run.seconds)
    cell.max_rss.append(run.max_rss_bytes)
    cell.last_stdout = run.stdout
    return run


def _cache_files(folder: Path | None) -> set[tuple[str, int, int]]:
    """The trace files of a cache dir, with their size and modification time."""
    if folder is None or not folder.is_dir():
        return set()
    found = set()
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            found.add((str(path), stat.st_size, stat.st_mtime_ns))
    return found


def measure(cells: list[Cell], rounds: int, scratch: Path, timeout_s: float) -> None:
    """Prime the warm caches, then run every cell once per round (progress on stderr)."""
    for cell in cells:
        if cell.cache != "warm":
            continue
        cell.warm_dir = Path(tempfile.mkdtemp(prefix="warm-cache-", dir=scratch))
        primer = dataclasses.replace(cell, times=[], max_rss=[], failures=[])
        run = run_cell(primer, scratch, timeout_s)
        cell.priming_seconds = run.seconds if run else None
        cell.failures += [f"priming: {f}" for f in primer.failures]
        _progress(f"priming {cell.row} / {cell.column}: " + _said(run, primer))
    rows = list(dict.fromkeys(c.row for c in cells))
    for r in range(rounds):
        for row in rows:
            mine = [
                c
                for c in cells
                if c.row == row and not (c.cache == "warm" and c.priming_seconds is None)
            ]
            shift = r % len(mine) if mine else 0
            for cell in mine[shift:] + mine[:shift]:
                failed, misses = len(cell.failures), cell.cache_misses
                run = run_cell(cell, scratch, timeout_s)
                said = f"{run.seconds:.2f} s" if run else cell.failures[failed]
                if cell.cache_misses > misses:
                    said += " (it wrote to its warm cache: a miss)"
                _progress(f"round {r + 1}/{rounds} {row} / {cell.column}: {said}")


def _said(run: Run | None, cell: Cell) -> str:
    return f"{run.seconds:.2f} s" if run else (cell.failures[-1] if cell.failures else "failed")


def _progress(line: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# --- printing --------------------------------------------------------------------------------------
def seconds_text(cell: Cell | None) -> str:
    """`median (min)` of a cell, or why there is no figure."""
    if cell is None:
        return "—"
    if not cell.times:
        return "failed" if cell.failures else "—"
    return f"{cell.median:.2f} ({cell.minimum:.2f})"


def print_table(cells: list[Cell], title: str) -> None:
    rows = list(dict.fromkeys(c.row for c in cells))
    columns = list(dict.fromkeys(c.column for c in cells))
    by_key = {(c.row, c.column): c for c in cells}
    table = [["", *columns]] + [
        [row, *(seconds_text(by_key.get((row, col))) for col in columns)] for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns) + 1)]
    print(f"\n{title}")
    for n, line in enumerate(table):
        print(
            "  "
            + "  ".join(
                text.ljust(w) if i == 0 else text.rjust(w)
                for i, (text, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    for cell in cells:
        for failure in cell.failures:
            print(f"  ! {cell.row} / {cell.column}: {failure}")
        if cell.cache_misses:
            print(
                f"  ! {cell.row} / {cell.column}: {cell.cache_misses} of {len(cell.times)} warm "
                "run(s) wrote new traces to the cache (a miss: not a warm figure)"
            )


def verdict(value: float | None, limit: float | None) -> str:
    if value is None:
        return "n/a"
    if limit is None:
        return ""
    return "PASS" if value <= limit else "MISS"


def ratio(numerator: Cell | None, denominator: Cell | None) -> float | None:
    """The ratio of two cells' medians, None when either has no figure."""
    if numerator is None or denominator is None or not numerator.times or not denominator.times:
        return None
    return numerator.median / denominator.median  # type: ignore[operator]


def ratio_line(name: str, value: float | None, limit: float | None) -> dict[str, Any]:
    target = f"target ≤ {limit:g}×" if limit is not None else "no target"
    shown = f"{value:6.2f}×" if value is not None else "    n/a"
    print(f"  {name:<52} {shown}  ({target}) {verdict(value, limit)}".rstrip())
    return {"name": name, "ratio": value, "target": limit, "verdict": verdict(value, limit) or None}


# --- the record ---------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "packages": {
            p: version(p) for p in ("torch", "transformers", "accelerate", "peft", "deepspeed")
        },
    }


def print_machine(sides: list[Checkout]) -> dict[str, Any]:
    info = machine()
    pkgs = ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)
    print(
        f"# {info['platform']}, {info['cpus']} CPUs, load {info['load_average'][0]:.2f}; Python {info['python']}; {pkgs}"
    )
    described = [side.describe() for side in sides]
    for d in described:
        commit = (d["commit"] or "no git")[:12] + (" + modified src/" if d["src_modified"] else "")
        print(f"# {d['label']}: {d['root']} @ {commit}")
    info["checkouts"] = described
    return info


def deepspeed_importable() -> bool:
    return find_spec("deepspeed") is not None


def print_load_end() -> None:
    """The load average at the end: with the one printed first, how busy the machine was."""
    one, five, fifteen = os.getloadavg()
    print(f"\n# load average at the end: {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)")


def write_json(path: str | None, script: str, payload: dict[str, Any]) -> None:
    if not path:
        return
    payload = {
        "bench": script,
        "command": reproduce_line(script)[2:],
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    payload["machine"]["load_average_end"] = os.getloadavg()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {path}")
