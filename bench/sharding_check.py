"""Sharded estimates against the ZeRO paper, DeepSpeed's own estimator and a measured FSDP step.

Three checks of ``memfit estimate --world-size W --sharding S`` (see
``memfit.estimate.sharding`` for the accounting):

1. **Model states** (parameters, gradients, optimizer state of one rank) for registry models ×
   W ∈ {1, 2, 4, 8} × schemes, mixed-precision (bf16) AdamW:

   - against the ZeRO paper (Rajbhandari et al., K = 12): ZeRO-1 4P + 12P/W, ZeRO-2 2P + 14P/W,
     ZeRO-3 and FSDP 16P/W, plain data parallelism 16P; memfit's figure by the paper's
     categories (implementation buffers left out);
   - against DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs``,
     ``estimate_zero3_model_states_mem_needs``, no offload) when ``deepspeed`` imports: ZeRO-2
     2P + 18P/W, ZeRO-3 4·largest_layer + 18P/W. memfit's comparable figure adds its fp32
     gradient partition (DeepSpeed's "4_grads_32bit") and, for ZeRO-3, the largest layer's
     16-bit parameters and gradients that its gather buffers hold (DeepSpeed's 4·largest_layer),
     minus the persistent small parameters DeepSpeed's formula does not count;

   plus the full per-GPU estimate (bf16, batch 8 × 512 tokens, or 8 × 1024 for GPT-2, H100).

2. **FSDP, measured** (``--fsdp-truth``): two CPU ranks (torchrun, gloo) run real FSDP2 steps
   (``fully_shard`` on each transformer block, then the root, default resharding) of
   small BERT and GPT-2 models built from configs; a dispatch mode counts the live tensor bytes
   of each rank (DTensor shards unwrapped, FSDP's ``storage.resize_`` frees and re-allocations
   followed), and the peak of the third step is compared with
   ``estimate(..., device="cpu", world_size=2, sharding="fsdp")`` (its raw tensor bytes, the
   total less the page rounding). The same runs without sharding (memfit's data parallelism:
   each ``.grad`` all-reduced in place) give the baseline error of the unsharded estimate.

Usage::

    /tmp/dsvenv/bin/python bench/sharding_check.py --out bench/results/sharding_check.json
    python bench/sharding_check.py --quick                    # bert-base only, no FSDP run
    python bench/sharding_check.py --fsdp-truth --only-fsdp   # the measured FSDP runs only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MiB = 2**20
DEFAULT_OUT = ROOT / "bench" / "results" / "sharding_check.json"
MODELS = {
    # model -> (task, seq_len)
    "bert-base-uncased": ("classification", 512),
    "bert-large-uncased": ("classification", 512),
    "gpt2": ("causal-lm", 1024),
    "gpt2-xl": ("causal-lm", 1024),
}
WORLD_SIZES = (1, 2, 4, 8)
SCHEMES = ("none", "zero1", "zero2", "zero3", "fsdp")

# small models for the measured FSDP runs (architecture numbers only, random weights)
FSDP_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert-mini": (
        "bert",
        "classification",
        dict(
            vocab_size=30522,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=512,
        ),
    ),
    "gpt2-mini": (
        "gpt2",
        "causal-lm",
        dict(vocab_size=50257, n_embd=256, n_layer=4, n_head=4, n_positions=1024),
    ),
}
FSDP_CASES = [
    # (model, precision, batch, seq, world size, gradient checkpointing)
    ("bert-mini", "fp32", 8, 128, 2, False),
    ("gpt2-mini", "fp32", 4, 128, 2, False),
    ("bert-mini", "bf16", 8, 128, 2, False),
    ("gpt2-mini", "bf16", 4, 128, 2, False),
    ("bert-mini", "bf16", 8, 128, 4, False),
    ("gpt2-mini", "fp32", 4, 128, 4, False),
    ("gpt2-mini", "fp32", 4, 256, 2, True),
    ("bert-mini", "bf16", 8, 256, 2, True),
]


# --- 1. model states ------------------------------------------------------------------------------
def deepspeed_functions() -> tuple[Any, Any] | None:
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:  # not installed, or its import fails here: the columns stay empty
        return None
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def model_state_rows(models: list[str], gpu: str) -> list[dict[str, Any]]:
    from memfit.estimate import estimate

    ds = deepspeed_functions()
    rows = []
    for model in models:
        task, seq_len = MODELS[model]
        for scheme in SCHEMES:
            for world in WORLD_SIZES:
                est = estimate(
                    model,
                    task=task,
                    batch_size=8,
                    seq_len=seq_len,
                    precision="bf16",
                    world_size=world,
                    sharding=scheme,
                    gpu=gpu,
                )
                d = est.details
                state = d["model_state"]
                P = d["num_parameters"]
                paper = state["paper_formula_bytes"]
                by_paper = state["by_paper_categories_bytes"]
                row: dict[str, Any] = {
                    "model": model,
                    "sharding": scheme,
                    "world_size": world,
                    "parameters": P,
                    "memfit_by_paper_categories_bytes": by_paper,
                    "memfit_model_state_bytes": state["total_bytes"],
                    "paper_bytes": paper,
                    "memfit_over_paper": None if not paper else by_paper / paper,
                    "estimate_total_bytes": est.total_bytes,
                    "estimate_peak_phase": est.peak_phase,
                    "estimate_phase_peak_bytes": est.details["phase_peak_bytes"],
                    "estimate_breakdown": est.breakdown,
                }
                if scheme in ("zero2", "zero3"):
                    comparable = _deepspeed_comparable(d, scheme)
                    row["memfit_deepspeed_comparable_bytes"] = comparable
                    gap = 2 * -(-P // world) if scheme == "zero3" else 0
                    row["explained_gap_bytes"] = gap
                    row["deepspeed_formula_bytes"] = state["deepspeed_formula_bytes"]
                    if ds is not None:
                        zero2, zero3 = ds
                        if scheme == "zero2":
                            _, gpu_bytes = zero2(P, num_gpus_per_node=world, cpu_offload=False)
                        else:
                            largest = d["gather"]["largest_layer_parameters"]
                            _, gpu_bytes, _ = zero3(
                                P,
                                largest,
                                num_gpus_per_node=world,
                                cpu_offload=False,
                                cpu_offload_params=False,
                            )
                        row["deepspeed_bytes"] = int(gpu_bytes)
                        row["memfit_over_deepspeed"] = comparable / gpu_bytes
                        row["memfit_less_gap_over_deepspeed"] = (comparable - gap) / gpu_bytes
                rows.append(row)
    return rows


def _deepspeed_comparable(details: dict[str, Any], scheme: str) -> int:
    """memfit's model states counted as DeepSpeed's estimator counts them.

    ZeRO-3: plus the largest layer's 16-bit parameters and gradients (memfit's gather buffers
    hold them; DeepSpeed's 4·largest_layer), without the persistent small parameters (which
    DeepSpeed's formula does not count). memfit's figure then stays 2P/W above DeepSpeed's: the
    16-bit parameter partition, which DeepSpeed's ZeRO-3 formula leaves out (its 18P/W is ZeRO-2's
    "2 grads 16-bit + 4 grads 32-bit + 4 params 32-bit + 8 optimizer states"); the rows give it as
    ``explained_gap_bytes``.
    """
    state = details["model_state"]
    comparable = state["by_paper_categories_bytes"]
    comparable += state["implementation_bytes"]["fp32_gradient_partition"]
    if scheme == "zero3":
        comparable += 4 * details["gather"]["largest_layer_parameters"]
    return int(comparable)


# --- 2. FSDP measured on the CPU ------------------------------------------------------------------
def fsdp_worker(args: argparse.Namespace) -> int:
    """One rank of a measured run (started by torchrun); writes its peak to ``args.result``."""
    import functools
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from memfit.estimate import workload
    from memfit.estimate.trace import fsdp_blocks
    from memfit.guard.cap import CpuMemoryCap

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kind, task, numbers = FSDP_MODELS[args.model]
    config = _config(kind, numbers)
    spec = workload.StepSpec(
        task=task,
        precision=args.precision,
        device="cpu",
        gradient_checkpointing=args.gradient_checkpointing,
    )
    torch.manual_seed(0)
    model = workload.build_model(config, spec)
    if args.sharding == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(
                param_dtype=workload.PRECISION_DTYPES[args.precision], reduce_dtype=torch.float32
            )
            if args.precision != "fp32"
            else MixedPrecisionPolicy()
        )
        # as memfit train wraps them: the blocks reshard after forward (the default), the root
        # (left at the default too) keeps its parameters until backward ends
        for block in fsdp_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = workload.make_optimizer("adamw", model, "cpu")
    autocast = workload.default_autocast(spec, "cpu")

    class Counter(CpuMemoryCap):
        """Live tensor bytes, with DTensor shards unwrapped and storage resizes followed."""

        def _count(self, tensor: torch.Tensor) -> int:
            if isinstance(tensor, DTensor):
                tensor = tensor._local_tensor
            return super()._count(tensor)

        def resized(self, storage: Any, before: int, after: int) -> None:
            key = storage._cdata
            entry = self._live.get(key)
            if entry is None:
                if after == 0:
                    return
                ref = weakref.ref(storage, functools.partial(self._on_free, key))
                self._live[key] = (ref, after)
                self.live_bytes += after
            else:
                self._live[key] = (entry[0], after)
                self.live_bytes += after - entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    counter = Counter(1 << 60)  # a cap that never binds: only the counting is wanted
    original_resize = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        # FSDP frees unsharded parameters by resizing their storage to 0 (and back)
        before = storage.nbytes()
        out = original_resize(storage, size)
        counter.resized(storage, before, storage.nbytes())
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    peaks = []
    try:
        with counter:
            counter.track(model, optimizer)
            for _ in range(args.steps):
                counter.reset_peak()
                start = counter.live_bytes
                batch = workload.make_batch(config, spec, args.batch_size, args.seq_len)
                with autocast():
                    loss = workload.compute_loss(model, batch, spec)
                forward_peak = counter.peak_bytes
                counter.reset_peak()
                loss.backward()
                # free the graph's last reference before the optimizer runs
                del loss
                if args.sharding == "none":
                    # memfit's data parallelism: each gradient all-reduced in place
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                backward_peak = counter.peak_bytes
                counter.reset_peak()
                optimizer.step()
                # flush the gradients as soon as we can, no need for this memory anymore
                optimizer.zero_grad(set_to_none=True)
                del batch
                peaks.append(
                    {
                        "peak": max(forward_peak, backward_peak, counter.peak_bytes),
                        "forward_peak": forward_peak,
                        "backward_peak": backward_peak,
                        "forward_backward_peak": max(forward_peak, backward_peak),
                        "optimizer_peak": counter.peak_bytes,
                        "start": start,
                    }
                )
    finally:
        torch.UntypedStorage.resize_ = original_resize  # type: ignore[method-assign]

    def local_bytes(tensors: Any) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t = t._local_tensor if isinstance(t, DTensor) else t
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(seen.values())

    # what stays between steps: parameters (their local shards) and optimizer state
    resident = {
        "parameters": local_bytes(model.parameters()),
        "optimizer_state": local_bytes(v for st in optimizer.state.values() for v in st.values()),
    }
    if args.result:
        Path(f"{args.result}.{rank}").write_text(
            json.dumps({"rank": rank, "steps": peaks, "resident": resident})
        )
    dist.destroy_process_group()
    return 0


def _config(kind: str, numbers: dict[str, Any]) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(kind, **numbers)


def fsdp_truth_rows() -> list[dict[str, Any]]:
    from memfit.estimate import estimate

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memfit-sharding-") as tmp:
        for model, precision, batch, seq, world_size, checkpointing in FSDP_CASES:
            kind, task, numbers = FSDP_MODELS[model]
            folder = Path(tmp) / model
            if not folder.exists():
                _config(kind, numbers).save_pretrained(folder)
            for sharding in ("none", "fsdp"):
                result = Path(tmp) / f"{model}-{precision}-{sharding}-{len(rows)}"
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    str(world_size),
                    "--master_port",
                    str(29500 + len(rows)),
                    str(Path(__file__).resolve()),
                    "--fsdp-worker",
                    "--model",
                    model,
                    "--precision",
                    precision,
                    "--sharding",
                    sharding,
                    "--batch-size",
                    str(batch),
                    "--seq-len",
                    str(seq),
                    "--result",
                    str(result),
                ] + (["--gradient-checkpointing"] if checkpointing else [])
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, timeout=900)
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    rows.append(
                        {
                            "model": model,
                            "precision": precision,
                            "sharding": sharding,
                            "world_size": world_size,
                            "error": done.stderr[-2000:],
                        }
                    )
                    print(f"{model} {precision} {sharding}: failed\n{done.stderr[-2000:]}")
                    continue
                ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(world_size)]
                # the steady step: the last one (the first creates optimizer state and FSDP's
                # lazy state)
                measured = max(r["steps"][-1]["peak"] for r in ranks)
                est = estimate(
                    str(folder),
                    task=task,
                    batch_size=batch,
                    seq_len=seq,
                    precision=precision,
                    device="cpu",
                    world_size=world_size,
                    sharding=sharding,
                    gradient_checkpointing=checkpointing,
                )
                raw = est.total_bytes - est.breakdown["allocator_overhead"]
                row = {
                    "model": model,
                    "precision": precision,
                    "sharding": sharding,
                    "world_size": world_size,
                    "batch_size": batch,
                    "seq_len": seq,
                    "gradient_checkpointing": checkpointing,
                    "measured_peak_bytes": measured,
                    "measured_per_rank": [r["steps"][-1]["peak"] for r in ranks],
                    "measured_forward_backward_bytes": max(
                        r["steps"][-1]["forward_backward_peak"] for r in ranks
                    ),
                    "measured_optimizer_bytes": max(
                        r["steps"][-1]["optimizer_peak"] for r in ranks
                    ),
                    "measured_resident_rank0": ranks[0]["resident"],
                    "measured_phase_peaks": {
                        phase: max(r["steps"][-1][f"{phase}_peak"] for r in ranks)
                        for phase in ("forward", "backward", "optimizer")
                    },
                    "estimated_bytes": raw,
                    "estimate_peak_phase": est.peak_phase,
                    "estimate_phase_peak_bytes": est.details["phase_peak_bytes"],
                    "estimate_breakdown": est.breakdown,
                    "error_pct": 100 * (raw - measured) / measured,
                    "seconds": round(seconds, 1),
                }
                rows.append(row)
                print(
                    f"{model:10} {precision:5} {sharding:5} W={world_size}"
                    f"{' ckpt' if checkpointing else '     '}: measured "
                    f"{measured / MiB:8.2f} MiB, estimated {raw / MiB:8.2f} MiB "
                    f"({row['error_pct']:+.2f} %)",
                    flush=True,
                )
    return rows


# --- printing and main ----------------------------------------------------------------------------
def _fsdp_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = {
        sharding: [
            abs(r["error_pct"]) for r in rows if r.get("sharding") == sharding and "error_pct" in r
        ]
        for sharding in ("none", "fsdp")
    }
    return {
        "cases": len(rows),
        "failed": sum(1 for r in rows if "error" in r),
        **{f"{k}_max_abs_error_pct": max(v, default=None) for k, v in errors.items()},
    }


def print_model_states(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':20} {'scheme':6} {'W':>2} {'memfit MiB':>11} {'paper MiB':>10} {'ratio':>6} "
        f"{'DS-comp MiB':>11} {'DeepSpeed':>10} {'ratio':>6} {'per-GPU GiB':>11} phase"
    )
    print(header)
    for r in rows:
        paper = r["paper_bytes"]
        ds = r.get("deepspeed_bytes")
        comparable = r.get("memfit_deepspeed_comparable_bytes")
        print(
            f"{r['model']:20} {r['sharding']:6} {r['world_size']:>2} "
            f"{r['memfit_by_paper_categories_bytes'] / MiB:11.1f} "
            f"{(paper or 0) / MiB:10.1f} {(r['memfit_over_paper'] or 0):6.3f} "
            f"{(comparable or 0) / MiB:11.1f} {(ds or 0) / MiB:10.1f} "
            f"{(r.get('memfit_over_deepspeed') or 0):6.3f} "
            f"{r['estimate_total_bytes'] / 2**30:11.2f} {r['estimate_peak_phase']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", nargs="?", const=str(DEFAULT_OUT), help="write the JSON here")
    parser.add_argument("--quick", action="store_true", help="bert-base-uncased only")
    parser.add_argument("--gpu", default="h100-80gb", help="catalog GPU for the per-GPU column")
    parser.add_argument("--fsdp-truth", action="store_true", help="also run the FSDP CPU runs")
    parser.add_argument("--only-fsdp", action="store_true", help="only the FSDP CPU runs")
    # the worker's own flags (torchrun starts this file with --fsdp-worker)
    parser.add_argument("--fsdp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fsdp_worker:
        return fsdp_worker(args)

    started = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    import torch
    import transformers

    result: dict[str, Any] = {
        "command": command,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "deepspeed": _deepspeed_version(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
    }
    if not args.only_fsdp:
        models = ["bert-base-uncased"] if args.quick else list(MODELS)
        rows = model_state_rows(models, args.gpu)
        print_model_states(rows)
        result["model_states"] = rows
        result["model_state_summary"] = _summary(rows)
    if args.fsdp_truth or args.only_fsdp:
        result["fsdp_truth"] = fsdp_truth_rows()
        result["fsdp_truth_summary"] = _fsdp_summary(result["fsdp_truth"])
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(f"reproduce: {command}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    paper = [r["memfit_over_paper"] for r in rows if r["memfit_over_paper"]]
    ds = [r["memfit_over_deepspeed"] for r in rows if r.get("memfit_over_deepspeed")]
    less_gap = [r["memfit_less_gap_over_deepspeed"] for r in rows if "deepspeed_bytes" in r]
    return {
        "cases": len(rows),
        "paper_ratio_min": min(paper, default=None),
        "paper_ratio_max": max(paper, default=None),
        "deepspeed_compared": len(ds),
        "deepspeed_ratio_min": min(ds, default=None),
        "deepspeed_ratio_max": max(ds, default=None),
        "deepspeed_ratio_less_explained_gap_min": min(less_gap, default=None),
        "deepspeed_ratio_less_explained_gap_max": max(less_gap, default=None),
    }


def _deepspeed_version() -> str | None:
    try:
        import deepspeed

        return str(deepspeed.__version__)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
