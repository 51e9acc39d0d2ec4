"""memfit doctor advises only what memfit plan would take for the failed job's loss, data and
device, each fix priced by the estimate at the shapes the run really fed (issue 19, item 1)."""

from __future__ import annotations

import json
import re
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest

from cli_run import run_cli
from memfit.cli import main
from memfit.devices.catalog import catalog
from memfit.estimate import estimate
from memfit.report.doctor import diagnose, failed_job, from_run_dir, knobs_from_run
from memfit.report.oom_message import parse_oom
from memfit.report.shapes import run_width
from tiny_models import save_bert

# a CUDA message whose capacity is no catalog GPU's (11.17 GiB)
CUDA_OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 256.00 MiB (GPU 0; 11.17 GiB total "
    "capacity; 10.21 GiB already allocated; 117.81 MiB free; 10.45 GiB reserved in total by PyTorch)"
)
CAP = (
    "memfit memory cap: tried to hold 434.86 MiB, the cap is 434.31 MiB (simulated CPU out of "
    "memory. Raised by aten.embedding_dense_backward.default)"
)


def cuda_message(capacity_gib: float) -> str:
    """A CUDA out-of-memory message (PyTorch ≥ 2.1) from a GPU of ``capacity_gib``."""
    return (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        f"total capacity of {capacity_gib:.2f} GiB of which 8.00 MiB is free. Of the allocated "
        "memory 10.20 GiB is allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but "
        "unallocated."
    )


def levers(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["lever"]: f for f in d["fixes"]}


def truncation_target(fix: dict[str, Any]) -> int:
    found = re.search(r"--max-seq-len (\d+)", fix["change"])
    assert found is not None, fix["change"]
    return int(found.group(1))


def write_folder(
    folder: Path, config: dict[str, Any], resolved: dict[str, Any], events: list[dict[str, Any]]
) -> Path:
    """A run folder as memfit train writes it: run.json (config, resolved) and events.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    run = {"config": config, "resolved": resolved, "plan": None}
    (folder / "run.json").write_text(json.dumps(run), encoding="utf-8")
    lines = "".join(json.dumps(e) + "\n" for e in events)
    (folder / "events.jsonl").write_text(lines, encoding="utf-8")
    return folder


def mnrl_folder(folder: Path, model: str, *, longest: int, seq_len: int, failed: int) -> Path:
    """The demo's shape of run: MNRL, batch 32 on the CPU under a cap, the data shorter than
    --max-seq-len, the OOM at ``failed`` rows embedded at once."""
    config = {
        "model": model,
        "task": "sentence-embedding",
        "loss": None,
        "max_seq_len": 4 * seq_len,
        "effective_batch_size": 32,
        "optimizer": "adamw",
        "device": "cpu",
        "padding": "longest",
    }
    resolved = {
        "device": "cpu",
        "micro_batch_size": 32,
        "precision": "fp32",
        "gradient_checkpointing": False,
        "longest_tokens": longest,
        "seq_len": seq_len,
        "pad_to_multiple_of": 1,
        "world_size": 1,
    }
    events = [
        {"type": "probe", "step": 0, "rows": 32, "longest_tokens": longest, "ooms": 0,
         "micro_batch_size": 32},
        {"type": "oom", "step": 3, "micro_batch_size": failed, "error": CAP},
        {"type": "backoff", "step": 3, "from": failed, "to": failed // 2},
    ]  # fmt: skip
    return write_folder(folder, config, resolved, events)


# --- fast: which fixes, without pricing (a model the estimator does not know) ----------------------
def test_mnrl_run_folder_lowers_the_mini_batch_not_the_batch(tmp_path: Path) -> None:
    for failed, expected in ((32, "32 → 16"), (8, "8 → 4")):
        folder = mnrl_folder(
            tmp_path / str(failed),
            str(tmp_path / "no-model"),
            longest=16,
            seq_len=16,
            failed=failed,
        )
        d = from_run_dir(str(folder)).to_dict()
        fixes = levers(d)
        assert "micro_batch" not in fixes
        assert not any("gradient accumulation" in f["change"] for f in d["fixes"])
        mini = fixes["mini_batch"]
        assert expected in mini["change"] and "--mini-batch-size" in mini["change"]
        text = "\n".join(d["diagnosis"])
        assert "not proposed: a smaller micro-batch with gradient accumulation" in text
        assert "the guard lowered the GradCache mini-batch" in text
        # the CPU trains in fp32: no mixed precision
        assert "precision" not in fixes


def test_mnrl_mini_batch_of_one_offers_no_batch_cure(tmp_path: Path) -> None:
    folder = mnrl_folder(tmp_path, str(tmp_path / "no-model"), longest=16, seq_len=16, failed=1)
    d = from_run_dir(str(folder)).to_dict()
    assert not {"micro_batch", "mini_batch"} & set(levers(d))


def test_truncation_only_where_the_data_is_longer(tmp_path: Path) -> None:
    # padded to --max-seq-len 64 but no row is longer than 20 tokens: a cut to 32 cuts nothing
    config = {"model": str(tmp_path / "no-model"), "task": "classification", "max_seq_len": 64,
              "effective_batch_size": 16, "padding": "max_length"}  # fmt: skip
    resolved = {"device": "cuda", "micro_batch_size": 8, "longest_tokens": 20, "seq_len": 64}
    events = [{"type": "oom", "step": 1, "micro_batch_size": 8, "error": CUDA_OLD}]
    d = from_run_dir(str(write_folder(tmp_path / "short", config, resolved, events))).to_dict()
    assert "truncation" not in levers(d)
    assert any("longest row has 20 tokens, nothing would be cut" in x for x in d["diagnosis"])
    # the same run with rows of 60 tokens: the cut is real
    resolved["longest_tokens"] = 60
    d = from_run_dir(str(write_folder(tmp_path / "long", config, resolved, events))).to_dict()
    assert truncation_target(levers(d)["truncation"]) < 60


def test_old_run_folders_fall_back_to_the_probe_then_the_config() -> None:
    config = {"model": "m", "task": "classification", "max_seq_len": 64, "effective_batch_size": 8}
    old = {"device": "cuda", "micro_batch_size": 8, "pad_to_multiple_of": 8}
    probe = [{"type": "probe", "step": 0, "longest_tokens": 13, "micro_batch_size": 8}]
    run = {"config": config, "resolved": old}
    # no resolved.seq_len: the probe's longest row, padded to the run's multiple of 8
    seq, longest, source = astuple(run_width(run, probe))
    assert (seq, longest) == (16, 13) and "probe" in source
    job = knobs_from_run(run, None, probe)
    assert job is not None and (job.seq_len, job.longest_tokens) == (16, 13)
    # padded to --max-seq-len: the width is the limit
    padded = {"config": config | {"padding": "max_length"}, "resolved": old}
    assert astuple(run_width(padded, probe))[:2] == (64, 13)
    # neither: the config's limit, said so
    seq, longest, source = astuple(run_width(run, []))
    assert (seq, longest) == (64, None) and "max_seq_len" in source
    # the new keys win over both
    new = {"config": config, "resolved": old | {"longest_tokens": 30, "seq_len": 32}}
    assert astuple(run_width(new, probe))[:2] == (32, 30)


def test_no_mixed_precision_on_the_cpu() -> None:
    report = parse_oom(CAP)
    assert report is not None
    assert "precision" not in {f.lever for f in diagnose(report).fixes}


# --- priced: the estimate at the run's real shapes ---------------------------------------------------
@pytest.mark.slow
def test_classification_run_folder_priced_at_resolved_seq_len(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_bert: str
) -> None:
    """Rows up to 60 tokens, micro-batches 64 wide, --max-seq-len 128: every saving is the
    estimate's at 64 tokens, and the cut to 32 tokens is offered (the data is longer)."""
    config = {"model": tiny_bert, "task": "classification", "max_seq_len": 128,
              "effective_batch_size": 16, "optimizer": "adamw"}  # fmt: skip
    resolved = {"device": "cuda", "micro_batch_size": 8, "precision": "fp32",
                "gradient_checkpointing": False, "longest_tokens": 60, "seq_len": 64,
                "pad_to_multiple_of": 8}  # fmt: skip
    events = [{"type": "oom", "step": 2, "micro_batch_size": 8, "error": CUDA_OLD}]
    folder = write_folder(tmp_path / "run", config, resolved, events)
    code, out, _ = run_cli(capsys, "doctor", str(folder), "--json")
    assert code == 0
    d = json.loads(out)
    assert d["knobs"]["seq_len"] == 64 and d["knobs"]["longest_tokens"] == 60
    job = dict(task="classification", seq_len=64, batch_size=8, gradient_accumulation_steps=2)
    base = estimate(tiny_bert, **job).total_bytes
    fixes = levers(d)
    assert fixes["gradient_checkpointing"]["saves_bytes"] == (
        base - estimate(tiny_bert, **job, gradient_checkpointing=True).total_bytes
    )
    halved = job | {"batch_size": 4, "gradient_accumulation_steps": 4}
    assert fixes["micro_batch"]["saves_bytes"] == base - estimate(tiny_bert, **halved).total_bytes
    target = truncation_target(fixes["truncation"])
    assert target < 60  # rows longer than the cut exist
    cut = estimate(tiny_bert, **job, max_seq_len=target).total_bytes
    assert fixes["truncation"]["saves_bytes"] == base - cut > 0
    assert "--seq-len 64" in fixes["plan"]["change"]


@pytest.mark.slow
def test_precision_is_the_gpus_own(capsys: pytest.CaptureFixture[str], tiny_bert: str) -> None:
    """A GPU without bf16 (named by its capacity in the message) gets fp16, priced as fp16."""
    no_bf16 = next(g for g in catalog().values() if not g.bf16)
    message = cuda_message(no_bf16.memory_bytes / (1 << 30))
    # large enough for autocast to save (on a tiny model the casts can outweigh it)
    job = ["--model", tiny_bert, "--task", "classification", "--batch-size", "64",
           "--seq-len", "128"]  # fmt: skip
    code, out, _ = run_cli(capsys, "doctor", "--message", message, *job, "--json")
    assert code == 0
    fix = levers(json.loads(out))["precision"]
    assert "--precision fp16" in fix["change"] and "bf16 autocast" not in fix["change"]
    kwargs = dict(task="classification", batch_size=64, seq_len=128)
    fp16 = estimate(tiny_bert, **kwargs, precision="fp16").total_bytes
    assert fix["saves_bytes"] == estimate(tiny_bert, **kwargs).total_bytes - fp16


def test_mini_batch_flag_only_with_the_cached_loss(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["--model", "m", "--task", "sentence-embedding", "--batch-size", "16", "--seq-len", "32"]
    argv = ["doctor", "--message", CUDA_OLD, *job, "--loss", "mnrl", "--mini-batch-size", "8"]
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--mini-batch-size: only the cached loss" in err


# --- a real MNRL run under a memory cap ----------------------------------------------------------
WORDS = ["how", "do", "i", "reset", "my", "password", "steps", "to", "update", "your", "phone",
         "cancel", "the", "order", "guide", "a"]  # fmt: skip


@pytest.fixture(scope="module")
def mnrl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """memfit train: a tiny BERT with MNRL, batch 16, rows of at most 20 tokens under
    --max-seq-len 64, on the CPU capped at 60 % of what the whole batch needs (measured by a
    run without a cap), so that the guard must lower the mini-batch."""
    import random

    from memfit.train import TrainConfig, train

    root = tmp_path_factory.mktemp("mnrl")
    (root / "model").mkdir()
    save_bert(root / "model", WORDS, hidden_size=64, intermediate_size=128)
    rng = random.Random(0)
    rows = [
        {k: " ".join(rng.choices(WORDS, k=rng.randint(6, 18))) for k in ("anchor", "positive")}
        for _ in range(16)
    ]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def run(name: str, cap: int) -> Path:
        settings = dict(task="sentence-embedding", model=str(root / "model"), max_seq_len=64)
        train(
            TrainConfig(
                **settings, train_file=str(data), output_dir=str(root / name),
                effective_batch_size=16, max_steps=2, memory_cap=cap, device="cpu", quiet=True,
            )
        )  # fmt: skip
        return root / name

    metrics = (run("uncapped", 1 << 40) / "metrics.jsonl").read_text().splitlines()
    whole = max(int(json.loads(line)["peak_bytes"]) for line in metrics)
    return run("run", int(whole * 0.6))


@pytest.mark.slow
def test_doctor_on_a_real_mnrl_run(capsys: pytest.CaptureFixture[str], mnrl_run: Path) -> None:
    events = [json.loads(x) for x in (mnrl_run / "events.jsonl").read_text().splitlines()]
    ooms = [e for e in events if e["type"] == "oom"]
    assert ooms, "the cap did not bite"
    resolved = json.loads((mnrl_run / "run.json").read_text())["resolved"]
    seq, longest = resolved["seq_len"], resolved["longest_tokens"]
    assert longest < 64  # the data is shorter than --max-seq-len
    code, out, _ = run_cli(capsys, "doctor", str(mnrl_run), "--json")
    assert code == 0
    d = json.loads(out)
    fixes = levers(d)
    assert "micro_batch" not in fixes and "precision" not in fixes
    assert d["knobs"]["seq_len"] == seq and d["knobs"]["batch_size"] == 16
    # the job that failed: the whole batch at once, or the cached loss at the failed mini-batch
    failed = int(ooms[-1]["micro_batch_size"])
    model = str(mnrl_run.parent / "model")
    kwargs = dict(task="sentence-embedding", batch_size=16, seq_len=seq, device="cpu")
    own: dict[str, Any] = {"loss": "mnrl"}
    if failed < 16:
        own = {"loss": "cached-mnrl", "mini_batch_size": failed}
    base = estimate(model, **kwargs, **own).total_bytes
    fix = fixes["mini_batch"]
    lower = estimate(model, **kwargs, loss="cached-mnrl", mini_batch_size=failed // 2)
    assert f"{failed} → {failed // 2}" in fix["change"]
    assert fix["saves_bytes"] == base - lower.total_bytes
    ckpt = estimate(model, **kwargs, **own, gradient_checkpointing=True).total_bytes
    assert fixes["gradient_checkpointing"]["saves_bytes"] == base - ckpt
    for f in d["fixes"]:
        if f["lever"] == "truncation":  # only a cut that shortens real rows
            assert truncation_target(f) < longest
    # memfit plan prices a GPU: not offered for a CPU run, said so
    assert "plan" not in fixes
    assert any(line.startswith("not proposed: memfit plan") for line in d["diagnosis"])


def test_failed_job_record_keeps_the_contract_keys() -> None:
    job = failed_job(model="m", task="sentence-embedding", batch_size=8, seq_len=16,
                     loss="cached-mnrl", mini_batch_size=4)  # fmt: skip
    from memfit.report.doctor import job_record

    record = job_record(job)
    assert {"model", "task", "batch_size", "seq_len", "precision", "effective_batch_size",
            "device", "quantization", "double_quant"} <= set(record)  # fmt: skip
    assert record["mini_batch_size"] == 4 and record["loss"] == "cached-mnrl"
