"""memfit.plan: the contract, the budget kept, tightness, loss-awareness and the ranking."""

from __future__ import annotations

import json

import pytest

from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.plan import PLAN_KEYS, plan
from memfit.plan.planner import _divisors

GiB = 1 << 30


def _reestimate(model: str, task: str, seq_len: int, p) -> int:
    """What `memfit estimate` gives for the plan's knobs, by hand."""
    s = p.plan
    return estimate(
        model,
        task=task,
        batch_size=s["micro_batch_size"],
        seq_len=seq_len,
        precision=s["precision"],
        optimizer=s["optimizer"],
        gradient_checkpointing=s["gradient_checkpointing"],
        loss=s["loss"] if task == "sentence-embedding" else None,
        mini_batch_size=s["mini_batch_size"],
        lora_rank=s["lora_rank"],
        max_seq_len=s["max_seq_len"] if s["max_seq_len"] < seq_len else None,
        world_size=s["world_size"],
        gpu=p.gpu,
    ).total_bytes


@pytest.mark.parametrize(
    ("fixture", "task", "seq_len", "effective", "budgets"),
    [
        ("tiny_bert", "classification", 128, 96, (1.0, 1.3, 2.0)),
        ("tiny_gpt2", "causal-lm", 128, 64, (0.9, 1.2)),
    ],
)
def test_plan_keeps_the_budget_and_is_tight(
    request: pytest.FixtureRequest,
    fixture: str,
    task: str,
    seq_len: int,
    effective: int,
    budgets: tuple[float, ...],
) -> None:
    model = request.getfixturevalue(fixture)
    # budgets relative to what the whole batch at once needs in fp32 (so some cases must split)
    whole = estimate(model, task=task, batch_size=effective, seq_len=seq_len).total_bytes
    for fraction in budgets:
        budget = int(whole * fraction)
        p = plan(
            model, task=task, seq_len=seq_len, effective_batch_size=effective, gpu_memory=budget
        )
        d = p.to_dict()
        assert d["fits"] is True and set(PLAN_KEYS) <= set(d["plan"])
        s = d["plan"]
        assert (
            s["micro_batch_size"] * s["gradient_accumulation_steps"] * s["world_size"] == effective
        )
        assert d["predicted_peak_bytes"] <= budget * (1 - 0.05)
        assert d["predicted_peak_bytes"] == _reestimate(model, task, seq_len, p)
        # tightness: the next larger divisor with the same other knobs would not fit
        larger = [m for m in _divisors(effective) if m > s["micro_batch_size"]]
        if larger:
            over = estimate(
                model,
                task=task,
                batch_size=larger[0],
                seq_len=seq_len,
                precision=s["precision"],
                gradient_checkpointing=s["gradient_checkpointing"],
            ).total_bytes
            assert over > budget * (1 - 0.05)
        json.dumps(d)  # the contract is plain JSON


def test_ranking_is_not_always_the_largest_micro_batch() -> None:
    # bert-base, bf16, 256 tokens, 5 GiB: without checkpointing micro-batch 16 fits; with it,
    # micro-batch 64 would. Recomputing the forward costs more than the larger micro-batch gains.
    p = plan(
        "bert-base-uncased",
        task="classification",
        seq_len=256,
        effective_batch_size=64,
        gpu="a100-40gb",
        gpu_memory="5GiB",
    )
    s = p.plan
    assert s["precision"] == "bf16" and s["gradient_checkpointing"] is False
    ckpt_at_64 = estimate(
        "bert-base-uncased",
        task="classification",
        batch_size=64,
        seq_len=256,
        precision="bf16",
        gradient_checkpointing=True,
        gpu="a100-40gb",
    )
    assert ckpt_at_64.total_bytes <= 5 * GiB * 0.95  # the larger micro-batch would fit...
    assert s["micro_batch_size"] < 64  # ...but the plan keeps a smaller one, and says why
    assert any("Checkpointing not needed" in line for line in p.explanation)
    # with a tighter budget checkpointing wins: micro-batch 1-4 without it vs 16+ with it
    tight = plan(
        "bert-base-uncased",
        task="classification",
        seq_len=256,
        effective_batch_size=64,
        gpu="a100-40gb",
        gpu_memory="3.5GiB",
    )
    assert tight.plan is not None
    assert tight.plan["gradient_checkpointing"] is True
    assert tight.plan["micro_batch_size"] >= 16


def test_in_batch_negatives_plan_the_cached_loss(tiny_bert: str) -> None:
    effective = 64
    whole = estimate(
        tiny_bert, task="sentence-embedding", batch_size=effective, seq_len=128, loss="mnrl"
    ).total_bytes
    cached = estimate(
        tiny_bert,
        task="sentence-embedding",
        batch_size=effective,
        seq_len=128,
        loss="cached-mnrl",
        mini_batch_size=8,
    ).total_bytes
    checkpointed = estimate(
        tiny_bert,
        task="sentence-embedding",
        batch_size=effective,
        seq_len=128,
        loss="mnrl",
        gradient_checkpointing=True,
    ).total_bytes
    assert cached < checkpointed < whole
    # usable memory between mini-batches of 8 (fit) and the whole batch even with checkpointing
    p = plan(
        tiny_bert,
        task="sentence-embedding",
        seq_len=128,
        effective_batch_size=effective,
        gpu_memory=int((checkpointed + cached) / 2 / 0.95),
        precision="fp32",
    )
    s = p.plan
    assert s["loss"] == "cached-mnrl"
    assert s["gradient_accumulation_steps"] == 1 and s["micro_batch_size"] == effective
    assert s["mini_batch_size"] < effective
    assert p.predicted_peak_bytes == _reestimate(tiny_bert, "sentence-embedding", 128, p)
    assert any("objective" in line for line in p.explanation)


def test_nothing_fits_gives_the_least_and_suggestions(tiny_gpt2: str) -> None:
    p = plan(tiny_gpt2, task="causal-lm", seq_len=128, effective_batch_size=8, gpu_memory="64MiB")
    d = p.to_dict()
    assert d["fits"] is False and d["plan"] is None and d["predicted_peak_bytes"] is None
    assert d["min_required_bytes"] > 64 << 20
    assert any("--gpu" in line for line in d["suggestions"])
    assert any("--allow lora" in line for line in d["suggestions"])


def test_levers_only_when_allowed(tiny_gpt2: str) -> None:
    job = {"task": "causal-lm", "seq_len": 128, "effective_batch_size": 8}
    levers = ["optimizer", "truncation", "lora"]
    without = plan(tiny_gpt2, gpu_memory="64MiB", **job).min_required_bytes
    with_levers = plan(tiny_gpt2, gpu_memory="64MiB", allow=levers, **job).min_required_bytes
    assert with_levers < without
    # a budget between the two: only the allowed levers make it fit
    budget = int((with_levers + without) / 2 / 0.95)
    assert not plan(tiny_gpt2, gpu_memory=budget, **job).fits
    p = plan(tiny_gpt2, gpu_memory=budget, allow=levers, **job)
    assert p.fits
    s = p.plan
    assert s["optimizer"] != "adamw" or s["max_seq_len"] < 128 or s["lora_rank"]
    assert p.predicted_peak_bytes == _reestimate(tiny_gpt2, "causal-lm", 128, p)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_memory": 0}, "--gpu-memory"),
        ({"gpu_memory": "16GiB", "effective_batch_size": 0}, "--effective-batch-size"),
        ({"gpu_memory": "16GiB", "loss": "nope"}, "--loss"),
        ({"gpu_memory": "16GiB", "allow": ["magic"]}, "--allow"),
        ({"gpu": "gtx-potato"}, "--gpu"),
        ({"gpu": "t4", "precision": "bf16"}, "bf16"),
        ({"gpu_memory": "16GiB", "world_size": 3}, "--world-size"),
    ],
)
def test_bad_input_is_one_clear_error(tiny_bert: str, kwargs: dict, message: str) -> None:
    args = {"task": "classification", "seq_len": 64, "effective_batch_size": 32, **kwargs}
    if kwargs.get("loss"):
        args["task"] = "sentence-embedding"
    with pytest.raises(UsageError, match=message):
        plan(tiny_bert, **args)


def test_no_gpu_and_no_budget_says_which_flag() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: its free memory is the budget")
    with pytest.raises(UsageError, match="--gpu-memory"):
        plan("bert-base-uncased", task="classification", seq_len=64, effective_batch_size=8)
