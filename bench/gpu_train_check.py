"""The guard under a real CUDA cap (issue 35, part 1): a capped run must end as the uncapped one.

Four cases, each run as a user runs it (a subprocess: ``python -m memfit train …``
or ``python examples/trainer_after.py …``, with the repository's ``src`` on ``PYTHONPATH``), on
random-weight models built from configs into a temporary folder and generated data files:

1. ``bert-fp32``    a BERT-base-shaped classifier (12 layers × 768, dropout off), fp32, SGD;
2. ``llama-bf16``   a small Llama-shaped causal LM (8 layers × 1024, 16 heads over 4 key/value
                    heads, vocabulary 32 004 words), ``--lora-rank 8 --precision bf16``, SGD;
3. ``llama-fp16``   the same with ``--precision fp16`` (memfit's ``GradScaler``);
4. ``trainer``      ``examples/trainer_after.py`` (``GuardedTrainer``) on a MiniLM-L12-shaped random
                    BERT (12 layers × 384) under ``MEMFIT_MEMORY_CAP``.

Cases 1-3 run ``memfit train`` three times on the same rows and effective batch:

- ``plain``    the full micro-batch, no cap: the reference, and the full micro-batch's per-step
               peak (``peak_bytes`` in ``metrics.jsonl``: ``max_memory_allocated`` on CUDA);
- ``split1``   ``--micro-batch-size 1``: the per-step peak of one row; its weights are the same
               gradient summed in another order, the floor of "the same weights" in that precision;
- ``capped``   ``--memory-cap`` halfway between the two peaks, so that the full micro-batch runs
               out of memory for real (CUDA: ``set_per_process_memory_fraction``, a real
               ``torch.OutOfMemoryError`` from the caching allocator) and the guard backs off.

On the CPU, runs without a cap report the process's resident memory, not the cap's count: there
``plain`` and ``split1`` run under a cap that never bites (1000 TiB), which counts and changes
nothing.

Recorded per case: OOM events and back-offs (the run folder's ``events.jsonl``), the micro-batches
the capped run settled on, samples seen and optimizer steps (``metrics.jsonl``: exactly those of
the plain run, and the same tokens in each step: no lost or repeated sample), fp16 scaler skips,
the largest absolute difference of the trained weights (``DIR/model/*.safetensors``: the whole
model, or the LoRA adapters) from the plain run's, step times (median, first step left out), peak
allocated and reserved memory.

Tolerance of the weight difference. fp32: 1e-5 (issue 35; with SGD the difference is lr × the
gradient's rounding). bf16 and fp16: autocast rounds each chunk's matmul outputs to 16 bits
before the chunks add up in fp32, so any other split of the same batch moves the weights by
16-bit rounding, not fp32's. The honest bar is the ``split1`` run's own difference from the plain
one (the same samples, the extreme split); the capped run passes within twice it (two splits'
roundings are independent draws, one may land above the other), and never needs less than 1e-5.
Both figures are in the JSON.

Case 4 calibrates its cap with ``memfit.estimate`` (in this process, while case 1 runs; no probe
runs): halfway between the step's estimated peak at 1 row and at the example's 8 rows × 128
tokens (reserved memory on CUDA, which the allocator's fraction limits; the counted bytes on the
CPU). It passes when the capped run survives an OOM (``OUTPUT_DIR/memfit_events.jsonl``), makes
the same optimizer steps and ends with weights within 1e-5 of the uncapped run's (fp32, AdamW).

SGD, not AdamW, in cases 1-3: AdamW's first update is ±lr for every weight whatever the gradient's
size, so a gradient within rounding of 0 decides a full ±lr step; SGD's difference is the
gradient's. Dropout is off everywhere: in the models' configs, and for the LoRA adapters by
``--lora-dropout 0`` in cases 2-3 (memfit's default is peft's usual 0.1, and with dropout on a
re-run step draws new masks).

On the CPU (``--smoke``, ``--device cpu``) memfit refuses 16-bit precision: case 2 runs in fp32
and case 3, which would be the same runs again, is recorded as skipped.

Four runs go at once on CUDA (``--jobs 4``; two on the CPU): most of a run is its start (imports,
loading the model: 20 of a run's 22-33 s on the H200 host, where two at once took the eleven runs
past 142 s), and every figure but the step times is the process's own (its allocator's peaks, its
cap); ``ran_beside`` names the runs a run shared the device with (``--jobs 1`` for step times
alone). The runs start in priority order as their inputs are ready: case 4's first (its model is
the smallest to build, its runs the shortest), then each case's ``capped`` run as soon as its
``plain`` and ``split1`` have ended, before the next case's runs.

The JSON (``--json``) is rewritten after every case: a header (GPU, driver, CUDA, versions,
command), the cases, a summary. A failing case is recorded (error and traceback tail) and the
next one runs; the exit code is 0 unless the device asked for is missing (2).

Usage::

    python bench/gpu_train_check.py --json OUT/part1_guard_train.json --time-budget 150   # GPU
    python bench/gpu_train_check.py --smoke --json /tmp/train_check.json   # CPU, tiny, < 60 s
    python bench/gpu_train_check.py --device cpu --cases bert-fp32 --layers 2 --hidden 64 --rows 48
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as futures
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py

STARTED = time.monotonic()
EXAMPLE = ROOT / "examples" / "trainer_after.py"
NEVER = "1000TiB"  # a CPU cap that never bites: the cap's count of the peak, nothing else changes
FP32_TOLERANCE = 1e-5  # issue 35's bar for the largest weight difference, fp32 with dropout off
SPLIT_FACTOR = 2.0  # 16-bit: the capped run may differ from plain by this × the split-1 run's
CASE_NAMES = ("bert-fp32", "llama-bf16", "llama-fp16", "trainer")
VERSIONS = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "safetensors",
    "tokenizers",
    "bitsandbytes",
    "liger-kernel",
    "trl",
    "sentence-transformers",
)


@dataclass(frozen=True)
class Sizes:
    """The models and data of one mode (the GPU run, or the CPU smoke test)."""

    bert_layers: int
    bert_hidden: int
    bert_rows: int
    bert_batch: int
    bert_words: int
    llama_hidden: int
    llama_layers: int
    llama_heads: int
    llama_kv_heads: int
    llama_intermediate: int
    llama_words: int  # the vocabulary, besides <pad> <unk> <s> </s>
    llama_rows: int
    llama_batch: int
    llama_seq: int  # tokens per row (BOS and seq - 1 words)
    trainer_layers: int
    trainer_hidden: int


GPU_SIZES = Sizes(
    bert_layers=12,
    bert_hidden=768,
    bert_rows=256,
    bert_batch=64,
    bert_words=400,
    llama_hidden=1024,
    llama_layers=8,
    llama_heads=16,
    llama_kv_heads=4,
    llama_intermediate=2816,
    llama_words=32000,
    llama_rows=128,
    llama_batch=16,
    llama_seq=512,
    trainer_layers=12,
    trainer_hidden=384,
)
SMOKE_SIZES = Sizes(
    bert_layers=2,
    bert_hidden=64,
    bert_rows=32,
    bert_batch=16,
    bert_words=60,
    llama_hidden=64,
    llama_layers=2,
    llama_heads=4,
    llama_kv_heads=2,
    llama_intermediate=128,
    llama_words=1000,
    llama_rows=16,
    llama_batch=8,
    llama_seq=64,
    trainer_layers=2,
    trainer_hidden=64,
)


# --- models and data ---------------------------------------------------------------------------
def build_bert(folder: Path, layers: int, hidden: int, words: list[str]) -> str:
    """A random BERT encoder (dropout off) with a WordPiece tokenizer of ``words``."""
    import torch
    from transformers import BertConfig, BertModel

    from _tiny import save_bert_tokenizer

    folder.mkdir(parents=True)
    tokenizer = save_bert_tokenizer(folder, words)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return str(folder)


def bert_data(path: Path, rows: int, words: int) -> Path:
    """``rows`` texts of ``words`` words w0…w499 (one token each), labelled 1 where most of their
    words are among w0…w249 (about half the rows)."""
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(rows):
        drawn = [rng.randrange(500) for _ in range(words)]
        text = " ".join(f"w{i}" for i in drawn)
        lines.append(f"{text},{int(2 * sum(i < 250 for i in drawn) > words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def build_llama(folder: Path, s: Sizes) -> str:
    """A random Llama-shaped causal LM (fp32 weights, dropout off) with a word-level tokenizer
    whose vocabulary is the config's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from _tiny import save_word_tokenizer

    folder.mkdir(parents=True)
    tokenizer = save_word_tokenizer(folder, [f"w{i}" for i in range(s.llama_words)])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.llama_hidden,
        intermediate_size=s.llama_intermediate,
        num_hidden_layers=s.llama_layers,
        num_attention_heads=s.llama_heads,
        num_key_value_heads=s.llama_kv_heads,
        max_position_embeddings=2 * s.llama_seq,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def llama_data(path: Path, s: Sizes) -> Path:
    """``llama_rows`` texts of ``llama_seq - 1`` random words (with BOS: ``llama_seq`` tokens)."""
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(s.llama_rows):
            words = (f"w{rng.randrange(s.llama_words)}" for _ in range(s.llama_seq - 1))
            handle.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def review_words() -> list[str]:
    """The words (and punctuation) of the example's REVIEWS, read from its source, so that the
    random BERT's tokenizer knows every one of them."""
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "REVIEWS" for t in node.targets
        ):
            reviews = ast.literal_eval(node.value)
            texts = " ".join(text for text, _ in reviews).lower()
            return sorted(set(re.findall(r"[a-z]+|[^\sa-z]", texts)))
    raise RuntimeError(f"{EXAMPLE}: no REVIEWS list")


# --- runs ------------------------------------------------------------------------------------
CHILD_VARIABLES = (
    "PYTHONPATH",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def child_env(device: str, jobs: int) -> dict[str, str]:
    """The environment of every run: the repository's src first on PYTHONPATH, no Hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MEMFIT_MEMORY_CAP", None)  # set by the one run that wants it
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer would take a GPU that is there
        # runs side by side (--jobs) share the cores instead of each taking them all
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def run_process(
    argv: list[str], env: dict[str, str], log: Path, timeout: float | None
) -> dict[str, Any]:
    """Run ``argv`` from the repository root; its output goes to ``log``."""
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        try:
            rc: int | None = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = log.read_text(encoding="utf-8", errors="replace")
    return {
        "command": shlex.join(argv),
        "rc": rc,
        "timed_out": rc is None,
        "seconds": round(time.monotonic() - started, 2),
        # when it ran (seconds since this script started), to tell the runs that had the device
        # to themselves
        "span": (round(started - STARTED, 2), round(time.monotonic() - STARTED, 2)),
        "output_tail": text[-1500:],
        "stdout": text,
    }


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(folder: Path) -> dict[str, Any]:
    """What a ``memfit train`` run folder says: its steps, samples, memory and guard events."""
    metrics = jsonl(folder / "metrics.jsonl")
    events = jsonl(folder / "events.jsonl")
    seconds = [m["seconds"] for m in metrics]
    peaks = [m["peak_bytes"] for m in metrics if m.get("peak_bytes") is not None]
    reserved = [m["reserved_bytes"] for m in metrics if m.get("reserved_bytes") is not None]
    return {
        "steps": metrics[-1]["step"] if metrics else 0,
        "samples_seen": metrics[-1]["samples_seen"] if metrics else 0,
        "tokens": [m.get("tokens") for m in metrics],
        "losses": [m.get("loss") for m in metrics],
        "micro_batch_sizes": sorted({m["micro_batch_size"] for m in metrics}),
        "peak_bytes": max(peaks) if peaks else None,
        "reserved_bytes": max(reserved) if reserved else None,
        "step_seconds": seconds,
        # the first step pays for lazy set-up (kernels, caches): left out of the median
        "median_step_seconds": statistics.median(seconds[1:] or seconds) if seconds else None,
        "ooms": sum(e["type"] == "oom" for e in events),
        "backoffs": sum(e["type"] == "backoff" for e in events),
        "scaler_skips": sum(e["type"] == "skip" for e in events),
        "guard_events": [
            e for e in events if e["type"] in ("oom", "backoff", "grow", "stop", "skip", "probe")
        ],
    }


def weights_difference(a: Path, b: Path) -> dict[str, Any]:
    """The largest absolute difference between the tensors of two model folders' safetensors
    files (the whole model, or a LoRA adapter folder's adapters)."""
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"{a}: no .safetensors file")
    worst, worst_name, count = 0.0, None, 0
    for name in files:
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        if set(wa) != set(wb):
            raise RuntimeError(f"{name}: the two runs saved different tensors")
        for key in wa:
            count += 1
            diff = (
                float((wa[key].double() - wb[key].double()).abs().max()) if wa[key].numel() else 0
            )
            if diff > worst or worst_name is None:
                worst, worst_name = diff, key
    return {"max_abs": worst, "tensor": worst_name, "tensors": count, "files": files}


# --- the scheduler ---------------------------------------------------------------------------
@dataclass
class Task:
    """One unit of a case: a run in a subprocess (at most ``--jobs`` at once) or work in this
    process (``local``: building models, the estimate; one at a time, beside the runs)."""

    case: str
    name: str
    work: Callable[[float | None], Any]  # gets the seconds left (None: no budget)
    deps: tuple[str, ...] = ()  # "case/name" of tasks whose results it needs
    local: bool = False

    @property
    def key(self) -> str:
        return f"{self.case}/{self.name}"


@dataclass
class Board:
    """The tasks' results and errors, by key."""

    results: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def get(self, case: str, name: str) -> Any:
        return self.results[f"{case}/{name}"]


def schedule(
    board: Board,
    tasks: list[Task],
    jobs: int,
    deadline: float | None,
    case_done: Callable[[str, Board], None],
) -> None:
    """Run ``tasks`` in their order as their dependencies finish: at most ``jobs`` subprocess
    runs and one local task at once. A case's first task does not start when the time left is
    below what its runs are expected to take (the median run so far × its runs ÷ jobs); then,
    and when a dependency failed, its tasks are recorded as not run. ``case_done`` is called as
    each case's last task ends. ``board`` fills as the tasks end (later tasks read it)."""
    pending = list(tasks)
    running: dict[futures.Future[Any], Task] = {}
    run_seconds: list[float] = []
    started_cases: set[str] = set()
    skipped_cases: set[str] = set()
    remaining = {c: sum(t.case == c for t in tasks) for c in {t.case for t in tasks}}

    def settle(task: Task) -> None:
        remaining[task.case] -= 1
        if remaining[task.case] == 0:
            case_done(task.case, board)

    with futures.ThreadPoolExecutor(max_workers=jobs + 1) as pool:
        while pending or running:
            for task in list(pending):
                failed = [d for d in task.deps if d in board.errors]
                if task.case in skipped_cases or failed:
                    board.errors[task.key] = (
                        "skipped: time budget"
                        if task.case in skipped_cases
                        else f"not run: {failed[0]} failed"
                    )
                    pending.remove(task)
                    settle(task)
                    continue
                if not all(d in board.results for d in task.deps):
                    continue
                busy = [t for t in running.values() if t.local == task.local]
                if len(busy) >= (1 if task.local else jobs):
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                expected = 0.0
                if task.case not in started_cases and run_seconds:
                    runs = sum(t.case == task.case and not t.local for t in tasks)
                    expected = statistics.median(run_seconds) * runs / jobs
                if left is not None and (left <= 0 or left < expected):
                    if task.case not in started_cases:
                        skipped_cases.add(task.case)
                    board.errors[task.key] = "skipped: time budget"
                    pending.remove(task)
                    settle(task)
                    continue
                started_cases.add(task.case)
                pending.remove(task)
                running[pool.submit(task.work, left)] = task
            if not running:
                # nothing runs, so nothing can settle what the rest waits on: a task whose
                # dependency is no task of this list
                for task in pending:
                    board.errors[task.key] = "not run: a dependency is missing"
                    settle(task)
                pending.clear()
                continue
            done, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for future in done:
                task = running.pop(future)
                try:
                    result = future.result()
                    board.results[task.key] = result
                    if isinstance(result, dict) and "seconds" in result and not task.local:
                        run_seconds.append(float(result["seconds"]))
                except Exception as exc:
                    board.errors[task.key] = f"{type(exc).__name__}: {exc}\n" + "".join(
                        traceback.format_exception(exc)[-6:]
                    )
                settle(task)


# --- the cases ---------------------------------------------------------------------------------
@dataclass
class Check:
    """Everything one invocation shares: the device, the sizes, the work folder, the children's
    environment."""

    device: str
    sizes: Sizes
    work: Path
    jobs: int
    gpu_name: str | None
    board: Board = field(default_factory=Board)  # the tasks' results so far

    def folder(self, *parts: str) -> Path:
        return self.work.joinpath(*parts)


@dataclass(frozen=True)
class TrainCase:
    """A ``memfit train`` case (1-3): its model, data and flags."""

    name: str
    title: str
    model_task: str  # the key of the task that builds the model (shared by 2 and 3)
    precision: str  # asked for on CUDA; the CPU trains in fp32 (memfit refuses 16 bits there)
    flags: tuple[str, ...]
    batch: int


def train_argv(check: Check, case: TrainCase, run: str, extra: list[str]) -> list[str]:
    model, data = check.folder(case.model_task, "model"), check.folder(case.model_task, "data")
    data_file = next(data.iterdir())
    precision = case.precision if check.device == "cuda" else "fp32"
    return [
        sys.executable,
        "-m",
        "memfit",
        "train",
        "--model",
        str(model),
        "--train-file",
        str(data_file),
        "--output-dir",
        str(check.folder(case.name, run)),
        "--cache-dir",
        str(check.folder(case.name, f"cache-{run}")),  # its own: runs side by side never race
        "--device",
        check.device,
        "--effective-batch-size",
        str(case.batch),
        "--precision",
        precision,
        "--optimizer",
        "sgd",
        "--seed",
        "1",
        *case.flags,
        *extra,
    ]


def train_tasks(check: Check, case: TrainCase) -> list[Task]:
    env = child_env(check.device, check.jobs)
    never = ["--memory-cap", NEVER] if check.device == "cpu" else []

    def run(name: str, extra: Callable[[], list[str]]) -> Callable[[float | None], Any]:
        def work(left: float | None) -> dict[str, Any]:
            check.folder(case.name).mkdir(exist_ok=True)
            argv = train_argv(check, case, name, extra())
            result = run_process(argv, env, check.folder(case.name, f"{name}.log"), left)
            result.update(read_run(check.folder(case.name, name)))
            return result

        return work

    def cap() -> list[str]:
        peaks = []
        for probe in ("plain", "split1"):
            done = check.board.get(case.name, probe)
            if done["rc"] != 0 or done["peak_bytes"] is None:
                raise RuntimeError(f"the {probe} run failed (exit {done['rc']}): no peak to cap")
            peaks.append(done["peak_bytes"])
        return ["--micro-batch-size", str(case.batch), "--memory-cap", str(sum(peaks) // 2)]

    full_batch = ["--micro-batch-size", str(case.batch)]
    deps = (f"{case.model_task}/build",)
    return [
        Task(case.name, "plain", run("plain", lambda: [*full_batch, *never]), deps),
        Task(case.name, "split1", run("split1", lambda: ["--micro-batch-size", "1", *never]), deps),
        Task(
            case.name,
            "capped",
            run("capped", cap),
            (*deps, f"{case.name}/plain", f"{case.name}/split1"),
        ),
    ]


def train_result(check: Check, case: TrainCase, board: Board) -> dict[str, Any]:
    """Case 1-3's record: the runs, the cap, the checks."""
    runs = {n: board.results.get(f"{case.name}/{n}") for n in ("plain", "split1", "capped")}
    errors = {
        n: board.errors[f"{case.name}/{n}"]
        for n in ("plain", "split1", "capped")
        if f"{case.name}/{n}" in board.errors
    }
    precision = case.precision if check.device == "cuda" else "fp32"
    record: dict[str, Any] = {
        "name": case.name,
        "title": case.title,
        "precision": precision,
        "precision_asked": case.precision,
        "effective_batch_size": case.batch,
        # with dropout on, a re-run step draws new masks (equal in distribution only): the
        # adapters could not match, so the LoRA cases train with --lora-dropout 0
        "lora_dropout": 0.0 if "--lora-rank" in case.flags else None,
        "runs": {n: _public(r) for n, r in runs.items() if r is not None},
        "errors": errors,
    }
    problems = [f"{n}: {e.splitlines()[0]}" for n, e in errors.items()]
    for n, r in runs.items():
        if r is not None and r["rc"] != 0:
            problems.append(run_problem(n, r))
    plain, split1, capped = runs["plain"], runs["split1"], runs["capped"]
    if plain and split1 and capped and not problems:
        cap = (plain["peak_bytes"] + split1["peak_bytes"]) // 2
        diff = weights_difference(
            check.folder(case.name, "plain", "model"), check.folder(case.name, "capped", "model")
        )
        floor = weights_difference(
            check.folder(case.name, "plain", "model"), check.folder(case.name, "split1", "model")
        )
        if precision == "fp32":
            tolerance, why = FP32_TOLERANCE, "fp32: issue 35's 1e-5"
        else:
            tolerance = max(FP32_TOLERANCE, SPLIT_FACTOR * floor["max_abs"])
            why = f"{precision}: {SPLIT_FACTOR:g} × the split-1 run's difference, at least 1e-5"
        losses = [
            abs(a - b)
            for a, b in zip(plain["losses"], capped["losses"], strict=False)
            if a is not None and b is not None
        ]
        record.update(
            cap_bytes=cap,
            peak_full_bytes=plain["peak_bytes"],
            peak_micro1_bytes=split1["peak_bytes"],
            reserved_full_bytes=plain["reserved_bytes"],
            reserved_capped_bytes=capped["reserved_bytes"],
            peak_capped_bytes=capped["peak_bytes"],
            ooms=capped["ooms"],
            backoffs=capped["backoffs"],
            capped_micro_batch_sizes=capped["micro_batch_sizes"],
            samples_seen={"plain": plain["samples_seen"], "capped": capped["samples_seen"]},
            steps={"plain": plain["steps"], "capped": capped["steps"]},
            scaler_skips={"plain": plain["scaler_skips"], "capped": capped["scaler_skips"]},
            max_abs_weight_difference=diff["max_abs"],
            weight_difference=diff,
            split1_weight_difference=floor["max_abs"],
            tolerance=tolerance,
            tolerance_why=why,
            max_abs_loss_difference=max(losses) if losses else None,
            median_step_seconds={
                n: r["median_step_seconds"] for n, r in runs.items() if r is not None
            },
            # step times of a run beside another one (--jobs 2) share the device with it
            ran_beside={n: beside(check.board, f"{case.name}/{n}") for n in runs},
        )
        if capped["ooms"] < 1 or capped["backoffs"] < 1:
            problems.append("the cap did not bite: no OOM and back-off in the capped run")
        if capped["samples_seen"] != plain["samples_seen"] or capped["steps"] != plain["steps"]:
            problems.append("samples or steps differ from the plain run's")
        if capped["tokens"] != plain["tokens"]:
            problems.append("a step's tokens differ from the plain run's (lost or repeated rows)")
        if capped["scaler_skips"] != plain["scaler_skips"]:
            problems.append("the fp16 scaler skipped other steps than in the plain run")
        if diff["max_abs"] > tolerance:
            problems.append(f"max |Δweight| {diff['max_abs']:.2e} > {tolerance:.1e}")
    record["status"] = "ok" if not problems else "failed"
    record["problems"] = problems
    return record


def trainer_tasks(check: Check) -> list[Task]:
    env = child_env(check.device, check.jobs)
    name = "trainer"

    def run(which: str) -> Callable[[float | None], Any]:
        def work(left: float | None) -> dict[str, Any]:
            run_env = dict(env)
            if which == "capped":
                run_env["MEMFIT_MEMORY_CAP"] = str(check.board.get(name, "estimate")["cap_bytes"])
            out = check.folder(name, which)
            argv = [
                sys.executable,
                str(EXAMPLE.relative_to(ROOT)),
                "--model",
                str(check.folder(name, "model")),
                "--output-dir",
                str(out),
            ]
            result = run_process(argv, run_env, check.folder(name, f"{which}.log"), left)
            if which == "capped":
                result["command"] = (
                    f"MEMFIT_MEMORY_CAP={run_env['MEMFIT_MEMORY_CAP']} " + result["command"]
                )
            found = re.search(r"trained: (\d+) optimizer steps", result["stdout"])
            events = jsonl(out / "memfit_events.jsonl")
            result.update(
                memory_cap=run_env.get("MEMFIT_MEMORY_CAP"),
                steps=int(found.group(1)) if found else None,
                ooms=sum(e["type"] == "oom" for e in events),
                backoffs=sum(e["type"] == "backoff" for e in events),
                guard_events=events,
            )
            return result

        return work

    def build(_: float | None) -> dict[str, Any]:
        s = check.sizes
        build_bert(check.folder(name, "model"), s.trainer_layers, s.trainer_hidden, review_words())
        return {}

    def estimate(_: float | None) -> dict[str, Any]:
        return trainer_cap(check)

    return [
        Task(name, "build", build, local=True),
        Task(name, "estimate", estimate, (f"{name}/build",), local=True),
        Task(name, "plain", run("plain"), (f"{name}/build",)),
        Task(name, "capped", run("capped"), (f"{name}/estimate",)),
    ]


def trainer_cap(check: Check) -> dict[str, Any]:
    """MEMFIT_MEMORY_CAP for case 4: halfway between memfit's estimates of the example's step
    (fp32, AdamW, 128 tokens, 2 micro-batches a step) at 1 row and at its 8 rows. On CUDA the
    allocator's reserved bytes (what set_per_process_memory_fraction limits; the CUDA context is
    outside it); on the CPU the estimate's total, which the CPU cap counts."""
    import memfit
    from memfit.devices.catalog import find_gpu
    from memfit.errors import UsageError

    gpu = None
    if check.device == "cuda" and check.gpu_name:
        # the catalog's GPU (its cuBLAS workspace); one it does not know: the default profile
        with contextlib.suppress(UsageError):
            found = find_gpu(check.gpu_name)
            gpu = found.id if found is not None else None
    need: dict[int, int] = {}
    for rows in (1, 8):
        estimate = memfit.estimate(
            str(check.folder("trainer", "model")),
            task="classification",
            num_labels=2,
            batch_size=rows,
            seq_len=128,
            gradient_accumulation_steps=2,
            precision="fp32",
            optimizer="adamw",
            device=check.device,
            **({"gpu": gpu} if gpu else {}),
        )
        key = "reserved_peak_bytes" if check.device == "cuda" else "allocated_peak_bytes"
        need[rows] = int(estimate.details.get(key) or estimate.total_bytes)
    return {
        "method": "memfit.estimate: halfway between 1 row and 8 rows",
        "gpu_profile": gpu,
        "estimate_1_row_bytes": need[1],
        "estimate_8_rows_bytes": need[8],
        "cap_bytes": (need[1] + need[8]) // 2,
    }


def trainer_result(check: Check, board: Board) -> dict[str, Any]:
    runs = {n: board.results.get(f"trainer/{n}") for n in ("plain", "capped")}
    errors = {
        n: board.errors[f"trainer/{n}"]
        for n in ("build", "estimate", "plain", "capped")
        if f"trainer/{n}" in board.errors
    }
    record: dict[str, Any] = {
        "name": "trainer",
        "title": "examples/trainer_after.py (GuardedTrainer) under MEMFIT_MEMORY_CAP",
        "calibration": board.results.get("trainer/estimate"),
        "runs": {n: _public(r) for n, r in runs.items() if r is not None},
        "errors": errors,
    }
    problems = [f"{n}: {e.splitlines()[0]}" for n, e in errors.items()]
    for n, r in runs.items():
        if r is not None and r["rc"] != 0:
            problems.append(run_problem(n, r))
    plain, capped = runs["plain"], runs["capped"]
    if plain and capped and not problems:
        diff = weights_difference(
            check.folder("trainer", "plain", "model"), check.folder("trainer", "capped", "model")
        )
        record.update(
            cap_bytes=int(capped["memory_cap"]),
            ooms=capped["ooms"],
            backoffs=capped["backoffs"],
            steps={"plain": plain["steps"], "capped": capped["steps"]},
            seconds={"plain": plain["seconds"], "capped": capped["seconds"]},
            ran_beside={n: beside(check.board, f"trainer/{n}") for n in runs},
            max_abs_weight_difference=diff["max_abs"],
            weight_difference=diff,
            tolerance=FP32_TOLERANCE,
        )
        if capped["ooms"] < 1 or capped["backoffs"] < 1:
            problems.append("the cap did not bite: no OOM and back-off in memfit_events.jsonl")
        if plain["steps"] is None or capped["steps"] != plain["steps"]:
            problems.append(f"optimizer steps {capped['steps']} vs {plain['steps']}")
        if diff["max_abs"] > FP32_TOLERANCE:
            problems.append(f"max |Δweight| {diff['max_abs']:.2e} > {FP32_TOLERANCE:.0e}")
    record["status"] = "ok" if not problems else "failed"
    record["problems"] = problems
    return record


def beside(board: Board, key: str) -> list[str]:
    """The other runs whose time overlapped the run ``key``'s."""
    mine = board.results.get(key, {}).get("span")
    if mine is None:
        return []
    return [
        other
        for other, result in board.results.items()
        if other != key
        and isinstance(result, dict)
        and "span" in result
        and result["span"][0] < mine[1]
        and mine[0] < result["span"][1]
    ]


def run_problem(name: str, run: dict[str, Any]) -> str:
    if run["timed_out"]:
        return f"{name}: stopped at the time budget after {run['seconds']} s"
    lines = run["output_tail"].strip().splitlines()
    return f"{name}: exit {run['rc']}" + (f": {lines[-1]}" if lines else "")


def _public(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for the JSON (the full output stays in the log)."""
    return {k: v for k, v in run.items() if k != "stdout"}


def all_skipped(board: Board, case: str) -> bool:
    keys = [k for k in board.errors if k.startswith(f"{case}/")]
    return bool(keys) and all(board.errors[k] == "skipped: time budget" for k in keys)


# --- the report ------------------------------------------------------------------------------
def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def case_line(record: dict[str, Any]) -> str:
    name, status = record["name"], record["status"]
    if status in ("skipped", "pending"):
        return f"{name}: {status}" + (f" ({record.get('reason')})" if record.get("reason") else "")
    head = f"{name} {status.upper() if status != 'ok' else 'ok'}"
    if "max_abs_weight_difference" not in record:
        return f"{head}: " + "; ".join(record["problems"])
    if name == "trainer":
        text = (
            f"{head}: MEMFIT_MEMORY_CAP {gib(record['cap_bytes'])} (estimate: 1 row "
            f"{gib(record['calibration']['estimate_1_row_bytes'])}, 8 rows "
            f"{gib(record['calibration']['estimate_8_rows_bytes'])}): {record['ooms']} OOM, "
            f"{record['backoffs']} back-off; steps {record['steps']['capped']} vs "
            f"{record['steps']['plain']}; max |Δw| {record['max_abs_weight_difference']:.2e} "
            f"(≤ {record['tolerance']:.0e}); {record['seconds']['capped']} s vs "
            f"{record['seconds']['plain']} s"
        )
    else:
        steps = record["median_step_seconds"]
        text = (
            f"{head}: {record['precision']}, cap {gib(record['cap_bytes'])} between micro-batch 1 "
            f"({gib(record['peak_micro1_bytes'])}) and {record['effective_batch_size']} "
            f"({gib(record['peak_full_bytes'])}): {record['ooms']} OOM, {record['backoffs']} "
            f"back-off → micro-batches {record['capped_micro_batch_sizes']}; samples "
            f"{record['samples_seen']['capped']} vs {record['samples_seen']['plain']}, steps "
            f"{record['steps']['capped']} vs {record['steps']['plain']}; max |Δw| "
            f"{record['max_abs_weight_difference']:.2e} (≤ {record['tolerance']:.1e}; split-1 "
            f"{record['split1_weight_difference']:.2e}); step {steps.get('capped')} s capped vs "
            f"{steps.get('plain')} s plain"
            + (" (beside other runs)" if any(record["ran_beside"].values()) else " (alone)")
        )
    if record["problems"]:
        text += " — " + "; ".join(record["problems"])
    return text


def header(args: argparse.Namespace, command: str, gpu: dict[str, Any] | None) -> dict[str, Any]:
    import torch

    versions: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "script": "bench/gpu_train_check.py",
        "part": "issue 35 part 1: the guard under a real CUDA cap",
        "device": args.device,
        "smoke": args.smoke,
        "gpu": gpu,
        "driver": gpu.get("driver") if gpu else None,
        "cuda": torch.version.cuda,
        "versions": versions,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "start": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "jobs": args.jobs,
        "time_budget_s": args.time_budget,
        # what every run's command runs under, besides the environment it was started in
        "run_environment": {
            k: v
            for k, v in child_env(args.device, args.jobs).items()
            if k in CHILD_VARIABLES and os.environ.get(k) != v
        },
    }


def gpu_info() -> dict[str, Any] | None:
    """The GPU as nvidia-smi sees it (this process leaves CUDA alone: the runs own the GPU)."""
    from _gpu_report import nvidia_smi

    line = nvidia_smi()["nvidia_smi"]
    if not line:
        return None
    name, driver, memory = (x.strip() for x in line.split(","))
    return {"name": name, "driver": driver, "memory": memory}


def write(path: Path | None, doc: dict[str, Any]) -> None:
    from _gpu_report import write_json

    write_json(path, doc, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models: under a minute")
    parser.add_argument("--json", default=None, help="the JSON result, rewritten after each case")
    parser.add_argument("--out", default=None, help="a folder for a timestamped JSON result too")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for all cases")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs side by side (default 4 on CUDA, 2 on the CPU; 1: every run has the device "
        "to itself, for step times alone)",
    )
    parser.add_argument("--cases", default=",".join(CASE_NAMES), help="comma-separated subset")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    # case 1's sizes (the first version's flags)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--words", type=int, default=None)
    args = parser.parse_args()
    started = time.monotonic()
    if args.smoke:
        args.device = "cpu"
    # runs at once: most of a run is its start (imports, loading the model), and every figure
    # but the step times is the process's own (its allocator's peaks, its cap); four on the GPU
    # host's 16 cores (the 11 runs' starts, about 20 s each, overlap), two on a small CPU
    args.jobs = args.jobs or (4 if args.device == "cuda" else 2)
    command = shlex.join(["python", "bench/gpu_train_check.py", *sys.argv[1:]])
    print(f"reproduce: {command}", flush=True)
    base = SMOKE_SIZES if args.smoke else GPU_SIZES
    overrides = {
        "bert_layers": args.layers,
        "bert_hidden": args.hidden,
        "bert_rows": args.rows,
        "bert_batch": args.batch,
        "bert_words": args.words,
    }
    sizes = Sizes(**{**vars(base), **{k: v for k, v in overrides.items() if v is not None}})
    json_path = Path(args.json) if args.json else None
    out_path = None
    if args.out:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out_path = Path(args.out) / f"{stamp}_train-check_{args.device}.json"
    gpu = gpu_info() if args.device == "cuda" else None
    doc: dict[str, Any] = {
        "header": header(args, command, gpu),
        "sizes": vars(sizes),
        "cases": [],
        "summary": {},
    }
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CASE_NAMES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; from {', '.join(CASE_NAMES)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        doc["summary"] = {"error": "no CUDA device: run on a GPU machine, or --smoke"}
        for target in (json_path, out_path):
            write(target, doc)
        print("no CUDA device: run on a GPU machine, or --smoke", file=sys.stderr, flush=True)
        return 2
    work = Path(tempfile.mkdtemp(prefix="memfit-train-check-"))
    check = Check(args.device, sizes, work, args.jobs, gpu["name"] if gpu else None)
    s = sizes
    cases = [
        TrainCase(
            "bert-fp32",
            f"BERT-base-shaped classifier ({s.bert_layers} × {s.bert_hidden}), fp32, SGD",
            "bert",
            "fp32",
            (
                "--task",
                "classification",
                "--lr",
                "0.1",
                "--max-seq-len",
                "512",
            ),
            s.bert_batch,
        ),
        *(
            TrainCase(
                f"llama-{precision}",
                f"Llama-shaped causal LM ({s.llama_layers} × {s.llama_hidden}, vocabulary "
                f"{s.llama_words + 4}), LoRA rank 8, {precision}, SGD",
                "llama",
                precision,
                (
                    "--task",
                    "causal-lm",
                    "--lora-dropout",
                    "0",
                    "--lora-rank",
                    "8",
                    "--lr",
                    "0.1",
                    "--max-seq-len",
                    str(s.llama_seq),
                ),
                s.llama_batch,
            )
            for precision in ("bf16", "fp16")
        ),
    ]
    by_name = {c.name: c for c in cases}

    def build_bert_case(_: float | None) -> dict[str, Any]:
        build_bert(
            check.folder("bert", "model"),
            s.bert_layers,
            s.bert_hidden,
            [f"w{i}" for i in range(500)],
        )
        check.folder("bert", "data").mkdir()
        bert_data(check.folder("bert", "data", "train.csv"), s.bert_rows, s.bert_words)
        return {}

    def build_llama_case(_: float | None) -> dict[str, Any]:
        build_llama(check.folder("llama", "model"), s)
        check.folder("llama", "data").mkdir()
        llama_data(check.folder("llama", "data", "train.jsonl"), s)
        return {}

    tasks: list[Task] = []
    notes: dict[str, str] = {}
    if args.device == "cpu" and "llama-bf16" in wanted and "llama-fp16" in wanted:
        # memfit trains in fp32 on the CPU: case 3 would be case 2's runs again
        wanted.remove("llama-fp16")
        notes["llama-fp16"] = "the CPU trains in fp32 only: case 2's runs again"
    # the list is the priority order (the scheduler starts the first ready task): case 4 first,
    # its model the quickest to build and its two runs the shortest; its calibration (an estimate
    # in this process) after the other models are built, its capped run last of all (it needs
    # only the calibration, and ends within the others)
    trainer = trainer_tasks(check) if "trainer" in wanted else []
    tasks.extend(t for t in trainer if t.name in ("build", "plain"))
    if "bert-fp32" in wanted:
        tasks.append(Task("bert", "build", build_bert_case, local=True))
        tasks.extend(train_tasks(check, by_name["bert-fp32"]))
    if "llama-bf16" in wanted or "llama-fp16" in wanted:
        tasks.append(Task("llama", "build", build_llama_case, local=True))
    for name in ("llama-bf16", "llama-fp16"):
        if name in wanted:
            tasks.extend(train_tasks(check, by_name[name]))
    tasks.extend(t for t in trainer if t.name not in ("build", "plain"))
    records: dict[str, dict[str, Any]] = {
        name: {"name": name, "status": "pending"} for name in CASE_NAMES if name in wanted
    }
    for name, reason in notes.items():
        records[name] = {"name": name, "status": "skipped", "reason": reason}

    def refresh() -> None:
        doc["cases"] = [records[n] for n in CASE_NAMES if n in records]
        done = [r for r in doc["cases"] if r["status"] in ("ok", "failed")]
        doc["summary"] = {
            "ok": [r["name"] for r in done if r["status"] == "ok"],
            "failed": [r["name"] for r in done if r["status"] == "failed"],
            "skipped": [r["name"] for r in doc["cases"] if r["status"] == "skipped"],
            "pending": [r["name"] for r in doc["cases"] if r["status"] == "pending"],
            "seconds": round(time.monotonic() - started, 1),
            "work_folder": str(work),
        }
        for target in (json_path, out_path):
            write(target, doc)

    def case_done(case: str, board: Board) -> None:
        if case in ("bert", "llama"):  # building a shared model: its cases say if it failed
            return
        try:
            if all_skipped(board, case):
                record = {"name": case, "status": "skipped", "reason": "time budget"}
            elif case == "trainer":
                record = trainer_result(check, board)
            else:
                record = train_result(check, by_name[case], board)
        except Exception as exc:
            record = {
                "name": case,
                "status": "failed",
                "problems": [f"{type(exc).__name__}: {exc}"],
                "traceback": "".join(traceback.format_exception(exc)[-6:]),
            }
        records[case] = record
        refresh()
        print(case_line(record), flush=True)

    refresh()
    deadline = None if args.time_budget is None else started + args.time_budget
    try:
        schedule(check.board, tasks, args.jobs, deadline, case_done)
    finally:
        refresh()
    summary = doc["summary"]
    print(
        f"summary: {len(summary['ok'])} ok, {len(summary['failed'])} failed"
        + (f" ({', '.join(summary['failed'])})" if summary["failed"] else "")
        + f", {len(summary['skipped'])} skipped; {summary['seconds']} s on {args.device}"
        + (f" ({gpu['name']})" if gpu else "")
        + (f"; JSON {json_path}" if json_path else ""),
        flush=True,
    )
    print(f"reproduce: {command}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    elif args.keep:
        print(f"work folder: {work}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
