"""The TRL example pair: ``sft_after.py`` is ``sft_before.py`` with the SFTTrainer import changed,
and under the memory cap its docstring names it runs out of memory, backs off, does every step
and ends with the adapters of TRL's own run without a cap (≤ 1e-5; fp32 on the CPU, LoRA dropout
0)."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "examples" / "sft_before.py"
AFTER = ROOT / "examples" / "sft_after.py"


def test_the_two_scripts_differ_in_the_import_of_sft_trainer_only() -> None:
    before = BEFORE.read_text(encoding="utf-8").splitlines()
    after = AFTER.read_text(encoding="utf-8").splitlines()
    changed = [
        line
        for line in difflib.unified_diff(before, after, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == [
        "-from trl import SFTTrainer  # isort: skip",
        "+from memfit.integrations import GuardedSFTTrainer as SFTTrainer  # isort: skip",
    ]


def docstring_cap() -> str:
    """The cap sft_after.py's docstring runs it under."""
    found = re.search(
        r"MEMFIT_MEMORY_CAP=(\d+\w+) python examples/sft_after\.py", AFTER.read_text("utf-8")
    )
    assert found, "sft_after.py names no cap"
    return found.group(1)


def start(script: Path, out: Path, cap: str | None) -> subprocess.Popen[str]:
    """The script as a user runs it (both runs at once: each is mostly start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_MEMORY_CAP"}
    if cap is not None:
        env["MEMFIT_MEMORY_CAP"] = cap
    return subprocess.Popen(
        [sys.executable, str(script), "--output-dir", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    return out, err


def adapters(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model" / "adapter_model.safetensors"))


def test_the_docs_page_runs_the_example_under_the_same_cap() -> None:
    page = (ROOT / "docs" / "trl.md").read_text(encoding="utf-8")
    assert f"MEMFIT_MEMORY_CAP={docstring_cap()} python examples/sft_after.py" in page


@pytest.mark.slow
def test_sft_after_under_the_cap_ends_with_trls_own_adapters(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    capped = start(AFTER, tmp_path / "capped", docstring_cap())
    stock = start(BEFORE, tmp_path / "stock", None)  # TRL's own SFTTrainer, no cap
    capped_out, _ = finish(capped)
    finish(stock)
    events = [
        json.loads(line)
        for line in (tmp_path / "capped" / "memfit_events.jsonl").read_text().splitlines()
    ]
    # a real OOM of the cap in a forward or backward at 8 rows, survived at 4
    oom, backoff = events[0], events[1]
    assert oom["type"] == "oom" and oom["micro_batch_size"] == 8
    assert oom["error"].startswith("memfit memory cap:")
    assert (backoff["type"], backoff["from"], backoff["to"]) == ("backoff", 8, 4)
    assert "stop" not in [e["type"] for e in events]
    summary = capped_out.strip().splitlines()[-1]
    assert summary.startswith("trained: 2 optimizer steps of 8 rows × 2 micro-batches")
    assert not (tmp_path / "stock" / "memfit_events.jsonl").exists()
    got, expected = adapters(tmp_path / "capped"), adapters(tmp_path / "stock")
    assert got.keys() == expected.keys() and got
    for name, value in expected.items():
        difference = float((got[name] - value).abs().max())
        assert difference <= 1e-5, f"{name}: {difference:.3g}"
    # trained: the adapters moved from their start (LoRA's B starts at zero)
    assert any(float(v.abs().max()) > 0 for k, v in got.items() if "lora_B" in k)
