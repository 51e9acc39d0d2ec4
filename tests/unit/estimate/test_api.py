"""The estimator's contract: exact resident state, a breakdown that sums, clear errors."""

from __future__ import annotations

import pytest

from memfit.errors import UsageError
from memfit.estimate import BREAKDOWN_KEYS, estimate

BERT_BASE_2_LABELS = 109_483_778


@pytest.fixture(scope="module")
def bert_base_cpu():
    return estimate(
        "bert-base-uncased", task="classification", batch_size=8, seq_len=128, device="cpu"
    )


def test_bert_base_parameters_and_adamw_state_are_exact(bert_base_cpu) -> None:
    est = bert_base_cpu
    assert est.details["num_parameters"] == BERT_BASE_2_LABELS
    assert est.breakdown["parameters"] == BERT_BASE_2_LABELS * 4
    # AdamW keeps exp_avg and exp_avg_sq (fp32) plus one fp32 step counter per parameter tensor
    n_tensors = 201
    assert est.breakdown["optimizer_state"] == 2 * BERT_BASE_2_LABELS * 4 + n_tensors * 4


def test_breakdown_sums_to_total_and_has_the_contract_keys(bert_base_cpu) -> None:
    est = bert_base_cpu
    assert tuple(est.breakdown) == BREAKDOWN_KEYS
    assert sum(est.breakdown.values()) == est.total_bytes
    assert est.peak_phase in ("forward", "backward", "optimizer_step")
    data = est.to_dict()
    assert set(data) >= {"total_bytes", "breakdown", "peak_phase", "budget_bytes", "fits"}
    assert data["budget_bytes"] is None and data["fits"] is None


def test_budget_verdict() -> None:
    small = estimate(
        "bert-base-uncased",
        task="classification",
        batch_size=8,
        seq_len=128,
        device="cpu",
        gpu_memory="1GiB",
    )
    big = estimate(
        "bert-base-uncased",
        task="classification",
        batch_size=8,
        seq_len=128,
        device="cpu",
        gpu_memory=2**40,
    )
    assert small.budget_bytes == 2**30 and small.fits is False
    assert big.fits is True


def test_activations_grow_with_batch_and_sequence(tiny_bert: str) -> None:
    def above(b: int, s: int) -> int:
        e = estimate(tiny_bert, task="classification", batch_size=b, seq_len=s, device="cpu")
        return e.total_bytes - e.breakdown["parameters"] - e.breakdown["optimizer_state"]

    assert above(4, 64) > above(2, 64) > 0
    assert above(2, 128) > above(2, 64)


def test_gradient_checkpointing_saves_activations(tiny_bert: str) -> None:
    plain = estimate(tiny_bert, task="classification", batch_size=16, seq_len=128, device="cpu")
    ckpt = estimate(
        tiny_bert,
        task="classification",
        batch_size=16,
        seq_len=128,
        device="cpu",
        gradient_checkpointing=True,
    )
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"]


def test_eval_holds_no_gradients_or_optimizer_state(tiny_gpt2: str) -> None:
    est = estimate(tiny_gpt2, task="causal-lm", batch_size=4, seq_len=64, device="cpu", mode="eval")
    assert est.breakdown["gradients"] == 0
    assert est.breakdown["optimizer_state"] == 0
    assert est.peak_phase == "forward"


def test_sgd_has_no_state_and_adafactor_less_than_adamw(tiny_bert: str) -> None:
    kw = dict(task="classification", batch_size=2, seq_len=32, device="cpu")
    sgd = estimate(tiny_bert, optimizer="sgd", **kw)
    ada = estimate(tiny_bert, optimizer="adafactor", **kw)
    adamw = estimate(tiny_bert, optimizer="adamw", **kw)
    assert sgd.breakdown["optimizer_state"] == 0
    assert 0 < ada.breakdown["optimizer_state"] < adamw.breakdown["optimizer_state"]


def test_eight_bit_adamw_state_is_a_quarter(tiny_bert: str) -> None:
    kw = dict(task="classification", batch_size=2, seq_len=32, device="cpu")
    adamw = estimate(tiny_bert, optimizer="adamw", **kw)
    eight = estimate(tiny_bert, optimizer="adamw-8bit", **kw)
    ratio = eight.breakdown["optimizer_state"] / adamw.breakdown["optimizer_state"]
    # 2 bytes per parameter (+ block absmax, small tensors in fp32) instead of 8
    assert 0.25 <= ratio < 0.45


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_accumulated_micro_batches_run_beside_the_gradients(tiny_bert: str, device: str) -> None:
    # a later micro-batch's forward runs while the earlier ones' gradients are alive; its own
    # gradients are added in place, so the peak grows by at most one set of gradients
    kw = dict(task="classification", batch_size=8, seq_len=64, device=device)
    one = estimate(tiny_bert, **kw)
    four = estimate(tiny_bert, gradient_accumulation_steps=4, **kw)
    grads = one.breakdown["parameters"]  # fp32 gradients of every parameter
    assert one.total_bytes < four.total_bytes <= one.total_bytes + grads + 2 * 2**20
    assert four.breakdown["gradients"] >= grads
    assert four.details["gradient_accumulation_steps"] == 4
    # two or eight micro-batches: the same steady state
    assert estimate(tiny_bert, gradient_accumulation_steps=2, **kw).total_bytes == four.total_bytes
    # eval has no gradients to keep
    eval_kw = kw | dict(mode="eval")
    assert (
        estimate(tiny_bert, gradient_accumulation_steps=4, **eval_kw).total_bytes
        == estimate(tiny_bert, **eval_kw).total_bytes
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_size=0), r"--batch-size: must be a whole number ≥ 1, got 0"),
        (dict(gradient_accumulation_steps=0), r"--gradient-accumulation-steps: expected a whole"),
        (dict(seq_len=-3), r"--seq-len: must be a whole number ≥ 1"),
        (dict(seq_len=513), r"--seq-len: 513 is beyond the 512 positions"),
        (dict(precision="fp8"), r"--precision: unknown value 'fp8'"),
        (dict(optimizer="lion"), r"--optimizer: unknown value 'lion'"),
        (dict(task="translation"), r"--task: unknown value 'translation'"),
        (dict(loss="triplet"), r"--loss: 'triplet' is not a loss for --task classification"),
        (dict(gpu_memory="lots"), r"--gpu-memory: cannot read 'lots'"),
        (dict(gpu_memory=0), r"--gpu-memory: must be more than 0 bytes"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs: dict, message: str) -> None:
    args = dict(task="classification", batch_size=2, seq_len=32, device="cpu") | kwargs
    with pytest.raises(UsageError, match=message):
        estimate("bert-base-uncased", **args)


def test_every_problem_reported_at_once() -> None:
    with pytest.raises(UsageError, match=r"--precision.*--batch-size.*unknown model"):
        estimate(
            "no-such-model-xyz", task="classification", batch_size=0, seq_len=8, precision="fp8"
        )


def test_config_json_that_is_not_one(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "bert",\n  "hidden_size": 64,,\n}')
    with pytest.raises(UsageError, match=r"config.json.*line 2"):
        estimate(str(bad), task="classification", batch_size=2, seq_len=8, device="cpu")


def test_the_keywords_are_the_jobs_knobs() -> None:
    """estimate()'s keywords build one Job: a knob None is not given (the step's default), a
    list knob takes "a,b" as memfit train does, and a keyword that is no knob of a step is a
    TypeError naming it."""
    from memfit.estimate.api import step_job, validate

    job = step_job(
        "m", task="classification", batch_size=4, seq_len=32, precision=None,
        lora_rank=8, lora_target_modules="mlp, attention", effective_batch_size=None,
    )  # fmt: skip
    spec, problems = validate(job)
    assert problems == []
    assert (spec.precision, spec.attn_implementation, spec.device) == ("fp32", "sdpa", "cuda")
    assert spec.lora_rank == 8 and spec.lora_targets == ("mlp", "attention")
    args = dict(task="classification", batch_size=2, seq_len=8)
    for name in ("micro_batch_size", "effective_batch_size", "nope"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            estimate("bert-base-uncased", **args, **{name: 2})
