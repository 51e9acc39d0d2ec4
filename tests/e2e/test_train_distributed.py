"""`torchrun … -m memfit train` with 2 ranks on the CPU (gloo): one step for all, OOM agreed by all.

A tiny BERT classifier (dropout off, SGD, fp32). A memory cap makes each rank's CPU run out of
memory for real (live tensor bytes, `torch.OutOfMemoryError`); the caps are set from peaks the
ranks measured in an uncapped run, so each test knows that back-off must happen, and checks that
it did. Every launch has a timeout: a rank left waiting in a collective fails the test instead of
hanging it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

_NO_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)
# memfit's own data parallelism, PyTorch FSDP2, and DeepSpeed ZeRO stages 1-3 (memfit[deepspeed])
SHARDINGS = [
    "none",
    "fsdp",
    *(pytest.param(z, marks=_NO_DEEPSPEED) for z in ("zero1", "zero2", "zero3")),
]

WORDS = [f"w{i}" for i in range(60)]
LAUNCH_TIMEOUT = 240  # seconds for a whole 2-rank run: a hang fails instead of blocking CI


def _write_data(path: Path, rows: int, *, long_rows: tuple[int, ...] = (), seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = ["text,label"]
    for i in range(rows):
        n = 150 if i in long_rows else rng.randint(4, 10)
        words = [rng.choice(WORDS) for _ in range(n)]
        lines.append(f"{' '.join(words)},{int('w7' in words or 'w13' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MEMFIT_CACHE_DIR=str(tmp_path / "memfit-cache"),
        HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"),
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def _args(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--task",
        "classification",
        "--model",
        model,
        "--train-file",
        str(data),
        "--output-dir",
        str(out),
        "--effective-batch-size",
        "8",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--epochs",
        "2",
        *extra,
    ]


def _launch(tmp_path: Path, args: list[str], *, ranks: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={ranks}", "-m", "memfit", *args]
    return subprocess.run(
        command,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )


def _single(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memfit", *args],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )


def _ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stderr[-3000:]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _rank_peaks(out: Path) -> list[list[int]]:
    return [m["rank_peak_bytes"] for m in _jsonl(out / "metrics.jsonl") if "loss" in m]


def _assert_agreed(events: list[dict]) -> None:
    """Every back-off of a step was adopted by both ranks, with the same size."""
    backoffs: dict[tuple, set] = {}
    for event in events:
        if event["type"] == "backoff" and "cure" not in event:
            key = (event["step"], event.get("phase"), event["from"])
            backoffs.setdefault(key, set()).add((event["rank"], event["to"]))
    assert backoffs, "the cap was meant to force a back-off"
    for key, adopted in backoffs.items():
        assert {rank for rank, _ in adopted} == {0, 1}, key
        assert len({to for _, to in adopted}) == 1, (key, adopted)


@pytest.fixture(scope="module")
def one_process(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: one process, the same effective batch, no cap."""
    root = tmp_path_factory.mktemp("reference")
    data = _write_data(root / "train.csv", 40)
    long_data = _write_data(root / "long.csv", 40, long_rows=(5,))
    out = {}
    for name, path in (("short", data), ("long", long_data)):
        run = _single(root, _args(tiny_classifier, path, root / name, "--micro-batch-size", "4"))
        _ok(run)
        out[name] = root / name
    return {"data": data, "long_data": long_data, **out}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_ranks_equal_one_process(
    tiny_classifier: str, one_process: dict, tmp_path: Path, sharding: str
) -> None:
    out = tmp_path / "run"
    args = _args(tiny_classifier, one_process["data"], out, "--micro-batch-size", "4")
    run = _launch(tmp_path, [*args, "--sharding", sharding])
    _ok(run)
    assert _max_difference(one_process["short"], out) <= 1e-5
    metrics = [m for m in _jsonl(out / "metrics.jsonl") if "loss" in m]
    reference = [m for m in _jsonl(one_process["short"] / "metrics.jsonl") if "loss" in m]
    # the effective batch is global: the same samples per step, and the same losses
    assert [m["samples_seen"] for m in metrics] == [m["samples_seen"] for m in reference]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], abs=1e-5)
    assert all(m["world_size"] == 2 and len(m["rank_peak_bytes"]) == 2 for m in metrics)
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["resolved"]["world_size"] == 2
    assert run_json["resolved"]["sharding"] == sharding


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_cap_on_both_ranks_backs_off_together_same_weights(
    tiny_classifier: str, one_process: dict, tmp_path: Path, sharding: str
) -> None:
    data = one_process["data"]
    peaks = {}
    for micro in (4, 1):
        out = tmp_path / f"measure-{micro}"
        args = _args(tiny_classifier, data, out, "--micro-batch-size", str(micro))
        # a cap that never bites: every rank's live tensor bytes are counted
        _ok(_launch(tmp_path, [*args, "--sharding", sharding, "--memory-cap", "10GiB"]))
        peaks[micro] = _rank_peaks(out)
    fits = max(max(p) for p in peaks[1])
    too_big = max(max(p) for p in peaks[4])
    assert fits < too_big
    cap = (fits + too_big) // 2
    out = tmp_path / "capped"
    args = _args(tiny_classifier, data, out, "--micro-batch-size", "4")
    started = time.monotonic()
    run = _launch(tmp_path, [*args, "--sharding", sharding, "--memory-cap", str(cap)])
    _ok(run)
    assert time.monotonic() - started < LAUNCH_TIMEOUT
    events = _jsonl(out / "events.jsonl")
    assert any(e["type"] == "oom" for e in events)
    _assert_agreed(events)
    assert _max_difference(one_process["short"], out) <= 1e-5
    steps = [m["step"] for m in _jsonl(out / "metrics.jsonl") if "loss" in m]
    assert steps == list(range(1, len(steps) + 1))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_only_the_rank_with_the_long_sample_runs_out_no_hang(
    tiny_classifier: str, one_process: dict, tmp_path: Path, sharding: str
) -> None:
    """One long text in the data: the ranks' shards are dealt longest first, so the step that
    draws it (once an epoch) gives it to rank 0, whose micro-batch is then padded to 150 tokens;
    rank 1 holds short rows only. The cap sits between the two ranks' peaks at that step."""
    data = one_process["long_data"]
    measure = tmp_path / "measure"
    args = _args(tiny_classifier, data, measure, "--micro-batch-size", "4", "--no-probe")
    _ok(_launch(tmp_path, [*args, "--sharding", sharding, "--memory-cap", "10GiB"]))
    peaks = _rank_peaks(measure)
    long_steps = [i for i, (a, b) in enumerate(peaks) if a > 1.05 * b]
    assert long_steps, peaks  # the long texts made rank 0's peak stand out
    others = max(max(p) for i, p in enumerate(peaks) if i not in long_steps)
    longest = max(peaks[i][0] for i in long_steps)
    cap = (others + longest) // 2
    out = tmp_path / "capped"
    args = _args(tiny_classifier, data, out, "--micro-batch-size", "4", "--no-probe")
    run = _launch(tmp_path, [*args, "--sharding", sharding, "--memory-cap", str(cap)])
    _ok(run)
    events = _jsonl(out / "events.jsonl")
    ooms = [e for e in events if e["type"] == "oom"]
    assert ooms and {e["rank"] for e in ooms} == {0}, ooms  # only rank 0 ran out of memory
    assert {e["step"] - 1 for e in ooms} <= set(long_steps)
    _assert_agreed(events)
    # rank 1 followed rank 0's back-off without an OOM of its own
    assert any(e["type"] == "backoff" and e["rank"] == 1 and e.get("cause") for e in events)
    assert _max_difference(one_process["long"], out) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_sigterm_then_resume_on_two_ranks(
    tiny_classifier: str, one_process: dict, tmp_path: Path, sharding: str
) -> None:
    """torchrun forwards SIGTERM to both ranks; they agree to stop after the same step and write
    one checkpoint (torchrun itself then exits 1: it reports the signal it got); --resume then
    ends with the uninterrupted run's weights."""
    data = _write_data(tmp_path / "train.csv", 160)
    full = tmp_path / "full"
    args = _args(tiny_classifier, data, full, "--micro-batch-size", "4")
    _ok(_launch(tmp_path, [*args, "--sharding", sharding]))
    out = tmp_path / "stopped"
    args = _args(tiny_classifier, data, out, "--micro-batch-size", "4", "--save-every", "1000")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", "-m", "memfit", *args, "--sharding", sharding]
    process = subprocess.Popen(
        command,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
    # the ranks stopped cleanly (torchrun's own report of the signal is its business)
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr
    stops = [e for e in _jsonl(out / "events.jsonl") if e["type"] == "stop"]
    assert {e["rank"] for e in stops} == {0, 1}
    assert len({e["step"] for e in stops}) == 1  # both ranks stopped after the same step
    assert stops[0]["step"] < 40  # stopped before the end: the resume below has work to do
    assert (out / "checkpoints" / f"step-{stops[0]['step']}").is_dir()
    resumed = _launch(tmp_path, [*args, "--sharding", sharding, "--resume"])
    _ok(resumed)
    assert _max_difference(full, out) <= 1e-5
    steps = [m["step"] for m in _jsonl(metrics) if "loss" in m]
    assert steps == list(range(1, 41))


@pytest.mark.slow
def test_eval_is_split_over_the_ranks_and_reduced(
    tiny_classifier: str, one_process: dict, tmp_path: Path
) -> None:
    data = one_process["data"]
    dev = _write_data(tmp_path / "dev.csv", 13, seed=5)
    single = tmp_path / "single"
    args = _args(tiny_classifier, data, single, "--micro-batch-size", "4", "--eval-file", str(dev))
    _ok(_single(tmp_path, args))
    out = tmp_path / "two"
    args = _args(tiny_classifier, data, out, "--micro-batch-size", "4", "--eval-file", str(dev))
    _ok(_launch(tmp_path, args))
    expected = [m for m in _jsonl(single / "metrics.jsonl") if "eval_accuracy" in m][-1]
    got = [m for m in _jsonl(out / "metrics.jsonl") if "eval_accuracy" in m][-1]
    assert got["eval_accuracy"] == pytest.approx(expected["eval_accuracy"])
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
    assert (out / "best" / "config.json").is_file()


def test_zero_in_one_process_is_refused_before_anything_starts(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    run = _single(tmp_path, [*_args(tiny_classifier, data, out), "--sharding", "zero2"])
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: --sharding: zero2"), lines
    assert "torchrun --nproc_per_node N -m memfit train" in lines[0]
    assert "Traceback" not in run.stderr
    assert not out.exists()


def test_a_world_size_that_was_not_launched_is_refused(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    run = _single(tmp_path, [*_args(tiny_classifier, data, out), "--world-size", "4"])
    assert run.returncode == 2
    assert "torchrun --nproc_per_node 4 -m memfit train" in run.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_mismatched_world_size_under_torchrun_stops_every_rank(
    tiny_classifier: str, tmp_path: Path
) -> None:
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    run = _launch(tmp_path, [*_args(tiny_classifier, data, out), "--world-size", "3"])
    # torchrun's own exit code is 1 whenever a rank fails; rank 0 says why, once
    assert run.returncode != 0
    assert run.stderr.count("memfit: error: --world-size: 3 ranks asked for, but 2") == 1
    assert not out.exists()


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_job(
    tiny_classifier: str, one_process: dict, tmp_path: Path
) -> None:
    """`accelerate launch --multi_gpu` starts the ranks through torchrun's machinery; on the CPU
    memfit joins them with gloo (`--cpu` would start one process: accelerate's multi-CPU mode
    wants MPI)."""
    out = tmp_path / "run"
    args = _args(tiny_classifier, one_process["data"], out, "--micro-batch-size", "4")
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(_free_port()), "-m", "memfit", *args]
    run = subprocess.run(
        command, env=_env(tmp_path), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    _ok(run)
    assert json.loads((out / "run.json").read_text())["resolved"]["world_size"] == 2
    assert _max_difference(one_process["short"], out) <= 1e-5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_causal_lm_two_ranks_equal_one_process(
    gpt2_dir: str, tmp_path: Path, sharding: str
) -> None:
    """Per-token loss over texts of different lengths: each rank's share is weighted by the
    whole step's target tokens, so the sum is the one-process gradient (tied lm_head included)."""
    rng = random.Random(4)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "in", "park", "good", "movie"]
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 14)))})]
    lines += [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 14)))})
        for _ in range(23)
    ]
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(lines) + "\n")

    def args(out: Path) -> list[str]:
        return [
            "train", "--task", "causal-lm", "--model", gpt2_dir, "--train-file", str(data),
            "--output-dir", str(out), "--effective-batch-size", "6", "--micro-batch-size", "2",
            "--optimizer", "sgd", "--lr", "0.5", "--seed", "3", "--device", "cpu",
            "--max-seq-len", "32",
        ]  # fmt: skip

    _ok(_single(tmp_path, args(tmp_path / "one")))
    _ok(_launch(tmp_path, [*args(tmp_path / "two"), "--sharding", sharding]))
    assert _max_difference(tmp_path / "one", tmp_path / "two") <= 1e-5
    one = [m["loss"] for m in _jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in m]
    two = [m["loss"] for m in _jsonl(tmp_path / "two" / "metrics.jsonl") if "loss" in m]
    assert two == pytest.approx(one, abs=1e-5)


@pytest.mark.slow
@_NO_DEEPSPEED
def test_a_users_deepspeed_file_runs_its_stage(
    tiny_classifier: str, one_process: dict, tmp_path: Path
) -> None:
    """`--deepspeed ds_config.json` alone: the file's stage, its "auto" values filled; its
    optimizer section is left to memfit (said once), the result is the one-process run's."""
    config = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": False},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "gradient_accumulation_steps": "auto",
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "run"
    args = _args(tiny_classifier, one_process["data"], out, "--micro-batch-size", "4")
    run = _launch(tmp_path, [*args, "--deepspeed", str(path)])
    _ok(run)
    assert run.stderr.count("optimizer section is left out") == 1
    assert json.loads((out / "run.json").read_text())["resolved"]["sharding"] == "zero2"
    assert _max_difference(one_process["short"], out) <= 1e-5


def _stop_after_three_steps(command: list[str], tmp_path: Path, out: Path) -> int:
    """Run ``command``, SIGTERM it once its third step is logged; the step it stopped after."""
    process = subprocess.Popen(
        command, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    process.wait(timeout=LAUNCH_TIMEOUT)
    stops = [e for e in _jsonl(out / "events.jsonl") if e["type"] == "stop"]
    assert stops and stops[0]["reason"].startswith("signal"), stops
    return int(stops[0]["step"])


def _adamw_args(model: str, data: Path, out: Path) -> list[str]:
    args = _args(model, data, out, "--micro-batch-size", "4", "--save-every", "1000")
    # AdamW: the optimizer state (moments and step counters) must cross the resume too
    at = args.index("--optimizer")
    args[at + 1 : at + 4] = ["adamw", "--lr", "0.001"]
    return args


@pytest.mark.slow
@_NO_DEEPSPEED
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_an_adamw_zero_checkpoint_resumes_in_one_process(
    tiny_classifier: str, tmp_path: Path, sharding: str
) -> None:
    """The checkpoint holds the whole model and optimizer state (gathered from DeepSpeed's
    partitions), in the layout every run writes: a 2-rank ZeRO run stopped by SIGTERM ends as
    one process with --sharding none, with the weights of an uninterrupted run."""
    data = _write_data(tmp_path / "train.csv", 160)
    full = tmp_path / "full"
    _ok(_single(tmp_path, _adamw_args(tiny_classifier, data, full)))
    out = tmp_path / "stopped"
    args = _adamw_args(tiny_classifier, data, out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", "-m", "memfit", *args, "--sharding", sharding]
    assert _stop_after_three_steps(command, tmp_path, out) < 40
    _ok(_single(tmp_path, [*args, "--resume"]))
    assert _max_difference(full, out) <= 1e-5


@pytest.mark.slow
@_NO_DEEPSPEED
@pytest.mark.parametrize("sharding", ["zero1", "zero3"])
def test_a_one_process_adamw_checkpoint_resumes_under_zero(
    tiny_classifier: str, tmp_path: Path, sharding: str
) -> None:
    """The other way: one process stopped by SIGTERM, resumed on 2 ranks under ZeRO (its fresh
    engine gets the moments and step counters), ends with the uninterrupted run's weights."""
    data = _write_data(tmp_path / "train.csv", 160)
    full = tmp_path / "full"
    _ok(_single(tmp_path, _adamw_args(tiny_classifier, data, full)))
    out = tmp_path / "stopped"
    args = _adamw_args(tiny_classifier, data, out)
    command = [sys.executable, "-m", "memfit", *args]
    assert _stop_after_three_steps(command, tmp_path, out) < 40
    _ok(_launch(tmp_path, [*args, "--sharding", sharding, "--resume"]))
    assert _max_difference(full, out) <= 1e-5
