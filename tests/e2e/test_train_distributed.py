"""`memfit train` with 2 ranks on the CPU (gloo): one step for all, OOM agreed by all.

A tiny BERT classifier (dropout off, SGD, fp32). A memory cap makes each rank's CPU run out of
memory for real (live tensor bytes, `torch.OutOfMemoryError`); the caps are set from peaks the
ranks measured in an uncapped run, so each test knows that back-off must happen, and checks that
it did.

Every sharding scheme (memfit's own data parallelism, FSDP2, DeepSpeed ZeRO 1-3) runs the same
jobs, and a 2-rank launch costs far more to start than these jobs take: so each scheme's jobs run
in one torchrun launch (``tests/e2e/_train_ranks.py``, each job as ``memfit train`` in the rank's
process), and each one-process reference runs once, in this process. What only a launch of its
own can show keeps one: SIGTERM sent to torchrun (ZeRO-2 and ZeRO-3), ``accelerate launch``.
Every launch has a timeout: a rank left waiting in a collective fails the test instead of
hanging it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _train_ranks import Launched, jsonl, launch_jobs, rank_peaks
from safetensors.torch import load_file

from cli_run import run_cli, run_ok

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
JOB_TIMEOUT = 300  # seconds for each job of a launch (a collective waits no longer)
UNREACHABLE = "10GiB"  # a cap that never bites: every rank's live tensor bytes are counted
# the runs stopped by SIGTERM and resumed: 64 rows, 8 a step, 2 epochs
RESUME_ROWS = 64
RESUMED_STEPS = RESUME_ROWS // 8 * 2


def long_steps(peaks: list[list[int]]) -> list[int]:
    """The steps at which rank 0's peak stands out (its micro-batch holds the long row)."""
    return [i for i, (a, b) in enumerate(peaks) if a > 1.05 * b]


def halfway_cap(folder: Path, *, fits: str, too_big: str) -> int:
    """Between the largest peak of job ``fits`` (on any rank, any step) and that of ``too_big``."""
    most = {job: max(max(p) for p in rank_peaks(folder / job)) for job in (fits, too_big)}
    return (most[fits] + most[too_big]) // 2


def long_step_cap(folder: Path, *, measure: str) -> int:
    """Between rank 0's peak at the steps its long row made stand out in job ``measure`` and
    every other step's peak (on any rank)."""
    peaks = rank_peaks(folder / measure)
    standing_out = long_steps(peaks)
    others = max(max(p) for i, p in enumerate(peaks) if i not in standing_out)
    longest = max((peaks[i][0] for i in standing_out), default=others)
    return (others + longest) // 2


def _write_data(path: Path, rows: int, *, long_rows: tuple[int, ...] = (), seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = ["text,label"]
    for i in range(rows):
        n = 150 if i in long_rows else rng.randint(4, 10)
        words = [rng.choice(WORDS) for _ in range(n)]
        lines.append(f"{' '.join(words)},{int('w7' in words or 'w13' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_corpus(path: Path) -> Path:
    """24 texts of 2 to 14 words: per-token losses over texts of different lengths."""
    rng = random.Random(4)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "in", "park", "good", "movie"]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 14)))})
        for _ in range(24)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
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


def _causal_args(model: str, data: Path, out: Path) -> list[str]:
    return [
        "train", "--task", "causal-lm", "--model", model, "--train-file", str(data),
        "--output-dir", str(out), "--effective-batch-size", "6", "--micro-batch-size", "2",
        "--optimizer", "sgd", "--lr", "0.5", "--seed", "3", "--device", "cpu",
        "--max-seq-len", "32",
    ]  # fmt: skip


def _adamw_args(model: str, data: Path, out: Path) -> list[str]:
    args = _args(model, data, out, "--micro-batch-size", "4", "--save-every", "1000")
    # AdamW: the optimizer state (moments and step counters) must cross the resume too
    at = args.index("--optimizer")
    args[at + 1 : at + 4] = ["adamw", "--lr", "0.001"]
    return args


def _ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stderr[-3000:]


_jsonl = jsonl


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


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


def _stop_after_three_steps(command: list[str], tmp_path: Path, out: Path, *, ranks: int) -> int:
    """Run ``command``, SIGTERM it (torchrun forwards the signal to its ranks) once its third
    step is logged; every rank stops cleanly after the same step with a checkpoint of it: that
    step."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=stderr, text=True
        )
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                process.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        process.wait(timeout=LAUNCH_TIMEOUT)
        stderr.seek(0)
        said = stderr.read()
    stops = [e for e in _jsonl(out / "events.jsonl") if e["type"] == "stop"]
    assert stops and all(e["reason"].startswith("signal") for e in stops), stops
    assert len(stops) == ranks and len({e["step"] for e in stops}) == 1, stops
    if ranks > 1:
        assert {e["rank"] for e in stops} == set(range(ranks)), stops
    assert (out / "checkpoints" / f"step-{stops[0]['step']}").is_dir()
    # the ranks stopped cleanly (torchrun's own report of the signal it got is its business)
    tracebacks = [f"[rank{r}]: Traceback" for r in range(ranks)] if ranks > 1 else ["Traceback"]
    assert not any(t in said for t in tracebacks), said[-3000:]
    return int(stops[0]["step"])


def _cap(function: str, **kwargs: str) -> dict[str, Any]:
    """A job's memory cap: ``function(folder, **kwargs)`` of this module, in the launch."""
    return {"function": f"{__name__}:{function}", "kwargs": kwargs}


class Runs:
    """The module's runs, each made once, when a test first needs it."""

    def __init__(self, root: Path, classifier: str, gpt2: str) -> None:
        self.root, self.classifier, self.gpt2 = root, classifier, gpt2
        self._launches: dict[str, Launched | None] = {}
        inputs = root / "inputs"
        inputs.mkdir()
        self.data = _write_data(inputs / "train.csv", 40)
        self.long_data = _write_data(inputs / "long.csv", 40, long_rows=(5,))
        # RESUMED_STEPS steps: a SIGTERM after the third leaves the resume work to do, across the
        # epoch's end
        self.resume_data = _write_data(inputs / "resume.csv", RESUME_ROWS)
        self.dev = _write_data(inputs / "dev.csv", 13, seed=5)
        self.corpus = _write_corpus(inputs / "corpus.jsonl")

    @functools.cache  # noqa: B019 - one Runs per module, kept for the module's tests
    def one_process(self, name: str) -> Path:
        """The one-process reference ``name``, run in this process."""
        out = self.root / "one-process" / name
        args = {
            "short": _args(self.classifier, self.data, out, "--micro-batch-size", "4"),
            "long": _args(self.classifier, self.long_data, out, "--micro-batch-size", "4"),
            "eval": _args(
                self.classifier,
                self.data,
                out,
                "--micro-batch-size",
                "4",
                "--eval-file",
                str(self.dev),
            ),
            "causal": _causal_args(self.gpt2, self.corpus, out),
            "adamw": _adamw_args(self.classifier, self.resume_data, out),
        }[name]
        run_ok(*args)
        return out

    @functools.cache  # noqa: B019
    def stopped_in_one_process(self) -> Path:
        """An AdamW run in one process, stopped by SIGTERM after its third step (a folder the
        ZeRO launches copy and resume on 2 ranks)."""
        out = self.root / "one-process" / "adamw-stopped"
        command = [
            sys.executable,
            "-m",
            "memfit",
            *_adamw_args(self.classifier, self.resume_data, out),
        ]
        assert _stop_after_three_steps(command, self.root, out, ranks=1) < RESUMED_STEPS
        return out

    def jobs(self, sharding: str, folder: Path) -> list[dict[str, Any]]:
        """What every scheme runs, and the jobs only one scheme needs."""
        scheme = ["--sharding", sharding]

        def job(name: str, data: Path, *extra: str, **more: Any) -> dict[str, Any]:
            argv = _args(self.classifier, data, folder / name, *extra, *scheme)
            return {"name": name, "argv": argv, **more}

        micro_4 = ("--micro-batch-size", "4")
        counted = ("--memory-cap", UNREACHABLE)
        stopped = job("stopped", self.resume_data, *micro_4, "--save-every", "1000", stop_after=3)
        causal = [*_causal_args(self.gpt2, self.corpus, folder / "causal"), *scheme]
        jobs = [
            # the same effective batch as one process, no cap
            job("plain", self.data, *micro_4),
            # each rank's live tensor bytes at micro-batch 4 and 1 (the cap counts, never bites)
            job("measure-4", self.data, *micro_4, *counted),
            job("micro-1", self.data, "--micro-batch-size", "1", *counted),
            # a cap between the peaks at micro-batch 1 and 4: both ranks run out of memory
            job("capped", self.data, *micro_4, cap=_cap("halfway_cap", fits="micro-1",
                                                      too_big="measure-4")),
            # the long row: a cap only the rank that holds it crosses
            job("long-measure", self.long_data, *micro_4, "--no-probe", *counted),
            job("long-capped", self.long_data, *micro_4, "--no-probe",
                cap=_cap("long_step_cap", measure="long-measure")),
            {"name": "causal", "argv": causal},
            # uninterrupted, then stopped by SIGTERM to both ranks and resumed
            job("full", self.resume_data, *micro_4),
            stopped,
            {"name": "resumed", "argv": [*stopped["argv"], "--resume"]},
        ]  # fmt: skip
        if sharding == "none":
            # memfit's own default scheme, no --sharding flag
            eval_args = _args(self.classifier, self.data, folder / "eval", *micro_4)
            jobs.append({"name": "eval", "argv": [*eval_args, "--eval-file", str(self.dev)]})
        if sharding == "zero2":
            jobs.append(self._deepspeed_file_job(folder))
        if sharding in ("zero1", "zero3"):
            # a one-process AdamW checkpoint resumed under ZeRO
            copy = folder / "adamw-resumed"
            shutil.copytree(self.stopped_in_one_process(), copy)
            argv = [*_adamw_args(self.classifier, self.resume_data, copy), *scheme, "--resume"]
            jobs.append({"name": "adamw-resumed", "argv": argv})
        return jobs

    def _deepspeed_file_job(self, folder: Path) -> dict[str, Any]:
        config = {
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": False},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "gradient_accumulation_steps": "auto",
        }
        path = folder / "ds_config.json"
        path.write_text(json.dumps(config))
        out = folder / "deepspeed-file"
        args = _args(self.classifier, self.data, out, "--micro-batch-size", "4")
        return {"name": "deepspeed-file", "argv": [*args, "--deepspeed", str(path)]}

    def launched(self, sharding: str) -> Launched:
        """Every job of ``sharding``, in one 2-rank launch (the first test that needs it says
        why it failed; the scheme's other tests, that it did)."""
        if sharding not in self._launches:
            folder = self.root / sharding
            folder.mkdir()
            self._launches[sharding] = None
            jobs = self.jobs(sharding, folder)
            self._launches[sharding] = launch_jobs(
                folder, jobs, _env(folder), job_timeout=JOB_TIMEOUT
            )
        launched = self._launches[sharding]
        if launched is None:
            pytest.fail(f"the launch of the {sharding} jobs failed (see its first test)")
        return launched


@pytest.fixture(scope="module")
def runs(tiny_classifier: str, gpt2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("distributed"), tiny_classifier, gpt2_dir)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_ranks_equal_one_process(runs: Runs, sharding: str) -> None:
    out = runs.launched(sharding).out("plain")
    reference = runs.one_process("short")
    assert _max_difference(reference, out) <= 1e-5
    metrics = [m for m in _jsonl(out / "metrics.jsonl") if "loss" in m]
    expected = [m for m in _jsonl(reference / "metrics.jsonl") if "loss" in m]
    # the effective batch is global: the same samples per step, and the same losses
    assert [m["samples_seen"] for m in metrics] == [m["samples_seen"] for m in expected]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in expected], abs=1e-5)
    assert all(m["world_size"] == 2 and len(m["rank_peak_bytes"]) == 2 for m in metrics)
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["resolved"]["world_size"] == 2
    assert run_json["resolved"]["sharding"] == sharding


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_cap_on_both_ranks_backs_off_together_same_weights(runs: Runs, sharding: str) -> None:
    launched = runs.launched(sharding)
    peaks = {4: rank_peaks(launched.out("measure-4")), 1: rank_peaks(launched.out("micro-1"))}
    fits = max(max(p) for p in peaks[1])
    too_big = max(max(p) for p in peaks[4])
    assert fits < too_big
    out = launched.out("capped")
    config = json.loads((out / "run.json").read_text())["config"]
    assert (
        config["memory_cap"]
        == (fits + too_big) // 2
        == halfway_cap(launched.folder, fits="micro-1", too_big="measure-4")
    )
    assert launched.results["capped"]["seconds"] < LAUNCH_TIMEOUT
    events = _jsonl(out / "events.jsonl")
    assert any(e["type"] == "oom" for e in events)
    _assert_agreed(events)
    assert _max_difference(runs.one_process("short"), out) <= 1e-5
    steps = [m["step"] for m in _jsonl(out / "metrics.jsonl") if "loss" in m]
    assert steps == list(range(1, len(steps) + 1))


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_only_the_rank_with_the_long_sample_runs_out_no_hang(runs: Runs, sharding: str) -> None:
    """One long text in the data: the ranks' shards are dealt longest first, so the step that
    draws it (once an epoch) gives it to rank 0, whose micro-batch is then padded to 150 tokens;
    rank 1 holds short rows only. The cap sits between the two ranks' peaks at that step."""
    launched = runs.launched(sharding)
    peaks = rank_peaks(launched.out("long-measure"))
    standing_out = long_steps(peaks)
    assert standing_out, peaks  # the long texts made rank 0's peak stand out
    others = max(max(p) for i, p in enumerate(peaks) if i not in standing_out)
    longest = max(peaks[i][0] for i in standing_out)
    out = launched.out("long-capped")
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["memory_cap"] == (others + longest) // 2
    events = _jsonl(out / "events.jsonl")
    ooms = [e for e in events if e["type"] == "oom"]
    assert ooms and {e["rank"] for e in ooms} == {0}, ooms  # only rank 0 ran out of memory
    assert {e["step"] - 1 for e in ooms} <= set(standing_out)
    _assert_agreed(events)
    # rank 1 followed rank 0's back-off without an OOM of its own
    assert any(e["type"] == "backoff" and e["rank"] == 1 and e.get("cause") for e in events)
    assert _max_difference(runs.one_process("long"), out) <= 1e-5


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_sigterm_then_resume_on_two_ranks(runs: Runs, sharding: str) -> None:
    """SIGTERM reaches both ranks (as torchrun forwards it: see the ZeRO tests below for a signal
    to torchrun itself); they agree to stop after the same step and write one checkpoint;
    --resume then ends with the uninterrupted run's weights."""
    launched = runs.launched(sharding)
    full = launched.out("full")
    out = launched.out("stopped")
    # the ranks stopped cleanly: no traceback on either
    assert "Traceback" not in launched.output("stopped")
    events = _jsonl(out / "events.jsonl")
    # the stopped run's events: those before the resume's (which appends to the same file)
    resumes = [i for i, e in enumerate(events) if e["type"] == "resume"]
    assert resumes, "the resumed run logs its resume"
    stops = [e for e in events[: resumes[0]] if e["type"] == "stop"]
    assert {e["rank"] for e in stops} == {0, 1}
    assert len({e["step"] for e in stops}) == 1  # both ranks stopped after the same step
    assert (
        stops[0]["step"] < RESUMED_STEPS
    )  # stopped before the end: the resume below has work to do
    assert (out / "checkpoints" / f"step-{stops[0]['step']}").is_dir()
    assert launched.out("resumed") == out
    assert _max_difference(full, out) <= 1e-5
    steps = [m["step"] for m in _jsonl(out / "metrics.jsonl") if "loss" in m]
    assert steps == list(range(1, RESUMED_STEPS + 1))


def test_eval_is_split_over_the_ranks_and_reduced(runs: Runs) -> None:
    single = runs.one_process("eval")
    out = runs.launched("none").out("eval")
    expected = [m for m in _jsonl(single / "metrics.jsonl") if "eval_accuracy" in m][-1]
    got = [m for m in _jsonl(out / "metrics.jsonl") if "eval_accuracy" in m][-1]
    assert got["eval_accuracy"] == pytest.approx(expected["eval_accuracy"])
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
    assert (out / "best" / "config.json").is_file()


def test_zero_in_one_process_is_refused_before_anything_starts(
    tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    code, _out, err = run_cli(capsys, *_args(tiny_classifier, data, out), "--sharding", "zero2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: --sharding: zero2"), lines
    assert "torchrun --nproc_per_node N -m memfit train" in lines[0]
    assert "Traceback" not in err
    assert not out.exists()


def test_a_world_size_that_was_not_launched_is_refused(
    tiny_classifier: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    code, _out, err = run_cli(capsys, *_args(tiny_classifier, data, out), "--world-size", "4")
    assert code == 2
    assert "torchrun --nproc_per_node 4 -m memfit train" in err
    assert not out.exists()


def test_a_mismatched_world_size_stops_every_rank_before_they_join(
    tiny_classifier: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each of 2 launched ranks (the launcher's environment, no process group: the refusal comes
    before any rank waits for another) stops with exit 2; rank 0 says why, once."""
    data = _write_data(tmp_path / "train.csv", 8)
    out = tmp_path / "run"
    said = []
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        code, _out, err = run_cli(capsys, *_args(tiny_classifier, data, out), "--world-size", "3")
        assert code == 2
        said.append(err)
    assert "".join(said).count("memfit: error: --world-size: 3 ranks asked for, but 2") == 1
    assert said[1] == ""
    assert not out.exists()


def test_accelerate_launch_runs_the_same_job(runs: Runs, tmp_path: Path) -> None:
    """`accelerate launch --multi_gpu` starts the ranks through torchrun's machinery; on the CPU
    memfit joins them with gloo (`--cpu` would start one process: accelerate's multi-CPU mode
    wants MPI)."""
    out = tmp_path / "run"
    args = _args(runs.classifier, runs.data, out, "--micro-batch-size", "4")
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(_free_port()), "-m", "memfit", *args]
    run = subprocess.run(
        command, env=_env(tmp_path), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    _ok(run)
    assert json.loads((out / "run.json").read_text())["resolved"]["world_size"] == 2
    assert _max_difference(runs.one_process("short"), out) <= 1e-5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_causal_lm_two_ranks_equal_one_process(runs: Runs, sharding: str) -> None:
    """Per-token loss over texts of different lengths: each rank's share is weighted by the
    whole step's target tokens, so the sum is the one-process gradient (tied lm_head included)."""
    one = runs.one_process("causal")
    two = runs.launched(sharding).out("causal")
    assert _max_difference(one, two) <= 1e-5
    losses_one = [m["loss"] for m in _jsonl(one / "metrics.jsonl") if "loss" in m]
    losses_two = [m["loss"] for m in _jsonl(two / "metrics.jsonl") if "loss" in m]
    assert losses_two == pytest.approx(losses_one, abs=1e-5)


@_NO_DEEPSPEED
def test_a_users_deepspeed_file_runs_its_stage(runs: Runs) -> None:
    """`--deepspeed ds_config.json` alone: the file's stage, its "auto" values filled; its
    optimizer section is left to memfit (said once), the result is the one-process run's."""
    launched = runs.launched("zero2")
    out = launched.out("deepspeed-file")
    assert launched.output("deepspeed-file").count("optimizer section is left out") == 1
    assert json.loads((out / "run.json").read_text())["resolved"]["sharding"] == "zero2"
    assert _max_difference(runs.one_process("short"), out) <= 1e-5


@_NO_DEEPSPEED
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_an_adamw_zero_checkpoint_resumes_in_one_process(
    runs: Runs, tmp_path: Path, sharding: str
) -> None:
    """The checkpoint holds the whole model and optimizer state (gathered from DeepSpeed's
    partitions), in the layout every run writes: a 2-rank ZeRO run stopped by SIGTERM sent to
    torchrun ends as one process with --sharding none, with the weights of an uninterrupted
    run."""
    full = runs.one_process("adamw")
    out = tmp_path / "stopped"
    args = _adamw_args(runs.classifier, runs.resume_data, out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", "-m", "memfit", *args, "--sharding", sharding]
    assert _stop_after_three_steps(command, tmp_path, out, ranks=2) < RESUMED_STEPS
    run_ok(*args, "--resume")
    assert _max_difference(full, out) <= 1e-5


@_NO_DEEPSPEED
@pytest.mark.parametrize("sharding", ["zero1", "zero3"])
def test_a_one_process_adamw_checkpoint_resumes_under_zero(runs: Runs, sharding: str) -> None:
    """The other way: one process stopped by SIGTERM, resumed on 2 ranks under ZeRO (its fresh
    engine gets the moments and step counters), ends with the uninterrupted run's weights."""
    assert (
        _max_difference(runs.one_process("adamw"), runs.launched(sharding).out("adamw-resumed"))
        <= 1e-5
    )
