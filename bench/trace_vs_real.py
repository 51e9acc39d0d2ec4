"""A real CPU step against memfit's trace of it, kernel by kernel.

The estimator traces :mod:`memfit.estimate.workload`'s step on fake tensors and records every
storage allocation and free (``memfit.estimate.trace.StorageRecorder``). The same recorder also
works on real tensors: here the real step runs on the CPU (random weights, two warm-up steps, so
the optimizer state exists), the third step is recorded, and both sequences of allocations are
compared: the peak of live tensor bytes above what stays resident (each tensor costing what glibc
gives it, ``memfit.estimate.device.cpu_allocation_bytes``), and a diff of the allocations and frees
(op and bytes) where they differ.

``--hold-outputs`` runs the real step as many hand-written loops do (the accelerate and
transformers ``no_trainer`` examples)::

    outputs = model(**batch)
    outputs.loss.backward()     # ``outputs`` (and its logits) still referenced

instead of memfit's (and Hugging Face Trainer's) step, which takes the loss and drops the model's
output before backward. For a causal LM that keeps the fp32 logits (batch x tokens x vocab x 4
bytes) alive through the backward peak; the diff shows it as the logits' free moving to the end of
the step.

Usage::

    PYTHONPATH=src python bench/trace_vs_real.py MODEL --task causal-lm --batch-size 4 --seq-len 128
    PYTHONPATH=src python bench/trace_vs_real.py MODEL --task causal-lm ... --hold-outputs

``MODEL``: a registry name or a folder with ``config.json`` (random weights, nothing downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from memfit import step  # noqa: E402
from memfit.estimate import workload  # noqa: E402
from memfit.estimate.device import cpu_allocation_bytes  # noqa: E402
from memfit.estimate.trace import (  # noqa: E402
    ALLOC,
    FREE,
    FREE_PREV,
    StorageRecorder,
    trace_steps,
)
from memfit.estimate.workload import StepSpec  # noqa: E402

MiB = 2**20
WARMUP_STEPS = 2
# data-dependent checks transformers runs on real tensors only (is the mask all ones?): one-byte
# and eight-byte results, freed at once
REAL_ONLY_OPS = frozenset({"sum.default", "eq.Scalar", "all.default"})


@dataclass(frozen=True)
class Allocation:
    kind: str  # "alloc" or "free"
    op: str  # the op that created the storage
    nbytes: int


@dataclass(frozen=True)
class StepRecord:
    """One step's allocations and frees, in order, and the peak of live bytes above resident."""

    events: list[Allocation]
    peak_bytes: int
    peak_index: int  # the event at which the peak is reached


def _record(events: list[tuple[int, int]], sizes: list[int], ops: list[str]) -> StepRecord:
    live = peak = 0
    peak_index = -1
    alive: set[int] = set()
    out: list[Allocation] = []
    for kind, ref in events:
        if kind == ALLOC:
            alive.add(ref)
            live += cpu_allocation_bytes(sizes[ref])
            out.append(Allocation("alloc", ops[ref], sizes[ref]))
            if live > peak:
                peak, peak_index = live, len(out) - 1
        elif kind == FREE and ref in alive:  # a free of a resident storage is not the step's
            alive.discard(ref)
            live -= cpu_allocation_bytes(sizes[ref])
            out.append(Allocation("free", ops[ref], sizes[ref]))
    return StepRecord(out, peak, peak_index)


@contextlib.contextmanager
def _holding_outputs(hold: bool) -> Iterator[None]:
    """Run ``workload.forward_backward`` as a loop that keeps ``outputs`` through backward."""
    if not hold:
        yield
        return
    original = workload.forward_backward

    def forward_backward(
        model: torch.nn.Module, batch: dict[str, Any], spec: StepSpec, **kwargs: Any
    ) -> None:
        recorder, autocast = kwargs.get("recorder"), kwargs["autocast"]
        labels = batch["labels"]
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        with workload.phase(recorder, "forward"), autocast():
            # the recipe's own loss (memfit.step), with the model's outputs kept by the loop
            outputs = model(**inputs, **step.no_cache(model))
            units = labels.size(0) * max(labels.size(1) - 1, 1)
            loss = step.token_loss(outputs.logits, labels, units)
        with workload.phase(recorder, "backward"):
            loss.backward()
        del outputs, loss  # only now: the logits lived through the backward

    workload.forward_backward = forward_backward  # type: ignore[assignment]
    try:
        yield
    finally:
        workload.forward_backward = original  # type: ignore[assignment]


def real_step(
    config: Any, spec: StepSpec, batch_size: int, seq_len: int, *, hold_outputs: bool = False
) -> StepRecord:
    """Record the allocations of one real steady-state CPU step (after the warm-up steps)."""
    torch.manual_seed(0)
    model = workload.build_model(config, spec)
    train = spec.mode == "train"
    optimizer = workload.make_optimizer(spec.optimizer, model, "cpu") if train else None
    autocast = workload.default_autocast(spec, "cpu")

    def step(recorder: StorageRecorder | None) -> None:
        batch = workload.make_batch(config, spec, batch_size, seq_len)
        if optimizer is not None:
            workload.training_step(
                model, batch, spec, optimizer, autocast=autocast, recorder=recorder
            )
        else:
            workload.eval_step(model, batch, spec, autocast=autocast, recorder=recorder)
        del batch

    with _holding_outputs(hold_outputs):
        for _ in range(WARMUP_STEPS):
            step(None)
        gc.collect()
        recorder = StorageRecorder()
        for tensor in [*model.parameters(), *model.buffers()]:
            recorder.register(tensor, "parameters")
        for state in optimizer.state.values() if optimizer is not None else ():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    recorder.register(value, "optimizer_state")
        resident = len(recorder.sizes)
        # frees at the same points as in a trace: cyclic garbage only at the step's end
        gc.disable()
        try:
            with recorder:
                step(recorder)
        finally:
            gc.enable()
        gc.collect()
    events = [(k, r) for k, r in recorder.events if k in (ALLOC, FREE) and r >= resident]
    return _record(events, recorder.sizes, recorder.ops)


def traced_step(config: Any, spec: StepSpec, batch_size: int, seq_len: int) -> StepRecord:
    """The steady step of memfit's trace at this shape (forward, backward, optimizer step)."""
    train = spec.mode == "train"
    trace = trace_steps(
        config, spec, [(batch_size, seq_len)] * 2, optimizer_steps=2 if train else 0
    )
    _, fb, opt = trace.steps[1]
    events = [(k, r) for k, r in fb.events if k in (ALLOC, FREE)]
    sizes, ops = list(fb.sizes), list(fb.ops)
    if opt is not None:
        offset = len(sizes)
        for kind, ref in opt.events:
            if kind in (ALLOC, FREE):
                events.append((kind, ref + offset))
            elif kind == FREE_PREV:  # the gradients at zero_grad, the batch
                events.append((FREE, ref))
        sizes += opt.sizes
        ops += opt.ops
    return _record(events, sizes, ops)


def differences(real: StepRecord, traced: StepRecord, context: int = 1) -> list[str]:
    """A unified diff of the two sequences (traced first), without the real-only mask checks."""

    def lines(record: StepRecord) -> list[str]:
        return [f"{a.kind} {a.op} {a.nbytes}" for a in record.events if a.op not in REAL_ONLY_OPS]

    return list(
        difflib.unified_diff(lines(traced), lines(real), "trace", "real", n=context, lineterm="")
    )


def main(argv: list[str] | None = None) -> int:
    from memfit import job
    from memfit.models import resolve_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--task", required=True, choices=sorted(job.DEFAULT_LOSS))
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--mode", default="train", choices=("train", "eval"))
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--hold-outputs",
        action="store_true",
        help="run the real step as a loop that keeps the model's outputs through backward",
    )
    args = parser.parse_args(argv)
    raw = sys.argv[1:] if argv is None else argv
    print("reproduce: PYTHONPATH=src python bench/trace_vs_real.py " + shlex.join(raw))
    spec = StepSpec(
        task=args.task,
        mode=args.mode,
        optimizer=args.optimizer,
        attn_implementation=args.attn_implementation,
        gradient_checkpointing=args.gradient_checkpointing,
        device="cpu",
        loss=job.DEFAULT_LOSS[args.task],
    )
    config = resolve_model(args.model).config
    real = real_step(config, spec, args.batch_size, args.seq_len, hold_outputs=args.hold_outputs)
    traced = traced_step(config, spec, args.batch_size, args.seq_len)
    gap = real.peak_bytes - traced.peak_bytes
    print(
        f"real step   peak above resident {real.peak_bytes / MiB:10.2f} MiB ({real.peak_bytes} B)"
    )
    print(
        f"trace       peak above resident {traced.peak_bytes / MiB:10.2f} MiB ({traced.peak_bytes} B)"
    )
    print(f"real - trace {gap / MiB:+.2f} MiB ({gap:+d} B)")
    diff = differences(real, traced)
    print("\n".join(diff) if diff else "the allocations and frees are the same, in the same order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
