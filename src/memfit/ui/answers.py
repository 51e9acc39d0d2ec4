"""What ``memfit ui``'s page shows, from the CLI's own estimator and planner: the verdict and the
breakdown (:func:`estimate_answer`), memory against the sequence length and the batch size
(:func:`curves`), the plan (:func:`plan_answer`).

Each answer is the one ``memfit estimate`` or ``memfit plan`` gives for the same job
(:func:`memfit.ui.job.estimate_argv`, :func:`~memfit.ui.job.plan_argv`): the same calls with the
same inputs, and the lines the CLI prints (:mod:`memfit.report.console`). A user-caused problem is
a :class:`~memfit.errors.UsageError` whose text is the line the CLI prints. No Gradio here.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit import levers, progress
from memfit.errors import UsageError
from memfit.job import SEQ_LEN_MULTIPLE
from memfit.models.hub import locate_config
from memfit.report.console import (
    PART_LABELS,
    PLAN_SAFETY_MARGIN,
    budget_words,
    margin_keys,
    note_lines,
    plan_lines,
    plan_rows,
    usable_bytes,
    verdict_lines,
)
from memfit.ui.job import (
    PLAN_FIELDS,
    PageJob,
    command_line,
    estimate_argv,
    knob_widget,
    plan_argv,
)
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.estimate import Estimate
    from memfit.plan import Plan

Listen = Callable[[str], None]

# where an uploaded config.json is written (one folder per content: the trace cache's key is the
# file's, so the same upload is traced once)
UPLOADS = Path(tempfile.gettempdir()) / "memfit-ui"


# --- the model ----------------------------------------------------------------------------------
def resolve(job: PageJob) -> str:
    """The model argument memfit takes for ``job``: its registry name, Hub id or path, found as
    the CLI finds it (:func:`memfit.models.hub.locate_config`: one line when nowhere), or the
    uploaded config.json, checked and written under :data:`UPLOADS` (its path)."""
    if job.config_json is None:
        locate_config(job.model)
        return job.model
    return _write_upload(job.config_json)


# the memos below grow with each new job a page asks; past this many entries the oldest go
_MEMO_LIMIT = 4_096


def _keep(memo: OrderedDict[Any, Any], key: Any, value: Any, limit: int | None = None) -> None:
    """``memo[key] = value``, the oldest entries dropped past ``limit`` (default
    :data:`_MEMO_LIMIT`) entries."""
    limit = _MEMO_LIMIT if limit is None else limit
    memo[key] = value
    while len(memo) > limit:
        # (another request's thread may have emptied it meanwhile)
        with contextlib.suppress(KeyError):
            memo.popitem(last=False)


# the uploads checked: digest of the text → its path
_checked_uploads: OrderedDict[str, str] = OrderedDict()


def _write_upload(text: str) -> str:
    """An uploaded config.json's path, written once per content: broken JSON, or a config memfit's
    loader refuses, is a :class:`UsageError` with the loader's line (as ``memfit estimate
    config.json`` prints it)."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    checked = _checked_uploads.get(digest)
    if checked is not None:
        return checked
    path = UPLOADS / digest / "config.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".config.json.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)  # whole or not at all: another request may read it
    except OSError as exc:
        raise UsageError(f"config.json: cannot be kept at {path}: {exc.strerror or exc}") from None
    # start-up: the config is read by transformers (memfit.models loads it)
    from memfit.models import resolve_model

    try:
        resolve_model(str(path))
    except UsageError as exc:
        # the loader's line, naming the upload rather than the folder it was written to
        raise UsageError(str(exc).replace(str(path), "config.json")) from None
    _keep(_checked_uploads, digest, str(path))
    return str(path)


# --- the estimate ---------------------------------------------------------------------------------
@dataclass
class EstimateAnswer:
    """The page's answer to a job: ``memfit estimate``'s numbers and lines."""

    total_bytes: int
    budget_bytes: int | None
    fits: bool | None
    peak_phase: str
    breakdown: dict[str, int]  # Estimate.breakdown (bytes per part)
    labels: dict[str, str]  # part → its words (the CLI table's)
    verdict: list[str]  # the lines memfit estimate prints under its table, plain
    headline: str  # one line: the verdict, or the total where there is no budget
    as_json: dict[str, Any]  # what memfit estimate --json prints
    command: str  # the memfit estimate command of this job
    # the budget as the verdict names it ("a T4's 14.56 GiB"); None without one
    budget_words: str | None = None
    # the estimate traced (seconds, not a replay's milliseconds): the caller may then call
    # keep_traces(), between answers
    traced: bool = False


def _estimate_keywords(job: PageJob, model_arg: str, **shape: int) -> dict[str, Any]:
    """:func:`memfit.estimate.estimate`'s arguments for ``job`` (at another ``shape``: batch_size,
    seq_len), as memfit estimate passes them."""
    knobs = {k: list(v) if isinstance(v, tuple) else v for k, v in job.knobs.items()}
    return {
        "model": model_arg,
        "task": job.task,
        "batch_size": shape.get("batch_size", job.batch_size),
        "seq_len": shape.get("seq_len", job.seq_len),
        "mode": job.mode,
        "gpu_memory": job.gpu_memory,
        "gpu": job.gpu,
        **knobs,
    }


@contextlib.contextmanager
def _listening(listen: Listen | None) -> Iterator[None]:
    if listen is None:
        yield
        return
    with progress.listening(listen):
        yield


def _estimate(job: PageJob, model_arg: str, **shape: int) -> Estimate:
    # start-up: torch and transformers load with the estimator (seconds, once)
    from memfit.estimate import estimate

    keywords = _estimate_keywords(job, model_arg, **shape)
    return estimate(keywords.pop("model"), **keywords)


def estimate_answer(job: PageJob, *, listen: Listen | None = None) -> EstimateAnswer:
    """The estimate of ``job``, as ``memfit estimate`` answers it (its numbers, ``--json`` and
    lines); ``listen`` hears the progress messages while a first trace runs (seconds)."""
    # memfit estimate's own check, before the trace
    if not 0 <= job.safety_margin < 1:
        raise UsageError(f"--safety-margin: must be in [0, 1), got {job.safety_margin!r}")
    with _listening(listen):
        if listen is not None:
            listen("looking up the model's config.json")
        model_arg = resolve(job)
        if listen is not None and "transformers" not in sys.modules:
            listen("loading torch and transformers")  # seconds, once per process
        result = _estimate(job, model_arg)
    _remember(job, model_arg, result.batch_size, result.seq_len, result.total_bytes)
    _keep(_BUDGETS, _knobs_key(job, model_arg), result.budget_bytes)
    verdict = [line.plain for line in verdict_lines(result, job.safety_margin)]
    verdict += note_lines(result, job.knob("optimizer"), job.knob("device"))
    return EstimateAnswer(
        total_bytes=result.total_bytes,
        budget_bytes=result.budget_bytes,
        fits=result.fits,
        peak_phase=result.peak_phase,
        breakdown=dict(result.breakdown),
        labels={key: PART_LABELS.get(key, key) for key in result.breakdown},
        verdict=verdict,
        headline=_headline(result, verdict),
        as_json=result.to_dict() | margin_keys(result, job.safety_margin),
        command=command_line(estimate_argv(job, model_arg)),
        budget_words=None
        if result.budget_bytes is None
        else budget_words(result.budget_bytes, result.details.get("gpu")),
        traced=float(result.details.get("estimate_seconds") or 0) > _TRACED_SECONDS,
    )


# an estimate this slow traced (a replay is milliseconds)
_TRACED_SECONDS = 0.5


def keep_traces() -> None:
    """After a trace (:attr:`EstimateAnswer.traced`): its garbage collected now, and what is
    left (the traces, kept for the process's life) out of the collector's sight, so that a full
    collection never pauses a slider's answer (hundreds of milliseconds over a few traces'
    objects). Process-wide and for good (:func:`gc.freeze`): for the server that owns the process
    (memfit ui's page), never called by the answers themselves."""
    gc.collect()
    gc.freeze()


def _headline(result: Estimate, verdict: list[str]) -> str:
    """The verdict's line (``Fits in a T4's 14.56 GiB: 5.30 GiB to spare``), else the total."""
    if result.budget_bytes is None:
        return f"{format_bytes(result.total_bytes)} (no budget: name a card or a memory size)"
    return verdict[1].removesuffix(".")


def is_traced(job: PageJob, model_arg: str | None = None) -> bool:
    """Whether :func:`estimate_answer` answers ``job`` from a trace in memory or on disk
    (milliseconds), not a new trace (seconds). A model that is nowhere: False (the estimate says
    why)."""
    try:
        model_arg = model_arg or resolve(job)
        # start-up: torch and transformers load with the estimator
        from memfit.estimate.api import is_traced as traced

        keywords = _estimate_keywords(job, model_arg)
        return traced(keywords.pop("model"), **keywords)
    except UsageError:
        return False


# --- the curves -----------------------------------------------------------------------------------
@dataclass
class Curve:
    """Memory against one axis of the shape, the job's other knobs kept."""

    axis: str  # "seq_len" | "batch_size"
    points: list[tuple[int, int]]  # (x, total bytes), exact estimates, x ascending
    budget_bytes: int | None
    usable_bytes: int | None  # the budget less the job's safety margin
    crossing: int | None  # the largest x that fits the budget; None: all fit, none fit, no budget
    note: str  # what the curve says, in words
    # some points are missing: their kind of shape (a batch of one, a length that is no
    # multiple of 8) has no trace yet
    partial: bool = False
    at: int = 0  # the other axis's value (the job's batch size, or its sequence length)


# the totals already estimated: (the job's knobs, batch, length) → bytes; the page's curves ask
# the same shapes again and again as a slider moves
_TOTALS: OrderedDict[tuple[Any, ...], int] = OrderedDict()
_TOTALS_LIMIT = 20_000


def _knobs_key(job: PageJob, model_arg: str) -> tuple[Any, ...]:
    key = job.key()
    # the key without the shape (batch_size, seq_len) and the plan's settings
    return (model_arg, *key[:5], *key[7:9])


def _remember(job: PageJob, model_arg: str, batch: int, seq: int, total: int) -> None:
    _keep(_TOTALS, (_knobs_key(job, model_arg), batch, seq), total, _TOTALS_LIMIT)


def _total(job: PageJob, model_arg: str, batch: int, seq: int) -> int | None:
    """The total of ``job`` at (``batch``, ``seq``), from its traces only; None: that kind of
    shape is not traced yet (never traced here)."""
    key = (_knobs_key(job, model_arg), batch, seq)
    kept = _TOTALS.get(key)
    if kept is not None:
        return kept
    # start-up: the estimator's traces (torch) are loaded by the estimate before any curve
    from memfit.estimate.traces import NotTraced, only_cached

    try:
        with only_cached():
            total = _estimate(job, model_arg, batch_size=batch, seq_len=seq).total_bytes
    except NotTraced:
        return None
    _remember(job, model_arg, batch, seq, total)
    return total


def seq_grid(positions: int, at: int) -> list[int]:
    """The lengths of the length curve: 64, 96, 128, 192, 256, ... (each power of two and the
    one half-way to the next, multiples of 8) up to the model's ``positions``. Not the job's own
    length ``at``: the curve stays as it is while that length moves (the browser does not redraw
    it); the verdict is the job's point. ``at`` only where no other length fits the model."""
    grid: set[int] = set()
    x = 64
    while x <= positions:
        grid.add(x)
        if x * 3 // 2 <= positions:
            grid.add(x * 3 // 2)
        x *= 2
    grid.add(positions - positions % SEQ_LEN_MULTIPLE or positions)
    return sorted(g for g in grid if 1 <= g <= positions) or [at]


def batch_grid(at: int, limit: int = 256) -> list[int]:
    """The batch sizes of the batch curve: 1, 2, 4, ... up to ``limit`` (not the job's own
    ``at``: the curve stays as it is while the batch moves), and beyond it to ``at`` where the
    job's batch is larger."""
    grid: set[int] = set()
    x = 1
    while x <= limit:
        grid.add(x)
        x *= 2
    if at > limit:
        grid.add(at)
    return sorted(grid)


def curves(job: PageJob) -> tuple[Curve, Curve]:
    """Memory against the sequence length (at the job's batch size) and against the batch size
    (at the job's length), each with the budget's line and the largest value that fits it
    (exact: a search on exact estimates). Only shapes of the job's knobs, from their traces:
    never a trace here (a kind of shape not traced yet is left out, ``partial``); each total is
    kept (:data:`_TOTALS`), so a slider's next move re-asks few. Call after
    :func:`estimate_answer` of the job (which traces what is needed)."""
    model_arg = resolve(job)
    # start-up: the model's config (transformers) is loaded by the estimate before any curve
    from memfit.models import resolve_model

    positions = resolve_model(model_arg).max_positions
    budget = _budget(job, model_arg)
    usable = None if budget is None else usable_bytes(budget, job.safety_margin)
    where = _budget_phrase(job, budget)
    seq = _curve(
        job,
        model_arg,
        "seq_len",
        seq_grid(positions, job.seq_len),
        lambda x: _total(job, model_arg, job.batch_size, x),
        budget,
        usable,
        step=SEQ_LEN_MULTIPLE,
        limit=positions,
    )
    seq.note = _seq_note(seq, job, positions, where)
    batch = _curve(
        job,
        model_arg,
        "batch_size",
        batch_grid(job.batch_size),
        lambda x: _total(job, model_arg, x, job.seq_len),
        budget,
        usable,
        step=1,
        limit=None,
    )
    batch.note = _batch_note(batch, job, where)
    return seq, batch


# the budget of each job's knobs, as its estimate found it
_BUDGETS: OrderedDict[tuple[Any, ...], int | None] = OrderedDict()
_UNKNOWN = object()  # (a budget not kept yet; None is a job's without one)


def _budget(job: PageJob, model_arg: str) -> int | None:
    """The job's budget, as its estimate has it."""
    if job.gpu is None and job.gpu_memory is None:
        return None
    key = _knobs_key(job, model_arg)
    kept = _BUDGETS.get(key, _UNKNOWN)
    if kept is not _UNKNOWN:
        return kept  # type: ignore[return-value]
    # start-up: the estimator is loaded by then (estimate_answer ran)
    from memfit.estimate.traces import NotTraced, only_cached

    try:
        with only_cached():
            budget = _estimate(job, model_arg).budget_bytes
    except NotTraced:
        return None
    _keep(_BUDGETS, key, budget)
    return budget


def _budget_phrase(job: PageJob, budget: int | None) -> str:
    """``in a T4's 14.56 GiB``: the budget as the verdict names it."""
    if budget is None:
        return ""
    gpu = {"id": job.gpu, "budget_is_gpu_memory": job.gpu_memory is None} if job.gpu else None
    return f"in {budget_words(budget, gpu)}"


def _curve(
    job: PageJob,
    model_arg: str,
    axis: str,
    grid: list[int],
    total_at: Callable[[int], int | None],
    budget: int | None,
    usable: int | None,
    *,
    step: int,
    limit: int | None,
) -> Curve:
    points: list[tuple[int, int]] = []
    partial = False
    for x in grid:
        total = total_at(x)
        if total is None:
            partial = True
            continue
        points.append((x, total))
        if (
            budget is not None
            and total > 1.5 * budget
            and x > (job.seq_len if axis == "seq_len" else job.batch_size)
        ):
            break  # far past the card's line: the rest says nothing more
    crossing = None
    if budget is not None:
        crossing = _crossing(points, total_at, budget, step)
    at = job.batch_size if axis == "seq_len" else job.seq_len
    return Curve(axis, points, budget, usable, crossing, "", partial, at)


def _crossing(
    points: list[tuple[int, int]],
    total_at: Callable[[int], int | None],
    budget: int,
    step: int,
) -> int | None:
    """The largest x (a multiple of ``step``) that fits ``budget``, between the last point that
    fits and the first above it that does not, found on exact totals: a guess on the straight
    line between the two (memory is close to linear there) and its neighbour check it, a
    bisection where that does not close in. None: none of the points fits, or all do, or a shape
    it needs is not traced."""
    fitting = [x for x, total in points if total <= budget]
    if not fitting:
        return None
    low = max(fitting)
    above = [(x, total) for x, total in points if x > low]
    if not above:
        return None
    totals = dict(points)
    high = min(x for x, _ in above)

    def total(x: int) -> int | None:
        if x not in totals:
            found = total_at(x)
            if found is None:
                return None
            totals[x] = found
        return totals[x]

    for guesses in range(64):
        if high - low <= step:
            return low
        if guesses < 2 and totals[high] > totals[low]:
            # the straight line's crossing, rounded down to a multiple of step
            line = low + (budget - totals[low]) * (high - low) / (totals[high] - totals[low])
            mid = int(line) // step * step
        else:
            mid = (low + high) // 2 // step * step
        mid = min(max(mid, low + step), high - step)
        at = total(mid)
        if at is None:
            return None
        if at <= budget:
            low = mid
            # its neighbour above: does not fit, and the crossing is found
            after = total(mid + step) if mid + step < high else None
            if after is not None and after > budget:
                return mid
            if after is not None:
                low = mid + step
        else:
            high = mid
            before = total(mid - step) if mid - step > low else None
            if before is not None and before <= budget:
                return mid - step
            if before is not None:
                high = mid - step
    return low


def _seq_note(curve: Curve, job: PageJob, positions: int, where: str) -> str:
    at = f"at batch {job.batch_size}"
    return _note(
        curve, "tokens", at, where, f"every length up to the model's {positions:,} positions"
    )


def _batch_note(curve: Curve, job: PageJob, where: str) -> str:
    at = f"at {job.seq_len:,} tokens"
    top = curve.points[-1][0] if curve.points else 0
    return _note(curve, "rows", at, where, f"every batch size up to {top:,}")


def _note(curve: Curve, unit: str, at: str, where: str, all_fit: str) -> str:
    if not curve.points:
        note = f"no point {at} is traced yet"
    elif curve.budget_bytes is None:
        note = "no budget: name a card or a memory size to see where it stops fitting"
    elif curve.crossing is not None:
        note = f"fits up to {curve.crossing:,} {unit} {at} {where}"
    elif all(total <= curve.budget_bytes for _, total in curve.points):
        note = f"{all_fit} fits {at} {where}"
    else:
        note = f"none of these fits {at} {where}"
    if curve.partial:
        # start-up: the estimator is loaded by then
        from memfit.estimate import background

        note += (
            "; the shapes of other kinds (a batch of one, lengths that are no multiple of 8) "
            + ("are being traced in the background" if background.enabled() else "are not traced")
        )
    return note


# --- the plan ---------------------------------------------------------------------------------------
@dataclass
class PlanAnswer:
    """The page's plan: ``memfit plan``'s answer for the job."""

    fits: bool
    lines: list[str]  # the lines memfit plan prints besides its table, plain
    settings: dict[str, Any]  # memfit plan's table: setting → value (text)
    commands: list[str]  # the memfit train command, the memfit estimate that re-checks it
    trainer_lines: list[str]  # Python: apply_plan, and the TrainingArguments fields it sets
    as_json: dict[str, Any]  # what memfit plan --json prints
    command: str  # the memfit plan command of this job
    chosen: dict[str, Any] | None = field(default=None)  # the chosen settings (None: none fits)


def plan_answer(job: PageJob, *, listen: Listen | None = None) -> PlanAnswer:
    """The plan of ``job`` as ``memfit plan`` answers it (:func:`memfit.ui.job.plan_argv`):
    its effective batch, length and budget, the levers it may add, the knobs it pins. Nothing
    fits: ``fits`` False with the CLI's lines (not an exception)."""
    with _listening(listen):
        model_arg = resolve(job)
        # start-up: the planner loads torch and the estimator
        from memfit.plan import plan

        pins = {name: job.knobs[name] for name in PLAN_FIELDS if name in job.knobs}
        pins = {k: list(v) if isinstance(v, tuple) else v for k, v in pins.items()}
        result = plan(
            model_arg,
            task=job.task,
            seq_len=job.seq_len,
            effective_batch_size=job.plan_batch,
            gpu_memory=job.gpu_memory,
            gpu=job.gpu,
            allow=list(job.allow),
            safety_margin=job.safety_margin,
            **pins,
        )
    commands = [c for c in (result.train_command(), result.estimate_command()) if c is not None]
    return PlanAnswer(
        fits=result.fits,
        lines=[line.plain for line in plan_lines(result)],
        settings=dict(plan_rows(result)),
        commands=commands,
        trainer_lines=trainer_lines(result, job, model_arg),
        as_json=result.to_dict(),
        command=command_line(plan_argv(job, model_arg)),
        chosen=result.plan,
    )


# apply_plan's keywords among the page's knobs (it takes no LoRA or quantization: those are the
# model's, not TrainingArguments)
_APPLY_PLAN_KNOBS = ("num_labels", "loss", "precision", "weights_dtype", "cross_entropy")
# the levers apply_plan may add (lora, truncation and quantization it refuses)
_APPLY_PLAN_ALLOW = ("optimizer", "pure-16bit")


def trainer_lines(result: Plan, job: PageJob, model_arg: str) -> list[str]:
    """The plan for a Hugging Face Trainer: the :func:`memfit.integrations.apply_plan` call that
    plans the arguments, and the fields it sets (:func:`memfit.levers.trainer_args` of the chosen
    settings). Nothing fits: none."""
    if result.chosen is None:
        return []
    keywords = [f"seq_len={job.seq_len}", f"task={job.task!r}"]
    if job.gpu_memory is not None:
        keywords.append(f"gpu_memory={job.gpu_memory!r}")
    if job.gpu is not None:
        keywords.append(f"gpu={job.gpu!r}")
    keywords += [f"{name}={job.knobs[name]!r}" for name in _APPLY_PLAN_KNOBS if name in job.knobs]
    allow = [a for a in job.allow if a in _APPLY_PLAN_ALLOW]
    if allow:
        keywords.append(f"allow={allow!r}")
    if job.safety_margin != PLAN_SAFETY_MARGIN:  # apply_plan's default too
        keywords.append(f"safety_margin={job.safety_margin!r}")
    fields = levers.trainer_args(result.chosen.settings())
    # an upload is a config without its model: the call names the model's folder instead
    upload = job.config_json is not None
    model = "MODEL_DIR" if upload else repr(model_arg)
    # TRL's SFTConfig is a TrainingArguments with TRL's own fields (activation offloading, the
    # model's dtype): a causal LM's plan may set those
    arguments = "SFTConfig" if job.task == "causal-lm" else "TrainingArguments"
    lines = [
        "from memfit.integrations import apply_plan",
        "",
        "# args: your TrainingArguments (or TRL's SFTConfig); apply_plan plans the job again for",
        "# them (and for what is installed: Liger Kernel, bitsandbytes) and sets what it chose",
        "# apply_plan takes the effective batch from args: for this plan, their",
        "# per_device_train_batch_size × gradient_accumulation_steps × world size must be "
        f"{job.plan_batch}",
        *(
            ["# MODEL_DIR: the folder of the model whose config.json the page read"]
            if upload
            else []
        ),
        f"planned = apply_plan(args, {model}, {', '.join(keywords)})",
        "args = planned.args",
    ]
    # what the page's plan took that apply_plan does not (the model's and the data's levers)
    missing = [knob_widget(name).flag for name in PLAN_FIELDS if name in job.knobs]
    missing = [flag for flag in missing if flag.removeprefix("--").replace("-", "_")
               not in _APPLY_PLAN_KNOBS]  # fmt: skip
    missing += [f"--allow {a}" for a in job.allow if a not in _APPLY_PLAN_ALLOW]
    if missing:
        lines.append(
            f"# apply_plan takes no {', '.join(missing)} (not the arguments'): its plan is made "
            "without them and may differ from this one"
        )
    lines += [
        "",
        "# this plan's fields, by hand:",
        f"args = {arguments}(",
        '    output_dir="OUTPUT_DIR",',
        *(f"    {name}={value!r}," for name, value in fields.items()),
        ")",
    ]
    return lines


__all__ = [
    "Curve",
    "EstimateAnswer",
    "PlanAnswer",
    "batch_grid",
    "curves",
    "estimate_answer",
    "is_traced",
    "keep_traces",
    "plan_answer",
    "resolve",
    "seq_grid",
    "trainer_lines",
]
