"""``bench/plan_speed.py`` and ``bench/estimate_speed.py`` must measure what issue 34 asks.

The benchmarks themselves take minutes (the lead runs them); these check, in milliseconds, what
they are given and what they print: the jobs and targets, the shapes of every kind, the command
lines that reproduce a figure, and bad arguments refused as memfit refuses them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the scripts import _speed_common from beside them
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plan_speed() -> ModuleType:
    return _load("plan_speed")


@pytest.fixture(scope="module")
def estimate_speed() -> ModuleType:
    return _load("estimate_speed")


def test_plan_targets_are_the_issues(plan_speed: ModuleType) -> None:
    assert plan_speed.PLAN_LIMIT == 2.0 and plan_speed.WARM_LIMIT_S == 1.0
    targets = {name for name, job in plan_speed.PLAN_JOBS.items() if job.target}
    assert targets == set(plan_speed.DEFAULT_JOBS)
    args = plan_speed.PLAN_JOBS["llama31-8b-t4"].cli_args()
    assert args[:8] == [
        "meta-llama/Llama-3.1-8B",
        "--task",
        "causal-lm",
        "--seq-len",
        "2048",
        "--effective-batch-size",
        "16",
        "--gpu",
    ]
    assert args[8:] == ["t4", "--allow", "lora,quantization", "--json"]
    assert plan_speed.PLAN_JOBS["gpt2-medium-16gib"].cli_args()[-3:] == [
        "--gpu-memory",
        "16GiB",
        "--json",
    ]
    # both 8B plans against the plan's own job: the effective batch at once, nothing pinned
    estimate = plan_speed.JOBS[plan_speed.PLAN_JOBS["llama31-8b-t4-all"].estimate_job]
    assert estimate.cli_args() == [
        "meta-llama/Llama-3.1-8B",
        "--task",
        "causal-lm",
        "--batch-size",
        "16",
        "--seq-len",
        "2048",
    ]


def test_every_lever_job_allows_every_lever(plan_speed: ModuleType) -> None:
    # "every lever allowed" stays true when a lever is added to `memfit plan --allow`
    from memfit.levers import ALLOWABLE

    assert plan_speed.PLAN_JOBS["llama31-8b-t4-all"].allow == ALLOWABLE


def test_estimate_targets_per_row(estimate_speed: ModuleType) -> None:
    assert estimate_speed.COLD_LIMITS == {"bert": 1.0, "gpt2-xl": 1.0, "llama3-8b": 1.5}
    assert estimate_speed.JOBS["llama3-8b"].api_kwargs()["lora_rank"] == 16


@pytest.mark.parametrize("job", ["bert", "gpt2", "gpt2-xl"])
def test_new_shapes_start_with_each_kind(estimate_speed: ModuleType, job: str) -> None:
    es = estimate_speed
    first = es.JOBS[job]
    home = es.kind(first.batch_size, first.seq_len)
    shapes = [list(s) for s in es.NEW_SHAPES]
    firsts = es.first_of_each_kind(home, shapes)
    # every other kind of shape is asked, batch 1 and odd lengths; none is the job's own shape
    assert {es.kind(b, s) for b, s in firsts} == {
        (True, True),
        (False, False),
        (True, False),
        (False, True),
    } - {home}
    assert [first.batch_size, first.seq_len] not in shapes
    if home == (False, True):
        assert firsts == [[1, 128], [3, 123], [1, 77]]
    assert all(s <= 512 for _, s in shapes)  # bert-base's longest


def test_rerun_line_narrows_and_drops_json(
    plan_speed: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["x", "--rounds", "2", "--json=out.json", "--jobs", "a,b", "--memfit-src", "b=/x"]
    monkeypatch.setattr(sys, "argv", argv)
    line = plan_speed.rerun_line("plan_speed.py", jobs="bert-t4", budget_jobs="")
    assert line == (
        "python bench/plan_speed.py --rounds 2 --memfit-src b=/x --jobs bert-t4 --budget-jobs ''"
    )


def test_command_text_says_the_environment(
    plan_speed: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMFIT_TRACE_DEPTH", "full")  # the caller's: not the child's
    monkeypatch.delenv("MEMFIT_NO_BACKGROUND", raising=False)  # (the suite's own: see conftest)
    env = plan_speed.Checkout("x", Path("/co")).env(None)
    text = plan_speed.command_text(["python", "-m", "memfit", "plan", "a b"], env, "cold")
    assert text.startswith("env -u MEMFIT_TRACE_DEPTH ")
    assert "MEMFIT_CACHE_DIR=$(mktemp -d) " in text
    assert "PYTHONPATH=/co/src" in text
    assert text.endswith("python -m memfit plan 'a b'")


@pytest.mark.parametrize(
    ("script", "args", "flag"),
    [
        ("plan_speed.py", ["--jobs", "nope"], "--jobs"),
        ("estimate_speed.py", ["--shape-modes", "later"], "--shape-modes"),
        ("estimate_speed.py", ["--rounds", "0"], "--rounds"),
        ("ui_speed.py", ["--jobs", "nope"], "--jobs"),
        ("ui_speed.py", ["--seq-moves", "-1"], "--seq-moves"),
    ],
)
def test_bad_arguments_exit_2(script: str, args: list[str], flag: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(flag) and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def ui_speed() -> ModuleType:
    return _load("ui_speed")


def test_ui_jobs_and_target_are_the_issues(ui_speed: ModuleType) -> None:
    # issue 37: a slider move to new figures in ≤ 100 ms, on the three jobs of the speed benches
    assert ui_speed.LIMIT_MS == 100.0
    assert ui_speed.DEFAULT_JOBS == ("bert-t4", "gpt2-medium-16gib", "llama31-8b-t4")
    llama = ui_speed.JOBS["llama31-8b-t4"].page_job()
    assert (llama.model, llama.gpu, llama.task) == ("meta-llama/Llama-3.1-8B", "t4", "causal-lm")
    assert dict(llama.knobs) == {"lora_rank": 16, "quantization": "nf4", "precision": "fp16"}
    medium = ui_speed.JOBS["gpt2-medium-16gib"].page_job()
    assert (medium.gpu, medium.gpu_memory) == (None, "16GiB")
    # the smoke's model travels in the link, as an uploaded config.json does
    assert ui_speed.JOBS["smoke"].page_job().config_json is not None


@pytest.mark.parametrize(("job", "maximum"), [("bert-t4", 512), ("llama31-8b-t4", 131072)])
def test_ui_moves_are_new_shapes_odd_ones_among_them(
    ui_speed: ModuleType, job: str, maximum: int
) -> None:
    first = ui_speed.JOBS[job]
    seqs = ui_speed.seq_values(first, 20, 1, 1, maximum)
    batches = ui_speed.batch_values(first, 10, 256)
    assert len(seqs) == len(set(seqs)) == 20 and len(batches) == len(set(batches)) == 10
    assert first.seq_len not in seqs and first.batch_size not in batches
    assert all(1 <= s <= maximum for s in seqs)
    assert any(s % 8 for s in seqs) and any(s % 8 == 0 for s in seqs)  # both kinds of length
    assert any(b % 2 for b in batches)
    assert (1 in batches) == (first.batch_size != 1)  # a batch of one: its own kind
    # on a slider in steps of 8 (from 8), every length is one it can take
    assert all(s % 8 == 0 for s in ui_speed.seq_values(first, 20, 8, 8, maximum))


@pytest.mark.slow
def test_ui_speed_smoke(tmp_path: Path) -> None:
    # the bench end to end on a 2-layer GPT-2 config (seconds): the page, Chromium, the peer
    pytest.importorskip("gradio", reason="the ui extra")
    pytest.importorskip("playwright.sync_api", reason="the dev extra")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium)")
    out = tmp_path / "ui_speed.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "ui_speed.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    command = f"$ python bench/ui_speed.py --smoke --out {out}"
    assert lines[0] == command and lines[-1] == command  # the command, first and last
    record = json.loads(out.read_text())
    (summary,) = record["summaries"]
    assert summary["job"] == "smoke" and summary["moves"] == 3 and summary["failed_moves"] == 0
    assert 0 < summary["handler_median_ms"] <= summary["median_ms"]
    assert summary["verdict_median"] in ("PASS", "MISS") and summary["cli_median_s"] > 0
    assert f"median {summary['median_ms']:6.1f} ms {summary['verdict_median']}" in done.stdout
