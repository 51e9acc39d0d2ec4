"""`memfit ui` driven in a real browser: the page's answers are the CLI's (issue 37's acceptance).

The page is served by `memfit ui` in a process of its own, and Chromium (Debian's, which `.ci/run`
installs: Playwright's own browser download cannot be reached here) is driven by Playwright as a
user would: pick a registry model, a task and a card in their dropdowns, move the sequence-length
slider with the keyboard, set the batch size in its number box. The total the page shows is then
held against `memfit estimate … --json` for the job the test itself set (its command line built
here from what the test typed, not read from the page), the plan against `memfit plan … --json`,
the page's link opened in a new page against the same inputs and total, and a broken config.json
against one line on the page (no traceback) with the server still answering after it.

Screenshots (the whole page after the estimate and after the plan) go to docs/images/ with
``MEMFIT_SCREENSHOTS=1`` (docs/ui.md shows them), else to the test's temporary folder.

Every wait is on a condition of the page (an input's value, the answer's CLI line, the figures'
SVG), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main

# .ci/run sets it: there the browser test is the acceptance, and a missing browser,
# Playwright or Gradio fails it instead of skipping it
REQUIRED = os.environ.get("CI_REQUIRE_BROWSER") == "1"
try:
    import gradio  # noqa: F401
    from playwright import sync_api
except ImportError as exc:
    if REQUIRED:
        raise
    pytest.skip(f"{exc.name} is not installed (the ui and dev extras)", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
# the job the test sets through the widgets (the page opens on bert-base-uncased, classification)
MODEL, TASK, CARD, CARD_LABEL = "gpt2", "causal-lm", "t4", "T4"
BATCH_SIZE, EFFECTIVE_BATCH_SIZE = 4, 16
SEQ_STEPS = 16  # presses of → on the sequence-length slider, one slider step each
# one page answer (a model traced cold on a loaded 2-core machine, or the plan's traces)
ANSWER_MS = 90_000
PLOTS = ("breakdown", "seq-curve", "batch-curve")


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def page_url() -> Iterator[str]:
    """`memfit ui` on a free port, in a process of its own (the suite's environment: offline, the
    session's trace cache, no background tracer); its URL once it says it serves."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "memfit", "ui", "--port", str(port), "--no-open"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
    )
    lines: list[str] = []
    stderr: list[str] = []
    # its stderr read aside (a full pipe would block the server)
    reader = threading.Thread(target=lambda: stderr.extend(server.stderr or ()), daemon=True)
    reader.start()
    try:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if line.startswith("memfit ui: http://"):
                break
        assert server.poll() is None, f"memfit ui exited: {''.join(lines + stderr)}"
        yield f"http://127.0.0.1:{port}/"
        assert server.poll() is None, "the server died during the test:\n" + "".join(stderr)[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = _chromium()
    if executable is None:
        if REQUIRED:
            pytest.fail("no chromium on PATH, and CI_REQUIRE_BROWSER=1 (.ci/run installs it)")
        pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


# --- the CLI's answers, for the job the test set -------------------------------------------------
def _cli_json(*argv: str) -> dict[str, Any]:
    """`memfit ARGV --json` in this process: what it prints, parsed (`memfit plan` exits 3 when
    nothing fits: an answer too)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--json"])
        except SystemExit as exc:
            assert exc.code in (0, 3, None), f"memfit {' '.join(argv)} exited {exc.code}"
    return json.loads(out.getvalue())


def _cli_error(*argv: str) -> str:
    """The one line `memfit ARGV` exits 2 with (on stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2, err.getvalue()
    (line,) = err.getvalue().strip().splitlines()
    return line


def _without_timings(value: Any) -> Any:
    """A JSON value without the keys that are wall-clock times (`…_seconds`)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not k.endswith("_seconds")}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


# --- the page ------------------------------------------------------------------------------------
def _value(page: Any, elem_id: str) -> str:
    """A text output's value (a Textbox renders a textarea)."""
    return str(page.locator(f"#{elem_id} textarea").input_value())


def _markdown(page: Any, elem_id: str) -> str:
    """A Markdown output's text (without the status tracker's timer)."""
    return str(page.locator(f"#{elem_id} [data-testid='markdown']").inner_text())


def _code(page: Any, elem_id: str) -> str:
    """A Code output's whole text: CodeMirror draws only the lines in view, so its document is
    read from the editor (newer CodeMirror: ``cmTile``; older: ``cmView``)."""
    return str(
        page.evaluate(
            """(id) => {
                const content = document.querySelector(`#${id} .cm-content`);
                if (!content) return "";
                const view = (content.cmTile || content.cmView || {}).view;
                return view ? view.state.doc.toString() : content.innerText;
            }""",
            elem_id,
        )
    )


def _pick(page: Any, elem_id: str, text: str) -> None:
    """A dropdown's choice as a user makes it: click, type, Enter."""
    box = page.locator(f"#{elem_id} input[role='combobox']")
    box.click()
    box.fill(text)
    box.press("Enter")


def _wait_for_answer(page: Any, *phrases: str) -> None:
    """Until the page answered the job whose CLI line has every one of ``phrases`` (the model,
    each flag with its value: the answer's outputs arrive together), and its figures are drawn."""
    page.wait_for_function(
        """(phrases) => {
            const line = document.querySelector('#cli-command textarea');
            return line && phrases.every((f) => (' ' + line.value + ' ').includes(' ' + f + ' '));
        }""",
        arg=list(phrases),
        timeout=ANSWER_MS,
    )
    _wait_for_figures(page)


def _wait_for_figures(page: Any) -> None:
    """Until every figure is drawn (the breakdown's bar, the curves' SVGs) and no element
    shows progress."""
    page.wait_for_function(
        """(ids) => ids.every((id) => document.querySelector(
                id === 'breakdown' ? '#breakdown .memfit-bar' : `#${id} svg.memfit-curve`))
            && !document.querySelector('[data-testid="status-tracker"]:not(.hide)')""",
        arg=list(PLOTS),
        timeout=ANSWER_MS,
    )


def _screenshot(page: Any, name: str, tmp_path: Path) -> Path:
    folder = IMAGES if os.environ.get("MEMFIT_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000  # a page with figures, not a blank one
    return path


def _job_flags(seq_len: int) -> list[str]:
    return [
        MODEL, "--task", TASK, "--batch-size", str(BATCH_SIZE), "--seq-len", str(seq_len),
        "--gpu", CARD,
    ]  # fmt: skip


def _phrases(flags: list[str]) -> list[str]:
    """The model, then each flag with its value: what the page's CLI line must hold."""
    pairs = zip(flags[1::2], flags[2::2], strict=True)
    return [flags[0], *(f"{flag} {value}" for flag, value in pairs)]


def test_the_page_answers_as_the_cli(page_url: str, browser: Any, tmp_path: Path) -> None:
    laps: list[str] = []
    started = last = time.monotonic()

    def lap(name: str) -> None:  # where the test's time goes (printed at the end, with -s)
        nonlocal last
        now = time.monotonic()
        laps.append(f"{name} {now - last:.1f} s")
        last = now

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(page_url)
    # the page load answers its default job
    page.wait_for_function(
        "document.querySelector('#total-bytes textarea')?.value.length > 0", timeout=ANSWER_MS
    )
    _wait_for_figures(page)
    lap("the first answer")

    # the model, the task and the card through their dropdowns
    _pick(page, "model", MODEL)
    _wait_for_answer(page, MODEL)
    lap("gpt2")
    _pick(page, "task", TASK)
    _wait_for_answer(page, MODEL, f"--task {TASK}")
    lap("causal-lm")
    _pick(page, "gpu", CARD_LABEL)
    assert page.locator("#gpu input[role='combobox']").input_value().startswith(CARD_LABEL)
    # the batch size in the slider's number box, the sequence length with the keyboard
    number = page.locator("#batch-size input[type='number']")
    number.fill(str(BATCH_SIZE))
    number.press("Enter")
    slider = page.locator("#seq-len input[type='range']")
    start, step = int(slider.input_value()), int(slider.get_attribute("step") or 1)
    slider.focus()
    for _ in range(SEQ_STEPS):
        slider.press("ArrowRight")
    seq_len = start + SEQ_STEPS * step
    assert int(slider.input_value()) == seq_len
    flags = _job_flags(seq_len)
    _wait_for_answer(page, *_phrases(flags))
    assert _markdown(page, "error").strip() == ""
    total = int(_value(page, "total-bytes"))
    lap("the estimate")
    _screenshot(page, "ui-estimate.png", tmp_path)

    # the same job, as `memfit estimate` answers it
    cli = _cli_json("estimate", *flags)
    assert total == cli["total_bytes"], (total, cli["total_bytes"], flags)
    lap("memfit estimate")

    # the plan, at an effective batch, against `memfit plan`'s
    effective = page.locator("#effective-batch-size input")
    effective.fill(str(EFFECTIVE_BATCH_SIZE))
    effective.press("Enter")
    page.locator("#plan-button").click()
    page.wait_for_function(
        """() => { const c = document.querySelector('#plan-json .cm-content');
                   return c && c.innerText.trim().startsWith('{'); }""",
        timeout=ANSWER_MS,
    )
    _wait_for_figures(page)
    assert _markdown(page, "error").strip() == ""
    lap("the plan")
    shown_plan = json.loads(_code(page, "plan-json"))
    cli_plan = _cli_json(
        "plan", MODEL, "--task", TASK, "--seq-len", str(seq_len),
        "--effective-batch-size", str(EFFECTIVE_BATCH_SIZE), "--gpu", CARD,
    )  # fmt: skip
    lap("memfit plan")
    assert _without_timings(shown_plan) == _without_timings(cli_plan)
    assert f"--effective-batch-size {EFFECTIVE_BATCH_SIZE}" in _code(page, "plan-commands")
    page.locator("#plan-json").scroll_into_view_if_needed()
    _screenshot(page, "ui-plan.png", tmp_path)

    # the link, opened in a new page: the same inputs, the same answer
    link = _value(page, "link")
    assert link.startswith(page_url) and f"model={MODEL}" in link, link
    reader = context.new_page()
    reader.goto(link)
    _wait_for_answer(reader, *_phrases(flags))
    assert reader.locator("#model input[role='combobox']").input_value() == MODEL
    assert reader.locator("#task input[role='combobox']").input_value() == TASK
    assert reader.locator("#gpu input[role='combobox']").input_value().startswith(CARD_LABEL)
    assert reader.locator("#seq-len input[type='number']").input_value() == str(seq_len)
    assert reader.locator("#batch-size input[type='number']").input_value() == str(BATCH_SIZE)
    assert reader.locator("#effective-batch-size input").input_value() == str(EFFECTIVE_BATCH_SIZE)
    assert int(_value(reader, "total-bytes")) == total
    # its length slider spans the model's positions (GPT-2's 1,024, past the default BERT's 512)
    # and a move to the end answers
    end = reader.locator("#seq-len input[type='range']")
    assert end.get_attribute("max") == "1024"
    end.focus()
    end.press("End")
    _wait_for_answer(reader, *_phrases(_job_flags(1024)))
    assert _markdown(reader, "error").strip() == ""
    lap("the link")

    # a broken config.json: one line, as the CLI says it; no answer beside it (the inputs show
    # the upload, the last answer was another job's)
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "gpt2", "n_layer": ')
    page.locator("#config-upload input[type='file']").set_input_files(str(broken))
    page.wait_for_function(
        """() => document.querySelector("#error [data-testid='markdown']")
                     ?.innerText.trim().length > 0""",
        timeout=ANSWER_MS,
    )
    line = _markdown(page, "error").strip()
    assert "\n" not in line and "Traceback" not in line and "internal error" not in line, line
    # what the CLI says of the same file: the page names the upload, not its path on the server
    said = _cli_error(
        "estimate", str(broken), "--task", TASK, "--batch-size", "1", "--seq-len", "8"
    )
    reason = said.rsplit(": ", 1)[-1]  # the JSON parser's own words
    assert "config.json" in line and "not valid JSON" in said and reason in line, (line, said)
    said = said.removeprefix("memfit: error: ")
    assert line == said.replace(str(broken), "config.json"), (line, said)
    assert _value(page, "total-bytes") == ""
    lap("the upload")

    # the server still answers: the page is served, and a new shape is answered (a batch size
    # of the same kind of shape: from the fit, no new trace)
    with urllib.request.urlopen(page_url, timeout=30) as response:
        assert response.status == 200
    number = reader.locator("#batch-size input[type='number']")
    number.fill(str(2 * BATCH_SIZE))
    number.press("Enter")
    after = _job_flags(1024)  # the reader's length, moved to the end above
    after[after.index("--batch-size") + 1] = str(2 * BATCH_SIZE)
    _wait_for_answer(reader, *_phrases(after))
    assert _markdown(reader, "error").strip() == ""
    assert int(_value(reader, "total-bytes")) > total
    context.close()
    lap("a new shape")
    print(f"the browser test took {time.monotonic() - started:.1f} s: {', '.join(laps)}")
