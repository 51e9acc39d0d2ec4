"""`torchrun … -m memfit train --task sentence-embedding` on 2 CPU ranks (gloo): in-batch negatives
over the global batch, so the run equals one process's.

A tiny sentence-transformers model (1-layer BERT, mean pooling, dropout off), SGD, fp32, 22 pairs,
7 a step: the ranks' shares are 4 and 3, and in the last step of each epoch (1 pair) 1 and 0, so
rank 1 joins the collectives with no pair of its own. Each rank embeds its share and the positives
are gathered across the ranks: every anchor is scored against all of the step's positives. The
plain loss (``--loss mnrl``) and GradCache (``--loss cached-mnrl``) must both end with the one
process's weights and losses; under a memory cap set from the peaks the ranks measured, an OOM
happens and both ranks adopt the same smaller mini-batch, with the same weights again. Every
launch has a timeout: a rank left waiting in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from _train_ranks import launch_jobs, rank_peaks
from safetensors.torch import load_file

from cli_run import run_ok
from tiny_models import save_bert, save_sentence_transformer

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(40)]
JOB_TIMEOUT = 300  # seconds for each 2-rank run of the launch: a hang fails, never blocks CI
PAIRS_PER_STEP = "7"  # odd: the ranks get 4 and 3 pairs
LOSSES = ("mnrl", "cached-mnrl")


def _write_pairs(path: Path, rows: int, *, seed: int) -> Path:
    """Anchors of 3 to 8 words; a positive shares about half of its anchor's words."""
    rng = random.Random(seed)
    lines = ["anchor,positive"]
    for _ in range(rows):
        anchor = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        positive = [w for w in anchor if rng.random() < 0.5] + [rng.choice(WORDS) for _ in "ab"]
        lines.append(f"{' '.join(anchor)},{' '.join(positive)}")
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


def _args(model: str, data: Path, dev: Path, out: Path, loss: str, *extra: str) -> list[str]:
    return [
        "train", "--task", "sentence-embedding", "--model", model, "--train-file", str(data),
        "--eval-file", str(dev), "--output-dir", str(out), "--loss", loss,
        "--effective-batch-size", PAIRS_PER_STEP, "--optimizer", "sgd", "--lr", "0.2",
        "--seed", "3", "--device", "cpu", "--epochs", "2", "--max-seq-len", "16", *extra,
    ]  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _steps(out: Path) -> list[dict]:
    return [m for m in _jsonl(out / "metrics.jsonl") if "loss" in m]


def _max_difference(a: Path, b: Path) -> float:
    """The largest weight difference of two sentence-transformers folders (runs' ``model/``)."""
    wa = load_file(str(a / "model.safetensors"))
    wb = load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def capped_cap(folder: Path) -> int:
    """Between one pair per mini-batch (cached-mnrl at 1, either rank) and a whole share (mnrl's
    first step, on the smaller rank)."""
    peaks = {loss: rank_peaks(folder / loss) for loss in LOSSES}
    fits = max(max(p) for p in peaks["cached-mnrl"])
    whole = min(peaks["mnrl"][0])
    return (fits + whole) // 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process (the reference, in this process), then one 2-rank launch: each loss under a cap
    that never bites (live tensor bytes counted, for the capped jobs' cap), then each loss under
    a cap between one pair per mini-batch and a whole share."""
    root = tmp_path_factory.mktemp("embedding-ranks")
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, layers=1, seed=0)
    model = root / "st"
    save_sentence_transformer(model, encoder, max_seq_length=16)
    data = _write_pairs(root / "train.csv", 22, seed=1)
    dev = _write_pairs(root / "dev.csv", 15, seed=2)
    out: dict[str, Any] = {"model": model, "data": data, "dev": dev, "one": root / "one"}
    run_ok(*_args(str(model), data, dev, out["one"], "mnrl"))
    launch = root / "launch"
    launch.mkdir()
    # mnrl: each rank's whole share at once; cached-mnrl: one pair per mini-batch
    jobs: list[dict[str, Any]] = [
        {"name": loss, "argv": _args(str(model), data, dev, launch / loss, loss, *extra,
                                     "--memory-cap", "10GiB")}
        for loss, extra in zip(LOSSES, ([], ["--mini-batch-size", "1"]), strict=True)
    ]  # fmt: skip
    # mnrl backs off from each rank's whole share to GradCache; cached-mnrl to a smaller
    # mini-batch
    cap = {"function": f"{__name__}:capped_cap"}
    for loss, extra in zip(LOSSES, ([], ["--mini-batch-size", "4"]), strict=True):
        argv = _args(str(model), data, dev, launch / f"capped-{loss}", loss, *extra)
        jobs.append({"name": f"capped-{loss}", "argv": argv, "cap": cap})
    out["launched"] = launch_jobs(launch, jobs, _env(root), job_timeout=JOB_TIMEOUT)
    for loss in LOSSES:
        out[loss] = out["launched"].out(loss)
    return out


@pytest.mark.parametrize("loss", ["mnrl", "cached-mnrl"])
def test_two_ranks_equal_one_process(runs: dict[str, Path], loss: str) -> None:
    one, two = runs["one"], runs[loss]
    assert _max_difference(one / "model", two / "model") <= 1e-5
    reference, metrics = _steps(one), _steps(two)
    assert len(metrics) == 8  # 22 pairs, 7 a step (the 4th holds 1), 2 epochs
    assert [m["samples_seen"] for m in metrics] == [m["samples_seen"] for m in reference]
    # the ranks' losses add up to the one-process loss of the same global batch
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], abs=1e-5)
    assert reference[0]["loss"] > 0.5  # a loss with something to learn: the comparison bites
    assert all(m["world_size"] == 2 for m in metrics)
    # the model learnt: the run's weights moved away from the initial ones
    assert _max_difference(runs["model"], two / "model") > 1e-3
    # retrieval over the whole eval set (every query against every document), as in one process
    expected = [m for m in _jsonl(one / "metrics.jsonl") if "eval_retrieval_accuracy" in m]
    got = [m for m in _jsonl(two / "metrics.jsonl") if "eval_retrieval_accuracy" in m]
    assert got and len(got) == len(expected)
    for key in ("eval_retrieval_accuracy", "eval_mrr@10", "eval_ndcg@10"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], abs=1e-6)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_cap_on_both_ranks_backs_off_together_same_weights(
    runs: dict[str, Any], loss: str
) -> None:
    """mnrl backs off from each rank's whole share to GradCache; cached-mnrl (at a mini-batch of
    4) to a smaller mini-batch. The cap sits between one pair per mini-batch and a whole share on
    either rank."""
    peaks = {name: [m["rank_peak_bytes"] for m in _steps(runs[name])] for name in LOSSES}
    fits = max(max(p) for p in peaks["cached-mnrl"])  # one pair per mini-batch
    whole = min(peaks["mnrl"][0])  # the first step's whole share, on the smaller rank
    assert fits < whole, peaks
    out = runs["launched"].out(f"capped-{loss}")
    cap = json.loads((out / "run.json").read_text())["config"]["memory_cap"]
    assert cap == (fits + whole) // 2 == capped_cap(runs["launched"].folder)
    events = _jsonl(out / "events.jsonl")
    ooms = [e for e in events if e["type"] == "oom" and e.get("phase") is None]
    assert {e["rank"] for e in ooms} == {0, 1}, events  # both ranks ran out of memory
    backoffs: dict[tuple, set] = {}
    for event in events:
        if event["type"] == "backoff" and "cure" not in event and event.get("phase") is None:
            key = (event["step"], event["from"])
            backoffs.setdefault(key, set()).add((event["rank"], event["to"]))
    assert backoffs
    for key, adopted in backoffs.items():
        assert {rank for rank, _ in adopted} == {0, 1}, key  # both ranks backed off
        assert len({to for _, to in adopted}) == 1, (key, adopted)  # to the same mini-batch
    assert _max_difference(runs["one"] / "model", out / "model") <= 1e-5
    assert [m["step"] for m in _steps(out)] == list(range(1, 9))
