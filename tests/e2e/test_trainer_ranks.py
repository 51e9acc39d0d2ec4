"""GuardedTrainer and GuardedSentenceTransformerTrainer under `torchrun` (2 ranks, CPU, gloo).

One launch runs a user's training script (written below into tmp_path) on both ranks, job after
job in one process group: without a reachable cap (each rank's peak at its micro-batch of 8, and
with chunks of 4), then under a MEMFIT_MEMORY_CAP halfway between the two peaks, on both ranks and
on rank 1 only. The ranks must run out of memory, back off to the same size together and end
with the weights of a one-process run with the same global batch (8 rows × 2 ranks per call, rows
in order, dropout off, SGD). The launch has a timeout: a rank left waiting in a collective fails
the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

LAUNCH_TIMEOUT = 300  # seconds for the whole 2-rank launch (about 40 on 2 busy cores)
PER_DEVICE, ACCUMULATION, ROWS, RANKS = 8, 2, 48, 2

SCRIPT = '''"""GuardedTrainer and GuardedSentenceTransformerTrainer scripts, run as every rank of torchrun.

Each job is an ordinary training script (SGD, dropout off, rows in order); the ranks run them one
after the other in one process group: first without a reachable cap (the rank's peak at its
micro-batch, and with chunks of half of it), then under a MEMFIT_MEMORY_CAP halfway between the
two (on every rank, or on rank 1 only). Each job leaves weights{rank}.pt and rank{rank}.json.
Loaded without torchrun (runpy), its ``run`` trains a script in one process: the reference.
"""

import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(60)]
UNREACHABLE = "64GiB"


def texts(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


def arguments(out, per_device, accumulation):
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        # the rows of each optimizer step are those of a one-process run with the global batch
        train_sampling_strategy="sequential",
        # BERT's loss is its own mean whatever num_items_in_batch says: no scaling by the ranks
        average_tokens_across_devices=False,
    )


def classifier(model_dir, out, per_device, accumulation, rows, stock=False, long_row=None):
    """A BERT classifier on short rows padded to 16 tokens; with ``long_row``, that row is long
    and every batch is padded to its own longest row."""
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainingArguments,
        set_seed,
    )

    if stock:
        from transformers import Trainer as GuardedTrainer
    else:
        from memfit.integrations import GuardedTrainer

    set_seed(0)  # the classification head is drawn when the model loads
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    sentences = texts(rows, seed=1)
    padding = dict(padding="max_length", max_length=16)
    if long_row is not None:
        sentences[long_row] = " ".join(WORDS[i % 60] for i in range(100))
        padding = dict(padding="longest")
    labels = [int("w7" in s.split() or "w13" in s.split()) for s in sentences]
    data = Dataset.from_dict({"text": sentences, "label": labels}).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=128), batched=True
    )
    trainer = GuardedTrainer(
        model=model,
        args=TrainingArguments(**arguments(out, per_device, accumulation)),
        train_dataset=data,
        data_collator=DataCollatorWithPadding(tokenizer, **padding),
    )
    return trainer, model


LATE_ROWS = 64


def late(model_dir, out, per_device, accumulation, rows, stock=False):
    """64 rows, the long one in the 8th batch of 8: on 2 ranks, rank 1's second call of step 2
    (one process, 16 rows a call: the second call of step 2 as well)."""
    return classifier(
        model_dir, out, per_device, accumulation, LATE_ROWS, stock, long_row=LATE_ROWS - 4
    )


def embedder(model_dir, out, per_device, accumulation, rows, stock=False, loss="cosine"):
    """CosineSimilarityLoss (a mean over pairs), or in-batch negatives (``mnrl``; with
    ``mnrl-gather`` gathered across the ranks)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    if stock:
        from sentence_transformers import SentenceTransformerTrainer as Trainer
    else:
        from memfit.integrations import GuardedSentenceTransformerTrainer as Trainer
    from memfit.integrations.sentence_transformers import losses_module

    torch.manual_seed(0)
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = 16
    if loss == "cosine":
        scores = [random.Random(i).random() for i in range(rows)]
        data = Dataset.from_dict(
            {"sentence1": texts(rows, seed=4), "sentence2": texts(rows, seed=5), "score": scores}
        )
        objective = losses_module().CosineSimilarityLoss(model)
    else:
        anchors = texts(rows, seed=4)
        positives = [" ".join(a.split()[:5] + b.split()[:4]) for a, b in zip(anchors, texts(rows, 6))]
        data = Dataset.from_dict({"anchor": anchors, "positive": positives})
        objective = losses_module().MultipleNegativesRankingLoss(
            model, gather_across_devices=loss == "mnrl-gather"
        )
    trainer = Trainer(
        model=model,
        args=SentenceTransformerTrainingArguments(**arguments(out, per_device, accumulation)),
        train_dataset=data,
        loss=objective,
    )
    return trainer, model


def mnrl(*args, **kwargs):
    return embedder(*args, loss="mnrl", **kwargs)


def mnrl_gather(*args, **kwargs):
    return embedder(*args, loss="mnrl-gather", **kwargs)


SCRIPTS = {
    "classifier": classifier,
    "late": late,
    "embedder": embedder,
    "mnrl": mnrl,
    "mnrl-gather": mnrl_gather,
}


class Said(logging.Handler):
    """The warnings memfit's integrations log."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run(kind, model_dir, out, *, per_device, accumulation, rows, chunk=None, stock=False):
    """One script's run; its weights and what the guard did, under ``out``."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    said = Said()
    logging.getLogger("memfit.integrations").addHandler(said)
    try:
        trainer, model = SCRIPTS[kind](model_dir, out, per_device, accumulation, rows, stock=stock)
        if chunk is not None:
            # as after a back-off, from the first step: chunks of the micro-batch, or the
            # GradCache mini-batch of an in-batch-negative loss
            name = "guard_mini_batch_size" if kind == "mnrl" else "guard_micro_batch_size"
            setattr(trainer, name, chunk)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(initial, out / f"initial{rank}.pt")
        forwarded = []  # the rows of every forward, failed and re-run ones included
        model.register_forward_pre_hook(
            lambda module, a, k: forwarded.append(int(k["input_ids"].shape[0]))
            if "input_ids" in k
            else None,
            with_kwargs=True,
        )
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    finally:
        logging.getLogger("memfit.integrations").removeHandler(said)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, out / f"weights{rank}.pt")
    ranks = getattr(trainer, "_guard_ranks", None)
    cap = getattr(trainer, "guard_cap", None)
    report = {
        "events": getattr(trainer, "guard_events", []),
        "micro_batch_size": getattr(trainer, "guard_micro_batch_size", None),
        "mini_batch_size": getattr(trainer, "guard_mini_batch_size", None),
        "peak_bytes": cap.peak_bytes if cap is not None else None,
        "steps": trainer.state.global_step,
        "syncs": ranks.syncs if ranks is not None else None,
        "guarded_ranks": ranks is not None,
        "warnings": [line for line in said.lines if line.startswith("memfit:")],
        "forwarded": forwarded,
        "seconds": seconds,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    return report


def ranks_main(settings):
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    root = Path(settings["out"])
    size = dict(
        per_device=settings["per_device"],
        accumulation=settings["accumulation"],
        rows=settings["rows"],
    )
    for kind in settings.get("stock", []):
        # the stock trainer under DDP, no cap: what the guard's own reduction must reproduce
        os.environ.pop("MEMFIT_MEMORY_CAP", None)
        run(kind, settings["model"], root / kind / "stock", stock=True, **size)
    for kind in settings.get("aside", []):
        os.environ["MEMFIT_MEMORY_CAP"] = UNREACHABLE
        run(kind, settings["model"], root / kind / "aside", **size)
    for kind in settings["kinds"]:
        os.environ["MEMFIT_MEMORY_CAP"] = UNREACHABLE
        whole = run(kind, settings["model"], root / kind / "whole", **size)
        half = run(
            kind, settings["model"], root / kind / "half", chunk=settings["per_device"] // 2, **size
        )
        # every rank's peaks (the process group is up: the Trainer joined it)
        peaks = [None] * world
        dist.all_gather_object(peaks, (whole["peak_bytes"], half["peak_bytes"]))
        cap = (max(p[1] for p in peaks) + min(p[0] for p in peaks)) // 2
        os.environ["MEMFIT_MEMORY_CAP"] = str(cap)
        run(kind, settings["model"], root / kind / "capped", **size)
        if kind in settings.get("one_rank", []):
            # the cap on rank 1 only: rank 0 has the memory, and backs off with it all the same
            os.environ["MEMFIT_MEMORY_CAP"] = str(cap) if rank == 1 else UNREACHABLE
            run(kind, settings["model"], root / kind / "one-rank", **size)
        (root / kind / "cap.json").write_text(json.dumps({"cap": cap, "peaks": peaks}))
    if settings.get("late"):
        # the long row is rank 1's: a cap above every other call at 8 rows and its call at 4,
        # below its call at 8
        os.environ["MEMFIT_MEMORY_CAP"] = UNREACHABLE
        whole = run("late", settings["model"], root / "late" / "whole", **size)
        half = run("late", settings["model"], root / "late" / "half", chunk=4, **size)
        peaks = [None] * world
        dist.all_gather_object(peaks, (whole["peak_bytes"], half["peak_bytes"]))
        cap = (max(peaks[0][0], peaks[1][1]) + peaks[1][0]) // 2
        os.environ["MEMFIT_MEMORY_CAP"] = str(cap)
        run("late", settings["model"], root / "late" / "capped", **size)
        (root / "late" / "cap.json").write_text(json.dumps({"cap": cap, "peaks": peaks}))


if __name__ == "__main__":
    import torch.distributed as dist

    ranks_main(json.loads(Path(sys.argv[1]).read_text()))
    # the Trainer leaves its process group up: ended here, as PyTorch asks of a training script;
    # then the rank ends without the interpreter's teardown, as memfit train's ranks do (in it,
    # gloo's threads can still end a finished rank with SIGABRT: a CI run saw it)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
'''


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class Launch:
    """The launch's results: ``report(kind, job, rank)``, ``weights(kind, job, rank)``."""

    def __init__(self, root: Path, script: Path) -> None:
        self.root, self.script = root, script

    def report(self, kind: str, job: str, rank: int) -> dict[str, Any]:
        return json.loads((self.root / kind / job / f"rank{rank}.json").read_text())

    def weights(
        self, kind: str, job: str, rank: int, *, initial: bool = False
    ) -> dict[str, torch.Tensor]:
        name = f"initial{rank}.pt" if initial else f"weights{rank}.pt"
        return torch.load(self.root / kind / job / name)

    def cap(self, kind: str) -> dict[str, Any]:
        return json.loads((self.root / kind / "cap.json").read_text())


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` with a timeout that also ends the ranks torchrun started (its process group)."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the 2-rank launch hung (over {LAUNCH_TIMEOUT} s): {err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.fixture(scope="module")
def launched(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    folder = tmp_path_factory.mktemp("trainer-ranks")
    script = folder / "train_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    settings = {
        "model": tiny_classifier,
        "out": str(folder / "runs"),
        "per_device": PER_DEVICE,
        "accumulation": ACCUMULATION,
        "rows": ROWS,
        "kinds": ["classifier", "embedder", "mnrl"],
        "one_rank": ["classifier"],
        "stock": ["classifier", "mnrl"],
        "aside": ["mnrl-gather"],
        "late": True,
    }
    (folder / "settings.json").write_text(json.dumps(settings))
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_MEMORY_CAP"}
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={RANKS}", str(script), str(folder / "settings.json")]
    done = _run(command, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return Launch(folder / "runs", script)


@pytest.fixture(scope="module")
def one_process(launched: Launch, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same scripts in one process with the global batch: 16 rows per call, 2 calls a step."""
    folder = tmp_path_factory.mktemp("one-process")
    script = runpy.run_path(str(launched.script), run_name="train_script")
    model = json.loads((launched.script.parent / "settings.json").read_text())["model"]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MEMFIT_MEMORY_CAP", raising=False)
        patch.delenv("RANK", raising=False)
        for kind in ("classifier", "embedder", "late"):
            report = script["run"](
                kind,
                model,
                folder / kind,
                per_device=PER_DEVICE * RANKS,
                accumulation=ACCUMULATION,
                rows=ROWS,
            )
            assert report["events"] == [] and report["steps"] == 2
    kinds = ("classifier", "embedder", "late")
    return {kind: torch.load(folder / kind / "weights0.pt") for kind in kinds}


def _assert_the_cap_bites_halfway(launched: Launch, kind: str) -> None:
    """The cap lies between every rank's peak with chunks of 4 and at the whole micro-batch."""
    cap = launched.cap(kind)
    for whole, half in cap["peaks"]:
        assert half < cap["cap"] < whole


def test_guarded_trainer_on_two_ranks_backs_off_together_and_matches_one_process(
    launched: Launch, one_process: dict[str, Any]
) -> None:
    reference = one_process["classifier"]
    _assert_the_cap_bites_halfway(launched, "classifier")
    for rank in range(RANKS):
        report = launched.report("classifier", "capped", rank)
        kinds = [e["type"] for e in report["events"]]
        # each rank ran out of memory itself, and all adopted the same size
        assert kinds == ["oom", "backoff"], report["events"]
        assert report["events"][1]["from"] == 8 and report["events"][1]["to"] == 4
        assert report["micro_batch_size"] == 4
        assert report["steps"] == 2  # 48 rows / (8 × 2 ranks × 2 calls), the last step 1 call
        weights = launched.weights("classifier", "capped", rank)
        assert max_difference(reference, weights) <= 1e-5
    # without an OOM the guard's own reduction is DDP's: the uncapped guarded run, the stock
    # Trainer under DDP and the one-process run agree
    assert launched.report("classifier", "whole", 0)["events"] == []
    stock = launched.weights("classifier", "stock", 0)
    assert max_difference(stock, launched.weights("classifier", "whole", 0)) <= 1e-6
    assert max_difference(stock, reference) <= 1e-5
    # and training moved the weights far more than that: the comparisons above can fail
    initial = launched.weights("classifier", "stock", 0, initial=True)
    assert max_difference(initial, reference) > 1e-2


def test_an_oom_on_one_rank_backs_off_every_rank(
    launched: Launch, one_process: dict[str, Any]
) -> None:
    capped, free = (
        launched.report("classifier", "one-rank", 1),
        launched.report("classifier", "one-rank", 0),
    )
    assert [e["type"] for e in capped["events"]] == ["oom", "backoff"]
    # rank 0 had the memory: it learnt of rank 1's OOM at the next sync point and backed off too
    assert free["events"][0]["type"] == "backoff" and free["events"][0]["cause"] == "another rank"
    assert [e["type"] for e in free["events"]] == ["backoff"]
    assert capped["micro_batch_size"] == free["micro_batch_size"] == 4
    # both re-ran the step: the same number of sync points
    assert capped["syncs"] == free["syncs"]
    for rank in range(RANKS):
        weights = launched.weights("classifier", "one-rank", rank)
        assert max_difference(one_process["classifier"], weights) <= 1e-5


def test_guarded_sentence_transformer_trainer_on_two_ranks(
    launched: Launch, one_process: dict[str, Any]
) -> None:
    # a per-pair mean (CosineSimilarityLoss): row chunks, the one-process weights
    _assert_the_cap_bites_halfway(launched, "embedder")
    for rank in range(RANKS):
        report = launched.report("embedder", "capped", rank)
        assert [e["type"] for e in report["events"]] == ["oom", "backoff"]
        assert report["micro_batch_size"] == 4
        weights = launched.weights("embedder", "capped", rank)
        assert max_difference(one_process["embedder"], weights) <= 1e-5
    # in-batch negatives (MultipleNegativesRankingLoss, each rank's own rows): GradCache at a
    # mini-batch of 4 on every rank, the weights of the stock trainer under DDP
    _assert_the_cap_bites_halfway(launched, "mnrl")
    stock = launched.weights("mnrl", "stock", 0)
    for rank in range(RANKS):
        report = launched.report("mnrl", "capped", rank)
        backoffs = [e for e in report["events"] if e["type"] == "backoff"]
        assert backoffs and backoffs[0]["loss"] == "cached MultipleNegativesRankingLoss"
        assert report["mini_batch_size"] == 4
        assert max_difference(stock, launched.weights("mnrl", "capped", rank)) <= 1e-5


def test_a_loss_that_gathers_across_ranks_steps_aside_with_one_warning(
    launched: Launch,
) -> None:
    for rank in range(RANKS):
        report = launched.report("mnrl-gather", "aside", rank)
        assert not report["guarded_ranks"]
        assert len(report["warnings"]) == 1
        assert "gather_across_devices=True" in report["warnings"][0]
        assert "steps aside" in report["warnings"][0]
    # the cases that are covered say nothing
    assert launched.report("classifier", "capped", 0)["warnings"] == []


def test_an_oom_in_a_later_call_reruns_the_steps_calls_on_every_rank(
    launched: Launch, one_process: dict[str, Any]
) -> None:
    """Rank 1 runs out of memory in the second call of step 2 (its long row): both ranks drop
    step 2's gradient and re-run both of its calls in chunks of 4."""
    cap = launched.cap("late")
    (short_whole, _), (long_whole, long_half) = cap["peaks"]
    assert max(short_whole, long_half) < cap["cap"] < long_whole
    failed, fine = launched.report("late", "capped", 1), launched.report("late", "capped", 0)
    assert [(e["type"], e["step"]) for e in failed["events"]] == [("oom", 2), ("backoff", 2)]
    assert [(e["type"], e["step"], e.get("cause")) for e in fine["events"]] == [
        ("backoff", 2, "another rank")
    ]
    # step 1: 8 + 8; step 2: 8, then 8 that fails (rank 1) or is dropped (rank 0); the probe of
    # the loss's reduction (two one-row forwards without a graph); step 2 again at 4 + 4, 4 + 4
    expected = [8, 8, 8, 8, 1, 1, 4, 4, 4, 4]
    assert failed["forwarded"] == fine["forwarded"] == expected
    assert failed["syncs"] == fine["syncs"]
    for rank in range(RANKS):
        weights = launched.weights("late", "capped", rank)
        assert max_difference(one_process["late"], weights) <= 1e-5
