"""How fast `memfit.estimate` answers a new shape once the model is traced, and that it answers alike.

    python bench/replay_speed.py                                   # this checkout
    python bench/replay_speed.py --tree /tmp/before --tree .       # A/B: two source trees, ratio
    python bench/replay_speed.py --check --tree /tmp/before --tree .   # identity of the answers

After the first estimate of a model and knob set (its trace, timed apart and not counted), every
other shape is a replay of the fitted trace through the simulated CUDA caching allocator
(`memfit.estimate.replay`, `memfit.estimate.device`). Speed: per job, `--shapes` new shapes
(an even batch of 2 or more and a length that is a multiple of 8, so that no other kind of shape
is traced), each `memfit.estimate` call timed in this process; the median and the maximum in ms,
over `--rounds` passes (each pass asks the same shapes again: answers are not cached). Jobs:
bert (bert-base-uncased, classification), gpt2-medium (causal-lm), llama3-8b
(meta-llama/Llama-3.1-8B, LoRA rank 16, nf4, fp16, gpu t4).

`--check`: a matrix of models and knobs (sharding, accumulation, offloading, eval, CPU, two GPU
profiles, ...) at ~20 shapes each; every answer's `Estimate.to_dict()` (less the keys ending in
`_seconds`, which are timings) is written as JSON by each tree, and the trees' answers must be
identical: exit 1 and the first differences otherwise.

Each `--tree DIR` runs in its own child process with PYTHONPATH=DIR/src (the default: this
checkout); all share one MEMFIT_CACHE_DIR (`--cache-dir`, default a new temporary one), since the
traces are the same in every tree being compared, and run with MEMFIT_NO_BACKGROUND=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

LLAMA_LORA = {
    "task": "causal-lm",
    "lora_rank": 16,
    "quantization": "nf4",
    "precision": "fp16",
    "gpu": "t4",
}
SPEED_JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("bert-base-uncased", {"task": "classification"}),
    "gpt2-medium": ("gpt2-medium", {"task": "causal-lm"}),
    "llama3-8b": ("meta-llama/Llama-3.1-8B", LLAMA_LORA),
}
# the identity matrix: each case's knobs cover one path of the replay
CHECK_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("bert-base-uncased", {"task": "classification"}),
    "bert-ckpt-eager-a100": (
        "bert-base-uncased",
        {
            "task": "classification",
            "gradient_checkpointing": True,
            "attn_implementation": "eager",
            "gpu": "a100-80gb",
        },
    ),
    "gpt2-t4": ("gpt2", {"task": "causal-lm", "gpu": "t4"}),
    "gpt2-eval": ("gpt2", {"task": "causal-lm", "mode": "eval"}),
    "gpt2-accum2": ("gpt2", {"task": "causal-lm", "gradient_accumulation_steps": 2}),
    "gpt2-zero2": ("gpt2", {"task": "causal-lm", "world_size": 2, "sharding": "zero2"}),
    "gpt2-fsdp": ("gpt2", {"task": "causal-lm", "world_size": 2, "sharding": "fsdp"}),
    "gpt2-offload": ("gpt2", {"task": "causal-lm", "activation_offloading": True}),
    "gpt2-cpu": ("gpt2", {"task": "causal-lm", "device": "cpu"}),
    "gpt2-medium-bf16-ckpt": (
        "gpt2-medium",
        {"task": "causal-lm", "precision": "bf16", "gradient_checkpointing": True},
    ),
    "llama3-8b-lora-nf4": ("meta-llama/Llama-3.1-8B", LLAMA_LORA),
    "llama3-8b-lora-nf4-a100-ckpt": (
        "meta-llama/Llama-3.1-8B",
        {**LLAMA_LORA, "gpu": "a100-80gb", "gradient_checkpointing": True},
    ),
    "qwen-bf16-accum2-eager": (
        "Qwen/Qwen2.5-0.5B",
        {
            "task": "causal-lm",
            "precision": "bf16",
            "gradient_accumulation_steps": 2,
            "attn_implementation": "eager",
        },
    ),
    "qwen-eval-a100": (
        "Qwen/Qwen2.5-0.5B",
        {"task": "causal-lm", "mode": "eval", "gpu": "a100-80gb"},
    ),
    "qwen-zero3-offload": (
        "Qwen/Qwen2.5-0.5B",
        {
            "task": "causal-lm",
            "world_size": 2,
            "sharding": "zero3",
            "activation_offloading": True,
        },
    ),
}
FIRST_SHAPE = (8, 128)


def shapes(count: int) -> list[tuple[int, int]]:
    """``count`` shapes other than the first estimate's: even batches of 2..64, lengths in 8s."""
    batches = [2, 4, 6, 10, 12, 16, 20, 24, 32, 40, 48, 64]
    lengths = [64, 96, 136, 200, 256, 320, 384, 512]
    found: list[tuple[int, int]] = []
    i = 0
    while len(found) < count:
        shape = (batches[(i * 5) % len(batches)], lengths[(i * 3) % len(lengths)])
        i += 1
        if shape not in found and shape != FIRST_SHAPE:
            found.append(shape)
        if i > 10_000:
            break
    return found


def _answer(estimate: Any, model: str, knobs: dict[str, Any], shape: tuple[int, int]) -> Any:
    return estimate(model, batch_size=shape[0], seq_len=shape[1], **knobs)


def _clean(value: Any) -> Any:
    """``value`` without the keys ending in ``_seconds`` (timings), at any depth."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not str(k).endswith("_seconds")}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def child_speed(jobs: list[str], count: int, rounds: int) -> dict[str, Any]:
    from memfit.estimate import estimate

    out: dict[str, Any] = {}
    for job in jobs:
        model, knobs = SPEED_JOBS[job]
        started = time.perf_counter()
        _answer(estimate, model, knobs, FIRST_SHAPE)
        first = time.perf_counter() - started
        times = []
        for _ in range(rounds):
            for shape in shapes(count):
                started = time.perf_counter()
                _answer(estimate, model, knobs, shape)
                times.append(time.perf_counter() - started)
        out[job] = {"first_s": first, "times_s": times}
    return out


def child_check(cases: list[str], count: int) -> dict[str, Any]:
    from memfit.estimate import estimate

    out: dict[str, Any] = {}
    for case in cases:
        model, knobs = CHECK_CASES[case]
        answers = []
        for shape in [FIRST_SHAPE, *shapes(count)]:
            answer = _answer(estimate, model, knobs, shape)
            answers.append({"shape": list(shape), "answer": _clean(answer.to_dict())})
        out[case] = answers
    return out


def run_tree(tree: str, argv: list[str], cache: str) -> dict[str, Any]:
    """This script's child in ``tree`` (PYTHONPATH=tree/src); its JSON answer."""
    src = str(Path(tree).resolve() / "src")
    env = {**os.environ, "PYTHONPATH": src, "MEMFIT_CACHE_DIR": cache, "MEMFIT_NO_BACKGROUND": "1"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        path = handle.name
    command = [sys.executable, str(HERE), "--child-out", path, *argv]
    done = subprocess.run(command, env=env, check=False)
    if done.returncode:
        sys.exit(f"replay_speed: the child in {tree} exited {done.returncode}")
    data: dict[str, Any] = json.loads(Path(path).read_text())
    os.unlink(path)
    return data


def _diff(a: Any, b: Any, where: str, found: list[str]) -> None:
    if len(found) >= 10:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key, "<missing>"), b.get(key, "<missing>"), f"{where}.{key}", found)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{where}[{i}]", found)
    elif a != b or type(a) is not type(b):
        found.append(f"{where}: {a!r} != {b!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="a source tree (repeatable)")
    parser.add_argument("--check", action="store_true", help="the identity check, not speed")
    parser.add_argument("--jobs", default=",".join(SPEED_JOBS), help="speed jobs, comma-separated")
    parser.add_argument("--cases", default=",".join(CHECK_CASES), help="--check's cases")
    parser.add_argument("--shapes", type=int, default=20, help="new shapes per job or case")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the shapes (speed)")
    parser.add_argument("--cache-dir", help="MEMFIT_CACHE_DIR shared by the trees")
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    cases = [c for c in args.cases.split(",") if c]
    for name in jobs if not args.check else cases:
        if name not in (CHECK_CASES if args.check else SPEED_JOBS):
            parser.error(f"--{'cases' if args.check else 'jobs'}: unknown {name!r}")
    if args.child_out:
        if args.check:
            data = child_check(cases, args.shapes)
        else:
            data = child_speed(jobs, args.shapes, args.rounds)
        Path(args.child_out).write_text(json.dumps(data, sort_keys=True))
        return 0

    trees = args.tree or [str(ROOT)]
    cache = args.cache_dir or tempfile.mkdtemp(prefix="memfit-replay-speed-")
    forwarded = [a for a in sys.argv[1:]]
    child_argv = []
    skip = False
    for arg in forwarded:  # the child gets every flag but --tree and --cache-dir
        if skip:
            skip = False
            continue
        if arg in ("--tree", "--cache-dir"):
            skip = True
            continue
        if arg.startswith(("--tree=", "--cache-dir=")):
            continue
        child_argv.append(arg)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"cache: MEMFIT_CACHE_DIR={cache}  MEMFIT_NO_BACKGROUND=1")
    # the first tree fills the cache: every tree then reads the same traces from it
    results = [(tree, run_tree(tree, child_argv, cache)) for tree in trees]

    if args.check:
        base_tree, base = results[0]
        failed = False
        for tree, data in results[1:]:
            found: list[str] = []
            _diff(base, data, "", found)
            answers = sum(len(v) for v in data.values())
            if found:
                failed = True
                print(f"DIFFERENT: {tree} vs {base_tree}:")
                for line in found:
                    print("  ", line)
            else:
                print(f"identical: {tree} vs {base_tree}: {answers} answers, {len(data)} cases")
        return 1 if failed else 0

    print(f"{'job':12} {'tree':40} {'first s':>8} {'median ms':>10} {'max ms':>8} {'ratio':>6}")
    for job in jobs:
        base_median = None
        for tree, data in results:
            times = [t * 1000 for t in data[job]["times_s"]]
            median = statistics.median(times)
            base_median = base_median or median
            ratio = base_median / median
            print(
                f"{job:12} {tree[-40:]:40} {data[job]['first_s']:8.2f} {median:10.2f} "
                f"{max(times):8.2f} {ratio:6.2f}"
            )
    print("ratio: the first tree's median over this tree's (above 1: faster than the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
