"""Read an out-of-memory message (for ``memfit doctor``): its kind and its numbers, in bytes.

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

import re
from dataclasses import dataclass, field
from decimal import Decimal

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
KIND_TITLES = {
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
    """``("10.21", "GiB")`` → bytes, rounded to the nearest byte.

    Exact decimal arithmetic: a float overflows on a figure of a few hundred digits (a garbled or
    tampered message), and two decimals of a binary unit never fall on a half byte, so the
    rounding is that of the float product on every figure PyTorch prints.
    """
    return round(Decimal(number) * _UNITS[unit.lower()])


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
    # what made the message's device figures impossible (a capacity of 0, more free than the
    # whole device, ...): they are then all None, as if the message had not given them
    impossible: list[str] = field(default_factory=list)

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
    report = _parse(message)
    _drop_impossible(report)
    return report


def _parse(message: str) -> OomReport:
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
            requested = round(Decimal(match.group(1))) if match else None
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
    gpu = re.search(r"GPU (\d{1,9})\b", message)  # a device index, not a garbled number
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


# the most memory any one device has (the largest GPUs hold a few hundred GiB; a Mac's unified
# memory under 1 TiB): a capacity above it is a garbled or tampered message's
MAX_DEVICE_BYTES = 2**50
# more than a 64-bit allocator can ask for or count: no figure of a real message is larger
MAX_FIGURE = 2**64
# the note on a request past MAX_FIGURE (dropped alone: the device's figures may still hold)
HUGE_REQUEST = "a request of more than 2^64 bytes"
# two printed decimals of a GiB: figures that should add up may be off by this much each
_SLACK = 2**30 // 100 * 2
# the figures of the device and of PyTorch's cache (not the request: one tensor may well ask
# for more than the device has, and the doctor says so)
_DEVICE_KEYS = (
    "capacity_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "reserved_unallocated_bytes",
    "process_bytes",
    "other_processes_bytes",
    "other_bytes",
    "allowed_bytes",
)


def _drop_impossible(report: OomReport) -> None:
    """Set every device figure of ``report`` to None when they cannot be true together (a
    capacity of 0 or of more than any device, more free than the capacity, more reserved than
    the capacity, more allocated than reserved), and any figure beyond 2^64 bytes, and say why
    in ``report.impossible``: a fix computed from them (``memfit plan --gpu-memory 0``) would
    be as wrong as they are."""
    fb = format_bytes
    if report.requested_bytes is not None and report.requested_bytes > MAX_FIGURE:
        # no allocator asks for it: the request alone is dropped (the device's figures may hold)
        report.impossible.append(HUGE_REQUEST)
        report.requested_bytes = None
    huge = {key for key in _DEVICE_KEYS if (getattr(report, key) or 0) > MAX_FIGURE}
    found = [
        f"a {key.removesuffix('_bytes').replace('_', ' ')} figure of more than 2^64 bytes"
        for key in _DEVICE_KEYS
        if key in huge
    ]
    cap, free = report.capacity_bytes, report.free_bytes
    reserved, allocated = report.reserved_bytes, report.allocated_bytes
    noun = {"mps": "limit", "memfit-cap": "cap"}.get(report.kind, "capacity")
    # (figures past 2^64 are not compared: they are dropped with the rest below)
    if cap is not None and "capacity_bytes" not in huge:
        if cap <= 0:
            found.append(f"a {noun} of {fb(cap)}")
        elif cap > MAX_DEVICE_BYTES:
            found.append(f"a {noun} of {fb(cap)}, more than any device has")
        elif report.kind != "memfit-cap":  # a cap is there to be passed
            for key, label in (
                ("free_bytes", "free"),
                ("reserved_bytes", "reserved by PyTorch"),
                ("process_bytes", "in use by this process"),
                ("allowed_bytes", "allowed"),
            ):
                value = getattr(report, key)
                if value is not None and key not in huge and value > cap + _SLACK:
                    found.append(f"{fb(value)} {label} of a {noun} of {fb(cap)}")
            # what PyTorch holds is not free
            if (
                not found
                and free is not None
                and reserved is not None
                and free + reserved > cap + 2 * _SLACK
            ):  # (a figure past 2^64 is in found already)
                found.append(f"{fb(free)} free and {fb(reserved)} reserved of {fb(cap)}")
    if (
        not found  # (nor past 2^64)
        and report.kind == "cuda-old"
        and reserved is not None
        and allocated is not None
        and allocated > reserved + _SLACK
    ):
        found.append(f"{fb(allocated)} allocated of {fb(reserved)} reserved")
    if not found:
        return
    report.impossible += found
    for key in _DEVICE_KEYS:
        setattr(report, key, None)
    report.derived = []
