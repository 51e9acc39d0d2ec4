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
        sharding=s["sharding"],
        gpu=p.gpu,
        # the weights' dtype and the causal-LM loss, when the plan names them
        weights_dtype=s.get("weights_dtype"),
        cross_entropy=s.get("cross_entropy"),
        gradient_accumulation_steps=s["gradient_accumulation_steps"]
        if task != "sentence-embedding"
        else 1,
    ).total_bytes


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# a causal LM's plan tries both losses (cross-entropy lever): over 10 s here
@pytest.mark.slow
def test_nothing_fits_gives_the_least_and_suggestions(tiny_gpt2: str) -> None:
    p = plan(tiny_gpt2, task="causal-lm", seq_len=128, effective_batch_size=8, gpu_memory="64MiB")
    d = p.to_dict()
    assert d["fits"] is False and d["plan"] is None and d["predicted_peak_bytes"] is None
    assert d["min_required_bytes"] > 64 << 20
    assert any("--gpu" in line for line in d["suggestions"])
    assert any("--allow lora" in line for line in d["suggestions"])


@pytest.mark.slow
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
        ({"gpu_memory": "16GiB", "sharding": "zero4"}, "--sharding: unknown value 'zero4'"),
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


def test_sharded_plan_is_per_rank_and_says_its_scheme(tiny_bert: str) -> None:
    job = {"task": "classification", "seq_len": 128, "effective_batch_size": 32}
    whole = estimate(
        tiny_bert,
        task="classification",
        batch_size=16,
        seq_len=128,
        world_size=2,
        sharding="fsdp",
    ).total_bytes
    p = plan(tiny_bert, gpu_memory=int(whole * 1.2), world_size=2, sharding="fsdp", **job)
    d = p.to_dict()
    s = d["plan"]
    assert d["fits"] and s["sharding"] == "fsdp" and s["world_size"] == 2
    assert d["sharding"] == "fsdp" and d["world_size"] == 2 and d["scale_out"] == []
    # micro-batch × accumulation × GPUs = the effective batch; the peak is one rank's
    assert s["micro_batch_size"] * s["gradient_accumulation_steps"] * 2 == 32
    assert d["predicted_peak_bytes"] == _reestimate(tiny_bert, "classification", 128, p)
    command = p.estimate_command()
    assert command is not None and "--world-size 2 --sharding fsdp" in command
    assert any("--sharding fsdp over 2 GPUs" in line for line in p.explanation)
    # the same job unsharded: a different per-rank peak for the same knobs
    plain = plan(tiny_bert, gpu_memory=int(whole * 1.2), world_size=2, **job)
    assert plain.plan is not None and plain.plan["sharding"] == "none"


@pytest.mark.slow
def test_nothing_fits_prices_scaling_out() -> None:
    # bert-base at 2 GiB: one GPU needs ~3 GiB even at micro-batch 1 with checkpointing, its
    # optimizer's state on the GPU (pinned: in host memory it fits one GPU); more GPUs help only
    # when they shard the model states
    job = {
        "task": "classification",
        "seq_len": 128,
        "effective_batch_size": 16,
        "optimizer_offload": "none",
    }
    p = plan("bert-base-uncased", gpu_memory="2GiB", **job)
    d = p.to_dict()
    assert d["fits"] is False and d["plan"] is None
    rows = d["scale_out"]
    assert {r["world_size"] for r in rows} == {2, 4, 8}
    assert {r["sharding"] for r in rows} == {"none", "zero1", "zero2", "zero3", "fsdp"}
    by = {(r["world_size"], r["sharding"]): r for r in rows}
    for world in (2, 4, 8):
        # plain data parallelism holds the whole model states on every GPU: no help
        assert by[(world, "none")]["predicted_peak_bytes"] >= d["min_required_bytes"]
        assert not by[(world, "none")]["fits"]
    for scheme in ("zero2", "zero3", "fsdp"):
        peaks = [by[(w, scheme)]["predicted_peak_bytes"] for w in (2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True) and peaks[-1] < d["min_required_bytes"]
    for r in rows:
        assert r["fits"] == (r["predicted_peak_bytes"] <= 2 * GiB * 0.95)
    # the fewest GPUs that fit, with the least harmful scheme, as a command to run
    fitting = [r for r in rows if r["fits"]]
    assert fitting
    world = min(r["world_size"] for r in fitting)
    line = next(x for x in d["suggestions"] if x.startswith("Fewest GPUs that fit"))
    assert "memfit plan bert-base-uncased" in line and f"--world-size {world}" in line
    assert not any("plain data parallelism do not lower" in x for x in d["suggestions"])
    scheme = line.split("--sharding ")[-1].split()[0]
    # ...and that plan fits, at the memory the suggestion priced for its least configuration
    again = plan("bert-base-uncased", gpu_memory="2GiB", world_size=world, sharding=scheme, **job)
    assert again.fits and again.plan is not None and again.plan["sharding"] == scheme
    assert again.min_required_bytes == by[(world, scheme)]["predicted_peak_bytes"]
