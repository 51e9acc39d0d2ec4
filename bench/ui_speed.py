"""How fast `memfit ui` answers a slider move, in the browser: from the input event to new figures.

    python bench/ui_speed.py                              # every job, 20 + 10 moves each
    python bench/ui_speed.py --jobs bert-t4 --seq-moves 40 --out bench/results/ui_speed.json
    python bench/ui_speed.py --smoke                      # a tiny GPT-2 config, 3 moves (seconds)

The page (`memfit.ui.app.build_app`) is served in this process, with the background tracer on as
`memfit ui` runs it (`memfit.estimate.background`: the other kinds of shape traced ahead on the
machine's other core); Chromium (Debian's, through Playwright) opens the job's link. After the
page's first answer for the job, the bench waits for the background work it started to end
(`background.wait_all`), then asks the estimator directly, untimed, for one shape of each other
kind the moves will ask (a batch of one or more, a length that is a multiple of 8 or not; a
shape no move asks): a replay where the background traced that kind, its trace where the
background did not run (it starts only on a machine with a spare core); the seconds each took
are printed. Then the timed moves:

- `--seq-moves` moves of the sequence-length slider (each to a length not asked before, below
  and above the job's, every other one odd), then `--batch-moves` of the batch-size slider (odd
  sizes and a batch of one among them);
- each move is a script in the page: the time origin (`performance.now()`) just before the range
  input's `input` event; the time the answer is on the page (`#cli-command`, which names every
  flag of the job, changed: the total may not, two shapes can need the same bytes); the time each
  of the three figures (`#breakdown`, `#seq-curve`, `#batch-curve`) changed in the DOM (a new
  bar or SVG, watched by a MutationObserver; the progress tracker's own changes not counted). The
  move is over when nothing has changed for 1 s after the answer: a figure not redrawn by then
  was not sent (its data the same: the length curve while the length moves). Two latencies per
  move, each median and max against 100 ms (issue 37), PASS or MISS: the first figures (the
  verdict, the total and the breakdown: the event's first step, one estimate) and every figure
  (the curves too: the event's second step, several estimates at other shapes);
- the server's share: the first step's handler (`memfit.ui.app._estimate_outputs`) and, within
  it, `memfit.ui.answers.estimate_answer`, then the second step's `answers.curves`, timed in the
  server as they answer each move;
- the peer, what a CLI user waits for the same new shape: a fresh `memfit estimate … --json`
  process (its disk cache the page's: warm) for the first `--peer-runs` moves, timed from outside
  (`bench/_speed_common.run_process`), and the ratio of its median to the browser's;
- the floor, what Gradio and the browser take on this machine whatever a page does: the same
  slider move on a page of one slider that sets one text box (no estimator, no figure, the queue
  skipped as the page's sliders skip it), in the same browser, and the ratio of the page's first
  figures to it.

Jobs (`--jobs`): bert-t4 (bert-base-uncased, classification, T4, 8 × 128), gpt2-medium-16gib
(causal-lm, a 16 GiB budget, 8 × 512), llama31-8b-t4 (meta-llama/Llama-3.1-8B, causal-lm, T4,
LoRA rank 16, nf4, fp16, 1 × 1024). The command that reproduces the figures is printed first and
last; `--out FILE` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _speed_common import (
    REPO,
    Checkout,
    die,
    offline_env,
    pick,
    print_load_end,
    print_machine,
    reproduce_line,
    run_process,
    verdict,
    write_json,
)

LIMIT_MS = 100.0  # issue 37: a slider move to new figures, median and max
FIGURES = ("breakdown", "seq-curve", "batch-curve")
# a move is over when no figure has changed for this long after its answer; a figure not
# redrawn by then is not redrawn (the page did not send it: its data the same)
QUIET_MS = 1000
MOVE_TIMEOUT_MS = 120_000
FIRST_TIMEOUT_MS = 600_000
# the smoke's model: a 2-layer GPT-2 config, uploaded through the link (no registry model traced)
TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "n_positions": 256,
    "n_ctx": 256,
    "vocab_size": 1000,
}


@dataclass(frozen=True)
class UiJob:
    """A page job whose sliders the bench moves: `page_job()` is `memfit.ui.job.PageJob`'s."""

    name: str
    model: str
    task: str
    batch_size: int
    seq_len: int
    gpu: str | None = "t4"
    gpu_memory: str | None = None
    knobs: tuple[tuple[str, Any], ...] = ()
    config: dict[str, Any] | None = None  # uploaded (carried by the link) instead of `model`
    describe: str = ""

    def page_job(self, **shape: int) -> Any:
        from memfit.ui.job import PageJob  # start-up: the bench's --help needs no memfit

        return PageJob(
            model=self.model,
            config_json=json.dumps(self.config) if self.config else None,
            task=self.task,
            gpu=self.gpu,
            gpu_memory=self.gpu_memory,
            batch_size=shape.get("batch_size", self.batch_size),
            seq_len=shape.get("seq_len", self.seq_len),
            knobs=dict(self.knobs),
        )


JOBS: dict[str, UiJob] = {
    job.name: job
    for job in (
        UiJob("bert-t4", "bert-base-uncased", "classification", 8, 128, describe="on a T4"),
        UiJob(
            "gpt2-medium-16gib",
            "gpt2-medium",
            "causal-lm",
            8,
            512,
            gpu=None,
            gpu_memory="16GiB",
            describe="in 16 GiB",
        ),
        UiJob(
            "llama31-8b-t4",
            "meta-llama/Llama-3.1-8B",
            "causal-lm",
            1,
            1024,
            knobs=(("lora_rank", 16), ("quantization", "nf4"), ("precision", "fp16")),
            describe="on a T4, LoRA rank 16, nf4, fp16",
        ),
        UiJob(
            "smoke",
            "tiny-gpt2",
            "causal-lm",
            4,
            64,
            config=TINY_GPT2,
            describe="a 2-layer GPT-2 config.json, on a T4",
        ),
    )
}
DEFAULT_JOBS = ("bert-t4", "gpt2-medium-16gib", "llama31-8b-t4")


# the lengths of the moves, as fractions of the job's own (every other one made odd)
SEQ_FACTORS = (
    1.5, 0.5, 2.0, 0.75, 3.0, 1.25, 0.375, 2.5, 1.75, 0.625, 3.5, 0.875, 2.25, 1.125, 0.25,
    2.75, 1.375, 3.25, 0.8125, 1.875, 3.75, 0.5625, 2.125, 1.0625, 0.6875, 2.625, 1.3125, 3.125,
    0.4375, 1.625,
)  # fmt: skip


def seq_values(job: UiJob, moves: int, step: int, minimum: int, maximum: int) -> list[int]:
    """`moves` sequence lengths the slider can take, none the job's own, spread below and above
    it; every other one odd where the slider's step allows it. More moves than
    :data:`SEQ_FACTORS` walk on from the last one, a step at a time."""
    values: list[int] = []
    for i, factor in enumerate(SEQ_FACTORS):
        value = round(job.seq_len * factor) + (i % 2)
        value = minimum + (value - minimum) // step * step
        if minimum <= value <= maximum and value != job.seq_len and value not in values:
            values.append(value)
    value = max(values, default=job.seq_len)
    while len(values) < moves and value + step <= maximum:
        value += step
        if value != job.seq_len and value not in values:
            values.append(value)
    return values[:moves]


def batch_values(job: UiJob, moves: int, maximum: int) -> list[int]:
    """`moves` batch sizes, odd ones among them, none the job's own; a batch of one among them
    (its own kind of shape) where the job's is larger."""
    values: list[int] = []
    for value in (1, 3, 5, 2, 7, 12, 9, 6, 11, 16, 13, 24, 17, 10, 31, 20, 15, 32, 27, 48):
        if value != job.batch_size and value <= maximum and value not in values:
            values.append(value)
    return values[:moves]


def _spread(count: int) -> Iterator[int]:
    """1, -1, 3, -2, 5, -3, … : steps above and below a start, odd and even."""
    for i in range(1, count + 1):
        yield 2 * i - 1 if i % 2 else -(i // 2)


def kind(batch_size: int, seq_len: int) -> tuple[bool, bool]:
    """The kind of shape a fit covers (as `bench/estimate_speed.py`'s): a batch of one or not, a
    length that is a multiple of 8 or not."""
    return batch_size == 1, seq_len % 8 == 0


# --- the server's share ----------------------------------------------------------------------------
@dataclass
class ServerTimes:
    """Seconds of the page's handler and of memfit.ui.answers' functions, per answer."""

    handler: list[float] = field(default_factory=list)
    answer: list[float] = field(default_factory=list)
    curves: list[float] = field(default_factory=list)
    # the handler's start and end on the wall clock (the browser's clock is the same machine's)
    handler_spans: list[tuple[float, float]] = field(default_factory=list)

    def clear(self) -> None:
        self.handler.clear()
        self.answer.clear()
        self.curves.clear()
        self.handler_spans.clear()


def _timed(
    function: Callable[..., Any], into: list[float], spans: list[tuple[float, float]] | None = None
) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, started = time.time(), time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            into.append(seconds)
            if spans is not None:
                spans.append((wall, wall + seconds))

    return wrapper


@contextlib.contextmanager
def serve() -> Iterator[tuple[str, ServerTimes]]:
    """The page on a free port of this process, its handler and answers timed."""
    # optional: the ui extra (gradio); start-up: the bench's --help imports nothing
    from memfit.ui import answers, app

    times = ServerTimes()
    patched = {
        (app, "_estimate_outputs"): times.handler,
        (answers, "estimate_answer"): times.answer,
        (answers, "curves"): times.curves,
    }
    originals = {key: getattr(*key) for key in patched}
    for (module, name), into in patched.items():
        spans = times.handler_spans if into is times.handler else None
        setattr(module, name, _timed(originals[(module, name)], into, spans))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    demo = app.build_app(server=True)  # as `memfit ui` builds it (its process its own)
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **app.LAUNCH)
    try:
        yield f"http://127.0.0.1:{port}/", times
    finally:
        demo.close()
        for (module, name), original in originals.items():
            setattr(module, name, original)


# --- one move, in the page -------------------------------------------------------------------------
MOVE_JS = """async ({slider, value, figures, quietMs, timeoutMs}) => {
    const range = document.querySelector(`#${slider} input[type=range]`);
    const total = document.querySelector('#total-bytes textarea');
    // the CLI line names every flag of the job: it changes with every answer, where the total
    // may not (two shapes can need the same bytes)
    const cli = document.querySelector('#cli-command textarea');
    const before = cli.value;
    const changed = {};
    let lastChange = null;
    const inTracker = (node) => {
        const element = node.nodeType === 1 ? node : node.parentElement;
        return !!(element && element.closest('[data-testid="status-tracker"]'));
    };
    const observers = figures.map((id) => {
        const observer = new MutationObserver((records) => {
            if (records.some((r) => !inTracker(r.target))) {
                changed[id] = lastChange = performance.now();
            }
        });
        observer.observe(document.querySelector(`#${id}`), {
            subtree: true, childList: true, attributes: true, characterData: true,
        });
        return observer;
    });
    return await new Promise((resolve) => {
        let answeredAt = null;
        const t0 = performance.now();
        const poll = () => {
            const now = performance.now();
            if (answeredAt === null && cli.value !== before) answeredAt = now;
            // done when nothing has changed for quietMs after the answer: a figure not redrawn
            // by then is not redrawn at all (its data the same: the page does not send it)
            const settled = answeredAt !== null && now - Math.max(lastChange ?? 0, answeredAt) > quietMs;
            if (settled || now - t0 > timeoutMs) {
                observers.forEach((o) => o.disconnect());
                const drawn = figures.filter((id) => changed[id] !== undefined);
                const last = Math.max(answeredAt ?? now, ...drawn.map((id) => changed[id]));
                // the first figures: the answer's text and the breakdown's bar redrawn
                const first = Math.max(answeredAt ?? now, changed['breakdown'] ?? 0);
                // when the page sent the request, and when the server took it (the queue's join)
                const join = performance.getEntriesByType('resource').find(
                    (e) => e.startTime >= t0 && e.name.includes('/queue/join'));
                resolve({
                    total_ms: answeredAt === null ? null : answeredAt - t0,
                    first_ms: answeredAt === null ? null : first - t0,
                    figures_ms: answeredAt === null ? null : last - t0,
                    redrawn: drawn,
                    request_sent_ms: join ? join.startTime - t0 : null,
                    request_joined_ms: join ? join.responseEnd - t0 : null,
                    value: total.value,
                    slider: range.value,
                    t0_epoch_ms: performance.timeOrigin + t0,
                });
                return;
            }
            setTimeout(poll, 0);
        };
        range.value = String(value);
        range.dispatchEvent(new Event('input', {bubbles: true}));
        range.dispatchEvent(new Event('change', {bubbles: true}));
        setTimeout(poll, 0);
    });
}"""


def move(page: Any, slider: str, value: int) -> dict[str, Any]:
    """One slider move, timed in the page (see the module), then until the page is idle."""
    result = page.evaluate(
        MOVE_JS,
        {
            "slider": slider,
            "value": value,
            "figures": list(FIGURES),
            "quietMs": QUIET_MS,
            "timeoutMs": MOVE_TIMEOUT_MS,
        },
    )
    _wait_idle(page)
    return dict(result)


def _wait_idle(page: Any, timeout_ms: float = MOVE_TIMEOUT_MS) -> None:
    page.wait_for_function(
        """(ids) => ids.every((id) => document.querySelector(
                id === 'breakdown' ? '#breakdown .memfit-bar' : `#${id} svg.memfit-curve`))
            && !document.querySelector('[data-testid="status-tracker"]:not(.hide)')""",
        arg=list(FIGURES),
        timeout=timeout_ms,
    )


def background_jobs() -> set[int]:
    """The background jobs known now (their ids): what a later page load adds is its own."""
    from memfit.estimate import background  # start-up: imported with the page already

    return {id(job) for job in getattr(background, "_JOBS", {}).values()}


def wait_for_background(known: set[int], timeout_s: float = 900.0) -> str:
    """Wait for the background work the first answer started (the jobs not in ``known``); what
    happened, in a sentence."""
    from memfit.estimate import background  # start-up: imported with the page already

    started = time.perf_counter()
    finished = background.wait_all(timeout_s)
    waited = time.perf_counter() - started
    jobs = [j for j in getattr(background, "_JOBS", {}).values() if id(j) not in known]
    done = sum(getattr(job, "state", None) == "done" for job in jobs)
    if not finished:
        return f"the background work had not ended after {timeout_s:g} s"
    if not jobs:
        return (
            "the first answer started no background job (background.enabled() is "
            f"{background.enabled()} now: it starts only with a spare core)"
        )
    return f"{done} of {len(jobs)} background job(s) done, waited {waited:.1f} s"


def prime_kinds(job: UiJob, shapes: list[tuple[int, int]]) -> list[str]:
    """Each kind of shape among ``shapes`` but the job's own, asked of the estimator once (at a
    shape of that kind none of ``shapes`` is), untimed: the shapes asked, each with its seconds
    (a trace where the background had not traced that kind; a replay where it had)."""
    from memfit.ui import answers  # start-up: imported with the page already

    asked = {kind(job.batch_size, job.seq_len)}
    primed = []
    for batch_size, seq_len in shapes:
        key = kind(batch_size, seq_len)
        if key in asked:
            continue
        asked.add(key)
        one, aligned = key
        size = 1 if one else max(2, job.batch_size)
        length = next(
            n
            for n in range(job.seq_len, job.seq_len + 64)
            if (n % 8 == 0) == aligned and (size, n) not in shapes
        )
        started = time.perf_counter()
        answers.estimate_answer(job.page_job(batch_size=size, seq_len=length))
        primed.append(f"{size} × {length} ({time.perf_counter() - started:.2f} s)")
    return primed


# --- the peer -------------------------------------------------------------------------------------
def cli_seconds(job: UiJob, batch_size: int, seq_len: int, cache: str) -> float:
    """A fresh `memfit estimate … --json` process for the shape, timed from outside."""
    # start-up: imported with the page already
    from memfit.ui import answers
    from memfit.ui.job import estimate_argv

    page_job = job.page_job(batch_size=batch_size, seq_len=seq_len)
    argv = estimate_argv(page_job, answers.resolve(page_job))
    env = Checkout("memfit", REPO).env(Path(cache))
    run = run_process([sys.executable, "-m", "memfit", *argv, "--json"], env, timeout_s=600)
    if run.returncode != 0:
        tail = " | ".join(run.stderr.strip().splitlines()[-2:])
        raise RuntimeError(f"memfit {shlex.join(argv)} exited {run.returncode}: {tail}")
    return run.seconds


# --- one job ---------------------------------------------------------------------------------------
def measure_job(
    browser: Any, url: str, times: ServerTimes, job: UiJob, args: argparse.Namespace
) -> dict[str, Any]:
    from memfit.ui.job import to_query  # start-up: imported with the page already

    first = job.page_job()
    known = background_jobs()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    started = time.perf_counter()
    page.goto(url + "?" + to_query(first))
    page.wait_for_function(
        "document.querySelector('#total-bytes textarea')?.value.length > 0",
        timeout=FIRST_TIMEOUT_MS,
    )
    _wait_idle(page, FIRST_TIMEOUT_MS)
    first_s = time.perf_counter() - started
    background_said = wait_for_background(known)
    slider = page.locator("#seq-len input[type=range]")
    step = int(float(slider.get_attribute("step") or 1))
    seq_min = int(float(slider.get_attribute("min") or 1))
    seq_max = int(float(slider.get_attribute("max") or job.seq_len))
    batch_max = int(float(page.locator("#batch-size input[type=range]").get_attribute("max") or 1))
    seqs = seq_values(job, args.seq_moves, step, seq_min, seq_max)
    batches = batch_values(job, args.batch_moves, batch_max)
    plan = [("seq-len", s, job.batch_size, s) for s in seqs]
    plan += [("batch-size", b, b, seqs[-1] if seqs else job.seq_len) for b in batches]
    # each other kind of shape the moves ask, asked once of the estimator directly at a shape
    # no move asks: a replay where the background traced it, else its trace (as the background
    # would have made it)
    primed = prime_kinds(job, [(b, s) for _, _, b, s in plan])
    moves = []
    times.clear()
    for slider_id, value, batch_size, seq_len in plan:
        handler_before = len(times.handler)
        spans_before = len(times.handler_spans)
        answer_before, curves_before = len(times.answer), len(times.curves)
        result = move(page, slider_id, value)
        result.update(
            slider_id=slider_id,
            batch_size=batch_size,
            seq_len=seq_len,
            handler_ms=1000 * sum(times.handler[handler_before:]),
            answer_ms=1000 * sum(times.answer[answer_before:]),
            curves_ms=1000 * sum(times.curves[curves_before:]),
            answers=len(times.handler) - handler_before,
        )
        spans = times.handler_spans[spans_before:]
        if spans:  # on the page's clock: when the server began and ended the answer
            result["handler_start_ms"] = 1000 * spans[0][0] - result["t0_epoch_ms"]
            result["handler_end_ms"] = 1000 * spans[-1][1] - result["t0_epoch_ms"]
        moves.append(result)
    page.close()
    peers = []
    cache = os.environ["MEMFIT_CACHE_DIR"]
    for m in moves[: args.peer_runs]:
        peers.append(cli_seconds(job, m["batch_size"], m["seq_len"], cache))
    return {
        "job": job.name,
        "describe": job.describe,
        "link": "?" + to_query(first),
        "first_answer_s": first_s,
        "background": background_said,
        "primed": primed,
        "moves": moves,
        "cli_seconds": peers,
    }


def report(result: dict[str, Any], job: UiJob) -> dict[str, Any]:
    moves = result["moves"]
    figures = [m["figures_ms"] for m in moves if m["figures_ms"] is not None]
    firsts = [m["first_ms"] for m in moves if m["first_ms"] is not None]
    totals = [m["total_ms"] for m in moves if m["total_ms"] is not None]
    handler = [m["handler_ms"] for m in moves]
    failed = [m for m in moves if m["total_ms"] is None]
    print(f"\n{job.name}: {job.model} {job.describe}, first {job.batch_size} × {job.seq_len}")
    print(f"  link: {result['link']}")
    print(f"  first answer (page load, traces included): {result['first_answer_s']:.1f} s")
    print(f"  background: {result['background']}")
    if result["primed"]:
        print(
            "  each other kind of shape, asked of the estimator first, untimed (seconds: a trace "
            "where the background had not traced it): "
            f"{', '.join(result['primed'])}"
        )
    summary: dict[str, Any] = {"job": job.name, "moves": len(moves), "failed_moves": len(failed)}
    if not figures:
        print("  no move was answered")
        return summary
    median, worst = statistics.median(figures), max(figures)
    first_median, first_worst = statistics.median(firsts), max(firsts)
    summary.update(
        first_median_ms=first_median,
        first_max_ms=first_worst,
        first_verdict_median=verdict(first_median, LIMIT_MS),
        first_verdict_max=verdict(first_worst, LIMIT_MS),
        median_ms=median,
        max_ms=worst,
        total_median_ms=statistics.median(totals),
        handler_median_ms=statistics.median(handler),
        handler_max_ms=max(handler),
        answer_median_ms=statistics.median(m["answer_ms"] for m in moves),
        curves_median_ms=statistics.median(m["curves_ms"] for m in moves),
        curves_max_ms=max(m["curves_ms"] for m in moves),
        verdict_median=verdict(median, LIMIT_MS),
        verdict_max=verdict(worst, LIMIT_MS),
    )
    print(
        f"  {len(moves)} moves ({sum(m['slider_id'] == 'seq-len' for m in moves)} sequence "
        f"length, {sum(m['slider_id'] == 'batch-size' for m in moves)} batch size), input event "
        "to new figures:"
    )
    print(
        f"    the verdict, the total and the breakdown: median {first_median:6.1f} ms "
        f"{verdict(first_median, LIMIT_MS)}, max {first_worst:6.1f} ms "
        f"{verdict(first_worst, LIMIT_MS)} (target ≤ {LIMIT_MS:g} ms)"
    )
    print(
        f"    every figure, the curves too: median {median:6.1f} ms {verdict(median, LIMIT_MS)}, "
        f"max {worst:6.1f} ms {verdict(worst, LIMIT_MS)} (target ≤ {LIMIT_MS:g} ms)"
    )
    sent = [m["request_sent_ms"] for m in moves if m.get("request_sent_ms") is not None]
    joined = [m["request_joined_ms"] for m in moves if m.get("request_joined_ms") is not None]
    print(
        f"    the total shown: median {summary['total_median_ms']:6.1f} ms"
        + (f"; the request sent at {statistics.median(sent):.1f} ms" if sent else "")
        + (f", queued by the server at {statistics.median(joined):.1f} ms" if joined else "")
    )
    spans = [m for m in moves if "handler_end_ms" in m and m["figures_ms"] is not None]
    if spans:
        began = statistics.median(m["handler_start_ms"] for m in spans)
        ended = statistics.median(m["handler_end_ms"] for m in spans)
        after = statistics.median(m["first_ms"] - m["handler_end_ms"] for m in spans)
        print(
            f"    on the page's clock (medians): the answer's handler began at {began:.1f} ms, "
            f"ended at {ended:.1f} ms; the first figures were in the DOM {after:.1f} ms after it "
            "ended"
        )
    print(
        f"    server, the answer's handler: median {summary['handler_median_ms']:6.1f} ms, max "
        f"{summary['handler_max_ms']:6.1f} ms (estimate_answer median "
        f"{summary['answer_median_ms']:.1f} ms); then the curves' step: answers.curves median "
        f"{summary['curves_median_ms']:.1f} ms, max {summary['curves_max_ms']:.1f} ms"
    )
    unredrawn = {f: sum(f not in m["redrawn"] for m in moves) for f in FIGURES}
    if any(unredrawn.values()):
        print(f"    not redrawn within {QUIET_MS} ms of the total (moves per figure): {unredrawn}")
    if failed:
        print(f"    ! {len(failed)} move(s) got no new total within {MOVE_TIMEOUT_MS / 1000:g} s")
    slow = [m for m in moves if (m["figures_ms"] or 0) > LIMIT_MS]
    for m in slow:
        print(
            f"    over {LIMIT_MS:g} ms: {m['slider_id']} → {m['batch_size']} × {m['seq_len']}: "
            f"{m['figures_ms']:.1f} ms (handler {m['handler_ms']:.1f} ms)"
        )
    peers = result["cli_seconds"]
    if peers:
        peer = statistics.median(peers)
        summary.update(cli_median_s=peer, cli_over_browser=1000 * peer / median)
        print(
            f"    peer: a fresh `memfit estimate … --json` for the same new shape (warm disk "
            f"cache), median of {len(peers)}: {peer:.2f} s = {1000 * peer / median:.0f}× the "
            "page's move"
        )
    return summary


# --- the floor: Gradio's own round trip on this machine ------------------------------------------
FLOOR_JS = """async ({value}) => {
    const range = document.querySelector('#floor-slider input[type=range]');
    const out = document.querySelector('#floor-out textarea');
    const before = out.value;
    return await new Promise((resolve) => {
        const t0 = performance.now();
        const poll = () => {
            if (out.value !== before) return resolve(performance.now() - t0);
            setTimeout(poll, 0);
        };
        range.value = String(value);
        range.dispatchEvent(new Event('input', {bubbles: true}));
        range.dispatchEvent(new Event('change', {bubbles: true}));
        setTimeout(poll, 0);
    });
}"""


def floor_moves(browser: Any, moves: int) -> list[float]:
    """The same slider move on the least page Gradio serves: a slider whose move sets one text
    box (no estimator, no figure), skipping the queue as the page's sliders do. What Gradio and
    the browser take on this machine whatever the page does: the page's latency is read
    against it."""
    import gradio as gr  # optional: the ui extra (the page's own)

    from memfit.ui.app import LAUNCH  # the page's launch options (no run history)

    with gr.Blocks(analytics_enabled=False) as floor:
        slider = gr.Slider(1, 4096, value=1, step=1, elem_id="floor-slider")
        out = gr.Textbox(elem_id="floor-out")
        slider.change(
            lambda v: f"{int(v)} tokens",
            slider,
            out,
            queue=False,
            trigger_mode="always_last",
            show_progress="hidden",
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    floor.launch(prevent_thread_lock=True, server_port=port, quiet=True, **LAUNCH)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#floor-slider input[type=range]")
        times = []
        for i in range(moves):
            times.append(float(page.evaluate(FLOOR_JS, {"value": 100 + 37 * i})))
            page.wait_for_timeout(200)
        page.close()
        return times
    finally:
        with contextlib.redirect_stdout(None):  # (Gradio says it closes the server)
            floor.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--jobs",
        default=",".join(DEFAULT_JOBS),
        help=f"comma-separated: {','.join(JOBS)} (default: {','.join(DEFAULT_JOBS)})",
    )
    parser.add_argument("--seq-moves", type=int, default=20, help="moves of the length slider")
    parser.add_argument("--batch-moves", type=int, default=10, help="moves of the batch slider")
    parser.add_argument(
        "--peer-runs", type=int, default=3, help="fresh `memfit estimate` runs per job (the peer)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny job, 2 + 1 moves, 1 peer run (seconds)"
    )
    parser.add_argument("--out", "--json", dest="out", metavar="OUT", help="write figures as JSON")
    args = parser.parse_args()
    jobs = ["smoke"] if args.smoke else pick(args.jobs, list(JOBS), "--jobs")
    if args.smoke:
        args.seq_moves, args.batch_moves, args.peer_runs = 2, 1, 1
    for flag in ("seq_moves", "batch_moves", "peer_runs"):
        if getattr(args, flag) < 0:
            die(f"--{flag.replace('_', '-')}: at least 0")
    if args.seq_moves + args.batch_moves < 1:
        die("--seq-moves: with --batch-moves, at least one move")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        die("chromium: not on PATH (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright  # optional: the dev extra
    except ImportError:
        die("playwright: not installed (pip install -e '.[dev]')")

    print(reproduce_line("ui_speed.py"))
    record: dict[str, Any] = {"machine": print_machine([Checkout("memfit", REPO)])}
    results, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="memfit-ui-speed-") as tmp:
        scratch = Path(tmp)
        # the page's own trace cache (empty: the first answer traces), offline as a CI machine
        os.environ.update(offline_env())
        os.environ["MEMFIT_CACHE_DIR"] = str(scratch / "cache")
        os.environ.pop("MEMFIT_NO_BACKGROUND", None)
        with serve() as (url, times), sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                for name in jobs:
                    result = measure_job(browser, url, times, JOBS[name], args)
                    results.append(result)
                    summaries.append(report(result, JOBS[name]))
                floor = floor_moves(browser, max(5, args.seq_moves))
            finally:
                browser.close()
    floor_median = statistics.median(floor)
    print(
        f"\nthe floor, a one-slider Gradio page that sets one text box (the same move, the same "
        f"browser): median {floor_median:.1f} ms, max {max(floor):.1f} ms over {len(floor)} moves"
    )
    print(
        "\nSlider move to new figures (target ≤ 100 ms, median and max): first the verdict, "
        "the total and the breakdown; then every figure (the curves too)"
    )
    for s in summaries:
        if "median_ms" in s:
            print(
                f"  {s['job']:<20} first: median {s['first_median_ms']:6.1f} ms "
                f"{s['first_verdict_median']}  max {s['first_max_ms']:6.1f} ms "
                f"{s['first_verdict_max']};  every figure: median {s['median_ms']:6.1f} ms "
                f"{s['verdict_median']}  max {s['max_ms']:6.1f} ms {s['verdict_max']}"
                + (f";  CLI {s['cli_over_browser']:.0f}× slower" if "cli_over_browser" in s else "")
                + f";  first ÷ floor {s['first_median_ms'] / floor_median:.1f}×"
            )
        else:
            print(f"  {s['job']:<20} no figure")
    record.update(
        limit_ms=LIMIT_MS,
        jobs=results,
        summaries=summaries,
        floor_ms={"median": floor_median, "max": max(floor), "moves": floor},
    )
    print_load_end()
    write_json(args.out, "ui_speed.py", record)
    print(reproduce_line("ui_speed.py"))


if __name__ == "__main__":
    main()
