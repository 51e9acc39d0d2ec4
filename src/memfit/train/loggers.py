"""``--report-to tensorboard|wandb|none``: the run's figures in the trackers people already watch.

The run folder's ``metrics.jsonl`` and ``events.jsonl`` stay the record; a reporter receives the
same lines as they are written and hands them to the library's own writer:

- every numeric key of a step line: ``train/<key>`` (loss, lr, grad_norm, samples_per_second,
  micro_batch_size, …) and ``memory/<key>`` for the memory figures (``peak_bytes``, the phase
  peaks ``forward|backward|optimizer_peak_bytes``, CUDA's ``reserved_bytes``, each rank's peak);
- eval lines: ``eval/<metric>``;
- guard events: ``guard/oom_count`` (running count), ``guard/micro_batch_size`` (after a back-off
  or a grow) as scalars, and the event itself as text (TensorBoard) — at the step it happened.

TensorBoard goes through ``torch.utils.tensorboard.SummaryWriter`` into ``DIR/tensorboard/``
(needs the ``tensorboard`` package: ``pip install 'memfit[tensorboard]'``); W&B through
``wandb.init``/``wandb.log`` (``pip install 'memfit[wandb]'``; ``WANDB_MODE=offline`` and the
other ``WANDB_*`` variables are honoured by wandb itself; the project is ``WANDB_PROJECT`` or
``memfit``). Only rank 0 reports: it holds the whole step's figures (losses summed over the ranks,
the largest rank's peak).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from memfit.extras import is_installed

REPORTERS = ("tensorboard", "wandb")
_INSTALL = {
    "tensorboard": "pip install 'memfit[tensorboard]' (or pip install tensorboard)",
    "wandb": "pip install 'memfit[wandb]' (or pip install wandb)",
}
# events worth a mark on the charts (probe, checkpoint, eval and resume are in events.jsonl)
GUARD_EVENTS = ("oom", "backoff", "grow", "stop")


def parse_report_to(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``tensorboard``, ``wandb``, ``tensorboard,wandb`` or ``none`` as a list of reporters."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(x) for x in value]
    names = [x.strip().lower() for x in items if x.strip()]
    return [x for x in dict.fromkeys(names) if x != "none"]


def report_problems(value: Any) -> list[str]:
    """Unknown reporters, and those whose library is not installed (with the install line)."""
    names = parse_report_to(value)
    problems = []
    unknown = [x for x in names if x not in REPORTERS]
    if unknown:
        problems.append(
            f"--report-to: unknown value {', '.join(unknown)!r}; tensorboard, wandb or none"
        )
    for name in names:
        if name in REPORTERS and not _installed(name):
            problems.append(f"--report-to: {name} is not installed; {_INSTALL[name]}")
    return problems


def _installed(name: str) -> bool:
    # found, not imported: wandb and tensorboard take seconds to import
    return is_installed(name)


class Reporter(Protocol):
    """Where the run's lines go besides the JSON Lines files."""

    def log_metrics(self, record: dict[str, Any]) -> None: ...

    def log_event(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl line as tracker scalars: ``train/…``, ``memory/…`` or ``eval/…``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key.startswith("eval_"):
            if _is_number(value):
                out[f"eval/{key.removeprefix('eval_')}"] = float(value)
        elif key == "rank_peak_bytes" and isinstance(value, list):
            for rank, peak in enumerate(value):
                if _is_number(peak):
                    out[f"memory/rank{rank}_peak_bytes"] = float(peak)
        elif _is_number(value):
            group = "memory" if key.endswith("_bytes") else "train"
            out[f"{group}/{key}"] = float(value)
    return out


class _GuardCounts:
    """The guard's figures that events carry: OOMs so far, the micro-batch after a change."""

    def __init__(self) -> None:
        self.ooms = 0

    def scalars(self, event: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        if event.get("type") == "oom":
            self.ooms += 1
            out["guard/oom_count"] = float(self.ooms)
        if event.get("type") in ("backoff", "grow") and _is_number(event.get("to")):
            out["guard/micro_batch_size"] = float(event["to"])
        if event.get("type") in ("backoff", "grow") and _is_number(event.get("max_tokens_to")):
            out["guard/max_tokens_per_micro_batch"] = float(event["max_tokens_to"])
        return out


class TensorBoardReporter:
    """``torch.utils.tensorboard.SummaryWriter`` into ``folder``."""

    def __init__(self, folder: Path, *, purge_step: int | None = None) -> None:
        # optional: tensorboard (memfit[tensorboard])
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run redoes the steps after its checkpoint; TensorBoard hides what
        # the killed run logged from that step on, as metrics.jsonl drops those lines
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)
        self.guard = _GuardCounts()

    def log_metrics(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        # on disk at once: a run killed (or stopped with exit 3) keeps what it logged
        self.writer.flush()

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("type") not in GUARD_EVENTS:
            return
        step = int(event.get("step") or 0)
        for tag, value in self.guard.scalars(event).items():
            self.writer.add_scalar(tag, value, global_step=step)
        shown = {k: v for k, v in event.items() if k not in ("time", "type", "step")}
        self.writer.add_text(f"guard/{event['type']}", json.dumps(shown), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """``wandb.init`` once, ``wandb.log`` per line (offline with ``WANDB_MODE=offline``)."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        import wandb  # optional: memfit[wandb]

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "memfit",
            name=folder.name,
            dir=str(folder),
            config=config,
        )
        self.guard = _GuardCounts()

    def log_metrics(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("type") not in GUARD_EVENTS:
            return
        values = self.guard.scalars(event)
        if values:
            self.run.log(values, step=int(event.get("step") or 0))
        if event["type"] == "oom":
            self.run.summary["guard/oom_count"] = self.guard.ooms

    def close(self) -> None:
        self.run.finish()


class _Tee:
    """A JSON Lines log (``write``/``close``) whose lines also go to the reporters."""

    def __init__(self, log: Any, reporters: list[Reporter], *, events: bool) -> None:
        self.log, self.reporters, self.events = log, reporters, events

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(record)
        for reporter in self.reporters:
            if self.events:
                reporter.log_event(record)
            else:
                reporter.log_metrics(record)

    def close(self) -> None:
        self.log.close()
        if not self.events:
            # the metrics log closes last in the loop's order: the reporters end with it
            for reporter in self.reporters:
                reporter.close()


def open_reporters(
    report_to: Any, out: Path, config: dict[str, Any], metrics: Any, events: Any
) -> tuple[Any, Any]:
    """``metrics`` and ``events`` (the run's JSON Lines logs) wrapped so that every line also
    goes to the reporters ``report_to`` names; unchanged for ``none``."""
    reporters: list[Reporter] = []
    for name in parse_report_to(report_to):
        if name == "tensorboard":
            purge = None
            if config.get("resume"):
                # the CLI's config reads this module: memfit.train.checkpoint (torch) loads here
                # for its start-up time
                from memfit.train.checkpoint import completed_steps

                steps = completed_steps(out / "checkpoints")
                purge = (steps[-1] if steps else 0) + 1
            reporters.append(TensorBoardReporter(out / "tensorboard", purge_step=purge))
        elif name == "wandb":
            reporters.append(WandbReporter(out, config))
    if not reporters:
        return metrics, events
    return _Tee(metrics, reporters, events=False), _Tee(events, reporters, events=True)
