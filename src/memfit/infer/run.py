"""Guarded inference, shared by ``memfit predict`` and ``memfit embed``.

The flow, top to bottom (:func:`run`):

1. **Check** every flag at once before anything is read or allocated (:func:`config_problems`).
2. **Read** the rows with memfit's data reader (:mod:`memfit.infer.inputs`): a bad row is exit 2
   with the file and line, and nothing is written.
3. **Measure** every row's length in tokens as the model will see it (truncated to
   ``--max-seq-len``, special tokens in).
4. **Plan** the starting batch (:func:`plan_batch_size`): ``--batch-size`` if given; else, with a
   budget (``--gpu-memory``, or the GPU's free memory), the largest batch whose
   ``memfit.estimate(..., mode="eval")`` at the longest row fits the budget less a 5 % margin;
   else (the CPU without a budget) 64. Never more rows than there are.
5. **Run** the rows in blocks of at least 4,096 (so outputs go to disk as they come): each block
   longest first, in chunks of the current batch, through
   :meth:`memfit.guard.Guard.evaluate`, the guard's eval path: on out-of-memory only the failed
   chunk is re-run, at half the size; finished chunks are kept. The smaller size then holds for
   the rest of the run (no growing back: a later block may hold rows as long as the one that
   failed). A row that does not fit even alone stops the run with exit 3.
6. **Write** each block's outputs back in input order (:class:`GuardedInference` checks that every
   row came back exactly once), atomically (:mod:`memfit.infer.output`).

``--memory-cap SIZE`` makes the device behave as if it had SIZE (:func:`memfit.guard.memory_cap`:
on the CPU live tensor bytes are counted and a real ``torch.OutOfMemoryError`` is raised past the
cap), so the back-off is exercised, and tested, without a GPU. The cap plays the device; it does
not inform the plan (``--gpu-memory`` does), exactly as in ``memfit train``.

A row's output does not depend on the batch it ran in (dropout is off in eval mode; padding is
masked): runs that backed off give the same outputs as runs that did not, up to float summation
order (the chunk widths differ).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from memfit.data.batching import padded_width
from memfit.data.rows import DataError, problem_at
from memfit.errors import NothingFitsError, UsageError
from memfit.estimate import estimate as memfit_estimate
from memfit.guard import Guard, StepTooLarge, memory_cap
from memfit.infer.inputs import Input
from memfit.job import DEVICES, PRECISIONS, choice_problem, whole_problem
from memfit.paths import dir_problem, file_problem
from memfit.runtime import JsonlLog, autocast, resolve_device
from memfit.units import format_bytes, parse_size

# the starting batch on the CPU without a budget: large enough to batch well, backed off on OOM
DEFAULT_BATCH_SIZE = 64
# the planner never starts above this: larger batches gain no speed and hold more memory
MAX_PLANNED_BATCH_SIZE = 1024
# rows read, sorted and written at a time (at least 16 batches): outputs reach the file as they
# come, and memory holds one block's texts and outputs, not the whole input's
BLOCK_ROWS = 4096
# the share of the budget the plan leaves free, as memfit plan does
SAFETY_MARGIN = 0.05


@dataclass
class InferConfig:
    """What ``memfit predict`` and ``memfit embed`` take (the CLI flags, one to one)."""

    model: str
    """MODEL_DIR: a model folder, or a ``memfit train`` run folder (its ``model/``)."""
    file: str
    """``--file``: the rows (CSV, TSV, JSON Lines, JSON, Parquet, a folder, save_to_disk)."""
    output: str
    """``--output``: ``.jsonl`` (predict), ``.npy`` or ``.parquet`` (embed)."""
    task: str | None = None
    """``--task``: classification | causal-lm (predict); None: read from MODEL_DIR."""
    text_column: str = "text"
    """``--text-column``: the text to run."""
    text_pair_column: str | None = None
    """``--text-pair-column``: the second text of a sentence-pair classifier."""
    id_column: str | None = None
    """``--id-column``: copied to the output beside each row; None: ``id`` when the input has it."""
    batch_size: int | None = None
    """``--batch-size``: the starting batch (overrides the plan); the guard still backs off."""
    gpu_memory: int | str | None = None
    """``--gpu-memory``: the budget the batch is planned for (default: the GPU's free memory)."""
    memory_cap: int | str | None = None
    """``--memory-cap``: behave as if the device had only this much memory."""
    device: str | None = None
    """``--device``: cuda | cpu (default: cuda when there is one)."""
    max_seq_len: int | None = None
    """``--max-seq-len``: truncate rows to this many tokens (default: the model's limit)."""
    precision: str = "fp32"
    """``--precision``: fp32 | bf16 | fp16 (autocast; the weights stay as saved)."""
    events: str | None = None
    """``--events``: write plan, oom, backoff and done events here (JSON Lines)."""
    cache_dir: str | None = None
    """``--cache-dir``: where the data reader caches its Arrow files (default: datasets')."""
    prompt_name: str | None = None
    """``--prompt-name`` (embed): a prompt of the sentence-transformers model's ``prompts``."""
    normalize: bool = False
    """``--normalize`` (embed): unit-length embeddings."""
    base_model: str | None = None
    """``--base-model``: the folder of the model whose LoRA adapters MODEL_DIR holds (default:
    the one their ``adapter_config.json`` names)."""
    overwrite: bool = False
    """``--overwrite``: replace an existing ``--output`` or ``--events`` file that memfit did not
    write (an input never: :func:`memfit.infer.output.destination_problems`)."""


@dataclass(frozen=True)
class InferResult:
    """What a run did; :meth:`summary` is the line the CLI prints to stderr."""

    command: str
    task: str
    rows: int
    output: Path
    batch_size: int
    """The batch the run started with."""
    batch_source: str
    """Where it came from: ``--batch-size``, ``memfit estimate …`` or the default."""
    final_batch_size: int
    """The batch after the back-offs (equal to ``batch_size`` when there were none)."""
    ooms: int
    backoffs: int
    longest_tokens: int
    seconds: float
    """Wall time of the guarded loop (model and data loading excluded)."""
    peak_bytes: int | None
    """CUDA: max allocated; under ``--memory-cap`` on the CPU: live tensor bytes; else None."""
    predicted_peak_bytes: int | None
    budget_bytes: int | None

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        ran = (
            f"ran down to {self.final_batch_size} after {self.backoffs} back-off(s)"
            if self.backoffs
            else "no back-off"
        )
        peak = f"; peak {format_bytes(self.peak_bytes)}" if self.peak_bytes is not None else ""
        return (
            f"memfit {self.command}: {self.rows} rows ({self.task}) -> {self.output}; batch "
            f"{self.batch_size} ({self.batch_source}), {ran}; "
            f"{self.rows_per_second:.1f} rows/s{peak}"
        )


class Runner(Protocol):
    """One task's model: what the shared loop needs of it (``memfit.infer.predict``/``embed``)."""

    task: str  # the task as memfit.estimate names it
    model: torch.nn.Module
    max_seq_len: int
    num_labels: int  # the estimate's classification head (2 elsewhere)

    def lengths(self, texts: list[tuple[str, ...]]) -> list[int]:
        """Each row's length in tokens as the model sees it."""
        ...

    def run_chunk(self, items: list[Item]) -> list[Any]:
        """The outputs of one chunk, one per item, in host memory (numpy, not tensors)."""
        ...

    def to(self, device: torch.device) -> None: ...


@dataclass(frozen=True)
class Item:
    """One input row as the guard sees it."""

    index: int
    """The row's place in the input (0-based): what the output is ordered by."""
    length: int
    """Its length in tokens (truncated, special tokens in): the guard sorts by it."""
    texts: tuple[str, ...]
    where: str
    """``--file: data.csv line 7``: for messages."""


# --- checks --------------------------------------------------------------------------------------
def config_problems(cfg: InferConfig) -> list[str]:
    """Every problem with the flags, at once, before anything is read or loaded."""
    problems: list[str] = []
    for flag, count in (("--batch-size", cfg.batch_size), ("--max-seq-len", cfg.max_seq_len)):
        if count is not None and (problem := whole_problem(flag, count)):
            problems.append(problem)
    for flag, value in (("--gpu-memory", cfg.gpu_memory), ("--memory-cap", cfg.memory_cap)):
        if value is not None:
            try:
                parse_size(value, name=flag)
            except UsageError as exc:
                problems.append(str(exc))
    if problem := choice_problem("--precision", cfg.precision, PRECISIONS):
        problems.append(problem)
    if cfg.device is not None:
        if problem := choice_problem("--device", cfg.device, DEVICES):
            problems.append(problem)
        elif cfg.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda: this machine has no CUDA GPU; use --device cpu")
    # destinations that cannot be written fail now, before the model loads and the rows run
    if cfg.events is not None:
        problem = file_problem(cfg.events, "--events")
        if problem is not None:
            problems.append(problem)
    if cfg.cache_dir is not None:
        problem = dir_problem(cfg.cache_dir, "--cache-dir")
        if problem is not None:
            problems.append(problem)
    columns = [cfg.text_column, cfg.text_pair_column]
    if cfg.id_column is not None and cfg.id_column in columns:
        problems.append(f"--id-column: {cfg.id_column!r} is also a text column; pick another")
    return problems


def check_max_seq_len(cfg: InferConfig, limit: int, what: str) -> int:
    """``--max-seq-len`` (or the model's ``limit`` without it); never past the positions."""
    if cfg.max_seq_len is None:
        return limit
    if cfg.max_seq_len > limit:
        raise UsageError(
            f"--max-seq-len: {cfg.max_seq_len} is beyond the {limit} tokens {what} can take; "
            f"use --max-seq-len {limit} or less"
        )
    return cfg.max_seq_len


# --- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchPlan:
    """The starting batch and where it came from."""

    batch_size: int
    source: str
    seq_len: int | None = None
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None


def plan_batch_size(
    folder: Path,
    task: str,
    *,
    rows: int,
    longest: int,
    device: torch.device,
    budget: int | None,
    counts_context: bool = False,
    precision: str = "fp32",
    num_labels: int = 2,
    given: int | None = None,
    estimate: Callable[..., Any] | None = None,
) -> BatchPlan:
    """The batch to start with: ``given``; else the largest batch (up to ``rows`` and 1024)
    whose eval-mode estimate at the longest row fits ``budget`` less the safety margin; else
    (no budget) 64. ``counts_context``: the budget is free memory measured with this process's
    CUDA context already made, so the estimate's context (runtime overhead) is not counted twice.
    Exit 3 (NothingFitsError) when even one row of the longest length does not fit."""
    if given is not None:
        return BatchPlan(given, "--batch-size")
    if budget is None:
        return BatchPlan(
            min(DEFAULT_BATCH_SIZE, rows), f"default {DEFAULT_BATCH_SIZE}: no GPU, no --gpu-memory"
        )
    if estimate is None:
        estimate = memfit_estimate
    assert estimate is not None
    # the width the longest chunk is fed at: rounded up to 8 on GPUs (aligned shapes)
    seq_len = padded_width(longest, 8 if device.type == "cuda" else 1)
    usable = int(budget * (1 - SAFETY_MARGIN))

    def need(batch_size: int) -> int:
        result = estimate(
            str(folder),
            task=task,
            batch_size=batch_size,
            seq_len=seq_len,
            mode="eval",
            device=device.type,
            precision=precision,
            num_labels=num_labels,
        )
        context = int(result.breakdown.get("runtime_overhead", 0)) if counts_context else 0
        return int(result.total_bytes) - context

    try:
        one = need(1)
    except UsageError as exc:
        # a model the estimator cannot trace still runs: from the default, guarded
        return BatchPlan(
            min(DEFAULT_BATCH_SIZE, rows),
            f"default {DEFAULT_BATCH_SIZE}: not planned ({str(exc).splitlines()[0]})",
            seq_len,
            budget,
        )
    if one > usable:
        raise NothingFitsError(
            f"one row of {seq_len} tokens needs {format_bytes(one)} (memfit estimate --mode eval), "
            f"more than {format_bytes(usable)} ({format_bytes(budget)} less "
            f"{SAFETY_MARGIN:.0%}): cut rows with --max-seq-len, try --precision bf16, or give "
            "more memory (--batch-size 1 runs it anyway, guarded)"
        )
    high = min(rows, MAX_PLANNED_BATCH_SIZE)
    best, best_need = 1, one
    top = need(high) if high > 1 else one
    if top <= usable:
        best, best_need = high, top
    else:
        # the estimate grows with the batch: the largest that fits, by bisection
        low = 1
        while high - low > 1:
            middle = (low + high) // 2
            needed = need(middle)
            if needed <= usable:
                low, best, best_need = middle, middle, needed
            else:
                high = middle
    return BatchPlan(
        best,
        f"memfit estimate --mode eval: fits {format_bytes(budget)} at {seq_len} tokens",
        seq_len,
        budget,
        best_need,
    )


def budget_bytes(cfg: InferConfig, device: torch.device) -> tuple[int | None, bool]:
    """The plan's budget and whether it is free memory measured with the CUDA context made."""
    if cfg.gpu_memory is not None:
        return parse_size(cfg.gpu_memory, name="--gpu-memory"), False
    if device.type == "cuda":
        # before the model is moved there: the estimate counts the weights itself
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), True
    return None, False


# --- the guarded loop ----------------------------------------------------------------------------
class _Chunks:
    """What :meth:`memfit.guard.Guard.evaluate` needs of a recipe: the items' lengths (it sorts
    by them) and a chunk's outputs; ``eval_reduce`` collects the outputs instead of reducing."""

    splittable = True

    def __init__(self, run_chunk: Callable[[list[Item]], list[Any]], pad_multiple: int) -> None:
        self.run_chunk = run_chunk
        self.pad_multiple = pad_multiple
        self.attempted: list[Item] = []  # the chunk in flight: the one an OOM came from
        self.outputs: list[tuple[int, Any]] = []

    def lengths(self, items: list[Item]) -> list[int]:
        return [item.length for item in items]

    def units(self, rows: list[Any]) -> int:
        return len(rows)

    def loss(
        self, rows: list[Any], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        raise TypeError("inference has no training loss")  # pragma: no cover - never trained

    def eval_partial(self, items: list[Item]) -> list[tuple[int, Any]]:
        self.attempted = items
        outputs = self.run_chunk(items)
        if len(outputs) != len(items):  # pragma: no cover - a runner bug
            raise RuntimeError(f"{len(outputs)} outputs for a chunk of {len(items)} rows")
        return [(item.index, out) for item, out in zip(items, outputs, strict=True)]

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        self.outputs = [pair for partial in partials for pair in partial]
        return {"rows": float(len(self.outputs))}


class GuardedInference:
    """Runs blocks of items through the guard and returns their outputs in the items' order.

    The batch starts at ``batch_size``; each back-off lowers it for the rest of the run.
    ``on_event`` receives the guard's ``oom`` and ``backoff`` events, tagged with ``phase``
    (the command) and the failed chunk's longest row.
    """

    def __init__(
        self,
        run_chunk: Callable[[list[Item]], list[Any]],
        *,
        batch_size: int,
        device: torch.device,
        phase: str = "predict",
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.run_chunk = run_chunk
        self.batch_size = int(batch_size)
        self.phase = phase
        self.autocast = autocast
        self.on_event = on_event
        self.ooms = 0
        self.backoffs = 0
        self._chunks = _Chunks(run_chunk, 8 if device.type == "cuda" else 1)
        self.guard = Guard(self.batch_size, on_event=self._event, device=device)

    def _event(self, event: dict[str, Any]) -> None:
        event = {k: v for k, v in event.items() if k != "step"}
        event["phase"] = self.phase
        if event["type"] == "oom":
            self.ooms += 1
            failed = self._chunks.attempted
            if failed:
                event["longest_tokens"] = max(item.length for item in failed)
        elif event["type"] == "backoff":
            self.backoffs += 1
            # the size that failed stays too large for the rest of the run
            self.batch_size = int(event["to"])
        if self.on_event is not None:
            self.on_event(event)

    def run(self, items: list[Item]) -> list[Any]:
        """The outputs of ``items``, in the order of ``items``; every item exactly once."""
        self._chunks.outputs = []
        try:
            self.guard.evaluate(
                items, self._chunks, autocast=self.autocast, micro_batch_size=self.batch_size
            )
        except StepTooLarge as exc:
            failed = self._chunks.attempted
            where = failed[0].where if failed else "a row"
            tokens = failed[0].length if failed else 0
            raise NothingFitsError(
                f"{where}: this row ({tokens} tokens) runs out of memory even alone ({exc.error}); "
                "cut rows with --max-seq-len, try --precision bf16, or give the device more memory"
            ) from None
        by_index = dict(self._chunks.outputs)
        if len(by_index) != len(self._chunks.outputs) or len(by_index) != len(items):
            raise RuntimeError(  # pragma: no cover - the guard runs every row exactly once
                f"{len(self._chunks.outputs)} outputs for {len(items)} rows"
            )
        return [by_index[item.index] for item in items]


# --- the run -------------------------------------------------------------------------------------
def measure_lengths(runner: Runner, data: Input) -> np.ndarray[Any, Any]:
    """Every row's token length, read in blocks; a row with no tokens is a problem at its line
    (nothing to run), all reported at once."""
    lengths = np.zeros(len(data), dtype=np.int64)
    problems = []
    for start in range(0, len(data), 1000):
        rows = data.texts(start, min(start + 1000, len(data)))
        counted = runner.lengths([texts for texts, _ in rows])
        lengths[start : start + len(rows)] = counted
        for (_, where), n in zip(rows, counted, strict=True):
            if n < 1:
                problems.append(problem_at(where, "the text has no tokens for this model"))
    if problems:
        raise DataError(problems)
    return lengths


def run(
    cfg: InferConfig,
    command: str,
    runner: Runner,
    data: Input,
    folder: Path,
    write: Callable[[list[int], list[Any]], None],
) -> InferResult:
    """Plan, then run every row of ``data`` under the guard; ``write(indices, outputs)`` gets each
    block in input order (ascending indices). The caller opened the output and commits it."""
    device = resolve_device(cfg.device)
    lengths = measure_lengths(runner, data)
    longest = int(lengths.max())
    budget, counts_context = budget_bytes(cfg, device)
    plan = plan_batch_size(
        folder,
        runner.task,
        rows=len(data),
        longest=longest,
        device=device,
        budget=budget,
        counts_context=counts_context,
        precision=cfg.precision,
        num_labels=runner.num_labels,
        given=cfg.batch_size,
    )
    cap_bytes = parse_size(cfg.memory_cap, name="--memory-cap") if cfg.memory_cap else None
    # --events FILE: a log, flushed as each event happens (a run that stops leaves the events up
    # to the stop; the output file is the atomic one), made afresh when the run starts
    events = JsonlLog(cfg.events or None, mode="w", stamp=True, open_now=True)
    try:
        events.write(
            {
                "type": "plan",
                "phase": command,
                "batch_size": plan.batch_size,
                "source": plan.source,
                "rows": len(data),
                "longest_tokens": longest,
                "budget_bytes": plan.budget_bytes,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "memory_cap_bytes": cap_bytes,
            }
        )
        guarded = GuardedInference(
            runner.run_chunk,
            batch_size=plan.batch_size,
            device=device,
            phase=command,
            autocast=autocast(device, cfg.precision),
            on_event=events.write,
        )
        runner.to(device)
        with memory_cap(cap_bytes, device) as cap:
            if cap is not None:
                # the weights were made before the cap: count them, as a device would hold them
                cap.track(runner.model)
            if cap_bytes is not None:
                _check_weights_fit(cap_bytes, cap, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            block = max(BLOCK_ROWS, 16 * plan.batch_size)
            for start in range(0, len(data), block):
                stop = min(start + block, len(data))
                items = [
                    Item(start + k, int(lengths[start + k]), texts, where)
                    for k, (texts, where) in enumerate(data.texts(start, stop))
                ]
                write([item.index for item in items], guarded.run(items))
            seconds = time.perf_counter() - started
            peak: int | None = None
            if cap is not None:
                peak = int(cap.peak_bytes)
            elif device.type == "cuda":
                peak = int(torch.cuda.max_memory_allocated(device))
        result = InferResult(
            command=command,
            task=runner.task,
            rows=len(data),
            output=Path(cfg.output),
            batch_size=plan.batch_size,
            batch_source=plan.source,
            final_batch_size=guarded.batch_size,
            ooms=guarded.ooms,
            backoffs=guarded.backoffs,
            longest_tokens=longest,
            seconds=seconds,
            peak_bytes=peak,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            budget_bytes=plan.budget_bytes,
        )
        events.write(
            {
                "type": "done",
                "phase": command,
                "rows": result.rows,
                "batch_size": result.final_batch_size,
                "ooms": result.ooms,
                "backoffs": result.backoffs,
                "seconds": round(seconds, 3),
                "peak_bytes": peak,
            }
        )
        return result
    finally:
        events.close()


def _check_weights_fit(cap_bytes: int, cap: Any, device: torch.device) -> None:
    """A cap the model's weights fill by themselves: no row can run, and the first allocation
    would fail wherever it happens to be (inside the tokenizer, which words the OOM as a
    truncation problem). One line now, exit 3."""
    held = int(cap.live_bytes) if cap is not None else int(torch.cuda.memory_allocated(device))
    if held >= cap_bytes:
        raise NothingFitsError(
            f"--memory-cap: the model's weights alone hold {format_bytes(held)} and the cap is "
            f"{format_bytes(cap_bytes)}: no row can run; give a --memory-cap above the weights "
            "(or none)"
        )


def config_from(config: InferConfig | None, knobs: dict[str, Any]) -> InferConfig:
    """An InferConfig from the API's arguments (a config, keyword knobs, or both)."""
    if config is None:
        return InferConfig(**knobs)
    return dataclasses.replace(config, **knobs) if knobs else config
