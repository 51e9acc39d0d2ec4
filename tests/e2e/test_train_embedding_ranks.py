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
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tiny_models import save_bert, save_sentence_transformer

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(40)]
LAUNCH_TIMEOUT = 240  # seconds for a whole 2-rank run: a hang fails instead of blocking CI
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
        MEMFIT_CACHE_DIR=str(tmp_path / "memfit-cache"),
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


def _launch(tmp_path: Path, args: list[str], *, ranks: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={ranks}", "-m", "memfit", *args]
    return subprocess.run(
        command, env=_env(tmp_path), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
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


def _steps(out: Path) -> list[dict]:
    return [m for m in _jsonl(out / "metrics.jsonl") if "loss" in m]


def _max_difference(a: Path, b: Path) -> float:
    """The largest weight difference of two sentence-transformers folders (runs' ``model/``)."""
    wa = load_file(str(a / "model.safetensors"))
    wb = load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process (the reference), then 2 ranks with each loss; the 2-rank runs count live
    tensor bytes under a cap that never bites, for the capped test's cap."""
    root = tmp_path_factory.mktemp("embedding-ranks")
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, layers=1, seed=0)
    model = root / "st"
    save_sentence_transformer(model, encoder, max_seq_length=16)
    data = _write_pairs(root / "train.csv", 22, seed=1)
    dev = _write_pairs(root / "dev.csv", 15, seed=2)
    out = {"model": model, "data": data, "dev": dev, "one": root / "one"}
    _ok(_single(root, _args(str(model), data, dev, out["one"], "mnrl")))
    # mnrl: each rank's whole share at once; cached-mnrl: one pair per mini-batch
    for loss, extra in zip(LOSSES, ([], ["--mini-batch-size", "1"]), strict=True):
        out[loss] = root / loss
        args = _args(str(model), data, dev, out[loss], loss, *extra, "--memory-cap", "10GiB")
        _ok(_launch(root, args))
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


@pytest.mark.parametrize(
    ("loss", "mini_batch"), [("mnrl", []), ("cached-mnrl", ["--mini-batch-size", "4"])]
)
def test_a_cap_on_both_ranks_backs_off_together_same_weights(
    runs: dict[str, Path], tmp_path: Path, loss: str, mini_batch: list[str]
) -> None:
    """mnrl backs off from each rank's whole share to GradCache; cached-mnrl to a smaller
    mini-batch. The cap sits between one pair per mini-batch and a whole share on either rank."""
    peaks = {name: [m["rank_peak_bytes"] for m in _steps(runs[name])] for name in LOSSES}
    fits = max(max(p) for p in peaks["cached-mnrl"])  # one pair per mini-batch
    whole = min(peaks["mnrl"][0])  # the first step's whole share, on the smaller rank
    assert fits < whole, peaks
    cap = (fits + whole) // 2
    out = tmp_path / "capped"
    args = _args(str(runs["model"]), runs["data"], runs["dev"], out, loss, *mini_batch)
    _ok(_launch(tmp_path, [*args, "--memory-cap", str(cap)]))
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
