"""``memfit doctor``: read an out-of-memory message, say what happened and what to change.

The messages come from PyTorch's allocators, in every form they have taken:

* ``cuda-new`` (PyTorch ≥ 2.1, c10/cuda/CUDACachingAllocator.cpp): "CUDA out of memory. Tried to
  allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB of which 1.06 GiB is free. Including
  non-PyTorch memory, this process has 14.69 GiB memory in use. Of the allocated memory 10.25 GiB
  is allocated by PyTorch, and 4.02 GiB is reserved by PyTorch but unallocated. …" (2.1 spelled
  "capacty"; "Process 1234 has X memory in use." appears once per process when the driver can
  tell them apart).
* ``cuda-old`` (PyTorch 1.x, 2.0): "CUDA out of memory. Tried to allocate 256.00 MiB (GPU 0;
  11.17 GiB total capacity; 10.21 GiB already allocated; 117.81 MiB free; 10.45 GiB reserved in
  total by PyTorch)" — before 1.4 the last field was "X cached"; with a memory fraction set there
  is an "X allowed;" field too.
* ``cuda-bare``: "CUDA error: out of memory" (the CUDA runtime itself failed, e.g. creating the
  context or inside a library kernel: no numbers).
* ``cpu`` (c10/core/impl/alloc_cpu.cpp): "DefaultCPUAllocator: can't allocate memory: you tried
  to allocate N bytes. Error code 12 (Cannot allocate memory)"; on Windows "DefaultCPUAllocator:
  not enough memory: you tried to allocate N bytes."
* ``mps`` (aten/src/ATen/mps/MPSAllocator.mm): "MPS backend out of memory (MPS allocated: X,
  other allocations: Y, max allowed: Z). Tried to allocate W on private pool."
* ``memfit-cap``: memfit's own CPU memory cap (:mod:`memfit.guard.cap`): "memfit memory cap:
  tried to hold X, the cap is Y (…)".

Units: PyTorch formats sizes by dividing by powers of 1024 and printing two decimals, so "MiB" and
"GiB" are 2^20 and 2^30 — and so are the "KB"/"MB"/"GB" of the MPS allocator, whose
``format_size`` divides by 1024 too but writes the decimal names. Every unit here is binary. A
printed value is turned into bytes as ``int(round(value * unit))``: the message keeps two decimals,
so the result is within half a hundredth of the unit of what the allocator saw.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.report.events import agreed_events
from memfit.units import format_bytes

# every unit of PyTorch's OOM messages is binary (see the module docstring)
_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"

# where a message starts; the last one in the text is the one diagnosed
_ANCHORS = re.compile(
    r"CUDA out of memory"
    r"|CUDA error: out of memory"
    r"|MPS backend out of memory"
    r"|DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
    r"|memfit memory cap:",
    re.IGNORECASE,
)
# a message ends before a blank line or a new traceback (wrapped lines are joined)
_END = re.compile(r"\n\s*\n|Traceback \(most recent call last\)")
_MAX_MESSAGE_CHARS = 2000

KINDS = ("cuda-new", "cuda-old", "cuda-bare", "cpu", "mps", "memfit-cap", "unknown")
_KIND_TITLES = {
    "cuda-new": "CUDA out of memory (PyTorch ≥ 2.1 message)",
    "cuda-old": "CUDA out of memory (PyTorch 1.x / 2.0 message)",
    "cuda-bare": "CUDA error: out of memory (the CUDA runtime, not PyTorch's allocator)",
    "cpu": "CPU out of memory (PyTorch's DefaultCPUAllocator)",
    "mps": "MPS (Apple GPU) out of memory",
    "memfit-cap": "memfit's CPU memory cap was reached (a simulated out of memory)",
    "unknown": "out of memory (a message memfit does not know how to read)",
}
_NUMERIC_KEYS = (
    "requested_bytes",
    "capacity_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "reserved_unallocated_bytes",
)


def parse_size_text(number: str, unit: str) -> int:
    """``("10.21", "GiB")`` → bytes, rounded to the nearest byte."""
    return round(float(number) * _UNITS[unit.lower()])


def _size(pattern: str, text: str) -> int | None:
    """The size that ``pattern`` (with ``{SIZE}`` where the size is) finds in ``text``."""
    match = re.search(pattern.replace("{SIZE}", _SIZE), text, re.IGNORECASE)
    return None if match is None else parse_size_text(match.group(1), match.group(2))


@dataclass
class OomReport:
    """What one out-of-memory message says; ``None`` where it does not say.

    ``derived`` names the fields computed from others (e.g. the new CUDA message gives allocated
    and reserved-but-unallocated, and reserved is their sum), not read off the message.
    """

    kind: str
    message: str
    gpu: int | None = None
    requested_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_bytes: int | None = None  # "this process has X memory in use" (all of it, CUDA)
    other_processes_bytes: int | None = None  # "Process N has X" lines beyond the first
    other_bytes: int | None = None  # MPS "other allocations"
    allowed_bytes: int | None = None  # a memory fraction's limit
    derived: list[str] = field(default_factory=list)

    def numbers(self) -> dict[str, int | None]:
        return {key: getattr(self, key) for key in _NUMERIC_KEYS}


def find_oom_message(text: str) -> str | None:
    """The last out-of-memory message in ``text``, its wrapped lines joined; None if none."""
    starts = [m.start() for m in _ANCHORS.finditer(text)]
    if not starts:
        return None
    tail = text[starts[-1] :]
    end = _END.search(tail)
    if end is not None:
        tail = tail[: end.start()]
    return " ".join(tail[:_MAX_MESSAGE_CHARS].split())


def parse_oom(text: str) -> OomReport | None:
    """Parse the last out-of-memory message in ``text`` (a message, a log, a traceback).

    Returns None when there is none. Numbers the message does not give stay None.
    """
    message = find_oom_message(text)
    if message is None:
        return None
    lowered = message.lower()
    if lowered.startswith("cuda out of memory"):
        return _parse_cuda(message)
    if lowered.startswith("cuda error: out of memory"):
        return OomReport(kind="cuda-bare", message=message)
    if lowered.startswith("mps backend"):
        return _parse_mps(message)
    if lowered.startswith("defaultcpuallocator"):
        requested = _size(r"you tried to allocate {SIZE}", message)
        if requested is None:  # the bare byte count, without a unit word
            match = re.search(r"you tried to allocate (\d+)", message)
            requested = int(match.group(1)) if match else None
        return OomReport(kind="cpu", message=message, requested_bytes=requested)
    return OomReport(
        kind="memfit-cap",
        message=message,
        capacity_bytes=_size(r"the cap is {SIZE}", message),
        # what the process would have held with the op's outputs: cap reached at this total
        allocated_bytes=_size(r"tried to hold {SIZE}", message),
    )


def _parse_cuda(message: str) -> OomReport:
    report = OomReport(kind="cuda-old", message=message)
    report.requested_bytes = _size(r"Tried to allocate {SIZE}", message)
    gpu = re.search(r"GPU (\d+)", message)
    report.gpu = int(gpu.group(1)) if gpu else None
    report.allowed_bytes = _size(r"{SIZE} allowed", message)
    if re.search(r"has a total capac", message, re.IGNORECASE):
        report.kind = "cuda-new"
        report.capacity_bytes = _size(r"total capac\w* of {SIZE}", message)
        report.free_bytes = _size(r"of which {SIZE} is free", message)
        report.allocated_bytes = _size(r"Of the allocated memory {SIZE} is allocated", message)
        report.reserved_unallocated_bytes = _size(
            r"{SIZE} is reserved by PyTorch but unallocated", message
        )
        report.process_bytes = _size(r"this process has {SIZE} memory in use", message)
        processes = [
            parse_size_text(m.group(1), m.group(2))
            for m in re.finditer(
                r"Process \d+ has " + _SIZE + r" memory in use", message, re.IGNORECASE
            )
        ]
        if processes and report.process_bytes is None:
            # "Process N has X" lines: the driver cannot say which one is this process; the
            # largest is the likeliest (the one that grew until it failed)
            report.process_bytes = max(processes)
            report.other_processes_bytes = sum(processes) - max(processes)
        if report.allocated_bytes is not None and report.reserved_unallocated_bytes is not None:
            # the allocator prints reserved − allocated as "reserved but unallocated"
            report.reserved_bytes = report.allocated_bytes + report.reserved_unallocated_bytes
            report.derived.append("reserved_bytes")
    else:
        report.capacity_bytes = _size(r"{SIZE} total capacity", message)
        report.free_bytes = _size(r"{SIZE} free", message)
        report.allocated_bytes = _size(r"{SIZE} already allocated", message)
        report.reserved_bytes = _size(r"{SIZE} reserved in total by PyTorch", message)
        if report.reserved_bytes is None:  # before PyTorch 1.4 the cache was "cached"
            report.reserved_bytes = _size(r"{SIZE} cached", message)
        if report.reserved_bytes is not None and report.allocated_bytes is not None:
            report.reserved_unallocated_bytes = max(
                0, report.reserved_bytes - report.allocated_bytes
            )
            report.derived.append("reserved_unallocated_bytes")
    return report


def _parse_mps(message: str) -> OomReport:
    report = OomReport(
        kind="mps",
        message=message,
        allocated_bytes=_size(r"MPS allocated: {SIZE}", message),
        other_bytes=_size(r"other allocations: {SIZE}", message),
        # the high-watermark limit is what the process may use: its "capacity"
        capacity_bytes=_size(r"max allowed: {SIZE}", message),
        requested_bytes=_size(r"Tried to allocate {SIZE}", message),
    )
    if report.capacity_bytes is not None and report.allocated_bytes is not None:
        report.free_bytes = max(
            0, report.capacity_bytes - report.allocated_bytes - (report.other_bytes or 0)
        )
        report.derived.append("free_bytes")
    return report


# --- diagnosis -----------------------------------------------------------------------------------
@dataclass
class Fix:
    """One change that cures (or helps cure) the OOM: what to change, what it saves, its price."""

    change: str
    saves_bytes: int | None
    cost: str
    lever: str  # a stable name: expandable_segments, micro_batch, precision, …

    def to_dict(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "saves_bytes": self.saves_bytes,
            "cost": self.cost,
            "lever": self.lever,
        }


@dataclass
class Knobs:
    """The job that ran out of memory, as ``memfit estimate`` names it (for ``saves_bytes``)."""

    model: str
    task: str
    batch_size: int  # the micro-batch that failed
    seq_len: int
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    num_labels: int = 2
    loss: str | None = None
    lora_rank: int | None = None
    gradient_accumulation_steps: int = 1
    effective_batch_size: int | None = None
    device: str = "cuda"

    def estimate_kwargs(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "gradient_checkpointing": self.gradient_checkpointing,
            "optimizer": self.optimizer,
            "num_labels": self.num_labels,
            "loss": self.loss,
            "lora_rank": self.lora_rank,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "device": self.device,
        }


@dataclass
class Diagnosis:
    report: OomReport
    diagnosis: list[str]
    fixes: list[Fix]
    source: str = "message"
    knobs: Knobs | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` contract: the six numbers, ``diagnosis`` and ranked ``fixes``."""
        return {
            **self.report.numbers(),
            "diagnosis": list(self.diagnosis),
            "fixes": [fix.to_dict() for fix in self.fixes],
            "kind": self.report.kind,
            "gpu": self.report.gpu,
            "source": self.source,
            "derived": list(self.report.derived),
            "message": self.report.message,
            "knobs": None if self.knobs is None else dataclasses.asdict(self.knobs),
        }


def is_fragmented(report: OomReport) -> bool:
    """The cache held enough bytes, just not in one piece: reserved-but-unallocated memory at
    least as large as the request, or a fifth or more of everything reserved."""
    unallocated = report.reserved_unallocated_bytes
    if not unallocated or report.kind not in ("cuda-new", "cuda-old"):
        return False
    if report.requested_bytes is not None and unallocated >= report.requested_bytes:
        return True
    reserved = report.reserved_bytes
    return reserved is not None and reserved > 0 and unallocated / reserved >= 0.2


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "n/a"


def explain(report: OomReport) -> list[str]:
    """Plain-word lines about the numbers of the message."""
    lines = [
        _KIND_TITLES[report.kind] + (f" on GPU {report.gpu}" if report.gpu is not None else "")
    ]
    fb = format_bytes
    req, cap, free = report.requested_bytes, report.capacity_bytes, report.free_bytes
    if report.kind == "cuda-bare":
        lines.append(
            "the message carries no numbers: the CUDA runtime (creating its context, cuBLAS or "
            "NCCL workspaces, a library kernel) found no memory, often because PyTorch's cache "
            "or another process already held it all; nvidia-smi shows who holds what"
        )
    if report.kind == "memfit-cap":
        if report.allocated_bytes is not None and cap is not None:
            lines.append(
                f"the step would have held {fb(report.allocated_bytes)} of tensors against a cap "
                f"of {fb(cap)} (over by {fb(report.allocated_bytes - cap)})"
            )
    elif req is not None:
        asked = f"asked for {fb(req)} more"
        if free is not None:
            where = " within the MPS limit" if report.kind == "mps" else " on the device"
            asked += f" when {fb(free)} was free{where}"
        if cap is not None:
            asked += f" (limit {fb(cap)})" if report.kind == "mps" else f" ({fb(cap)} total)"
        lines.append(asked)
        if cap is not None and req > cap:
            lines.append(
                f"that one allocation is larger than the whole {'limit' if report.kind == 'mps' else 'device'}: "
                "no allocator setting helps, the tensor itself must shrink (smaller batch or "
                "sequence, checkpointing, a smaller vocabulary's logits)"
            )
    if report.kind == "cpu":
        lines.append(
            "the operating system refused the allocation (RAM and swap, or a container's "
            "memory limit); on a GPU job this is host memory: loading weights, a dataset held "
            "in memory, or a tensor that should be on the GPU"
        )
    if report.kind == "mps" and report.other_bytes is not None:
        lines.append(
            f"other allocations (Metal, outside PyTorch's pool) hold {fb(report.other_bytes)}; "
            "PYTORCH_MPS_HIGH_WATERMARK_RATIO raises the limit (0.0 removes it, at the risk of "
            "swapping the whole system)"
        )
    reserved, allocated = report.reserved_bytes, report.allocated_bytes
    unallocated = report.reserved_unallocated_bytes
    if report.kind in ("cuda-new", "cuda-old") and reserved is not None:
        held = f"PyTorch held {fb(reserved)} reserved"
        if allocated is not None and unallocated is not None:
            held += (
                f": {fb(allocated)} in live tensors and {fb(unallocated)} cached but unallocated "
                f"({_share(unallocated, reserved)} of the reserve)"
            )
        lines.append(held)
        if is_fragmented(report):
            unallocated = unallocated or 0
            lines.append(
                "fragmentation: "
                + (
                    f"the cache had {fb(unallocated)} free in total, more than the {fb(req)} asked "
                    "for, but not in one block"
                    if req is not None and unallocated >= req
                    else f"{_share(unallocated, reserved)} of the reserve is cached but unusable "
                    "for this request"
                )
                + "; expandable segments let the allocator grow blocks instead of splitting them"
            )
        if cap is not None and free is not None:
            outside = cap - free - reserved
            if outside > 0:
                note = (
                    f"{fb(outside)} of the device is outside PyTorch's cache: the CUDA context "
                    "(typically 300–600 MiB), cuBLAS/NCCL workspaces"
                )
                if outside > max(2 << 30, cap // 5):
                    note += (
                        " — far more than a context needs: another process (or another "
                        "PyTorch in this one) holds the rest; check nvidia-smi"
                    )
                else:
                    note += " and any other process on the GPU"
                lines.append(note)
    if report.other_processes_bytes:
        lines.append(
            f"other processes on the GPU hold {fb(report.other_processes_bytes)} (the message "
            "lists more than one process)"
        )
    if report.allowed_bytes is not None:
        lines.append(
            f"a memory fraction limits this process to {fb(report.allowed_bytes)} "
            "(torch.cuda.set_per_process_memory_fraction)"
        )
    if report.derived:
        lines.append(
            "computed from the message's other numbers, not printed in it: "
            + ", ".join(report.derived)
        )
    return lines


def _estimate_total(model: str, kwargs: dict[str, Any]) -> int:
    from memfit.estimate import estimate

    return estimate(model, **kwargs).total_bytes


def diagnose(
    report: OomReport,
    *,
    knobs: Knobs | None = None,
    context: list[str] | None = None,
    source: str = "message",
    catch_estimate_errors: bool = False,
) -> Diagnosis:
    """Explain ``report`` and rank the fixes; with ``knobs`` each fix's saving is estimated.

    ``context`` lines (what a run folder adds: how many OOMs, what the guard did) follow the
    explanation. With ``catch_estimate_errors`` a model the estimator cannot resolve leaves
    ``saves_bytes`` null with a line saying why, instead of raising ``UsageError``.
    """
    lines = explain(report) + list(context or [])
    cuda = report.kind in ("cuda-new", "cuda-old", "cuda-bare")
    fixes: list[Fix] = []
    if is_fragmented(report):
        fixes.append(
            Fix(
                change="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before the "
                "process starts)",
                saves_bytes=report.reserved_unallocated_bytes,
                cost="none measurable (PyTorch ≥ 2.1, Linux)",
                lever="expandable_segments",
            )
        )

    baseline: int | None = None
    if knobs is not None:
        try:
            baseline = _estimate_total(knobs.model, knobs.estimate_kwargs())
        except UsageError as exc:
            if not catch_estimate_errors:
                raise
            lines.append(f"saves_bytes unknown: the estimator cannot model this job ({exc})")
            knobs = None

    def saving(**changes: Any) -> int | None:
        if knobs is None or baseline is None:
            return None
        kwargs = {**knobs.estimate_kwargs(), **changes}
        try:
            return baseline - _estimate_total(knobs.model, kwargs)
        except UsageError as exc:
            lines.append(f"could not estimate {changes}: {exc}")
            return None

    candidates: list[Fix] = []
    batch = knobs.batch_size if knobs else None
    if batch is None or batch > 1:
        accumulation = knobs.gradient_accumulation_steps if knobs else 1
        change = (
            f"halve the micro-batch ({batch} → {batch // 2}) and double gradient accumulation "
            f"({accumulation} → {2 * accumulation}): the effective batch and the gradient stay the same"
            if batch is not None
            else "halve the micro-batch and double gradient accumulation (effective batch kept)"
        )
        candidates.append(
            Fix(
                change=change,
                saves_bytes=None
                if batch is None
                else saving(batch_size=batch // 2, gradient_accumulation_steps=2 * accumulation),
                cost="some throughput (smaller kernels, more steps per update); the recipe is unchanged",
                lever="micro_batch",
            )
        )
    if knobs is None or knobs.precision == "fp32":
        candidates.append(
            Fix(
                change="mixed precision: bf16 autocast (fp16 with loss scaling on GPUs without "
                "bf16, before Ampere)",
                saves_bytes=saving(precision="bf16"),
                cost="none on Ampere or newer (usually faster); fp16 needs a GradScaler",
                lever="precision",
            )
        )
    if knobs is None or not knobs.gradient_checkpointing:
        candidates.append(
            Fix(
                change="gradient checkpointing (recompute activations in backward)",
                saves_bytes=saving(gradient_checkpointing=True),
                cost="about 33 % more compute per step",
                lever="gradient_checkpointing",
            )
        )
    seq = knobs.seq_len if knobs else None
    if seq is None or seq > 8:
        shorter = None if seq is None else max(8, seq // 2 // 8 * 8)
        candidates.append(
            Fix(
                change="truncate sequences"
                + ("" if seq is None else f" ({seq} → {shorter} tokens, --max-seq-len {shorter})"),
                saves_bytes=None if shorter is None else saving(seq_len=shorter),
                cost="tokens past the limit are cut: check the data's lengths first "
                "(memfit plan --train-file reports the share cut)",
                lever="truncation",
            )
        )
    if knobs is None or knobs.optimizer == "adamw":
        candidates.append(
            Fix(
                change="8-bit AdamW (bitsandbytes) or Adafactor instead of AdamW",
                saves_bytes=saving(optimizer="adamw-8bit"),
                cost="changes the optimizer: state is quantized (8-bit AdamW) or factored "
                "(Adafactor); usually close in quality",
                lever="optimizer",
            )
        )
    if knobs is None or not knobs.lora_rank:
        candidates.append(
            Fix(
                change="LoRA adapters (peft, rank 8) instead of full fine-tuning",
                saves_bytes=saving(lora_rank=8),
                cost="trains adapters, not all weights: quality can differ from full fine-tuning",
                lever="lora",
            )
        )
    for fix in candidates:
        if fix.saves_bytes is not None and fix.saves_bytes <= 0:
            lines.append(
                f"not proposed: {fix.lever} would not lower this job's peak "
                f"(estimate: {format_bytes(-fix.saves_bytes)} more)"
            )
        else:
            fixes.append(fix)
    if report.kind == "mps":
        fixes.append(
            Fix(
                change="PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 (lift the MPS limit)",
                saves_bytes=None,
                cost="the system may swap or freeze instead of failing",
                lever="mps_watermark",
            )
        )
    fixes.append(_plan_fix(report, knobs, cuda))
    return Diagnosis(report=report, diagnosis=lines, fixes=fixes, source=source, knobs=knobs)


def _plan_fix(report: OomReport, knobs: Knobs | None, cuda: bool) -> Fix:
    """The command that searches every lever at once for this budget."""
    parts = ["memfit plan", knobs.model if knobs else "MODEL"]
    parts += ["--task", knobs.task if knobs else "TASK"]
    effective = None
    if knobs is not None:
        effective = (
            knobs.effective_batch_size or knobs.batch_size * knobs.gradient_accumulation_steps
        )
    parts += ["--effective-batch-size", str(effective) if effective else "N"]
    parts += ["--seq-len", str(knobs.seq_len) if knobs else "LEN"]
    budget = report.capacity_bytes
    if budget is not None:
        parts += ["--gpu-memory", str(budget)]
    else:
        parts += ["--gpu", "NAME"]
    return Fix(
        change="run `" + " ".join(parts) + "` for a full plan (cheapest cures first)",
        saves_bytes=None,
        cost="none: it only prints a plan",
        lever="plan",
    )


# --- inputs: a message, a log file, a run folder ---------------------------------------------------
_NO_OOM = "no out-of-memory message found in the text"


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat[:60] + ("…" if len(flat) > 60 else "")


def from_text(
    text: str, *, flag: str, knobs: Knobs | None = None, source: str = "message"
) -> Diagnosis:
    report = parse_oom(text)
    if report is None:
        raise UsageError(
            f"{flag}: {_NO_OOM} ({_excerpt(text)!r}); expected PyTorch's 'CUDA out of memory…', "
            "'CUDA error: out of memory', 'DefaultCPUAllocator: can't allocate memory…' or "
            "'MPS backend out of memory…'"
        )
    if knobs is not None and report.kind in ("cpu", "memfit-cap"):
        knobs = dataclasses.replace(knobs, device="cpu")
    return diagnose(report, knobs=knobs, source=source)


def from_file(path: str, *, knobs: Knobs | None = None) -> Diagnosis:
    """The last OOM message of a log file (``-``: standard input)."""
    import sys

    if path == "-":
        text = sys.stdin.read()
    else:
        file = Path(path)
        if not file.is_file():
            raise UsageError(f"--file: {path} does not exist (or is not a file)")
        text = file.read_text(encoding="utf-8", errors="replace")
    return from_text(text, flag=f"--file {path}", knobs=knobs, source=f"file {path}")


def _read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if isinstance(event, dict):
            events.append(event)
    # several ranks log each agreed back-off once each: keep one
    return agreed_events(events)


def knobs_from_run(run: dict[str, Any], micro_batch_size: int | None) -> Knobs | None:
    """The failed job's knobs from a run folder's ``run.json`` (None if it lacks the model)."""
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    model, task = config.get("model"), config.get("task")
    if not model or not task:
        return None
    batch = micro_batch_size or resolved.get("micro_batch_size") or config.get("micro_batch_size")
    if not batch:
        return None
    # as memfit train picks it: --max-seq-len, else --seq-len, else the task's default
    seq = (
        config.get("max_seq_len") or config.get("seq_len") or (512 if task == "causal-lm" else 128)
    )
    effective = int(config.get("effective_batch_size") or 0) or None
    world = int(config.get("world_size") or 1)
    accumulation = max(1, -(-(effective or batch) // (int(batch) * world)))
    device = str(resolved.get("device") or config.get("device") or "cuda")
    return Knobs(
        model=str(model),
        task=str(task),
        batch_size=int(batch),
        seq_len=int(seq),
        precision=str(resolved.get("precision") or config.get("precision") or "fp32"),
        gradient_checkpointing=bool(
            resolved.get("gradient_checkpointing", config.get("gradient_checkpointing")) or False
        ),
        optimizer=str(config.get("optimizer") or "adamw"),
        num_labels=int(config.get("num_labels") or len(config.get("labels") or []) or 2),
        loss=config.get("loss"),
        lora_rank=config.get("lora_rank"),
        gradient_accumulation_steps=accumulation,
        effective_batch_size=effective,
        device="cpu" if device.startswith("cpu") else "cuda",
    )


def from_run_dir(path: str) -> Diagnosis:
    """The last OOM of a ``memfit train`` run folder, what the guard did about it, and the fixes
    priced with the run's own model and knobs (from ``run.json``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"RUN_DIR: {path} is not a folder (give a memfit train output folder)")
    events_file = folder / "events.jsonl"
    if not events_file.is_file():
        raise UsageError(
            f"RUN_DIR: {path} has no events.jsonl; is it a memfit train output folder?"
        )
    events = _read_events(events_file)
    ooms = [e for e in events if e.get("type") == "oom"]
    if not ooms:
        raise UsageError(
            f"RUN_DIR: {_NO_OOM}s of {events_file} (the run had no out-of-memory event)"
        )
    last = ooms[-1]
    report = parse_oom(str(last.get("error") or "")) or OomReport(
        kind="unknown", message=str(last.get("error") or "")
    )
    context = [f"{len(ooms)} out-of-memory event{'s' if len(ooms) != 1 else ''} in {events_file}"]
    where = f"step {last.get('step')}" + (f" ({last['phase']})" if last.get("phase") else "")
    context.append(f"the last at {where} with micro-batch {last.get('micro_batch_size')}")
    for event in events:
        if event.get("type") == "backoff":
            if "cure" in event:
                context.append(f"step {event.get('step')}: the guard switched on {event['cure']}")
            elif event.get("max_tokens_from") is not None:
                context.append(
                    f"step {event.get('step')}: the guard backed off the token budget from "
                    f"{event['max_tokens_from']} to {event.get('max_tokens_to')} tokens"
                )
            else:
                context.append(
                    f"step {event.get('step')}: the guard backed off from micro-batch "
                    f"{event.get('from')} to {event.get('to')} and re-ran the step"
                )
        elif event.get("type") == "probe" and event.get("ooms"):
            context.append(
                f"the probe (step 0, the longest rows) hit {event['ooms']} OOM(s) and settled on "
                f"micro-batch {event.get('micro_batch_size')}"
            )
        elif event.get("type") == "grow":
            context.append(
                f"step {event.get('step')}: the guard grew the micro-batch to {event.get('to')}"
            )
        elif event.get("reason"):
            context.append(f"step {event.get('step')}: {event['reason']}")
    knobs = None
    run_file = folder / "run.json"
    if run_file.is_file():
        try:
            run = json.loads(run_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{run_file}: not JSON ({exc.msg})") from None
        knobs = knobs_from_run(run, last.get("micro_batch_size"))
        if knobs is None:
            context.append(f"saves_bytes unknown: {run_file} does not name the model and task")
    else:
        context.append(f"saves_bytes unknown: {folder} has no run.json")
    return diagnose(
        report,
        knobs=knobs,
        context=context,
        source=f"run folder {path}",
        catch_estimate_errors=True,
    )


def format_text(result: Diagnosis) -> str:
    """The readable report: numbers, the diagnosis, the fixes best first."""
    labels = {
        "requested_bytes": "requested",
        "capacity_bytes": "capacity" if result.report.kind != "mps" else "max allowed",
        "free_bytes": "free",
        "allocated_bytes": "allocated by PyTorch",
        "reserved_bytes": "reserved by PyTorch",
        "reserved_unallocated_bytes": "reserved, unallocated",
    }
    out = []
    diagnosis = list(result.diagnosis)
    out.append(diagnosis.pop(0))
    for key, value in result.report.numbers().items():
        if value is not None:
            out.append(f"  {labels[key]:<24}{format_bytes(value):>12}")
    out.append("diagnosis:")
    out += [f"  - {line}" for line in diagnosis]
    out.append("fixes, best first:")
    for number, fix in enumerate(result.fixes, 1):
        saves = "" if fix.saves_bytes is None else f" — saves {format_bytes(fix.saves_bytes)}"
        out.append(f"  {number}. {fix.change}{saves}")
        out.append(f"     cost: {fix.cost}")
    return "\n".join(out)
