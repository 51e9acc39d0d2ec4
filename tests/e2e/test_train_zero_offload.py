"""`memfit train --optimizer-offload cpu` under DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU ranks (gloo):
ZeRO-Offload (master weights, gradients and AdamW state in host memory, DeepSpeedCPUAdam's
update) ends with the weights of ZeRO-2 without offload, and a memory cap that forces an OOM ends with the weights
of the uncapped run (the guard's re-run after DeepSpeed's offload bookkeeping is reset:
memfit.train.zero.ZeroModel.reset).

DeepSpeed's CPU Adam is a C++ op built with ninja at its first use (about 3 minutes on 2 cores
here; cached in ~/.cache/torch_extensions after).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from _train_ranks import Launched, launch_jobs, rank_peaks
from safetensors.torch import load_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
    ),
]

WORDS = [f"w{i}" for i in range(60)]
JOB_TIMEOUT = 600  # the first job may build DeepSpeed's CPU Adam (minutes)
UNREACHABLE = "10GiB"  # a cap that never bites: every rank's live tensor bytes are counted
STAGES = ("zero2", "zero3")


def halfway_cap(folder: Path, *, fits: str, too_big: str) -> int:
    """Between the largest peak of job ``fits`` (on any rank, any step) and that of ``too_big``."""
    most = {job: max(max(p) for p in rank_peaks(folder / job)) for job in (fits, too_big)}
    return (most[fits] + most[too_big]) // 2


def _write_data(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        lines.append(f"{' '.join(words)},{int('w7' in words or 'w13' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _weights(out: Path) -> dict[str, Any]:
    return load_file(str(out / "model" / "model.safetensors"))


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def launched(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> Launched:
    folder = tmp_path_factory.mktemp("zero-offload")
    data = _write_data(folder / "train.csv", 40)

    def job(name: str, *extra: str, sharding: str = "zero2", **more: Any) -> dict[str, Any]:
        argv = ["train", "--task", "classification", "--model", tiny_classifier]
        argv += ["--train-file", str(data), "--output-dir", str(folder / name)]
        argv += ["--effective-batch-size", "8", "--optimizer", "adamw", "--lr", "0.001"]
        argv += ["--seed", "3", "--device", "cpu", "--epochs", "1", "--sharding", sharding]
        return {"name": name, "argv": [*argv, *extra], **more}

    offload = ("--optimizer-offload", "cpu")
    micro_4 = ("--micro-batch-size", "4")
    counted = ("--memory-cap", UNREACHABLE)
    jobs = [job("on-device", *micro_4)]
    for stage in STAGES:
        z = {"sharding": stage}
        cap = {
            "function": f"{__name__}:halfway_cap",
            "kwargs": {"fits": f"micro-1-{stage}", "too_big": f"measure-4-{stage}"},
        }
        jobs += [
            job(f"offloaded-{stage}", *offload, *micro_4, **z),
            job(f"measure-4-{stage}", *offload, *micro_4, *counted, **z),
            job(f"micro-1-{stage}", *offload, "--micro-batch-size", "1", *counted, **z),
            job(f"capped-{stage}", *offload, *micro_4, cap=cap, **z),
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["HF_DATASETS_CACHE"] = str(folder / "datasets-cache")
    return launch_jobs(folder, jobs, env, job_timeout=JOB_TIMEOUT)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_offload_ends_with_the_weights_of_zero_on_the_device(
    launched: Launched, stage: str
) -> None:
    offloaded = launched.out(f"offloaded-{stage}")
    assert _max_difference(launched.out("on-device"), offloaded) <= 1e-6
    resolved = json.loads((offloaded / "run.json").read_text())["resolved"]
    assert resolved["optimizer_offload"].startswith("DeepSpeed ZeRO-Offload")
    assert resolved["sharding"] == stage
    on_device = json.loads((launched.out("on-device") / "run.json").read_text())["resolved"]
    assert on_device["optimizer_offload"] is None


@pytest.mark.parametrize("stage", STAGES)
def test_a_cap_that_forces_an_oom_ends_with_the_weights_of_the_uncapped_run(
    launched: Launched, stage: str
) -> None:
    fits = max(max(p) for p in rank_peaks(launched.out(f"micro-1-{stage}")))
    too_big = max(max(p) for p in rank_peaks(launched.out(f"measure-4-{stage}")))
    assert fits < too_big
    out = launched.out(f"capped-{stage}")
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x]
    assert any(e["type"] == "oom" for e in events)
    assert any(e["type"] == "backoff" for e in events)
    assert _max_difference(launched.out(f"offloaded-{stage}"), out) <= 1e-6
