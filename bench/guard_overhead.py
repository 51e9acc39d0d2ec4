"""The guard's cost when no OOM happens, against a plain PyTorch training loop on the same model.

Every loop runs the same steps on the same batches: forward, loss, backward, optimizer step,
``zero_grad``. The loops, per precision (fp32; bf16 autocast on CUDA):

- ``plain``        forward, backward, ``optimizer.step()``: what a user writes by hand;
- ``guard``        the forward and backward through ``memfit.guard.Guard.step`` with a recipe (the
                   micro-batch is the whole step, as when the plan fits): the split, the OOM catch,
                   the loss read back to the host (``float(loss)``, a device sync);
- ``guard+peaks``  the guard as ``memfit train`` wires it: its ``on_phase`` hook is the loop's
                   :class:`memfit.train.memory.PeakMemory` (on CUDA ``reset_peak_memory_stats``,
                   ``max_memory_allocated`` and ``max_memory_reserved`` at every phase), reset
                   before the step and read after it. The headline figure: the guard's real cost;
- ``train-step``   ``guard+peaks`` plus what ``memfit train``'s update adds around the optimizer
                   step without ``--max-grad-norm``: the whole gradient's norm read back for the
                   finite check (``clip_grad_norm_(params, inf)``).

Steps alternate between the loops (interleaved, the order rotating, so drift in the machine's
speed hits all alike); on CUDA each timed step is bracketed by ``torch.cuda.synchronize()``. The
figure is the ratio of the medians (also the p90s and the means). Target: ≤ 1 % of step time.

Usage::

    python bench/guard_overhead.py                         # CUDA: BERT-base 12 × 768, batch 32 × 128
    python bench/guard_overhead.py --device cpu            # BERT 4 layers × 256, batch 16 × 128
    python bench/guard_overhead.py --json bench/results/guard_overhead_h100.json
    python bench/guard_overhead.py --smoke                 # tiny, CPU, a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import platform
import shlex
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _gpu_report import Report, nvidia_smi  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

LOOPS = ("plain", "guard", "guard+peaks", "train-step")
# the sizes of each device, and of --smoke (tiny, CPU)
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {
        "layers": 12,
        "hidden": 768,
        "vocab": 30522,
        "batch": 32,
        "seq_len": 128,
        "steps": 60,
        "warmup": 5,
        "precisions": "fp32,bf16",
    },
    "cpu": {
        "layers": 4,
        "hidden": 256,
        "vocab": 8000,
        "batch": 16,
        "seq_len": 128,
        "steps": 40,
        "warmup": 3,
        "precisions": "fp32",
    },
    "smoke": {
        "layers": 2,
        "hidden": 64,
        "vocab": 1000,
        "batch": 4,
        "seq_len": 16,
        "steps": 6,
        "warmup": 1,
        "precisions": "fp32,bf16",
    },
}


class _Recipe:
    """A minimal splittable recipe over pre-tokenized rows (per-sample cross-entropy) that
    knows its rows' lengths, as memfit train's recipes do."""

    splittable = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def units(self, rows: list[dict[str, Any]]) -> int:
        return len(rows)

    def lengths(self, rows: list[dict[str, Any]]) -> list[int]:
        # memfit train's recipes know their rows' token lengths: the guard then splits the step
        # by length and token budget (memfit.data.batching.split_into_chunks) and counts the
        # padded tokens, work this loop must include to measure the real path
        return [int(r["input_ids"].shape[0]) for r in rows]

    def loss(
        self, rows: list[dict[str, Any]], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["label"] for r in rows])
        logits = self.model(input_ids=ids).logits
        # fp32 sums under autocast, as memfit's recipes do
        return (
            torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / total_units
        )

    def eval_partial(self, rows: list[dict[str, Any]]) -> Any:  # pragma: no cover - unused
        raise NotImplementedError

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError


# --- the JSON's header ---------------------------------------------------------------------------
def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("transformers", "peft", "accelerate", "bitsandbytes", "liger_kernel", "trl"):
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module is not None else None
    return out


def header(command: str, device: torch.device) -> dict[str, Any]:
    import transformers  # noqa: F401  (its version below)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "gpu": gpu,
        **nvidia_smi(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        **_versions(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


# --- the measurement -----------------------------------------------------------------------------
def _stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 4),
        "p90_ms": round(p90 * 1000, 4),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 4),
        "min_ms": round(ordered[0] * 1000, 4),
        "steps": len(ordered),
    }


def run_case(
    precision: str, sizes: dict[str, Any], device: torch.device, deadline: float
) -> dict[str, Any]:
    """The four loops, interleaved, at one precision; stops early (keeping what it has) when
    the deadline passes after at least a few timed steps."""
    from transformers import BertConfig, BertForSequenceClassification

    from memfit.guard import Guard
    from memfit.runtime import autocast
    from memfit.train.memory import PeakMemory

    torch.manual_seed(0)
    hidden = sizes["hidden"]
    config = BertConfig(
        vocab_size=sizes["vocab"],
        hidden_size=hidden,
        num_hidden_layers=sizes["layers"],
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        # dropout off: the loops differ only by what wraps the step
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    recipe = _Recipe(model)
    params = [p for p in model.parameters() if p.requires_grad]
    amp = autocast(device, precision)  # memfit train's own factory (fp32: no autocast)
    cuda = device.type == "cuda"
    batch, seq_len = sizes["batch"], sizes["seq_len"]

    # a few batches made before timing, on the device, cycled through
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
        labels = torch.randint(0, 2, (batch,), generator=gen).to(device)
        batches.append([{"input_ids": ids[i], "label": labels[i]} for i in range(batch)])

    guard = Guard(batch, device=device)
    # the guard as memfit train wires it (TrainingRun.setup: guard.on_phase = peak.phase)
    wired = Guard(batch, device=device)
    peak = PeakMemory(device, None)
    wired.on_phase = peak.phase
    seen_peaks: list[int | None] = []

    def plain(rows: list[dict[str, Any]]) -> None:
        with amp():
            loss = recipe.loss(rows, len(rows))
        loss.backward()
        optimizer.step()
        # the step's gradients are spent: free them before the next forward
        optimizer.zero_grad(set_to_none=True)

    def guarded(rows: list[dict[str, Any]]) -> None:
        guard.step(rows, recipe, params=params, autocast=amp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def guarded_peaks(rows: list[dict[str, Any]]) -> None:
        peak.reset()
        wired.step(rows, recipe, params=params, autocast=amp)
        peak.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen_peaks.append(peak.read())
        peak.record()

    def train_step(rows: list[dict[str, Any]]) -> None:
        peak.reset()
        loss = wired.step(rows, recipe, params=params, autocast=amp)
        peak.phase("optimizer")
        # memfit train's finite check without --max-grad-norm (TrainingRun.update)
        norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise RuntimeError(f"loss {loss} or gradient norm {norm} not finite")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen_peaks.append(peak.read())
        peak.record()

    loops: dict[str, Callable[[list[dict[str, Any]]], None]] = {
        "plain": plain,
        "guard": guarded,
        "guard+peaks": guarded_peaks,
        "train-step": train_step,
    }
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in LOOPS}
    started = time.perf_counter()
    stopped_early = False
    for i in range(sizes["warmup"] + sizes["steps"]):
        if i >= sizes["warmup"] + 3 and time.perf_counter() > deadline:
            stopped_early = True
            break
        # rotate the order: each loop runs first, second, … equally often
        order = list(LOOPS[i % len(LOOPS) :] + LOOPS[: i % len(LOOPS)])
        rows = batches[i % len(batches)]
        for name in order:
            sync()
            t0 = time.perf_counter()
            loops[name](rows)
            sync()
            elapsed = time.perf_counter() - t0
            if i >= sizes["warmup"]:
                times[name].append(elapsed)
    stats = {name: _stats(times[name]) for name in LOOPS}
    base = stats["plain"]
    overhead = {
        name: {
            key: round((stats[name][f"{key}_ms"] / base[f"{key}_ms"] - 1) * 100, 3)
            for key in ("median", "p90", "mean")
        }
        for name in LOOPS[1:]
    }
    row: dict[str, Any] = {
        "case": f"bert-{sizes['layers']}x{hidden}-{precision}",
        "status": "ok",
        "precision": precision,
        "device": str(device),
        "model": f"BERT {sizes['layers']} layers × {hidden} hidden, vocab {config.vocab_size}",
        "parameters": n_params,
        "batch": batch,
        "seq_len": seq_len,
        "optimizer": "AdamW (torch default: foreach)",
        "warmup_steps": sizes["warmup"],
        "timed_steps": len(times["plain"]),
        "stopped_early_by_time_budget": stopped_early,
        "seconds": round(time.perf_counter() - started, 2),
        "loops": stats,
        "overhead_percent_vs_plain": overhead,
        "target_percent": 1.0,
        "guard_micro_batch_after": guard.micro_batch_size,
    }
    if cuda:
        row["step_peak_bytes"] = max((p for p in seen_peaks if p is not None), default=None)
        row["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return row


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per loop")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument(
        "--precisions", default=None, help="comma-separated: fp32,bf16,fp16 (autocast)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for all cases")
    args = parser.parse_args()
    command = "python " + shlex.join(["bench/guard_overhead.py", *sys.argv[1:]])
    print(f"reproduce: {command}", flush=True)
    t_start = time.perf_counter()

    if args.smoke:
        device = torch.device("cpu")
        sizes = dict(SIZES["smoke"])
        # tiny models gain nothing from threads, and on a shared machine idle threads that spin
        # while others wait for a core cost more than the work
        torch.set_num_threads(1)
    else:
        name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            print("--device cuda: this machine has no CUDA GPU; use --device cpu", flush=True)
            return 2
        device = torch.device(name)
        sizes = dict(SIZES[name])
    for key in ("steps", "warmup", "batch", "seq_len", "layers", "hidden", "precisions"):
        value = getattr(args, key)
        if value is not None:
            sizes[key] = value
    precisions = [p.strip() for p in sizes["precisions"].split(",") if p.strip()]

    report = Report(args.json, header(command, device))
    budget_end = t_start + args.time_budget if args.time_budget else math.inf
    for index, precision in enumerate(precisions):
        name = f"bert-{sizes['layers']}x{sizes['hidden']}-{precision}"
        now = time.perf_counter()
        if now >= budget_end:
            row: dict[str, Any] = {"case": name, "status": "skipped: time budget"}
            report.case(row)
            print(f"{name}: skipped (time budget)", flush=True)
            continue
        # each case may use its share of what is left of the budget (fp32 steps take about
        # three times as long as 16-bit autocast ones on a GPU)
        weights = [3.0 if p == "fp32" else 1.0 for p in precisions[index:]]
        deadline = now + (budget_end - now) * weights[0] / sum(weights)
        try:
            row = run_case(precision, sizes, device, deadline)
        except Exception as exc:  # one case failing is a finding; the others still run
            row = {
                "case": name,
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-2000:],
            }
            print(f"{name}: ERROR {row['error']}", flush=True)
            report.case(row)
            _release(device)
            continue
        # the case's model and optimizer are gone with its frame: hand their memory back
        _release(device)
        report.case(row)
        loops, over = row["loops"], row["overhead_percent_vs_plain"]
        print(
            f"{name}: {row['parameters'] / 1e6:.1f} M params, batch {row['batch']} × "
            f"{row['seq_len']}, {row['timed_steps']} steps each on {device}; plain median "
            f"{loops['plain']['median_ms']:.2f} ms (p90 {loops['plain']['p90_ms']:.2f}, mean "
            f"{loops['plain']['mean_ms']:.2f}); overhead of medians: guard "
            f"{over['guard']['median']:+.2f} %, guard+peaks {over['guard+peaks']['median']:+.2f} %"
            f", train-step {over['train-step']['median']:+.2f} % (target ≤ 1 %)",
            flush=True,
        )

    done = [c for c in report.data["cases"] if c.get("status") == "ok"]
    worst = max(
        (c["overhead_percent_vs_plain"]["guard+peaks"]["median"] for c in done), default=None
    )
    report.data["summary"] = {
        "cases_ok": len(done),
        "cases": len(report.data["cases"]),
        "guard_overhead_median_percent": {
            c["case"]: c["overhead_percent_vs_plain"]["guard"]["median"] for c in done
        },
        "guard_with_peaks_overhead_median_percent": {
            c["case"]: c["overhead_percent_vs_plain"]["guard+peaks"]["median"] for c in done
        },
        "train_step_overhead_median_percent": {
            c["case"]: c["overhead_percent_vs_plain"]["train-step"]["median"] for c in done
        },
        "worst_guard_with_peaks_median_percent": worst,
        "target_percent": 1.0,
        "meets_target": None if worst is None else worst <= 1.0,
        "seconds": round(time.perf_counter() - t_start, 1),
        "command": command,
    }
    report.write()
    print(
        f"summary: {len(done)}/{len(report.data['cases'])} cases; worst guard (as memfit train "
        f"wires it) overhead of medians {worst if worst is None else f'{worst:+.2f} %'} "
        f"(target ≤ 1 %); {report.data['summary']['seconds']} s",
        flush=True,
    )
    print(f"reproduce: {command}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
