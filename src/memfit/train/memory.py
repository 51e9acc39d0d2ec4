"""A step's peak memory, by phase, and CUDA memory snapshots at each caught OOM."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class PeakMemory:
    """Peak memory of one step, and of its phases (forward, backward, optimizer) where that is
    cheap: on CUDA (the allocator's own counters) and under the CPU memory cap. Without a cap the
    CPU reports the process's peak resident memory for the whole step only (each reset walks the
    page tables)."""

    PHASES = ("forward", "backward", "optimizer")
    # the extra keys of record(), in a fixed order (several ranks gather them as one vector)
    RECORD_KEYS = (*(f"{name}_peak_bytes" for name in PHASES), "reserved_bytes")

    def __init__(self, device: torch.device, cap: Any) -> None:
        self.device, self.cap = device, cap
        self._proc = Path("/proc/self/clear_refs").exists()
        self.phased = device.type == "cuda" or cap is not None
        self._phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self._step_peak = 0
        self._reserved = 0

    def reset(self) -> None:
        """At a step's start: forget the last step's peaks."""
        self._phase, self.phase_peaks, self._step_peak, self._reserved = None, {}, 0, 0
        self._reset()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cap is not None:
            self.cap.reset_peak()
        elif self._proc:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS

    def phase(self, name: str | None) -> None:
        """The phase ``name`` starts (None: no phase): the one before ends and keeps its peak."""
        if not self.phased:
            return
        current = self._current()
        if current is not None:
            self._step_peak = max(self._step_peak, current)
            if self._phase is not None:
                self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), current)
        if self.device.type == "cuda":
            self._reserved = max(self._reserved, int(torch.cuda.max_memory_reserved(self.device)))
        self._phase = name
        self._reset()

    def _current(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.cap is not None:
            return int(self.cap.peak_bytes)
        if self._proc:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def read(self) -> int | None:
        """The step's peak: allocated bytes (CUDA), live tensor bytes (cap), or peak RSS."""
        self.phase(None)
        current = self._current()
        if current is None:
            return None
        return max(self._step_peak, current)

    def record(self) -> dict[str, int]:
        """The step's extra keys for metrics.jsonl: per-phase peaks, CUDA's reserved peak."""
        out = {
            f"{name}_peak_bytes": self.phase_peaks[name]
            for name in self.PHASES
            if name in self.phase_peaks
        }
        if self.device.type == "cuda":
            out["reserved_bytes"] = max(
                self._reserved, int(torch.cuda.max_memory_reserved(self.device))
            )
        return out


# at most this many snapshots a run (each is tens of MB)
MAX_SNAPSHOTS = 3


def snapshot_writer(
    folder: Path, on_event: Callable[[dict[str, Any]], None]
) -> Callable[[BaseException], None]:
    """Start recording the CUDA allocator's history; the returned hook dumps a snapshot of it
    when the guard catches an OOM (before the failed graph is released, so the snapshot shows
    what filled the memory)."""
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    written: list[Path] = []

    def dump(exc: BaseException) -> None:
        if len(written) >= MAX_SNAPSHOTS:
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"oom-{len(written) + 1}.pickle"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.cuda.memory._dump_snapshot(str(tmp))
        os.replace(tmp, path)
        written.append(path)
        on_event({"type": "memory_snapshot", "path": str(path), "error": str(exc)[:200]})

    return dump
