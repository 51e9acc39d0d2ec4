"""Check the guard on a real GPU: a capped run must end with the same weights as an uncapped one.

For a BERT-base-shaped classifier (random weights, dropout off, SGD, fp32) on generated data:

1. probe runs with a cap that never bites measure ``max_memory_allocated`` per step at the full
   micro-batch and at micro-batch 1;
2. a run without a cap, and a run whose ``--memory-cap`` (``set_per_process_memory_fraction``)
   lies between the two, so that the full micro-batch runs out of memory for real;
3. the figures: OOM events, back-offs, samples seen, the largest weight difference, step times.

The JSON goes to ``--out`` (with the GPU, driver, torch and transformers versions). ``--device cpu``
runs the same check on the CPU cap (a self-test where no GPU is lent).

Usage::

    python bench/gpu_train_check.py --out bench/results            # on a GPU machine
    python bench/gpu_train_check.py --device cpu --layers 2 --hidden 64 --rows 48
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py


def _model(folder: Path, layers: int, hidden: int) -> str:
    import torch
    from transformers import BertConfig, BertModel

    from _tiny import save_bert_tokenizer

    words = [f"w{i}" for i in range(500)]
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


def _data(path: Path, rows: int, words: int) -> Path:
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(rows):
        text = " ".join(f"w{rng.randrange(500)}" for _ in range(words))
        lines.append(f"{text},{int('w7 ' in text)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(
    model: str, data: Path, out: Path, device: str, batch: int, **knobs: Any
) -> dict[str, Any]:
    from memfit.train import TrainConfig, train

    started = time.perf_counter()
    result = train(
        TrainConfig(
            task="classification",
            model=model,
            train_file=str(data),
            output_dir=str(out),
            effective_batch_size=batch,
            optimizer="sgd",
            lr=0.1,
            seed=1,
            device=device,
            max_seq_len=512,
            quiet=True,
            **knobs,
        )
    )
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    return {
        "samples_seen": result.samples_seen,
        "steps": result.steps,
        "peaks": [m["peak_bytes"] for m in metrics],
        "micro_batch_sizes": [m["micro_batch_size"] for m in metrics],
        "events": [e for e in events if e["type"] in ("oom", "backoff", "grow")],
        "seconds": round(time.perf_counter() - started, 2),
        "out": out,
    }


def _difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = (
        load_file(str(a / "model" / "model.safetensors")),
        load_file(str(b / "model" / "model.safetensors")),
    )
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--out", default=None, help="folder for the JSON result")
    args = parser.parse_args()
    print(
        "reproduce: python "
        + " ".join(shlex.quote(a) for a in ["bench/gpu_train_check.py", *sys.argv[1:]])
    )
    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --device cpu", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="memfit-train-check-"))
    (work / "model").mkdir()
    model = _model(work / "model", args.layers, args.hidden)
    data = _data(work / "train.csv", args.rows, args.words)
    never = 1 << 50
    full = _run(model, data, work / "probe-full", args.device, args.batch, memory_cap=never)
    one = _run(
        model, data, work / "probe-1", args.device, args.batch, memory_cap=never, micro_batch_size=1
    )
    cap = (max(one["peaks"]) + max(full["peaks"])) // 2
    plain = _run(model, data, work / "plain", args.device, args.batch)
    capped = _run(model, data, work / "capped", args.device, args.batch, memory_cap=cap)
    diff = _difference(plain["out"], capped["out"])
    ok = capped["samples_seen"] == plain["samples_seen"] and diff <= 1e-5
    header: dict[str, Any] = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
    }
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        header["gpu"] = {"name": props.name, "total_memory_bytes": props.total_memory}
        header["driver"] = (
            torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        )
        header["cuda"] = torch.version.cuda
    doc = {
        "header": header,
        "cap_bytes": cap,
        "peak_full_bytes": max(full["peaks"]),
        "peak_micro1_bytes": max(one["peaks"]),
        "plain": {k: v for k, v in plain.items() if k != "out"},
        "capped": {k: v for k, v in capped.items() if k != "out"},
        "max_abs_weight_difference": diff,
        "same_result": ok,
    }
    ooms = sum(e["type"] == "oom" for e in capped["events"])
    print(
        f"{args.device}: cap {cap / 2**20:.0f} MiB between micro-batch 1 ({max(one['peaks']) / 2**20:.0f} MiB) "
        f"and {args.batch} ({max(full['peaks']) / 2**20:.0f} MiB): {ooms} OOM survived, micro-batches "
        f"{sorted(set(capped['micro_batch_sizes']))}, samples {capped['samples_seen']} vs "
        f"{plain['samples_seen']}, max |Δweight| {diff:.2e}, {capped['seconds']} s vs {plain['seconds']} s"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        path = out / f"{stamp}_train-check_{args.device}.json"
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"results: {path}")
    print("same result" if ok else "DIFFERENT RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
