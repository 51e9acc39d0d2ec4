"""The planner names no lever's fields: the pins it keeps, the values a configuration carries, what
a lever adds to the cost model and what it says in the explanation all come from the levers
(:data:`memfit.levers.LEVERS`). None of these tests traces a model."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from memfit.commands.plan import PLANNED
from memfit.devices.catalog import find_gpu
from memfit.job import Job
from memfit.levers import BY_NAME, LEVERS, quantization
from memfit.levers.base import Chosen
from memfit.plan import PLAN_KEYS, cost
from memfit.plan.configuration import Candidate, Levers
from memfit.plan.planner import PINS, _pinned, plan, plan_problems

JOB: dict[str, Any] = {"task": "causal-lm", "seq_len": 64, "effective_batch_size": 4}
QLORA_VALUES = {
    "precision": "fp16",
    "gradient_checkpointing": True,
    "optimizer": "adamw",
    "max_seq_len": 64,
    "lora_rank": 8,
    "quantization": "nf4",
    "double_quant": True,
}


def test_the_pins_are_the_levers_and_the_keywords_of_plan() -> None:
    assert tuple(name for lever in LEVERS for name in lever.pins) == PINS
    assert set(PINS) == {
        "lora_rank",
        "lora_dropout",
        "quantization",
        "double_quant",
        "weights_dtype",
        "cross_entropy",
        "activation_offloading",
        "optimizer_offload",
        "packing",
        "packing_strategy",
    }
    # memfit doctor reads which of the job's fields plan_problems takes from its signature
    for function in (plan, plan_problems):
        parameters = inspect.signature(function).parameters
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in PINS)
        assert all(parameters[name].default is None for name in PINS)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@pytest.mark.parametrize("name", ["foo", "lora_target_modules", "max_seq_len"])
def test_a_keyword_that_is_no_pin_is_a_type_error(name: str) -> None:
    # as a function's unknown keyword: before the model is read or anything is traced
    with pytest.raises(TypeError, match=rf"^plan\(\) got an unexpected keyword argument '{name}'$"):
        plan("no-such-model", gpu_memory="1GiB", **JOB, **{name: None})
    with pytest.raises(TypeError, match=r"^plan_problems\(\) got an unexpected keyword"):
        plan_problems("no-such-model", **JOB, **{name: 1})


def test_pins_reach_the_job_checks() -> None:
    problems = plan_problems("gpt2", **JOB, lora_rank=8, double_quant=True)
    assert any(
        p.startswith("--double-quant: only with --quantization nf4 or fp4") for p in problems
    )
    assert plan_problems("gpt2", **JOB, lora_rank=8, quantization="nf4", double_quant=True) == []


def test_the_plan_keeps_the_pins_as_the_commands_give_them() -> None:
    plain = Job(model="m", task="causal-lm", lora_rank=0, quantization="none", double_quant=False)
    assert _pinned(plain) == dict.fromkeys(PINS)
    qlora = Job(model="m", task="causal-lm", lora_rank=8, quantization="nf4", double_quant=True)
    assert _pinned(qlora) == {
        "lora_rank": 8,
        "lora_dropout": None,
        "quantization": "nf4",
        "double_quant": True,
        "weights_dtype": None,
        "cross_entropy": None,
        "activation_offloading": None,
        "optimizer_offload": None,
        "packing": None,
        "packing_strategy": None,
    }
    # the checkpoint's dtype and the standard loss are what no flag says; others are kept
    auto = Job(model="m", task="causal-lm", weights_dtype="auto", cross_entropy="standard")
    assert _pinned(auto) == dict.fromkeys(PINS)
    pure = Job(model="m", task="causal-lm", weights_dtype="bf16", cross_entropy="fused-linear")
    assert _pinned(pure)["weights_dtype"] == "bf16"
    assert _pinned(pure)["cross_entropy"] == "fused-linear"


def test_a_configuration_carries_every_lever_value_in_the_json_order() -> None:
    knobs = Levers.of(QLORA_VALUES)
    assert dict(knobs.values) == QLORA_VALUES and list(knobs.values) == list(QLORA_VALUES)
    assert knobs == Levers.of(dict(QLORA_VALUES))  # hashable and equal: the estimates' key
    assert knobs.others == (("double_quant", True),)
    # what the plan leaves off is not given to estimate: plain weights, double or not
    plain = Levers.of({**QLORA_VALUES, "quantization": "none", "double_quant": False})
    given = plain.job_values(seq_len=64)
    assert (given["quantization"], given["double_quant"], given["max_seq_len"]) == (None,) * 3
    assert knobs.job_values(seq_len=128)["double_quant"] is True
    settings = Candidate(knobs, 2, 2, 1, "cross-entropy", None, 1, 1.0).settings()
    # memfit plan --json's plan keys, in the order they always had
    assert list(settings) == [*PLAN_KEYS, "lora_rank", "quantization", "double_quant"]


def test_the_cost_model_adds_what_each_lever_charges_per_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape = cost.ModelShape(10**9, 10**9, 16, 2048, 9 * 10**8, 0, 10**5)
    t4 = find_gpu("t4")
    fixed: dict[str, Any] = dict(
        precision="fp16",
        micro_batch_size=1,
        accumulation_steps=4,
        seq_len=512,
        gradient_checkpointing=False,
        optimizer="adamw",
        lora=True,
        cached_loss=False,
        lora_rank=8,
    )
    plain = cost.samples_per_second(shape, t4, **fixed)
    nf4 = cost.samples_per_second(shape, t4, **fixed, values=QLORA_VALUES)
    per_pass = quantization.LEVER.dequantization_seconds(QLORA_VALUES, shape, t4)
    # 4 micro-batches × (forward, backward): the step's extra seconds
    assert 4 / nf4 - 4 / plain == pytest.approx(4 * 2 * per_pass)
    # any lever's charge counts: the cost model names none of them
    monkeypatch.setattr(BY_NAME["checkpointing"], "pass_seconds", lambda values, shape, gpu: 0.5)
    charged = cost.samples_per_second(shape, t4, **fixed, values=QLORA_VALUES)
    assert 4 / charged - 4 / nf4 == pytest.approx(4 * 2 * 0.5)


def _chosen(values: dict[str, Any], base: dict[str, Any]) -> Chosen:
    plain = {**values, "quantization": "none", "double_quant": False}
    return Chosen(
        values=values,
        base=base,
        micro=2,
        peak_bytes=3 << 30,
        usable=4 << 30,
        samples_per_step=16,
        shape=cost.ModelShape(10**9, 10**9, 16, 2048, 9 * 10**8, 0, 10**5),
        gpu=find_gpu("t4"),
        peak=lambda v: (6 << 30) if v == plain else (3 << 30),
        speed=lambda v: 1.0 if v == plain else 0.8,
        least=[(plain, 5 << 30), (values, 3 << 30)],
    )


def test_the_quantization_lever_explains_itself() -> None:
    lever = quantization.LEVER
    base = {"quantization": "none", "double_quant": False}
    lines = lever.plan_lines(_chosen(QLORA_VALUES, base))
    assert lines[0].startswith("Quantized base weights, nf4 with double quantization (allowed; ")
    assert "0.90 B frozen matmul weights in 4 bits" in lines[0]
    assert "unquantized weights would need 6.00 GiB" in lines[0]
    assert "about 25% more time per step (20.0 s per optimizer step" in lines[1]
    assert "cost model: 9 + 1.5 bytes per weight" in lines[1]
    assert lines[3].endswith(
        "unquantized weights needs 5.00 GiB of 4.00 GiB, the budget less the safety margin)."
    )
    # as given: no line on why the plan needed it
    pinned = lever.plan_lines(_chosen(QLORA_VALUES, dict(QLORA_VALUES)))
    assert len(pinned) == 3 and "(as given; QLoRA)" in pinned[0]
    assert lever.plan_lines(_chosen({**QLORA_VALUES, "quantization": "none"}, base)) == []
    assert lever.time_words(QLORA_VALUES) == "dequantizing the base weights on every pass"
    assert lever.time_words(base) is None


def test_every_knob_flag_of_memfit_plan_is_a_keyword_plan_takes() -> None:
    """memfit plan hands every knob flag it shows to :func:`memfit.plan.plan`: a lever field that
    is neither planned nor a pin (nor one of plan's own parameters) would be a TypeError
    traceback for a user who gives its flag (a new lever must declare its ``pins``)."""
    takes = set(inspect.signature(plan).parameters) | set(PINS)
    shown = {f.name for f in dataclasses.fields(Job)} - {"model", *PLANNED}
    assert shown - takes == set()
