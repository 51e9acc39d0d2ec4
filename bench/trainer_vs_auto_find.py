"""GuardedTrainer against the stock Trainer's ``auto_find_batch_size`` under the same memory cap.

One ordinary Trainer job (a BERT classifier, dropout off, SGD, micro-batch 8 × accumulation 2,
one epoch) runs three ways under memfit's CPU memory cap (a real ``torch.OutOfMemoryError`` past
the cap, with a message accelerate's ``find_executable_batch_size`` recognises):

* ``auto_find``: the stock ``Trainer`` with ``auto_find_batch_size=True``. On OOM, accelerate
  restarts the whole training loop with the micro-batch × 0.9 (rounded down); gradient
  accumulation is left as it is, so the effective batch shrinks; the weights the aborted attempt
  already updated are kept, the data starts again from the first batch.
* ``guarded``: ``memfit.integrations.GuardedTrainer``: the failed step is re-run at half the
  micro-batch with the same gradient.
* ``reference``: the stock ``Trainer`` under a cap too large to be reached (no OOM; the same
  cost of counting live tensors in Python as the capped runs, so wall times compare).

Two scenarios: ``first_step`` (every batch at 8 exceeds the cap) and ``mid_run`` (one long row:
only its batch does, in step 2). For each run: samples forwarded (rows entering the model's
forward: failed and re-run ones included), optimizer steps (all of them, across restarts),
samples per optimizer step at the end (micro-batch × accumulation the Trainer ends with), max
|Δw| against the reference, wall time (the fastest of ``--repeat`` runs: the machine may be
shared; the cap's Python bookkeeping slows every run alike). The cap sits halfway between the live tensor bytes of
the job at micro-batch 8 and at 4 (``first_step``), or of the job without and with the long row
(``mid_run``), measured first by running with a cap too large to be reached.

Usage::

    python bench/trainer_vs_auto_find.py
    python bench/trainer_vs_auto_find.py --out bench/results/trainer_vs_auto_find.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/_tiny.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WORDS = [f"w{i}" for i in range(60)]
UNREACHABLE = 64 << 30
PER_DEVICE, ACCUMULATION = 8, 2


def build_model(folder: Path, hidden: int, layers: int) -> str:
    """A BERT with dropout off and its own word vocabulary, saved like a Hub folder."""
    from transformers import BertConfig, BertForSequenceClassification

    from _tiny import save_bert_tokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    folder.mkdir(parents=True, exist_ok=True)
    save_bert_tokenizer(folder, WORDS)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        intermediate_size=4 * hidden,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def texts(rows: int, long_row: int | None) -> list[str]:
    rng = random.Random(1)
    out = []
    for i in range(rows):
        length = 200 if i == long_row else rng.randint(16, 32)
        out.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return out


def run(
    kind: str,
    model_dir: str,
    out: Path,
    *,
    rows: int,
    long_row: int | None,
    cap: int | None,
    per_device: int = PER_DEVICE,
    accumulation: int = ACCUMULATION,
) -> dict[str, Any]:
    """One training run of the job; ``kind``: reference, auto_find or guarded."""
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from memfit.guard import memory_cap
    from memfit.integrations import GuardedTrainer

    class Count(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0
            self.attempts: list[int] = []  # the micro-batch of each (re)start of the loop

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.attempts.append(int(state.train_batch_size or 0))

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.steps += 1

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    sentences = texts(rows, long_row)
    data = Dataset.from_dict(
        {"text": sentences, "label": [int("w7" in s.split()) for s in sentences]}
    ).map(lambda b: tokenizer(b["text"], truncation=True, max_length=256), batched=True)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        auto_find_batch_size=kind == "auto_find",
        num_train_epochs=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    steps = Count()
    forwarded: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, k: forwarded.append(int(k["input_ids"].shape[0])), with_kwargs=True
    )
    common = dict(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[steps],
    )
    started = time.perf_counter()
    peak = None
    if kind == "guarded":
        trainer: Any = GuardedTrainer(**common, memory_cap=cap)
        trainer.train()
        peak = trainer.guard_cap.peak_bytes if trainer.guard_cap is not None else None
        micro = trainer.guard_micro_batch_size or trainer.args.per_device_train_batch_size
        samples_per_step = trainer.args.per_device_train_batch_size * accumulation
        events = [
            {k: v for k, v in e.items() if k not in ("time", "error")} for e in trainer.guard_events
        ]
    else:
        trainer = Trainer(**common)
        if cap is None:
            trainer.train()
        else:
            with memory_cap(cap, torch.device("cpu")) as live:
                assert live is not None
                live.track(model)
                trainer.train()
                peak = live.peak_bytes
        # what auto_find_batch_size ended with (the micro-batch it shrank to)
        micro = trainer._train_batch_size
        samples_per_step = micro * trainer.args.gradient_accumulation_steps
        events = []
    seconds = time.perf_counter() - started
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "samples_forwarded": sum(forwarded),
        "forward_calls": len(forwarded),
        "optimizer_steps": steps.steps,
        "training_loop_starts": steps.attempts,
        "final_global_step": trainer.state.global_step,
        "final_micro_batch_size": micro,
        "final_samples_per_step": samples_per_step,
        "peak_live_bytes": peak,
        "wall_seconds": round(seconds, 3),
        "events": events,
        "_weights": weights,
    }


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def scenario(name: str, model_dir: str, scratch: Path, rows: int, repeat: int) -> dict[str, Any]:
    long_row = 21 if name == "mid_run" else None
    folder = scratch / name

    def go(kind: str, tag: str, **kw: Any) -> dict[str, Any]:
        return run(kind, model_dir, folder / tag, rows=rows, **kw)

    if name == "first_step":
        whole = go("guarded", "measure-8", long_row=None, cap=UNREACHABLE)
        half = go(
            "guarded",
            "measure-4",
            long_row=None,
            cap=UNREACHABLE,
            per_device=PER_DEVICE // 2,
            accumulation=ACCUMULATION * 2,
        )
        low, high = half["peak_live_bytes"], whole["peak_live_bytes"]
    else:
        short = go("guarded", "measure-short", long_row=None, cap=UNREACHABLE)
        long = go("guarded", "measure-long", long_row=long_row, cap=UNREACHABLE)
        low, high = short["peak_live_bytes"], long["peak_live_bytes"]
    cap = (low + high) // 2

    def timed(kind: str, cap: int) -> dict[str, Any]:
        """The run ``repeat`` times (deterministic: the same figures each time); the fastest
        wall time, as the machine may be shared."""
        runs = [go(kind, f"{kind}-{i}", long_row=long_row, cap=cap) for i in range(repeat)]
        return {**runs[0], "wall_seconds": min(r["wall_seconds"] for r in runs)}

    # an unreachable cap: no OOM, but the same cost of counting live tensors as the others
    reference = timed("reference", UNREACHABLE)
    results = {"reference": reference}
    for kind in ("auto_find", "guarded"):
        results[kind] = timed(kind, cap)
    for kind in ("auto_find", "guarded", "reference"):
        results[kind]["max_abs_weight_difference"] = max_difference(
            reference["_weights"], results[kind]["_weights"]
        )
    for result in results.values():
        result.pop("_weights")
    return {
        "cap_bytes": cap,
        "measured_low_bytes": low,
        "measured_high_bytes": high,
        "long_row": long_row,
        **results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="training rows (one epoch)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; fastest wall time")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    options = parser.parse_args()
    command = "python bench/trainer_vs_auto_find.py " + shlex.join(sys.argv[1:])
    import accelerate
    import transformers

    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as scratch_name:
        scratch = Path(scratch_name)
        model_dir = build_model(scratch / "model", options.hidden, options.layers)
        scenarios = {
            name: scenario(name, model_dir, scratch, options.rows, options.repeat)
            for name in ("first_step", "mid_run")
        }
    columns = (
        ("samples_forwarded", "samples fwd"),
        ("optimizer_steps", "opt steps"),
        ("final_micro_batch_size", "micro-batch"),
        ("final_samples_per_step", "samples/step"),
        ("max_abs_weight_difference", "max |Δw|"),
        ("wall_seconds", "wall s"),
    )
    for name, result in scenarios.items():
        print(f"\n{name}: cap {result['cap_bytes']:,} bytes of live tensors")
        print(f"{'run':<11}" + "".join(f"{title:>14}" for _, title in columns))
        for kind in ("reference", "auto_find", "guarded"):
            cells = []
            for key, _ in columns:
                value = result[kind][key]
                cells.append(f"{value:>14.3g}" if isinstance(value, float) else f"{value:>14}")
            print(f"{kind:<11}" + "".join(cells))
    print(f"\nreproduce: {command}")
    if options.out:
        record = {
            "benchmark": "trainer_vs_auto_find",
            "command": command,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "job": {
                "model": f"BERT {options.layers} layers x {options.hidden} hidden, dropout off",
                "rows": options.rows,
                "per_device_train_batch_size": PER_DEVICE,
                "gradient_accumulation_steps": ACCUMULATION,
                "optimizer": "sgd, lr 0.5, constant",
                "epochs": 1,
                "repeat": options.repeat,
            },
            "scenarios": scenarios,
            "machine": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
            },
        }
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
