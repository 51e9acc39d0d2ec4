"""What a run says on the terminal: its progress line or bar, and the guard's events."""

from __future__ import annotations

import sys
from typing import Any

from rich import progress as rich


def describe(event: dict[str, Any]) -> str:
    """A guard event (oom, backoff, grow) in one line for the terminal."""
    step = event.get("step")
    # the size the guard adapts: rows per micro-batch, or per GradCache mini-batch where the
    # recipe takes the whole step at once (in-batch negatives)
    unit = "GradCache mini-batch" if event.get("what") == "mini_batch" else "micro-batch"
    if event["type"] == "oom":
        if event.get("phase") == "optimizer":
            return f"out of memory in the optimizer step of step {step}"
        where = f"{unit} {event.get('micro_batch_size')}"
        if event.get("max_tokens") is not None:
            where += f" ({event.get('padded_tokens')} tokens, budget {event['max_tokens']})"
        return f"out of memory at step {step} with {where}"
    if event["type"] == "backoff":
        if event.get("cure"):
            return f"step {step}: {event['cure']} on, {unit} 1, step re-run from its start"
        if "max_tokens_to" in event:
            return (
                f"step {step}: token budget {event['max_tokens_from']} → "
                f"{event['max_tokens_to']}, step re-run from its start"
            )
        return (
            f"step {step}: {unit} {event.get('from')} → {event.get('to')}, "
            "step re-run from its start"
        )
    if "max_tokens_to" in event:
        return f"step {step}: trying a token budget of {event['max_tokens_to']}"
    return f"step {step}: trying {unit} {event.get('to')}"


def say(text: str) -> None:
    """A line on stderr (stdout is the verbs' result)."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    """A rich progress bar on a terminal; a plain line every ~5 % of the run otherwise."""

    def __init__(self, total: int, done: int, *, quiet: bool = False) -> None:
        self.total = total
        self.every = max(1, total // 20)
        self.quiet = quiet
        self._bar: Any = None
        if sys.stderr.isatty() and not quiet:
            self._bar = rich.Progress(
                rich.TextColumn("step {task.completed}/{task.total}"),
                rich.BarColumn(),
                rich.TextColumn("{task.fields[info]}"),
                rich.TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=done, info="")

    def update(self, record: dict[str, Any]) -> None:
        peak = record.get("peak_bytes")
        info = (
            f"loss {record['loss']:.4f}  {record.get('samples_per_second') or 0:.1f} samples/s  "
            f"{'mini' if record.get('what') == 'mini_batch' else 'micro'} "
            f"{record['micro_batch_size']}" + (f"  peak {peak / 2**20:.0f} MiB" if peak else "")
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], info=info)
        elif not self.quiet and (record["step"] % self.every == 0 or record["step"] == self.total):
            say(f"step {record['step']}/{self.total}  {info}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
