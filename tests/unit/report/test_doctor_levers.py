"""memfit doctor asks the levers (issue 31): each cure is written by its lever, in the plan's
order, and a cure memfit train would refuse for the failed job is never proposed; the report
reads a run's lever settings lever by lever."""

from __future__ import annotations

import dataclasses
import io
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from memfit import levers
from memfit.job import Job
from memfit.report import run_files
from memfit.report.console import print_plan
from memfit.report.doctor import (
    _plan_fix,
    diagnose,
    failed_job,
    from_run_dir,
    job_record,
    knobs_from_run,
)
from memfit.report.doctor_cures import cures
from memfit.report.oom_message import parse_oom

# a T4's message (the catalog names the card: fp16, no bf16)
T4_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    "capacity of 14.56 GiB of which 8.00 MiB is free. Of the allocated memory 14.20 GiB is "
    "allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated."
)
# the Fix's lever name → its lever's (a stable JSON name, older than the levers package)
LEVER_OF_FIX = {
    "micro_batch": "batch",
    "mini_batch": "mini-batch",
    "gradient_checkpointing": "checkpointing",
}


def _order(fix_lever: str) -> int:
    names = [lever.name for lever in levers.LEVERS]
    return names.index(LEVER_OF_FIX.get(fix_lever, fix_lever))


def test_the_cures_come_in_the_plans_order() -> None:
    """The doctor says its fixes come "in the order memfit plan tries them": the plan tries an
    optimizer swap (tier 1) before truncation (tier 2), and so does the doctor now."""
    report = parse_oom(T4_OOM)
    assert report is not None
    fixes = [f.lever for f in diagnose(report).fixes]
    cured = [f for f in fixes if f not in ("expandable_segments", "plan")]
    assert cured == sorted(cured, key=_order)
    assert cured.index("optimizer") < cured.index("truncation")


class Prices:
    """A stand-in for the estimate: every change saves 1 GiB; records what was priced."""

    def __init__(self) -> None:
        self.priced: list[dict[str, Any]] = []

    def __call__(self, settings: Mapping[str, Any]) -> int:
        self.priced.append(dict(settings))
        return 1 << 30


def test_no_cure_memfit_train_refuses_under_zero3() -> None:
    """memfit train runs ZeRO with adamw or sgd and without LoRA: the doctor proposed 8-bit
    AdamW, LoRA and QLoRA to a ZeRO-3 job all the same; now it says why it does not."""
    job = failed_job(model="m", task="causal-lm", batch_size=4, seq_len=512,
                     world_size=2, sharding="zero3")  # fmt: skip
    report = parse_oom(T4_OOM)
    assert report is not None and job.problems(run=True) == []
    prices, notes = Prices(), []
    offered = cures(job, prices, report, notes)
    proposed = [f.lever for f in offered]
    assert proposed == [
        "micro_batch",
        "precision",
        "gradient_checkpointing",
        "cross-entropy",
        "activation-offloading",
        "optimizer-offload",
        "truncation",
    ]
    refused = [n for n in notes if "memfit train refuses" in n]
    assert [n.split(" — ")[0] for n in refused] == [
        "not proposed: optimizer",
        "not proposed: lora",
        "not proposed: quantization",
    ]
    assert "--sharding: DeepSpeed ZeRO with --lora-rank/--quantization" in refused[1]
    # nothing refused was priced (an estimate costs seconds)
    assert all("lora_rank" not in s and "optimizer" not in s for s in prices.priced)


@pytest.mark.parametrize("task", ["classification", "causal-lm", "sentence-embedding"])
@pytest.mark.parametrize("sharding", ["none", "zero2", "fsdp"])
@pytest.mark.parametrize("extra", [{}, {"lora_rank": 8}, {"optimizer": "sgd"}])
def test_every_proposed_cure_is_a_job_train_takes(
    task: str, sharding: str, extra: dict[str, Any]
) -> None:
    job = failed_job(model="m", task=task, batch_size=8, seq_len=256, world_size=2,
                     sharding=sharding, **extra)  # fmt: skip
    report = parse_oom(T4_OOM)
    assert report is not None
    for fix in cures(job, Prices(), report, []):
        changed = job.knobs() | dict(fix.settings)
        cured = type(job)(**{k: v for k, v in changed.items()})
        refused = set(cured.problems(run=True)) - set(job.problems(run=True))
        assert not refused, (fix.lever, refused)


def test_a_fix_keeps_its_json_keys() -> None:
    report = parse_oom(T4_OOM)
    assert report is not None
    for fix in diagnose(report).fixes:
        assert set(fix.to_dict()) == {"change", "saves_bytes", "cost", "lever"}


def test_the_record_names_every_knob_of_the_step() -> None:
    job = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=64, lora_rank=8,
                     quantization="nf4", double_quant=True)  # fmt: skip
    record = job_record(job)
    assert (record["quantization"], record["double_quant"], record["lora_rank"]) == ("nf4", True, 8)
    plain = job_record(failed_job(model="m", task="causal-lm", batch_size=2, seq_len=64))
    # not given: a lever off, the step's defaults (as before: plain weights, fp32, one rank)
    assert (plain["quantization"], plain["double_quant"], plain["lora_rank"]) == (
        "none",
        False,
        None,
    )
    assert (plain["precision"], plain["gradient_accumulation_steps"], plain["device"]) == (
        "fp32",
        1,
        "cuda",
    )


CONFIG = {
    "model": "m",
    "task": "causal-lm",
    "optimizer": "adafactor",
    "attn_implementation": "eager",
    "lora_rank": 4,
    "lora_target_modules": ["q_proj"],
    "quantization": "nf4",
    "double_quant": True,
    "precision": "bf16",
    "max_seq_len": 100,
    "effective_batch_size": 8,
}


def test_a_runs_lever_settings_are_read_lever_by_lever() -> None:
    settings = run_files.lever_settings(CONFIG, skip=run_files.FROM_THE_RUN)
    assert settings == {
        "optimizer": "adafactor",
        "attn_implementation": "eager",
        "lora_rank": 4,
        "lora_target_modules": ["q_proj"],
        "quantization": "nf4",
        "double_quant": True,
    }
    # a lever the run did not use is left out whole (no rank: no targets; plain weights: no
    # double quantization), and so is a value no knob takes (an edited file)
    unused = CONFIG | {"lora_rank": 0, "quantization": "none", "optimizer": "adamw-16bit"}
    assert run_files.lever_settings(unused, skip=run_files.FROM_THE_RUN) == {
        "attn_implementation": "eager"
    }


def test_the_doctor_prices_a_run_with_its_own_levers() -> None:
    run = {"config": CONFIG, "resolved": {"micro_batch_size": 2, "seq_len": 64}}
    job = knobs_from_run(run, None)
    assert job is not None
    assert (job.lora_rank, job.quantization, job.double_quant) == (4, "nf4", True)
    assert (job.optimizer, job.lora_target_modules) == ("adafactor", ["q_proj"])
    assert job.precision == "bf16" and job.max_seq_len is None  # the run's, not its limit


def test_run_json_checks_every_lever_knob_as_train_writes_it() -> None:
    config = run_files.RUN_SECTIONS["config"]
    assert config["double_quant"] is run_files.flag
    assert config["lora_target_modules"] is run_files.strings
    assert config["quantization"] is run_files.text
    assert config["lora_rank"](0) is None  # 0: full fine-tuning
    assert config["micro_batch_size"](0) is not None


def test_plan_alternatives_are_said_by_each_lever() -> None:
    settings = {
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "precision": "bf16",
        "gradient_checkpointing": True,
        "optimizer": "adamw",
        "max_seq_len": 512,
        "mini_batch_size": None,
        "lora_rank": 8,
        "quantization": "nf4",
        "double_quant": True,
        "world_size": 1,
        "sharding": "none",
    }
    alt = SimpleNamespace(
        settings=lambda: settings, predicted_peak_bytes=3 << 30, predicted_samples_per_second=2.5
    )
    plan = SimpleNamespace(
        chosen=None,
        budget_words=lambda: "16.00 GiB",
        budget_bytes=16 << 30,
        safety_margin=0.05,
        min_required_bytes=1 << 30,
        explanation=[],
        alternatives=[alt],
        suggestions=[],
    )
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=300, highlight=False))  # type: ignore[arg-type]
    assert (
        "  micro-batch 4 × 2, bf16, checkpointing on, adamw, 512 tokens, LoRA r=8, nf4 base "
        "(double quant): 3.00 GiB, 2.5 samples/s"
    ) in out.getvalue()


# --- the ranks, the cut and the flags (review of issue 31's doctor) -------------------------------
def _sharded_run(tmp_path: Path) -> Path:
    """A run folder of a 4-rank ZeRO-3 causal-LM run that ran out of memory (its model is no
    model the estimator can read: the fixes stay unpriced, the doctor fast)."""
    folder = tmp_path / "run"
    folder.mkdir()
    oom = {"type": "oom", "step": 3, "micro_batch_size": 4, "error": T4_OOM}
    (folder / "events.jsonl").write_text(json.dumps(oom) + "\n", encoding="utf-8")
    run = {
        "config": {"model": str(tmp_path / "no-such-model"), "task": "causal-lm",
                   "effective_batch_size": 32, "world_size": 4, "sharding": "zero3"},
        "resolved": {"device": "cuda", "micro_batch_size": 4, "precision": "bf16",
                     "world_size": 4, "sharding": "zero3", "seq_len": 128},
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run), encoding="utf-8")
    return folder


def test_a_run_folder_keeps_its_ranks_and_sharding(tmp_path: Path) -> None:
    """The doctor read a 4-rank ZeRO-3 run as one unsharded rank: it priced the fixes on one
    GPU, proposed LoRA, QLoRA and 8-bit AdamW (which memfit train refuses under ZeRO) and its
    --json knobs said "world_size": 1, "sharding": "none"."""
    folder = _sharded_run(tmp_path)
    run, _ = run_files.read_run_json(folder / "run.json")
    job = knobs_from_run(run, 4)
    assert job is not None
    assert (job.world_size, job.sharding) == (4, "zero3")
    # 32 samples a step: 4 rows × 2 accumulated × 4 ranks
    assert (job.micro_batch_size, job.gradient_accumulation_steps) == (4, 2)
    record = job_record(job)
    assert (record["world_size"], record["sharding"]) == (4, "zero3")
    d = from_run_dir(str(folder))
    offered = {f.lever for f in d.fixes}
    assert not offered & {"lora", "quantization", "optimizer"}
    assert any(line.startswith("not proposed: lora") for line in d.diagnosis)
    # an edited scheme no sharding names is left out, not believed
    run["resolved"]["sharding"] = run["config"]["sharding"] = "zero9"
    edited = knobs_from_run(run, 4)
    assert edited is not None and edited.sharding == "none"


def test_the_plan_command_plans_the_same_ranks() -> None:
    """`memfit doctor --batch-size 8 --world-size 3 --sharding zero3` printed a `memfit plan …
    --effective-batch-size 8` without the ranks: another job. The effective batch is the
    micro-batch's accumulation over the ranks, and the plan keeps them."""
    job = failed_job(model="distilgpt2", task="causal-lm", batch_size=8, seq_len=512,
                     world_size=3, sharding="zero3")  # fmt: skip
    assert job.effective_batch_size == 24
    report = parse_oom(T4_OOM)
    assert report is not None
    change = _plan_fix(report, job).change
    assert "--effective-batch-size 24 --seq-len 512 --world-size 3 --sharding zero3 " in change
    # an effective batch the ranks cannot split is a placeholder: plan would refuse it
    uneven = dataclasses.replace(job, effective_batch_size=10)
    assert "--effective-batch-size N " in _plan_fix(report, uneven).change
    # one rank unsharded: the plan's own default, no flag
    alone = failed_job(model="distilgpt2", task="causal-lm", batch_size=8, seq_len=512)
    assert "--world-size" not in _plan_fix(report, alone).change


def test_truncation_starts_from_the_jobs_own_cut() -> None:
    """With --seq-len 512 --max-seq-len 128 the doctor tried 512 → 256 (no cut of a job already
    at 128 tokens) and said truncation would not lower the peak."""
    job = failed_job(model="m", task="causal-lm", batch_size=8, seq_len=512, max_seq_len=128)
    report = parse_oom(T4_OOM)
    assert report is not None
    prices = Prices()
    fix = next(f for f in cures(job, prices, report, []) if f.lever == "truncation")
    assert dict(fix.settings) == {"max_seq_len": 64}
    assert "128 → 64 tokens" in fix.change
    # the plan command plans the rows the job fed: memfit plan takes no cut
    change = _plan_fix(report, dataclasses.replace(job, model="distilgpt2")).change
    assert "--seq-len 128 " in change


def test_a_knobs_check_reads_its_resolved_type() -> None:
    """run.json's checks told a switch and a list from the text of the field's annotation
    ("bool | None"): an annotation spelled otherwise was read as text."""

    @dataclasses.dataclass
    class Knobs:
        # the old spellings are what is tested
        on: typing.Optional[bool] = None  # noqa: UP045
        names: typing.List[str] | None = None  # noqa: UP006
        rank: int | None = dataclasses.field(default=None, metadata={"minimum": 0})

    hints = typing.get_type_hints(Knobs)
    checks = {f.name: run_files._knob_check(f, hints[f.name]) for f in dataclasses.fields(Knobs)}
    assert checks["on"] is run_files.flag and checks["names"] is run_files.strings
    assert checks["rank"](0) is None and checks["rank"]("x") is not None


def test_off_reads_the_resolved_type() -> None:
    """A lever not given is off: a switch False, a choice "none", else None."""
    from memfit.report.doctor import _off

    hints = typing.get_type_hints(Job)
    for lever in levers.LEVERS:
        for name in lever.fields:
            if hints[name] in (bool, bool | None):
                assert _off(name) is False, name
    assert (_off("quantization"), _off("lora_rank")) == ("none", None)
