"""`memfit report` on a real CPU run whose first step runs out of memory under a memory cap.

The OOM must be on the memory plot (where the plot drew its OOM markers is checked against
events.jsonl), the page must be self-contained, and a real browser (Debian's headless Chromium)
must render it into a screenshot that is not blank.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.report.html import write_report
from memfit.report.plots import byte_unit, memory_plot
from memfit.train import TrainConfig, train
from memfit.units import format_bytes

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(60)]


def _write_data(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        lines.append(f"{' '.join(words)},{int('w7' in words or 'w13' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(model: str, data: Path, out: Path, **knobs: object) -> Path:
    settings: dict = dict(
        task="classification",
        model=model,
        train_file=str(data),
        eval_file=str(data),
        eval_every=2,
        output_dir=str(out),
        effective_batch_size=8,
        max_steps=4,
        optimizer="sgd",
        lr=0.5,
        seed=3,
        device="cpu",
        probe=False,  # the OOM then comes at step 1, inside the guard
        quiet=True,
    )
    train(TrainConfig(**(settings | knobs)))
    return out


def _peaks(out: Path) -> list[int]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [m["peak_bytes"] for m in lines if "peak_bytes" in m]


@pytest.fixture(scope="module")
def oom_run(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run capped between what micro-batch 1 and micro-batch 8 hold: an OOM at step 1."""
    tmp = tmp_path_factory.mktemp("report")
    data = _write_data(tmp / "train.csv", 40)
    # live tensor bytes of a step at micro-batch 8 and at 1, through a cap that never bites
    need8 = _peaks(_run(tiny_classifier, data, tmp / "p8", memory_cap=1 << 40, max_steps=1))[0]
    need1 = max(
        _peaks(
            _run(
                tiny_classifier,
                data,
                tmp / "p1",
                memory_cap=1 << 40,
                max_steps=2,
                micro_batch_size=1,
            )
        )
    )
    assert need1 < need8
    return _run(tiny_classifier, data, tmp / "run", memory_cap=(need1 + need8) // 2)


def test_the_oom_is_on_the_memory_plot(oom_run: Path) -> None:
    page = write_report(oom_run, estimate=False)
    assert page == oom_run / "report.html"
    for name in ("memory.png", "breakdown.png", "training.png"):
        assert (oom_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = [json.loads(x) for x in (oom_run / "events.jsonl").read_text().splitlines()]
    oom_steps = sorted({e["step"] for e in events if e["type"] == "oom"})
    backoff_steps = sorted({e["step"] for e in events if e["type"] == "backoff"})
    assert oom_steps == [1] and backoff_steps == [1]
    # the figure the page embeds, drawn again: where are its OOM and back-off markers?
    metrics = [json.loads(x) for x in (oom_run / "metrics.jsonl").read_text().splitlines()]
    run = json.loads((oom_run / "run.json").read_text())
    fig = memory_plot(metrics, events, run["config"]["memory_cap"])
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    assert list(lines["oom"].get_xdata()) == oom_steps
    assert list(lines["backoff"].get_xdata()) == backoff_steps
    budget = run["config"]["memory_cap"]
    _unit, size = byte_unit(max([budget, *(m["peak_bytes"] for m in metrics if "peak_bytes" in m)]))
    assert lines["budget"].get_ydata()[0] * size == pytest.approx(budget)
    assert format_bytes(budget) in lines["budget"].get_label()
    # the page: the same PNG bytes inline, no external resource, the OOM listed
    text = page.read_text()
    import base64

    for name in ("memory.png", "breakdown.png", "training.png"):
        encoded = base64.b64encode((oom_run / name).read_bytes()).decode()
        assert f'src="data:image/png;base64,{encoded}"' in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert "<script" not in text and "<link" not in text and "url(" not in text
    assert '<tr class="oom"><td>oom</td><td class="num">1</td>' in text
    assert "--no-estimate" in text


def test_the_cli_writes_the_report(oom_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["report", str(oom_run), "--no-estimate"])
    assert "report.html" in capsys.readouterr().out
    assert (oom_run / "report.html").stat().st_size > 10_000


def test_the_report_estimates_the_run(oom_run: Path, tmp_path: Path) -> None:
    # the tiny model's folder has a config.json: memfit.estimate traces it (a few seconds)
    run = tmp_path / "run"
    shutil.copytree(oom_run, run, ignore=shutil.ignore_patterns("model", "checkpoints"))
    text = write_report(run, estimate=True).read_text()
    # at the largest micro-batch the steps ran (the guard backed off from 8 at step 1)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ran = max(m.get("micro_batch_size") or 0 for m in lines)
    assert f"memfit.estimate for micro-batch {ran} ×" in text or "no estimate (" in text
    assert "estimated peak" in text, text[text.find("Estimate and measurement") :][:600]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_renders_in_a_browser(oom_run: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium)")
    page = write_report(oom_run, estimate=False)
    shot = tmp_path / "screenshot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1280,2000",
            page.resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    import numpy as np
    from matplotlib import image

    pixels = np.asarray(image.imread(shot))[..., :3]  # RGB floats in 0…1
    assert pixels.shape[:2] == (2000, 1280)
    assert pixels.std() > 0.05  # not one flat colour
    assert (pixels < 0.9).any(axis=-1).mean() > 0.02  # text and plots: not all white
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # the plots' colours, not a blank or error page
    # the OOM marker red (#d62728) of memory.png is on the screen
    red = (abs(pixels[..., 0] - 0xD6 / 255) < 0.05) & (abs(pixels[..., 1] - 0x27 / 255) < 0.05)
    assert red.sum() > 20
