"""``memfit ui``'s page: Gradio Blocks over :mod:`memfit.ui.answers`, whose answers are the CLI's.

The inputs are the page's job (:class:`memfit.ui.job.PageJob`): the model (a registry name, a Hub
id, or an uploaded ``config.json``), the task, the card and every knob of the estimate, grouped as
``memfit estimate --help`` groups them; the outputs are the verdict, the breakdown, the curves of
memory against sequence length and batch size with the card's line, the CLI line, and the link
that carries the job. Every element carries an ``elem_id`` that the browser test finds it by.

The handlers behind the events (:func:`load_page`, :func:`answer_estimate`, :func:`answer_plan`,
:func:`read_upload`) are plain functions of the inputs' values, called directly by the unit tests.
None of them raises: a :class:`~memfit.errors.UsageError` becomes its one line in the ``error``
element (the other outputs keep their values), and anything else "internal error: …" there (its
traceback on the server's stderr), so one bad request never takes the server down.

All estimator work runs one call at a time (the tracer holds module-level state): the events
that may trace (a model, a knob, the plan) go through Gradio's queue in one concurrency group of
one, so several tabs queue and see their place; a slider's move, which answers from the fit in
milliseconds, skips the queue (its round trip through the queue cost about 40 ms of the 100 a
move may take: bench/ui_speed.py) and waits for :data:`ESTIMATOR_LOCK` instead. This is the only module of memfit that imports Gradio (the ``ui`` extra).
"""

from __future__ import annotations

import collections
import html
import json
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from memfit import progress as memfit_progress
from memfit.devices import catalog
from memfit.errors import UsageError
from memfit.job import MODES, TASKS
from memfit.levers import ALLOWABLE
from memfit.models.names import REGISTRY, stored_rows
from memfit.ui import answers
from memfit.ui.figure import curve_svg
from memfit.ui.job import (
    KNOB_GROUPS,
    PageJob,
    from_query,
    knob_widget,
    parse_allow,
    parse_value,
    to_query,
)
from memfit.units import format_bytes

# the largest config.json the page takes (a model's is a few KiB; it travels in the link)
MAX_UPLOAD = "1mb"
# what every server of the page launches it with (memfit ui, app.py, bench/ui_speed.py): no run
# history, Gradio's record of every event's inputs and outputs in the browser's localStorage,
# read and written whole several times per event (an eighth of the browser's busy time in a
# slider's move, in a profile of eight moves in Chromium on 2 cores; it grows with the 100 runs
# it keeps); the page's link is its own history
LAUNCH: dict[str, Any] = {"max_file_size": MAX_UPLOAD, "run_history": False}
# the sequence-length slider's end where the model's positions are not known (a Hub id, an upload)
SEQ_LEN_MAX = 32_768
BATCH_SIZE_MAX = 256
# every event that runs the estimator or the planner: one at a time, whatever the tab
ESTIMATOR = "memfit-estimator"
# ... and every call into it, the queued events' and the sliders' (which skip the queue)
ESTIMATOR_LOCK = threading.RLock()
_NO_GPU = "none"

# the fixed inputs, in the order the handlers take their values (the knobs follow, then these)
FIXED = ("model", "task", "gpu", "gpu_memory", "batch_size", "seq_len", "mode", "safety_margin")
TAIL = ("effective_batch_size", "allow", "config_json")

# after each answer: the job into the address bar (a link that carries it) and the link box
_LINK_JS = """(query) => {
    const url = new URL(window.location.href);
    url.search = query ? "?" + query : "";
    window.history.replaceState(null, "", url.toString());
    return url.toString();
}"""


def knob_names() -> list[str]:
    """The knobs the page shows, group after group (:data:`memfit.ui.job.KNOB_GROUPS`)."""
    return [name for names in KNOB_GROUPS.values() for name in names]


def input_names() -> list[str]:
    """The names of the handlers' input values, in order."""
    return [*FIXED, *knob_names(), *TAIL]


def _positions() -> dict[str, int]:
    """Each registry name (and every other name it answers to) -> its usable positions."""
    rows = stored_rows()
    found: dict[str, int] = {}
    for name, aliases in REGISTRY.items():
        positions = rows.get(name, {}).get("max_positions")
        if isinstance(positions, int) and positions > 0:
            for alias in (name, *aliases):
                found[alias] = positions
    return found


_POSITIONS = _positions()


def seq_len_maximum(job: PageJob) -> int:
    """The sequence-length slider's end: the model's usable positions where the registry knows
    them (an upload's and a Hub id's are not read here), else :data:`SEQ_LEN_MAX`."""
    if job.config_json is not None:
        return SEQ_LEN_MAX
    positions = _POSITIONS.get(job.model)
    return SEQ_LEN_MAX if positions is None or positions >= 1 << 30 else positions


def _whole(flag: str, value: Any) -> int:
    """``value`` from a Number or Slider (a float) as a whole number ≥ 1, or the flag's line."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{flag}: must be a whole number ≥ 1, got {value!r}")
    return value


# whether the model box may name a path on the server (a folder, a config.json): yes where the page
# is this machine's own (memfit ui on a loopback address), no where others reach it (--host
# 0.0.0.0, --share, a Space), which must not read the server's files (build_app's local_paths)
# ("freeze": after a trace, gc.freeze, which only a server that owns its process may do)
_LOCAL_PATHS = {"on": True, "freeze": False}


def _path_problem(model: str) -> str | None:
    """The line for a model named by a path on the server, where the page does not read them."""
    if _LOCAL_PATHS["on"]:
        return None
    spelled = model.startswith(("/", "./", "../", "~", "\\")) or model.endswith(".json")
    if spelled or Path(model).expanduser().exists():
        return (
            "model: this page is served to other machines and reads no path on its server; "
            "upload the model's config.json instead"
        )
    return None


def job_of(values: Sequence[Any]) -> PageJob:
    """The page's job from the inputs' values (in :func:`input_names`' order); a knob at the
    estimate's default is not given (:class:`PageJob` drops it). A value that does not parse:
    its flag's one line, as the CLI says it."""
    named = dict(zip(input_names(), values, strict=True))
    model = str(named["model"] or "").strip()
    if not model and not named["config_json"]:
        raise UsageError("model: give a registry name, a Hub id, or upload a config.json")
    if not named["config_json"] and (problem := _path_problem(model)):
        raise UsageError(problem)
    gpu = named["gpu"] or None
    effective = named["effective_batch_size"]
    margin = named["safety_margin"]
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise UsageError(f"--safety-margin: must be in [0, 1), got {margin!r}")
    return PageJob(
        model=model or PageJob().model,
        config_json=named["config_json"] or None,
        task=named["task"],
        gpu=None if gpu == _NO_GPU else gpu,
        gpu_memory=str(named["gpu_memory"] or "").strip() or None,
        batch_size=_whole("--batch-size", named["batch_size"]),
        seq_len=_whole("--seq-len", named["seq_len"]),
        knobs={name: parse_value(name, named[name]) for name in knob_names()},
        mode=named["mode"],
        safety_margin=float(margin),
        effective_batch_size=None
        if effective in (None, "")
        else _whole("--effective-batch-size", effective),
        allow=parse_allow(named["allow"] or ()),
    )


def values_of(job: PageJob) -> list[Any]:
    """The inputs' values that show ``job`` (the inverse of :func:`job_of`)."""
    named: dict[str, Any] = {
        "model": job.model,
        "task": job.task,
        "gpu": job.gpu or _NO_GPU,
        "gpu_memory": job.gpu_memory or "",
        "batch_size": job.batch_size,
        "seq_len": job.seq_len,
        "mode": job.mode,
        "safety_margin": job.safety_margin,
        "effective_batch_size": job.effective_batch_size,
        "allow": list(job.allow),
        "config_json": job.config_json,
    }
    for name in knob_names():
        value = job.knob(name)
        if isinstance(value, tuple | list):
            value = ",".join(value)
        elif value is None and knob_widget(name).kind in ("choice", "text"):
            value = ""
        named[name] = value
    return [named[name] for name in input_names()]


# --- the answers as the page shows them ------------------------------------------------------------
# the parts' colours in the bar (matplotlib's tab10, the report page's): the breakdown's order
_PART_COLOURS = (
    "#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#2ca02c", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
)  # fmt: skip


# the bar's look, inline (the HTML is the whole figure): the boxes side by side on a grey track,
# the budget a red line across them, the legend wrapped below
_BAR = "position:relative;display:flex;height:34px;background:#eee;border-radius:3px"
_LINE = "position:absolute;top:-5px;bottom:-5px;width:0;border-left:3px solid #d62728;"
_LEGEND = "display:flex;flex-wrap:wrap;gap:4px 14px;margin-top:8px;font-size:0.85em"
_KEY = "display:inline-block;width:10px;height:10px;margin-right:4px;"


def breakdown_html(answer: answers.EstimateAnswer) -> str:
    """The breakdown as one stacked bar, the card's line across it, and a legend of the parts.

    Plain HTML, not a Vega plot: a slider move redraws this figure every time, and a Vega redraw
    costs 50-80 ms in a browser on a machine without a GPU (bench/ui_speed.py), most of the
    100 ms a move may take; boxes of a width in per cent draw at once. The curves are inline
    SVGs for the same reason (:mod:`memfit.ui.figure`)."""
    total = answer.total_bytes
    budget = answer.budget_bytes
    scale = max(total, budget or 0) or 1
    phase = _phase(answer)
    boxes, legend = [], []
    for i, (key, size) in enumerate(answer.breakdown.items()):
        if not size:
            continue
        colour = _PART_COLOURS[i % len(_PART_COLOURS)]
        label = html.escape(answer.labels.get(key, key))
        words = f"{label}: {format_bytes(size)} ({size / total * 100:.1f} %)"
        boxes.append(
            f'<div class="memfit-part" title="{words}" style="width:{size / scale * 100:.4f}%;'
            f'height:100%;background:{colour}"></div>'
        )
        legend.append(f'<span class="memfit-key"><i style="background:{colour}"></i>{words}</span>')
    line = ""
    if budget is not None:
        where = html.escape(answer.budget_words or format_bytes(budget))
        line = (
            f'<div class="memfit-budget" style="{_LINE}left:{budget / scale * 100:.4f}%" '
            f'title="the budget: {where}"></div>'
        )
    caption = f"Peak in the {phase} phase: {format_bytes(total)}"
    if budget is not None:
        caption += f" of {html.escape(answer.budget_words or format_bytes(budget))}"
    return (
        f'<div class="memfit-breakdown" style="padding:8px 4px">'
        f'<div class="memfit-caption" style="font-weight:600;margin-bottom:6px">{caption}</div>'
        f'<div class="memfit-bar" style="{_BAR}">{"".join(boxes)}{line}</div>'
        f'<div class="memfit-legend" style="{_LEGEND}">{"".join(legend)}</div></div>'
    )


def _curve_title(curve: answers.Curve, job: PageJob) -> str:
    if curve.axis == "seq_len":
        return f"Memory against sequence length (batch {job.batch_size})"
    return f"Memory against batch size ({job.seq_len} tokens)"


# --- the handlers --------------------------------------------------------------------------------
# what each session was last answered (its link): an event whose inputs are the job answered
# already (a slider set by the page itself) is skipped
_ANSWERED: collections.OrderedDict[str, str] = collections.OrderedDict()
_ANSWERED_LOCK = threading.Lock()
_SESSIONS = 1000


def _session(request: gr.Request | None) -> str | None:
    """The tab a request came from (None: a direct call, which remembers nothing)."""
    return getattr(request, "session_hash", None) if request is not None else None


def _shown_already(
    memory: collections.OrderedDict[Any, Any], key: Any, value: Any, limit: int = _SESSIONS
) -> bool:
    """Whether ``memory`` holds ``value`` at ``key`` (and remember it there, the oldest keys
    dropped past ``limit``)."""
    with _ANSWERED_LOCK:
        if memory.get(key) == value:
            return True
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > limit:
            memory.popitem(last=False)
    return False


def _seen(request: gr.Request | None, query: str) -> bool:
    """Whether this session was last answered ``query`` (and remember it)."""
    session = _session(request)
    return bool(session) and _shown_already(_ANSWERED, session, query)


def _forget(request: gr.Request | None) -> None:
    session = _session(request)
    if session:
        with _ANSWERED_LOCK:
            _ANSWERED.pop(session, None)


def _error_line(exc: BaseException) -> str:
    """What the ``error`` element says: a UsageError's line as the CLI prints it, else that the
    page failed (the traceback goes to the server's stderr)."""
    if isinstance(exc, UsageError):
        return str(exc)
    traceback.print_exception(exc, file=sys.stderr)
    return f"internal error: {type(exc).__name__}: {exc}"


def _listener(progress: Any) -> Callable[[str], None]:
    """The estimator's progress messages into the page's progress bar (no total: a trace's
    length is not known ahead)."""

    def listen(message: str) -> None:
        if progress is not None:
            progress((0, None), desc=message)

    return listen


# the estimate's outputs, in order: what a move answers first (one estimate)
ESTIMATE_OUTPUTS = (
    "error", "headline", "total-bytes", "verdict", "breakdown", "cli-command", "query",
)  # fmt: skip
# then the curves (several estimates at other shapes): a second step of the same event, so the
# verdict and the breakdown are on the page before the curves are worked out
CURVE_OUTPUTS = ("seq-curve", "batch-curve", "curve-note")


def _phase(answer: answers.EstimateAnswer) -> str:
    return answer.peak_phase.replace("_", " ")


def _estimate_outputs(job: PageJob, listen: Callable[[str], None]) -> list[Any]:
    with memfit_progress.listening(listen), ESTIMATOR_LOCK:
        answer = answers.estimate_answer(job, listen=listen)
        if answer.traced and _LOCAL_PATHS["freeze"]:
            # the server owns its process: what a trace left is kept for good, out of the
            # collector's sight (a full collection would pause a slider's answer)
            answers.keep_traces()
    return [
        "",
        f"**{answer.headline}**",
        str(answer.total_bytes),
        "\n\n".join(answer.verdict),
        breakdown_html(answer),
        answer.command,
        to_query(job),
    ]


def _failed(exc: BaseException, count: int) -> list[Any]:
    """The outputs of a failed answer: the error line, every other output emptied (the inputs
    show the job that failed: an answer beside them would be another job's, the link too)."""
    return [_error_line(exc), *("" for _ in range(count - 1))]


def answer_estimate(
    *values: Any,
    request: gr.Request | None = None,
    progress: Any = None,
    cached_only: bool = False,
) -> list[Any]:
    """The estimate's outputs (:data:`ESTIMATE_OUTPUTS`) for the inputs' ``values``; never raises.

    ``cached_only``: a slider's move, which skips Gradio's queue: it answers only from the traces
    already made (milliseconds); a shape of a kind not traced yet (a batch of one, a length that
    is no multiple of 8, before the background has traced it) is left to the queued step the
    move chains after it, which traces with its progress shown (every output skipped here)."""
    try:
        job = job_of(values)
        if _seen(request, to_query(job)):
            return [gr.skip() for _ in ESTIMATE_OUTPUTS]
        if not cached_only:
            return _estimate_outputs(job, _listener(progress))
        # start-up: the estimator is loaded by the page's first answer
        from memfit.estimate.traces import NotTraced, only_cached

        try:
            with only_cached():
                return _estimate_outputs(job, _listener(None))
        except NotTraced:
            _forget(request)  # the queued step answers it
            return [gr.skip() for _ in ESTIMATE_OUTPUTS]
    except Exception as exc:
        _forget(request)  # the same inputs again are asked again
        return _failed(exc, len(ESTIMATE_OUTPUTS))


def answer_curves(*values: Any, request: gr.Request | None = None) -> list[Any]:
    """The curves' outputs (:data:`CURVE_OUTPUTS`) for the inputs' ``values``, after
    :func:`answer_estimate` answered them: a curve whose figure is the one this tab shows already
    (the sequence-length curve when only the length moved) is not sent again, so the browser
    does not redraw it. Never raises: a job the estimate refused (its line is on the page) or a
    failure here empties the curves (they would be another job's)."""
    try:
        job = job_of(values)
        with ESTIMATOR_LOCK:
            seq_curve, batch_curve = answers.curves(job)
    except Exception as exc:
        if not isinstance(exc, UsageError):
            traceback.print_exception(exc, file=sys.stderr)
        _forget_curves(request)
        return ["", "", ""]
    shown = [
        curve_svg(seq_curve, _curve_title(seq_curve, job)),
        curve_svg(batch_curve, _curve_title(batch_curve, job)),
        "\n\n".join(note for note in (seq_curve.note, batch_curve.note) if note),
    ]
    return [
        gr.skip() if _curve_shown(request, name, value) else value
        for name, value in zip(CURVE_OUTPUTS, shown, strict=True)
    ]


# what each session's curves show now: (session, output) -> the figure (or the note)
_SHOWN: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()


def _curve_shown(request: gr.Request | None, name: str, value: str) -> bool:
    """Whether this session's ``name`` shows ``value`` already (and remember it)."""
    session = _session(request)
    limit = _SESSIONS * len(CURVE_OUTPUTS)
    return bool(session) and _shown_already(_SHOWN, (session, name), value, limit)


def _forget_curves(request: gr.Request | None) -> None:
    session = _session(request)
    if session:
        with _ANSWERED_LOCK:
            for name in CURVE_OUTPUTS:
                _SHOWN.pop((session, name), None)


# Gradio hands the request and the progress tracker to the parameters that ask for them (by
# type and default) among the positional ones: before the inputs' values
def _gradio_answer_estimate(
    request: gr.Request,
    progress: gr.Progress = gr.Progress(),  # noqa: B008
    *values: Any,
) -> list[Any]:
    return answer_estimate(*values, request=request, progress=progress)


def _gradio_answer_curves(request: gr.Request, *values: Any) -> list[Any]:
    return answer_curves(*values, request=request)


def keep_inputs(*values: Any) -> list[Any]:
    """The inputs' values as the user set them, kept in the tab's state for the sliders' moves
    (:func:`moved_values`)."""
    return list(values)


def moved_values(batch_size: Any, seq_len: Any, kept: Sequence[Any] | None) -> list[Any] | None:
    """The inputs' values of a slider's move: those the tab kept (:func:`keep_inputs`) with the
    sliders' own; None before the tab kept any (the page still loading).

    A move sends the two sliders and the tab's state, not all 34 inputs: Gradio's front end
    copies every input's whole component for each event it sends. A move's handler began 43 ms
    after its input event when it sent them all (with Gradio's run history on and the inputs set
    as the load's outputs, both since changed: :data:`LAUNCH`, :func:`load_page`), 13-16 ms after
    now, of the 100 ms a move may take (bench/ui_speed.py, 2 cores without a GPU)."""
    if kept is None or len(kept) != len(input_names()):
        return None
    values = list(kept)
    names = input_names()
    values[names.index("batch_size")] = batch_size
    values[names.index("seq_len")] = seq_len
    return values


def answer_moved(
    batch_size: Any, seq_len: Any, kept: Sequence[Any] | None, *, request: gr.Request | None = None
) -> list[Any]:
    """A slider's move, first step: :func:`answer_estimate` from the traces already made."""
    values = moved_values(batch_size, seq_len, kept)
    if values is None:
        return [gr.skip() for _ in ESTIMATE_OUTPUTS]
    return answer_estimate(*values, request=request, cached_only=True)


def curves_moved(
    batch_size: Any, seq_len: Any, kept: Sequence[Any] | None, *, request: gr.Request | None = None
) -> list[Any]:
    """A slider's move, second step: :func:`answer_curves` (which never traces)."""
    values = moved_values(batch_size, seq_len, kept)
    if values is None:
        return [gr.skip() for _ in CURVE_OUTPUTS]
    return answer_curves(*values, request=request)


def _gradio_answer_moved(
    request: gr.Request, batch_size: Any, seq_len: Any, kept: Any
) -> list[Any]:
    return answer_moved(batch_size, seq_len, kept, request=request)


def _gradio_curves_moved(
    request: gr.Request, batch_size: Any, seq_len: Any, kept: Any
) -> list[Any]:
    return curves_moved(batch_size, seq_len, kept, request=request)


# the inputs a page load sets in the browser (a script: see load_page); the uploaded config, a
# state of the server's, is set by the load itself
SHOWN = tuple(name for name in input_names() if name != "config_json")
# ... that script: the inputs' values (the sequence-length slider's an update: its range too)
_SHOW_INPUTS_JS = """(shown) => (shown ? JSON.parse(shown) : [])"""


def load_page(
    params: dict[str, str] | None, *, request: gr.Request | None = None, progress: Any = None
) -> list[Any]:
    """What the page's load sets for the job of its link (``params``: its query): the inputs'
    values as JSON (:data:`SHOWN`, set in the browser by a script), the tab's kept inputs, the
    uploaded config, and the answer to the job; never raises (a bad link: its line in ``error``,
    the inputs at the defaults).

    The inputs are set by a script, not as the load's outputs: Gradio's front end keeps a
    loading status for every output of a server's event and updates them all at each event
    after: a page of one slider and one text box answered a move in 18 ms (median), in 46 ms once
    a load had set forty text boxes beside it (Chromium on 2 cores, measured for this change with
    bench/ui_speed.py's floor page and those forty added)."""
    try:
        job = from_query(params or {})
    except Exception as exc:
        job = PageJob()
        problem: BaseException | None = exc
    else:
        problem = None
    kept = values_of(job)  # the tab's state: what the sliders' moves answer
    named = dict(zip(input_names(), kept, strict=True))
    shown = [named[name] for name in SHOWN]
    shown[SHOWN.index("seq_len")] = {
        "__type__": "update",
        "maximum": seq_len_maximum(job),
        "value": job.seq_len,
    }
    head = [json.dumps(shown), kept, job.config_json]
    if problem is not None:
        return [*head, *_failed(problem, len(ESTIMATE_OUTPUTS))]
    return [*head, *answer_estimate(*kept, request=request, progress=progress)]


def _gradio_load_page(
    request: gr.Request,
    progress: gr.Progress = gr.Progress(),  # noqa: B008
) -> list[Any]:
    return load_page(dict(request.query_params), request=request, progress=progress)


def read_upload(path: str | None) -> tuple[str | None, Any]:
    """An uploaded config.json: its text for the job (None: no upload), and the model box's
    state (not interactive while an upload stands in for it)."""
    if not path:
        return None, gr.update(interactive=True)
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return text, gr.update(interactive=False)


def model_changed(model: str | None, seq_len: Any) -> Any:
    """The sequence-length slider for a newly picked model: its positions as the range."""
    maximum = seq_len_maximum(PageJob(model=str(model or "").strip()))
    if isinstance(seq_len, int | float) and seq_len > maximum:
        return gr.update(maximum=maximum, value=maximum)
    return gr.update(maximum=maximum)


def model_picked(*values: Any) -> list[Any]:
    """A newly picked model: the sequence-length slider (:func:`model_changed`) and the tab's
    kept inputs with the length the slider shows (kept in the same answer: the slider's move
    that a shorter range sets off answers the new model)."""
    names = input_names()
    seq_at = names.index("seq_len")
    slider = model_changed(values[names.index("model")], values[seq_at])
    kept = keep_inputs(*values)
    if "value" in slider:
        kept[seq_at] = slider["value"]
    return [slider, kept]


PLAN_OUTPUTS = ("error", "plan-out", "plan-commands", "plan-trainer", "plan-json")


def _settings_table(settings: dict[str, Any]) -> str:
    if not settings:
        return ""
    lines = ["| setting | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in settings.items()]
    return "\n".join(lines)


def answer_plan(*values: Any, progress: Any = None) -> list[Any]:
    """The plan's outputs (:data:`PLAN_OUTPUTS`) for the inputs' ``values``; never raises."""
    try:
        job = job_of(values)
        listen = _listener(progress)
        with memfit_progress.listening(listen), ESTIMATOR_LOCK:
            plan = answers.plan_answer(job, listen=listen)
    except Exception as exc:
        return _failed(exc, len(PLAN_OUTPUTS))
    head = "**A plan that fits**" if plan.fits else "**Nothing fits**"
    text = "\n".join([head, "", *(f"- {line.removeprefix('• ')}" for line in plan.lines), ""])
    text += "\n" + _settings_table(plan.settings)
    return [
        "",
        text,
        "\n".join(plan.commands),
        "\n".join(plan.trainer_lines),
        json.dumps(plan.as_json, indent=2),
    ]


def _gradio_answer_plan(
    progress: gr.Progress = gr.Progress(),  # noqa: B008
    *values: Any,
) -> list[Any]:
    return answer_plan(*values, progress=progress)


# --- the page ------------------------------------------------------------------------------------
def _elem_id(name: str) -> str:
    return name.replace("_", "-")


def _knob_component(name: str) -> Any:
    """A knob's input, as :func:`memfit.ui.job.knob_widget` describes it."""
    widget = knob_widget(name)
    common: dict[str, Any] = {
        "label": widget.label,
        "info": widget.help,
        "elem_id": widget.elem_id,
        "value": widget.default,
    }
    if widget.kind == "choice":
        choices: list[Any] = list(widget.choices or ())
        if widget.default is None:
            # not given: the estimate's own default (the task's loss)
            choices = [("(the task's default)" if name == "loss" else "(not given)", ""), *choices]
            common["value"] = ""
        return gr.Dropdown(choices=choices, **common)
    if widget.kind == "bool":
        return gr.Checkbox(**common)
    if widget.kind in ("int", "float"):
        return gr.Number(precision=0 if widget.kind == "int" else None, **common)
    return gr.Textbox(**common)


def _gpu_choices() -> list[tuple[str, str]]:
    cards = [(f"{g.short_name} ({format_bytes(g.memory_bytes)})", g.id) for g in catalog().values()]
    return [("none: a memory size, or no budget", _NO_GPU), *cards]


def build_app(*, local_paths: bool = True, server: bool = False) -> gr.Blocks:
    """The page: inputs, outputs and the events between them (see the module).

    ``local_paths``: whether the model box may name a folder or a config.json on the server
    (``memfit ui`` on a loopback address); False for a page others reach (``--host 0.0.0.0``,
    ``--share``, a Space), which then takes uploads only. ``server``: the page owns its process
    (``memfit ui``, a Space): the traces each first answer makes are kept out of the garbage
    collector's sight (:func:`memfit.ui.answers.keep_traces`)."""
    _LOCAL_PATHS["on"] = local_paths
    _LOCAL_PATHS["freeze"] = server
    default = PageJob()
    with gr.Blocks(title="memfit: will it fit?", analytics_enabled=False) as demo:
        gr.Markdown(
            "# memfit: will it fit?\n"
            "The peak memory of one fine-tuning step, from the model's config alone, and a plan "
            "that fits a card: the answers of `memfit estimate` and `memfit plan`."
        )
        error = gr.Markdown("", elem_id="error")
        with gr.Row():
            with gr.Column(scale=1):
                model = gr.Dropdown(
                    choices=list(REGISTRY),
                    value=default.model,
                    allow_custom_value=True,
                    label="model",
                    info="A registry name (memfit models), or any Hub id (fetched when online).",
                    elem_id="model",
                )
                upload = gr.File(
                    label="or a config.json",
                    file_types=[".json"],
                    type="filepath",
                    height=120,
                    elem_id="config-upload",
                )
                task = gr.Dropdown(
                    choices=list(TASKS), value=default.task, label="task", elem_id="task"
                )
                gpu = gr.Dropdown(
                    choices=_gpu_choices(),
                    value=default.gpu or _NO_GPU,
                    label="card",
                    info="A catalog GPU (memfit gpus): its memory is the budget.",
                    elem_id="gpu",
                )
                gpu_memory = gr.Textbox(
                    value=default.gpu_memory or "",
                    label="memory",
                    info="A budget, e.g. 16GiB (2^30) or 16GB (10^9); with a card: instead of its memory.",
                    elem_id="gpu-memory",
                )
                batch_size = gr.Slider(
                    minimum=1,
                    maximum=BATCH_SIZE_MAX,
                    step=1,
                    value=default.batch_size,
                    label="batch size (per step)",
                    elem_id="batch-size",
                )
                seq_len = gr.Slider(
                    minimum=1,
                    # the server's bound for every model (it checks each value sent); the page
                    # load narrows the browser's range to the model's positions (load_page)
                    maximum=SEQ_LEN_MAX,
                    step=1,
                    value=default.seq_len,
                    label="sequence length (tokens)",
                    elem_id="seq-len",
                )
                with gr.Row():
                    mode = gr.Radio(
                        choices=list(MODES), value=default.mode, label="--mode", elem_id="mode"
                    )
                    safety_margin = gr.Number(
                        value=default.safety_margin,
                        minimum=0,
                        maximum=0.99,
                        step=0.01,
                        label="--safety-margin",
                        info="The share of the budget a plan keeps free.",
                        elem_id="safety-margin",
                    )
                knobs: dict[str, Any] = {}
                for title, names in KNOB_GROUPS.items():
                    with gr.Accordion(title, open=False):
                        for name in names:
                            knobs[name] = _knob_component(name)
            with gr.Column(scale=2):
                headline = gr.Markdown(elem_id="headline")
                total = gr.Textbox(label="peak (bytes)", interactive=False, elem_id="total-bytes")
                verdict = gr.Markdown(elem_id="verdict")
                breakdown = gr.HTML(elem_id="breakdown")
                with gr.Row():
                    seq_curve = gr.HTML(elem_id="seq-curve")
                    batch_curve = gr.HTML(elem_id="batch-curve")
                curve_note = gr.Markdown(elem_id="curve-note")
                cli_command = gr.Textbox(
                    label="the same answer in a terminal",
                    interactive=False,
                    buttons=["copy"],
                    elem_id="cli-command",
                )
                link = gr.Textbox(
                    label="a link to this answer",
                    interactive=False,
                    buttons=["copy"],
                    elem_id="link",
                )
                query = gr.Textbox(visible=False, elem_id="query")
                shown = gr.Textbox(visible=False, elem_id="shown")  # load_page's inputs
                with gr.Group():
                    gr.Markdown("### A plan that fits the card")
                    effective = gr.Number(
                        label="--effective-batch-size",
                        info="The batch the optimizer steps on (default: batch size × "
                        "gradient accumulation).",
                        precision=0,
                        value=None,
                        elem_id="effective-batch-size",
                    )
                    allow = gr.CheckboxGroup(
                        choices=list(ALLOWABLE),
                        label="--allow",
                        info="Levers that change the recipe.",
                        elem_id="allow",
                    )
                    plan_button = gr.Button("Plan", variant="primary", elem_id="plan-button")
                    plan_out = gr.Markdown(elem_id="plan-out")
                    plan_commands = gr.Code(
                        language="shell", label="commands", elem_id="plan-commands"
                    )
                    plan_trainer = gr.Code(
                        language="python", label="with a Trainer", elem_id="plan-trainer"
                    )
                    plan_json = gr.Code(
                        language="json", label="memfit plan --json", elem_id="plan-json"
                    )
        config_json = gr.State(None)
        # the inputs as the user last set them: what a slider's move answers (moved_values)
        kept = gr.State(None)

        named: dict[str, Any] = {
            "model": model,
            "task": task,
            "gpu": gpu,
            "gpu_memory": gpu_memory,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "mode": mode,
            "safety_margin": safety_margin,
            **knobs,
            "effective_batch_size": effective,
            "allow": allow,
            "config_json": config_json,
        }
        inputs = [named[name] for name in input_names()]
        sliders = [batch_size, seq_len, kept]
        estimate_outputs = [error, headline, total, verdict, breakdown, cli_command, query]
        curve_outputs = [seq_curve, batch_curve, curve_note]
        estimator: dict[str, Any] = {"concurrency_limit": 1, "concurrency_id": ESTIMATOR}
        # the progress (a trace's messages) over the figures, never over the error line, whose
        # text is the one thing a reader (or the browser test) waits for there
        figures: dict[str, Any] = {"show_progress_on": [verdict, breakdown]}
        unqueued: dict[str, Any] = {"queue": False, "show_progress": "hidden"}
        # every step of a chain answers its last trigger: a step still running when its chain
        # runs again (a trace, a long curve) would otherwise skip the newer run (Gradio's
        # default for a step, "once"), and the page would keep answering the older job
        last: dict[str, Any] = {"trigger_mode": "always_last"}

        def then_curves(event: Any) -> None:
            """After an answer: its curves (a second step: the verdict is on the page first),
            then the job into the address bar and the link box."""
            event.then(
                _gradio_answer_curves,
                inputs=inputs,
                outputs=curve_outputs,
                show_progress="hidden",
                **last,
                **estimator,
            ).then(None, inputs=[query], outputs=[link], js=_LINK_JS, queue=False, **last)

        def answered(event: Any, **progress: Any) -> None:
            """``event`` (which kept the inputs), then the estimate and its curves."""
            then_curves(
                event.then(
                    _gradio_answer_estimate,
                    inputs=inputs,
                    outputs=estimate_outputs,
                    **{"show_progress": "full", **figures, **progress},
                    **last,
                    **estimator,
                )
            )

        def answer(trigger: Any) -> None:
            answered(
                trigger(
                    keep_inputs,
                    inputs=inputs,
                    outputs=[kept],
                    **last,
                    **unqueued,
                )
            )

        loaded = demo.load(
            _gradio_load_page,
            inputs=None,
            outputs=[shown, kept, config_json, *estimate_outputs],
            **estimator,
            **figures,
        )
        # the curves after the inputs are set (they read them)
        then_curves(
            loaded.then(
                None,
                inputs=[shown],
                outputs=[named[name] for name in SHOWN],
                js=_SHOW_INPUTS_JS,
                **last,
            )
        )
        # a slider's move: from the traces already made, skipping the queue (milliseconds),
        # the verdict first, then the curves (which never trace); then the queued step, which
        # answers a shape not traced yet with its progress shown beside the headline (and skips
        # at once a move answered already: most moves), and the curves again (from the totals
        # kept: sent only where they changed, after a trace)
        for slider in (batch_size, seq_len):
            moved = slider.change(
                _gradio_answer_moved,
                inputs=sliders,
                outputs=estimate_outputs,
                **last,
                **unqueued,
            ).then(_gradio_curves_moved, inputs=sliders, outputs=curve_outputs, **last, **unqueued)
            answered(moved, show_progress="minimal", show_progress_on=[headline])
        # the user's own changes (not the page's: the load sets every input)
        for picked in (task, gpu, mode, allow, *knobs.values()):
            if isinstance(picked, gr.Textbox | gr.Number):
                answer(picked.submit)
                answer(picked.blur)
            else:
                answer(picked.input)
        for typed in (gpu_memory, safety_margin, effective):
            answer(typed.submit)
            answer(typed.blur)
        answered(
            model.input(
                model_picked,
                inputs=inputs,
                outputs=[seq_len, kept],
                **last,
                **unqueued,
            )
        )
        for event in (upload.upload, upload.clear):
            answered(
                event(read_upload, inputs=[upload], outputs=[config_json, model], queue=False).then(
                    keep_inputs, inputs=inputs, outputs=[kept], **last, **unqueued
                )
            )
        plan_button.click(
            _gradio_answer_plan,
            inputs=inputs,
            outputs=[error, plan_out, plan_commands, plan_trainer, plan_json],
            show_progress_on=[plan_out],
            **estimator,
        )
    demo.queue(default_concurrency_limit=1)
    return demo
