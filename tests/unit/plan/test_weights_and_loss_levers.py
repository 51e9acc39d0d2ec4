"""The weights' dtype (``--weights-dtype``; pure 16-bit training is the lever ``pure-16bit``) and
the causal-LM loss (``--cross-entropy``; the lever ``cross-entropy``): their flags and checks,
what a plan tries, what it chooses when the estimate says so, and what the cost model charges.
The planner's tests here answer with a stand-in estimate: nothing is traced."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from memfit.devices.catalog import find_gpu
from memfit.job import Job
from memfit.levers import ALLOWABLE, BY_NAME, LEVERS
from memfit.levers.base import Room
from memfit.plan import cost, plan
from memfit.plan import search as search_module
from memfit.plan.configuration import TIERS, tier_of

CE = BY_NAME["cross-entropy"]
PURE = BY_NAME["pure-16bit"]


def _job(**knobs: Any) -> Job:
    return Job(model="m", **{"task": "causal-lm", "seq_len": 64, **knobs})


# --- the knobs ---------------------------------------------------------------------------------


def test_the_knobs_are_flags_with_their_choices() -> None:
    fields = {f.name: f for f in dataclasses.fields(Job)}
    assert fields["weights_dtype"].metadata["choices"] == ("auto", "fp32", "bf16", "fp16")
    assert fields["cross_entropy"].metadata["choices"] == (
        "standard",
        "fused-linear",
        "trl-chunked",
    )
    assert PURE.flags({"weights_dtype": "bf16"}) == ["--weights-dtype bf16"]
    assert CE.flags({"cross_entropy": "fused-linear"}) == ["--cross-entropy fused-linear"]
    problems = _job(weights_dtype="fp64", cross_entropy="fused").problems()
    assert any(p.startswith("--weights-dtype: unknown value 'fp64'") for p in problems)
    assert any(p.startswith("--cross-entropy: unknown value 'fused'") for p in problems)


def test_fused_linear_is_for_a_causal_lm_only() -> None:
    assert _job(cross_entropy="fused-linear").problems() == []
    [problem] = _job(task="classification", cross_entropy="fused-linear").problems()
    assert problem.startswith("--cross-entropy fused-linear: only with --task causal-lm")


def test_pure_fp16_is_refused_in_every_verb() -> None:
    # pure fp16 has no loss scaling (torch's GradScaler refuses fp16 gradients, and memfit
    # train runs no scaler over 16-bit weights), whatever the precision
    for precision in (None, "fp32", "fp16", "bf16"):
        [problem] = _job(weights_dtype="fp16", precision=precision).problems()
        assert problem.startswith("--weights-dtype fp16: pure fp16 training"), problem
        assert "GradScaler" in problem and "--weights-dtype bf16" in problem
        assert "LoRA" not in problem
    # the adapters are trained in it too, said only under LoRA
    [problem] = _job(weights_dtype="fp16", precision="fp16", lora_rank=8).problems()
    assert "(LoRA adapters too)" in problem
    # a frozen fp16 base is auto over an fp16 checkpoint
    assert "auto over an fp16 checkpoint" in problem


def test_bf16_weights_are_refused_under_fp16_autocast() -> None:
    # fp16 autocast over bf16 trained weights: no loss scaler runs
    for rank in (None, 8):
        [problem] = _job(weights_dtype="bf16", precision="fp16", lora_rank=rank).problems()
        assert problem.startswith("--weights-dtype bf16 with --precision fp16: "), problem
        assert ("(LoRA adapters too)" in problem) == bool(rank)
    assert _job(weights_dtype="bf16", precision="bf16").problems() == []
    assert _job(weights_dtype="bf16", precision="fp32").problems() == []
    assert _job(weights_dtype="auto", precision="fp16").problems() == []
    assert _job(weights_dtype="fp32", precision="fp16").problems() == []


def test_the_plan_offers_pure_bf16_not_under_a_pinned_fp16_precision() -> None:
    allowed = ("pure-16bit",)
    room = Room(_job(precision="fp16"), allowed=allowed, mixed_precision="bf16")
    assert PURE.plan_options(room) == ({"weights_dtype": "auto"},)
    for precision in ("bf16", "fp32"):
        room = Room(_job(precision=precision), allowed=allowed, mixed_precision="bf16")
        assert {"weights_dtype": "bf16"} in PURE.plan_options(room)


# --- what a plan tries -------------------------------------------------------------------------


def test_the_new_levers_take_their_places_in_the_plans_order() -> None:
    names = [lever.name for lever in LEVERS]
    # the exact loss before every lever with a quality cost; pure bf16 after the optimizer swap
    # and before truncation and LoRA
    assert CE.tier == 0 and not CE.allow
    assert names.index("cross-entropy") < names.index("optimizer")
    assert ALLOWABLE[:3] == ("optimizer", "pure-16bit", "truncation")
    assert tier_of({"weights_dtype": "bf16"}, {"weights_dtype": "auto"}) == TIERS.index(
        "pure-16bit"
    )
    assert tier_of({"cross_entropy": "fused-linear"}, {"cross_entropy": "standard"}) == 0


def test_the_plan_tries_fused_linear_for_a_causal_lm_only_unless_pinned() -> None:
    assert CE.plan_options(Room(_job())) == (
        {"cross_entropy": "standard"},
        {"cross_entropy": "fused-linear"},
    )
    assert CE.plan_options(Room(_job(task="classification"))) == ({},)
    assert CE.plan_options(Room(_job(cross_entropy="standard"))) == ({"cross_entropy": "standard"},)
    assert CE.frugal(CE.plan_options(Room(_job())))[0] == {"cross_entropy": "fused-linear"}


def test_pure_bf16_only_when_allowed_on_a_bf16_gpu_and_not_pinned() -> None:
    plain = ({"weights_dtype": "auto"},)
    assert PURE.plan_options(Room(_job())) == plain
    allowed = ("pure-16bit",)
    assert PURE.plan_options(Room(_job(), allowed=allowed)) == (
        *plain,
        {"weights_dtype": "bf16"},
    )
    assert PURE.plan_options(Room(_job(), allowed=allowed, mixed_precision="fp16")) == plain
    # the job's own dtype is the job: kept
    assert PURE.plan_options(Room(_job(weights_dtype="fp32"), allowed=allowed)) == (
        {"weights_dtype": "fp32"},
    )
    # what no flag says stays off the printed commands
    assert PURE.as_given({"weights_dtype": "auto"}) == {"weights_dtype": None}
    assert CE.as_given({"cross_entropy": "standard"}) == {"cross_entropy": None}


def test_the_trainer_names() -> None:
    args = CE.trainer_args({"cross_entropy": "fused-linear"})
    assert args["use_liger_kernel"] is True
    # only the fused loss is patched: the step that runs is the one estimated
    config = args["liger_kernel_config"]
    assert config["fused_linear_cross_entropy"] is True
    assert not any(config[k] for k in ("cross_entropy", "rope", "rms_norm", "swiglu"))
    assert CE.trainer_args({"cross_entropy": "standard"}) == {}
    assert PURE.trainer_args({"weights_dtype": "bf16"}) == {
        "model_init_kwargs": {"dtype": "bfloat16"}
    }
    assert PURE.trainer_args({"weights_dtype": "auto"}) == {}


# --- time ----------------------------------------------------------------------------------------


def test_liger_chunks_as_its_source_does() -> None:
    # ceil(V / H) chunks, each a power of two: Llama 3 8B's head over 4096 rows: 32 of 128
    llama = cost.ModelShape(8 * 10**9, 8 * 10**9, 32, 4096, 0, vocab=128256)
    assert llama.loss_chunks(4096) == 32
    # Qwen2.5-0.5B's narrow hidden size over a 152k vocabulary: 128 chunks of 64 rows
    qwen = cost.ModelShape(5 * 10**8, 5 * 10**8, 24, 896, 0, vocab=151936)
    assert qwen.loss_chunks(8192) == 128
    assert qwen.loss_chunks(3) == 3


def test_the_cost_model_charges_the_fused_loss_a_little() -> None:
    shape = cost.ModelShape(5 * 10**8, 5 * 10**8, 24, 896, 0, vocab=151936)
    gpu = find_gpu("rtx4090")
    fixed: dict[str, Any] = dict(
        precision="bf16",
        micro_batch_size=8,
        accumulation_steps=1,
        seq_len=1024,
        gradient_checkpointing=False,
        optimizer="adamw",
        lora=False,
        cached_loss=False,
    )
    values = {"precision": "bf16", "cross_entropy": "standard"}
    standard = cost.samples_per_second(shape, gpu, **fixed, values=values)
    fused_values = {**values, "cross_entropy": "fused-linear"}
    fused = cost.samples_per_second(shape, gpu, **fixed, values=fused_values)
    extra = CE.micro_seconds(fused_values, shape, gpu, 8 * 1024)
    assert extra > 0
    assert 8 / fused - 8 / standard == pytest.approx(extra)
    # small beside the step: the same FLOPs, the head re-read once per chunk
    assert extra < 0.5 * (8 / standard)
    # a wide head over a small vocabulary: the chunks' matmuls are compute-bound, no charge
    wide = cost.ModelShape(10**9, 10**9, 16, 4096, 0, vocab=32000)
    assert CE.micro_seconds(fused_values, wide, gpu, 8 * 1024) == 0.0
    assert CE.micro_seconds(values, shape, gpu, 8 * 1024) == 0.0
    assert CE.time_words(fused_values) and CE.time_words(values) is None


# --- the planner, on a stand-in estimate ----------------------------------------------------------


def _stand_in(monkeypatch: pytest.MonkeyPatch, peak: Any) -> list[dict[str, Any]]:
    """The planner's estimates answered by ``peak(kwargs)``; returns the kwargs it got."""
    calls: list[dict[str, Any]] = []

    def estimate(model: str, **kwargs: Any) -> Any:
        calls.append(kwargs)
        total = int(peak(kwargs))
        # no weights said apart: no floor to skip by
        return SimpleNamespace(
            total_bytes=total,
            details={"model_state": {"total_bytes": total}},
            breakdown={"parameters": 0, "buffers": 0},
        )

    monkeypatch.setattr(search_module, "estimate", estimate)
    return calls


MIB = 1 << 20


def _logits_bound(kwargs: dict[str, Any]) -> int:
    # the standard loss's logits dominate: 100 MiB a row, 10 MiB with the fused loss
    per_row = 10 * MIB if kwargs.get("cross_entropy") == "fused-linear" else 100 * MIB
    return 50 * MIB + per_row * kwargs["batch_size"]


def test_the_plan_takes_fused_linear_when_the_logits_do_not_fit(
    monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    calls = _stand_in(monkeypatch, _logits_bound)
    job = {"task": "causal-lm", "seq_len": 64, "effective_batch_size": 8}
    p = plan(tiny_gpt2, gpu_memory=int(120 * MIB / 0.95) + 1, gpu="a100-80gb", **job)
    assert p.fits and p.plan is not None
    assert p.plan["cross_entropy"] == "fused-linear"
    assert p.plan["micro_batch_size"] == 4  # 50 + 4 × 10 MiB
    assert "--cross-entropy fused-linear" in (p.train_command() or "")
    assert "--cross-entropy fused-linear" in (p.estimate_command() or "")
    text = "\n".join(p.explanation)
    assert "Fused linear cross-entropy (chosen)" in text and "liger-kernel" in text
    assert any(c.get("cross_entropy") == "fused-linear" for c in calls)
    # pinned standard: nothing fits
    calls.clear()
    pinned = plan(tiny_gpt2, gpu_memory=int(120 * MIB / 0.95) + 1, cross_entropy="standard", **job)
    assert not pinned.fits
    assert not any(c.get("cross_entropy") == "fused-linear" for c in calls)
    assert "--cross-entropy standard" not in pinned.plan_command(1, "none")


def test_a_classifier_is_never_offered_fused_linear(
    monkeypatch: pytest.MonkeyPatch, tiny_bert: str
) -> None:
    calls = _stand_in(monkeypatch, _logits_bound)
    job = {"task": "classification", "seq_len": 64, "effective_batch_size": 4}
    p = plan(tiny_bert, gpu_memory="1GiB", **job)
    assert p.fits and p.plan is not None and "cross_entropy" not in p.plan
    assert calls and not any(c.get("cross_entropy") for c in calls)


def _weights_bound(kwargs: dict[str, Any]) -> int:
    # fp32 master weights with their gradients and AdamW state: 200 MiB; pure bf16: half
    state = 100 * MIB if kwargs.get("weights_dtype") == "bf16" else 200 * MIB
    return state + 5 * MIB * kwargs["batch_size"]


def test_pure_bf16_only_when_allowed_and_its_cost_said(
    monkeypatch: pytest.MonkeyPatch, tiny_bert: str
) -> None:
    _stand_in(monkeypatch, _weights_bound)
    job = {"task": "classification", "seq_len": 64, "effective_batch_size": 4}
    budget = int(150 * MIB / 0.95) + 1
    refused = plan(tiny_bert, gpu_memory=budget, gpu="a100-80gb", **job)
    assert not refused.fits
    # only the hint prices it: what allowing it would give
    hint = next(s for s in refused.suggestions if "--allow pure-16bit" in s)
    assert "pure bf16: weights, gradients and optimizer state in 16 bits" in hint, hint
    p = plan(tiny_bert, gpu_memory=budget, gpu="a100-80gb", allow=["pure-16bit"], **job)
    assert p.fits and p.plan is not None and p.plan["weights_dtype"] == "bf16"
    text = "\n".join(p.explanation)
    assert "Pure bf16 training (allowed)" in text
    assert "bf16 mixed precision (bf16 weights)" in text
    assert "(fp32 master weights)" not in text
    assert "bf16_stochastic_round=True" in text and "rounds away" in text
    assert "--weights-dtype bf16" in (p.train_command() or "")
    assert "--allow pure-16bit" in p.plan_command(1, "none")
    # a GPU without bf16 (a T4) is never offered it
    t4 = plan(tiny_bert, gpu_memory=budget, gpu="t4", allow=["pure-16bit"], **job)
    assert not t4.fits


def test_the_weights_pin_reaches_the_plan(monkeypatch: pytest.MonkeyPatch, tiny_bert: str) -> None:
    calls = _stand_in(monkeypatch, _weights_bound)
    job = {"task": "classification", "seq_len": 64, "effective_batch_size": 4}
    p = plan(tiny_bert, gpu_memory="1GiB", weights_dtype="bf16", **job)
    assert p.fits and all(c.get("weights_dtype") == "bf16" for c in calls)
    # as given: the job's own, no --allow needed, kept in the commands
    assert "--weights-dtype bf16" in p.plan_command(1, "none")
    assert "--weights-dtype bf16" in (p.train_command() or "")


def test_estimate_lines_read_the_details() -> None:
    details: dict[str, Any] = {
        "weights": {"frozen": "bf16", "trainable": "fp32", "checkpoint": "bf16"},
        "cross_entropy": {
            "kind": "fused-linear",
            "implementation": "Liger Kernel (CUDA)",
            "chunk_rows": 128,
            "chunks": 32,
        },
    }
    [line] = PURE.estimate_lines(details)
    assert line.startswith("weights: frozen in bf16, trainable in fp32 (fp32 master weights)")
    [line] = CE.estimate_lines(details)
    assert "Liger Kernel (CUDA)" in line and "32 chunks of 128 rows" in line
    assert PURE.estimate_lines({}) == [] and CE.estimate_lines({}) == []
    pure = {"weights": {"frozen": None, "trainable": "bf16", "checkpoint": "fp32"}}
    assert "pure 16-bit" in PURE.estimate_lines(pure)[0]
