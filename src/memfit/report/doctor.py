"""``memfit doctor``: say what happened in an out-of-memory error and what to change.

The message is read by :mod:`memfit.report.oom_message` (every form PyTorch's allocators have
printed); this module explains its numbers, prices each fix with the estimate of the failed job,
and reads the job from a run folder when there is one.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit import levers
from memfit.errors import UsageError
from memfit.job import (
    CACHED_LOSSES,
    IN_BATCH_NEGATIVE_LOSSES,
    STEP_DEFAULTS,
    STEP_FIELDS,
    Job,
    flag_of,
    resolve_loss,
)
from memfit.report import run_files
from memfit.report.doctor_cures import Fix, cures, gpu_of, loss_of
from memfit.report.events import agreed_events
from memfit.report.oom_message import HUGE_REQUEST, KIND_TITLES, OomReport, parse_oom
from memfit.report.shapes import run_width
from memfit.units import format_bytes, size_arg

__all__ = ["Diagnosis", "FailedJob", "Fix", "diagnose", "failed_job", "from_run_dir", "gpu_of"]


# --- diagnosis -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class FailedJob(Job):
    """The job that ran out of memory, as far as the flags, the run folder and the message tell."""

    # False: the effective batch was not given (the job's is the micro-batch's accumulation)
    effective_batch_known: bool = True
    # the data's longest row in tokens (None: not known) and where ``seq_len`` was read
    longest_tokens: int | None = None
    seq_len_source: str | None = None


def failed_job(
    *,
    batch_size: int,
    gradient_accumulation_steps: int | None = None,
    effective_batch_size: int | None = None,
    **knobs: Any,
) -> FailedJob:
    """The job that ran out of memory, ``batch_size`` its micro-batch that failed (as
    ``memfit doctor --batch-size`` and ``memfit estimate`` name it); the effective batch is the
    micro-batch's accumulation over the ranks when not given. ``knobs``: the other
    :class:`~memfit.job.Job` fields."""
    # None: not given (no accumulation, one rank); 0 stays 0, for the job's checks to refuse
    accumulation = 1 if gradient_accumulation_steps is None else gradient_accumulation_steps
    ranks = knobs.get("world_size")
    ranks = 1 if ranks is None else ranks
    return FailedJob(
        micro_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        effective_batch_size=effective_batch_size or batch_size * accumulation * ranks,
        effective_batch_known=effective_batch_size is not None,
        **knobs,
    )


# memfit estimate's names for the job's fields where it spells them otherwise
ESTIMATE_NAMES = {"micro_batch_size": "batch_size"}
_JOB_FIELDS = {f.name: f for f in dataclasses.fields(Job)}
_JOB_HINTS = typing.get_type_hints(Job)


def _off(name: str) -> Any:
    """A lever's value when the failed job does not say: a switch off, a choice of "none"."""
    f = _JOB_FIELDS[name]
    if bool in (_JOB_HINTS[name], *typing.get_args(_JOB_HINTS[name])):
        return False
    return "none" if "none" in (f.metadata.get("choices") or ()) else None


def step_values(job: Job) -> dict[str, Any]:
    """The failed ``job``'s step as :func:`memfit.estimate` names it, every knob of the step
    (:data:`~memfit.job.STEP_FIELDS`): the step's default where the job does not say (fp32, no
    checkpointing, two labels, no accumulation, CUDA), a lever not given off (plain weights),
    None where the estimate has no default; the mini-batch only with the cached loss that has
    one."""
    values: dict[str, Any] = {}
    for name in STEP_FIELDS:
        value = getattr(job, name)
        if value is None:
            value = STEP_DEFAULTS.get(name, _off(name))
        values[ESTIMATE_NAMES.get(name, name)] = value
    if loss_of(job) != "cached-mnrl":
        # a sentence-embedding job with no loss may name a mini-batch: its loss is plain MNRL
        values["mini_batch_size"] = None
    return values


def estimate_kwargs(job: Job) -> dict[str, Any]:
    """The :func:`memfit.estimate` arguments of the failed ``job`` (:func:`step_values`, the
    estimate's defaults for those it does not give)."""
    return {name: value for name, value in step_values(job).items() if value is not None}


def job_record(job: Job) -> dict[str, Any]:
    """The ``--json`` ``knobs``: the failed job as ``memfit estimate`` names it, with its model
    and effective batch (the keys are a contract)."""
    record = {"model": job.model, **step_values(job)}
    known = getattr(job, "effective_batch_known", True)
    effective = job.effective_batch_size if known else None
    shapes = {
        "mini_batch_size": record.pop("mini_batch_size", None),
        "longest_tokens": getattr(job, "longest_tokens", None),
        "seq_len_source": getattr(job, "seq_len_source", None),
    }
    return record | {"effective_batch_size": effective} | shapes


@dataclass
class Diagnosis:
    report: OomReport
    diagnosis: list[str]
    fixes: list[Fix]
    source: str = "message"
    knobs: Job | None = None  # the job that ran out of memory, when known

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
            "knobs": None if self.knobs is None else job_record(self.knobs),
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
    lines = [KIND_TITLES[report.kind] + (f" on GPU {report.gpu}" if report.gpu is not None else "")]
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
    if report.impossible:
        device = any(reason != HUGE_REQUEST for reason in report.impossible)
        lines.append(
            "the message's figures cannot be true ("
            + "; ".join(report.impossible)
            + "): a garbled or edited message; "
            + ("none of the device's figures is used" if device else "the request is not used")
        )
    if report.derived:
        lines.append(
            "computed from the message's other numbers, not printed in it: "
            + ", ".join(report.derived)
        )
    return lines


def _estimate_total(model: str, kwargs: dict[str, Any]) -> int:
    # start-up time: the estimator loads torch and transformers, which reading a message needs not
    from memfit.estimate import estimate

    return estimate(model, **kwargs).total_bytes


def diagnose(
    report: OomReport,
    *,
    knobs: Job | None = None,
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
    job = knobs  # the cures fit the job (its loss, data, device) even where none can be priced
    if knobs is not None:
        try:
            baseline = _estimate_total(knobs.model, estimate_kwargs(knobs))
        except UsageError as exc:
            if not catch_estimate_errors:
                raise
            lines.append(f"saves_bytes unknown: the estimator cannot model this job ({exc})")
            knobs = None

    def price(settings: Mapping[str, Any]) -> int | None:
        """What the job with ``settings`` (its fields changed) saves on the estimated peak."""
        if knobs is None or baseline is None:
            return None
        kwargs = estimate_kwargs(dataclasses.replace(knobs, **settings))
        try:
            return baseline - _estimate_total(knobs.model, kwargs)
        except UsageError as exc:
            lines.append(f"could not estimate {dict(settings)}: {exc}")
            return None

    notes: list[str] = []
    offered = cures(job, price, report, notes)
    lines += notes
    for fix in offered:
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
    if report.kind in ("cpu", "memfit-cap"):
        # memfit plan prices a GPU (its runtime, its kernels): no answer for a CPU process
        lines.append("not proposed: memfit plan — it plans for a GPU's memory, not the CPU's")
    else:
        fixes.append(_plan_fix(report, knobs))
    return Diagnosis(report=report, diagnosis=lines, fixes=fixes, source=source, knobs=knobs)


def _plan_fix(report: OomReport, knobs: Job | None) -> Fix:
    """The command that searches every lever at once for this budget.

    A value ``memfit plan`` would refuse (a run folder's edited ``run.json``, a message's
    impossible capacity) is printed as its placeholder (``N``, ``--gpu NAME``) instead: memfit
    never prints a command it refuses."""
    budget = report.capacity_bytes
    gpu_memory = size_arg(budget) if budget is not None and budget > 0 else None
    refused: list[str] = []
    kept: dict[str, Any] = {}
    ranks: dict[str, Any] = {}
    if knobs is not None:
        # start-up time: the planner loads the estimator (torch), which reading a message needs not
        from memfit.plan.planner import PINS, plan_problems

        # the job's own settings of the levers a plan uses only when allowed (its LoRA rank, its
        # base weights) that memfit plan keeps as given: the planner's pins
        kept = {name: getattr(knobs, name) for name in PINS if getattr(knobs, name) is not None}
        # its ranks and how they shard the model, which memfit plan plans at as given (one rank
        # unsharded: the plan's own default, no flag)
        ranks = {
            name: value
            for name, value in levers.BY_NAME["sharding"].values(knobs).items()
            if value not in (None, 1, "none")
        }
        try:
            refused = plan_problems(
                knobs.model,
                task=knobs.task,
                seq_len=_rows_length(knobs),
                effective_batch_size=knobs.effective_batch_size,
                gpu_memory=gpu_memory,
                loss=loss_of(knobs) if knobs.task == "sentence-embedding" else None,
                num_labels=knobs.num_labels or 2,
                **kept,
            )
            # what the planner checks of the ranks (the effective batch splits over them)
            refused += levers.BY_NAME["sharding"].problems(knobs)
        except Exception:  # the command is advice: unchecked, it is all placeholders
            knobs, kept, ranks = None, {}, {}

    def value(flag: str, given: Any, placeholder: str) -> str:
        """``given`` as the command's value of ``flag``, or the placeholder where plan refuses it."""
        if knobs is None or any(p.startswith((f"{flag}:", f"{flag} ")) for p in refused):
            return placeholder
        return str(given)

    # a problem that names no flag is the model's (it cannot be read, memfit does not know it)
    model_refused = knobs is None or any(not p.startswith("--") for p in refused)
    # quoted: a model folder's path may hold spaces or a shell's special characters
    parts = ["memfit plan", "MODEL" if model_refused or knobs is None else shlex.quote(knobs.model)]
    parts += ["--task", value("--task", knobs.task if knobs else None, "TASK")]
    parts += [
        "--effective-batch-size",
        value("--effective-batch-size", knobs.effective_batch_size if knobs else None, "N"),
    ]
    parts += ["--seq-len", value("--seq-len", _rows_length(knobs) if knobs else None, "LEN")]
    if knobs is not None and knobs.task == "sentence-embedding" and knobs.loss is not None:
        parts += ["--loss", value("--loss", loss_of(knobs), "LOSS")]
    if knobs is not None and knobs.task == "classification" and (knobs.num_labels or 2) != 2:
        parts += ["--num-labels", value("--num-labels", knobs.num_labels, "K")]
    # the job's own lever settings (the plan keeps them) and its ranks, each flag as its lever
    # writes it
    for setting in levers.flags(kept | ranks):
        flag, _, given = setting.partition(" ")
        parts += [flag, value(flag, given, _placeholder(flag))] if given else [flag]
    if gpu_memory is not None and not any(p.startswith("--gpu-memory") for p in refused):
        parts += ["--gpu-memory", gpu_memory]
    else:
        parts += ["--gpu", "NAME"]
    return Fix(
        change="run `" + " ".join(parts) + "` for a full plan (cheapest cures first)",
        saves_bytes=None,
        cost="none: it only prints a plan",
        lever="plan",
    )


def _rows_length(job: Job) -> int:
    """The tokens per row of ``job``'s step: its sequence length, cut to its ``max_seq_len``
    (memfit plan takes no cut: its ``--seq-len`` is the rows' length); 0 when not known."""
    seq_len, cut = job.seq_len or 0, job.max_seq_len
    return min(seq_len, cut) if cut else seq_len


def _placeholder(flag: str) -> str:
    """A command's stand-in for the value of a knob's ``flag`` that memfit plan refuses:
    ``KIND`` for a choice, else the initial of its last word (``--lora-rank R``)."""
    f = next((f for f in _JOB_FIELDS.values() if flag_of(f) == flag), None)
    if f is None or f.metadata.get("choices"):
        return "KIND"
    return f.name.rsplit("_", 1)[-1][0].upper()


# --- inputs: a message, a log file, a run folder ---------------------------------------------------
_NO_OOM = "no out-of-memory message found in the text"


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat[:60] + ("…" if len(flat) > 60 else "")


def from_text(
    text: str, *, flag: str, knobs: Job | None = None, source: str = "message"
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


def from_file(path: str, *, knobs: Job | None = None) -> Diagnosis:
    """The last OOM message of a log file (``-``: standard input)."""
    if path == "-":
        text = sys.stdin.read()
    else:
        file = Path(path)
        if not file.is_file():
            raise UsageError(f"--file: {path} does not exist (or is not a file)")
        text = file.read_text(encoding="utf-8", errors="replace")
    return from_text(text, flag=f"--file {path}", knobs=knobs, source=f"file {path}")


def _read_events(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The events memfit train wrote (:mod:`memfit.report.run_files`) and a note naming the lines
    left out (half a line from a run killed mid-write, an edited field)."""
    found = run_files.read_jsonl(path, "events")
    notes = [run_files.skipped_note(path, found.bad)] if found.bad else []
    # several ranks log each agreed back-off once each: keep one
    return agreed_events(found.rows), notes


def knobs_from_run(
    run: dict[str, Any], micro_batch_size: int | None, events: list[dict[str, Any]] | None = None
) -> FailedJob | None:
    """The failed job's knobs from a run folder's ``run.json`` and ``events`` (None if it lacks
    the model), at the shapes the run fed (:func:`memfit.report.shapes.run_width`). ``micro_batch_size``: the rows
    the failed step held at once; for an in-batch-negatives loss that is the GradCache
    mini-batch, the step's batch staying whole."""
    config = run.get("config") or {}
    resolved = run.get("resolved") or {}
    model, task = config.get("model"), config.get("task")
    if not model or not task:
        return None
    batch = micro_batch_size or resolved.get("micro_batch_size") or config.get("micro_batch_size")
    if not batch:
        return None
    batch = int(batch)
    width = run_width(run, events or [])
    effective = int(config.get("effective_batch_size") or 0) or None
    world = int(resolved.get("world_size") or config.get("world_size") or 1)
    loss, mini = config.get("loss"), None
    canonical = resolve_loss(str(task), loss, [])
    if canonical in IN_BATCH_NEGATIVE_LOSSES:
        # memfit train hands the whole step to the loss, ``batch`` rows embedded at a time
        per_rank = max(1, (effective or batch) // world)
        if batch < per_rank or canonical == "cached-mnrl":
            loss, mini = CACHED_LOSSES.get(canonical, canonical), batch
        batch, accumulation = per_rank, 1
    else:
        accumulation = max(1, -(-(effective or batch) // (batch * world)))
    device = str(resolved.get("device") or config.get("device") or "cuda")
    # the ranks' sharding as the run resolved it; an edited value no scheme names is left out
    sharding = resolved.get("sharding") or config.get("sharding") or "none"
    if sharding not in (_JOB_FIELDS["sharding"].metadata.get("choices") or ()):
        sharding = "none"
    # the run's own lever settings (its optimizer, LoRA, base weights, ...); the shapes, the
    # batches and what the run resolved are read above
    own = run_files.lever_settings(config, skip=run_files.FROM_THE_RUN)
    return failed_job(
        model=str(model),
        task=str(task),
        batch_size=batch,
        seq_len=width.seq_len,
        longest_tokens=width.longest_tokens,
        seq_len_source=width.source,
        precision=str(resolved.get("precision") or config.get("precision") or "fp32"),
        gradient_checkpointing=bool(
            resolved.get("gradient_checkpointing", config.get("gradient_checkpointing")) or False
        ),
        num_labels=int(config.get("num_labels") or len(config.get("labels") or []) or 2),
        loss=loss,
        mini_batch_size=mini,
        **own,
        gradient_accumulation_steps=accumulation,
        effective_batch_size=effective,
        world_size=world,
        sharding=str(sharding),
        device="cpu" if device.startswith("cpu") else "cuda",
    )


def _guard_lines(
    events: list[dict[str, Any]], last: dict[str, Any], job: Job | None, in_batch: bool
) -> list[str]:
    """What the run folder's events say the guard did. ``in_batch``: an in-batch-negatives loss,
    whose guard lowers the GradCache mini-batch (the rows embedded at once) and keeps the step's
    batch (``job``'s micro-batch) whole."""
    size = "mini-batch" if in_batch else "micro-batch"
    where = f"step {last.get('step')}" + (f" ({last['phase']})" if last.get("phase") else "")
    if not in_batch:
        lines = [f"the last at {where} with micro-batch {last.get('micro_batch_size')}"]
    else:
        whole = f": the step's batch of {job.micro_batch_size} stays whole" if job else ""
        lines = [
            f"the last at {where} with {last.get('micro_batch_size')} rows embedded at once "
            f"(in-batch negatives{whole})"
        ]
    for event in events:
        step = f"step {event.get('step')}"
        if event.get("type") == "backoff":
            if "cure" in event:
                lines.append(f"{step}: the guard switched on {event['cure']}")
            elif event.get("max_tokens_from") is not None:
                lines.append(
                    f"{step}: the guard backed off the token budget from "
                    f"{event['max_tokens_from']} to {event.get('max_tokens_to')} tokens"
                )
            elif in_batch:
                lines.append(
                    f"{step}: the guard lowered the GradCache mini-batch from {event.get('from')} "
                    f"to {event.get('to')} (the step's batch kept whole) and re-ran the step"
                )
            else:
                lines.append(
                    f"{step}: the guard backed off from micro-batch "
                    f"{event.get('from')} to {event.get('to')} and re-ran the step"
                )
        elif event.get("type") == "probe" and event.get("ooms"):
            lines.append(
                f"the probe (step 0, the longest rows) hit {event['ooms']} OOM(s) and settled on "
                f"{size} {event.get('micro_batch_size')}"
            )
        elif event.get("type") == "grow":
            lines.append(f"{step}: the guard grew the {size} to {event.get('to')}")
        elif event.get("reason"):
            lines.append(f"{step}: {event['reason']}")
    return lines


def _shapes_line(job: FailedJob, run: dict[str, Any]) -> str:
    """Which sequence length the fixes are priced at, and where it was read."""
    line = f"fixes priced at {job.seq_len} tokens per row, from {job.seq_len_source}"
    if job.longest_tokens is not None:
        line += f"; the data's longest row has {job.longest_tokens} tokens"
    allowed = (run.get("config") or {}).get("max_seq_len")
    if allowed and int(allowed) != job.seq_len:
        line += f" (--max-seq-len {allowed} is only the limit rows were cut to)"
    return line


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
    events, notes = _read_events(events_file)
    ooms = [e for e in events if e.get("type") == "oom"]
    if not ooms:
        left_out = f"; {notes[0]}" if notes else ""
        raise UsageError(
            f"RUN_DIR: {_NO_OOM}s of {events_file} (the run had no out-of-memory event)" + left_out
        )
    last = ooms[-1]
    report = parse_oom(str(last.get("error") or "")) or OomReport(
        kind="unknown", message=str(last.get("error") or "")
    )
    run: dict[str, Any] = {}
    run_file = folder / "run.json"
    if run_file.is_file():
        try:
            run, run_notes = run_files.read_run_json(run_file)
        except (ValueError, UnicodeDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise UsageError(f"{run_file}: not JSON ({reason})") from None
        notes += run_notes
    knobs = knobs_from_run(run, last.get("micro_batch_size"), events) if run else None
    in_batch = knobs is not None and loss_of(knobs) in IN_BATCH_NEGATIVE_LOSSES
    # newer run folders name what the guard lowered on each event
    in_batch = in_batch or any(e.get("what") == "mini_batch" for e in ooms)
    context = [f"{len(ooms)} out-of-memory event{'s' if len(ooms) != 1 else ''} in {events_file}"]
    context += notes
    context += _guard_lines(events, last, knobs, in_batch)
    if not run:
        context.append(f"saves_bytes unknown: {folder} has no run.json")
    elif knobs is None:
        context.append(f"saves_bytes unknown: {run_file} does not name the model and task")
    else:
        context.append(_shapes_line(knobs, run))
    return diagnose(
        report,
        knobs=knobs,
        context=context,
        source=f"run folder {path}",
        catch_estimate_errors=True,
    )


def format_text(result: Diagnosis) -> str:
    """The readable report: numbers, the diagnosis, the fixes cheapest first."""
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
    out.append("fixes, cheapest first (the order memfit plan tries them):")
    for number, fix in enumerate(result.fixes, 1):
        saves = "" if fix.saves_bytes is None else f" — saves {format_bytes(fix.saves_bytes)}"
        out.append(f"  {number}. {fix.change}{saves}")
        out.append(f"     cost: {fix.cost}")
    return "\n".join(out)
