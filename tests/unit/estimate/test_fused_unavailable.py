"""A causal LM whose head the fused linear cross-entropy cannot compute (Granite's
``logits_scaling``, Cohere's ``logit_scale``): every verb says so in one line, or leaves the fused
loss out, and never shows a traceback. The config alone shows it
(:func:`memfit.step.fused_linear_config_problem`); a head LoRA adapts only the built model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

import memfit
from cli_run import run_cli
from memfit import step
from memfit.errors import UsageError
from memfit.job import Job
from memfit.levers import BY_NAME
from memfit.levers.base import Room
from memfit.plan.search import Space
from memfit.report.doctor import failed_job
from memfit.report.doctor_cures import cures
from memfit.report.oom_message import parse_oom

CE = BY_NAME["cross-entropy"]
T4_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    "capacity of 14.56 GiB of which 8.00 MiB is free. Of the allocated memory 14.20 GiB is "
    "allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated."
)
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Granite folder whose head divides the logits by 8."""
    folder = tmp_path_factory.mktemp("granite")
    transformers.GraniteConfig(logits_scaling=8.0, **TINY).save_pretrained(folder)
    return str(folder)


def test_the_config_names_the_heads_transform() -> None:
    problem = step.fused_linear_config_problem(transformers.GraniteConfig(logits_scaling=8.0))
    assert problem is not None and "--cross-entropy" in problem and "logits_scaling=8.0" in problem
    cohere = step.fused_linear_config_problem(transformers.CohereConfig(logit_scale=0.0625))
    assert cohere is not None and "logit_scale=0.0625" in cohere
    # a head that scales by 1 computes what the fused loss does; a plain decoder has no transform
    assert step.fused_linear_config_problem(transformers.GraniteConfig(logits_scaling=1.0)) is None
    assert step.fused_linear_config_problem(transformers.LlamaConfig()) is None


def test_estimate_refuses_the_fused_loss_in_one_line(
    granite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "estimate", granite, "--task", "causal-lm", "--batch-size", "1",
        "--seq-len", "16", "--cross-entropy", "fused-linear",
    )  # fmt: skip
    assert code == 2 and "Traceback" not in err and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--cross-entropy" in lines[0] and "logits_scaling" in lines[0]
    with pytest.raises(UsageError, match="logits_scaling"):
        memfit.estimate(granite, task="causal-lm", batch_size=1, seq_len=16,
                        cross_entropy="fused-linear")  # fmt: skip


def test_a_head_lora_adapts_is_a_usage_error_too(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    # the config is fine; the built model's head carries adapters, which the fused loss refuses
    with pytest.raises(UsageError, match="--cross-entropy fused-linear cannot compute"):
        memfit.estimate(str(tmp_path), task="causal-lm", batch_size=1, seq_len=16, lora_rank=2,
                        lora_target_modules=["q_proj", "lm_head"],
                        cross_entropy="fused-linear")  # fmt: skip


def test_the_planner_does_not_try_the_fused_loss_there() -> None:
    job = Job(model="m", task="causal-lm", seq_len=64)
    problem = step.fused_linear_config_problem(transformers.GraniteConfig(logits_scaling=8.0))
    assert CE.plan_options(Room(job, fused_loss_problem=problem)) == (
        {"cross_entropy": "standard"},
    )
    options = dict(Space.of(Room(job, fused_loss_problem=problem)).options)
    assert options[CE] == ({"cross_entropy": "standard"},)
    # elsewhere both are tried
    assert {"cross_entropy": "fused-linear"} in CE.plan_options(Room(job))


def test_plan_refuses_a_pinned_fused_loss_in_one_line(
    granite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "plan", granite, "--task", "causal-lm", "--seq-len", "16",
        "--effective-batch-size", "2", "--gpu-memory", "8GiB", "--cross-entropy", "fused-linear",
    )  # fmt: skip
    assert code == 2 and "Traceback" not in err and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--cross-entropy" in lines[0] and "logits_scaling" in lines[0]
    with pytest.raises(UsageError, match="logits_scaling"):
        memfit.plan(granite, task="causal-lm", seq_len=16, effective_batch_size=2,
                    gpu_memory="8GiB", cross_entropy="fused-linear")  # fmt: skip


@pytest.mark.slow
def test_plan_without_the_flag_plans_the_standard_loss(
    granite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "plan", granite, "--task", "causal-lm", "--seq-len", "16",
        "--effective-batch-size", "2", "--gpu-memory", "8GiB", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert "Traceback" not in err
    plan = json.loads(out)
    tried = [plan["plan"], *plan["alternatives"]]
    assert plan["plan"]["cross_entropy"] == "standard"
    assert all(c.get("cross_entropy") != "fused-linear" for c in tried)


def test_the_doctor_does_not_offer_the_fused_loss_and_says_why(granite: str) -> None:
    job = failed_job(model=granite, task="causal-lm", batch_size=2, seq_len=16)
    report = parse_oom(T4_OOM)
    assert report is not None
    notes: list[str] = []
    fixes = cures(job, lambda settings: 1 << 20, report, notes)
    assert "cross-entropy" not in [f.lever for f in fixes]
    assert any(n.startswith("not proposed: cross-entropy") and "logits_scaling" in n for n in notes)
    # a causal LM whose head it computes is offered it (the same stand-in prices)
    plain = failed_job(model="gpt2", task="causal-lm", batch_size=2, seq_len=16)
    assert "cross-entropy" in [f.lever for f in cures(plain, lambda s: 1 << 20, report, [])]


def test_doctor_refuses_a_pinned_fused_loss_in_one_line(
    granite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run_cli(
        capsys, "doctor", "--message", T4_OOM, "--model", granite, "--task", "causal-lm",
        "--seq-len", "16", "--batch-size", "2", "--cross-entropy", "fused-linear",
    )  # fmt: skip
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "logits_scaling" in lines[0]
