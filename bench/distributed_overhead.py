"""memfit's agreed data parallelism against PyTorch DDP, 2 ranks on the CPU (gloo), no OOM.

Both loops train the same BERT on the same global batches with gradient accumulation:

- **DDP**: ``DistributedDataParallel`` (bucket_cap_mb 25), ``no_sync()`` for all micro-batches but
  the last, whose backward all-reduces the buckets (the usual recipe; a rank that ran out of memory
  mid-step would leave the other waiting in that all-reduce);
- **memfit**: ``memfit.guard.Guard`` with :class:`memfit.train.distributed.Ranks`: a sync point
  after every micro-batch, then every ``.grad`` all-reduced in place.

Each step of each loop is timed (interleaved, so drift in the machine hits both), and each rank's
live tensor bytes are counted (``CpuMemoryCap`` with a cap that never bites). Printed: median step
times and their ratio, the largest per-rank peak of each, and the largest weight difference between
the two after the same steps (SGD: they should agree to float summation order).

Usage::

    python bench/distributed_overhead.py                    # BERT 4 × 256, 16 × 128 per rank, micro 8
    python bench/distributed_overhead.py --steps 20 --layers 2 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _rows(args: argparse.Namespace, step: int, rank: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, 2, (args.batch,), generator=g)
    return [{"input_ids": ids[i], "label": labels[i]} for i in range(args.batch)]


def _worker(rank: int, port: int, args: argparse.Namespace, folder: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from guard_overhead import _Recipe
    from memfit.guard import CpuMemoryCap, Guard
    from memfit.train.distributed import Ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ranks = Ranks(
        rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo"
    )
    plain_model = _model(args)
    ours = _model(args)
    # one live-bytes counter per loop, entered around each of its steps; DDP's reducer allocates
    # its gradient buckets when the model is wrapped, so the wrap happens under the counter too
    caps = {"ddp": CpuMemoryCap(1 << 50), "memfit": CpuMemoryCap(1 << 50)}
    with caps["ddp"]:
        caps["ddp"].track(plain_model)
        ddp = DistributedDataParallel(plain_model, bucket_cap_mb=25)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    params = list(ours.parameters())
    ranks.prepare(params)
    caps["memfit"].track(ours, *ranks.buffers())
    guard = Guard(args.micro, ranks=ranks)
    recipe = _Recipe(ours)
    times: dict[str, list[float]] = {"ddp": [], "memfit": []}
    peaks: dict[str, int] = {"ddp": 0, "memfit": 0}
    total_units = 2 * args.batch

    def ddp_step(rows: list[dict[str, Any]]) -> None:
        chunks = [rows[i : i + args.micro] for i in range(0, len(rows), args.micro)]
        for index, chunk in enumerate(chunks):
            ids = torch.stack([r["input_ids"] for r in chunk])
            labels = torch.stack([r["label"] for r in chunk])
            last = index == len(chunks) - 1
            context = ddp.no_sync() if not last else _nothing()
            with context:
                logits = ddp(input_ids=ids).logits
                # DDP averages over 2 ranks: the sum over this rank's rows / half the step
                loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
                (loss * 2 / total_units).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def memfit_step(rows: list[dict[str, Any]]) -> None:
        guard.step(rows, recipe, params=params, total_units=total_units)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)

    for step in range(args.warmup + args.steps):
        rows = _rows(args, step, rank)
        for name, run in (("ddp", ddp_step), ("memfit", memfit_step)):
            dist.barrier()
            cap = caps[name]
            with cap:
                cap.reset_peak()
                started = time.perf_counter()
                run(rows)
                seconds = time.perf_counter() - started
            if step >= args.warmup:
                times[name].append(seconds)
                peaks[name] = max(peaks[name], cap.peak_bytes)
    difference = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(plain_model.parameters(), ours.parameters(), strict=True)
    )
    result = {"rank": rank, "times": times, "peaks": peaks, "max_weight_difference": difference}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--out", type=str, default=None, help="folder for a JSON result")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _worker, args=(_free_port(), args, folder), nprocs=2, join=True, start_method="spawn"
        )
        results = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    ddp_ms = statistics.median(t for r in results for t in r["times"]["ddp"]) * 1000
    ours_ms = statistics.median(t for r in results for t in r["times"]["memfit"]) * 1000
    ddp_peak = max(r["peaks"]["ddp"] for r in results)
    ours_peak = max(r["peaks"]["memfit"] for r in results)
    difference = max(r["max_weight_difference"] for r in results)
    command = "python bench/distributed_overhead.py " + shlex.join(sys.argv[1:])
    print(f"command: {command.strip()}")
    print(
        f"BERT {args.layers} × {args.hidden}, {args.batch} × {args.seq} per rank, micro-batch "
        f"{args.micro}, 2 gloo ranks, {args.steps} timed steps each (interleaved)"
    )
    print(
        f"step time (median): DDP {ddp_ms:.1f} ms, memfit {ours_ms:.1f} ms, ratio {ours_ms / ddp_ms:.3f}"
    )
    print(
        f"peak live tensor bytes per rank: DDP {ddp_peak / 2**20:.1f} MiB (its buckets included), "
        f"memfit {ours_peak / 2**20:.1f} MiB, ratio {ours_peak / ddp_peak:.3f}"
    )
    print(f"largest weight difference after {args.warmup + args.steps} steps: {difference:.2e}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "command": command.strip(),
            "config": vars(args),
            "ddp_median_step_ms": round(ddp_ms, 2),
            "memfit_median_step_ms": round(ours_ms, 2),
            "step_time_ratio": round(ours_ms / ddp_ms, 4),
            "ddp_peak_bytes": ddp_peak,
            "memfit_peak_bytes": ours_peak,
            "peak_ratio": round(ours_peak / ddp_peak, 4),
            "max_weight_difference": difference,
            "torch": torch.__version__,
        }
        (out / "distributed_overhead_cpu.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
