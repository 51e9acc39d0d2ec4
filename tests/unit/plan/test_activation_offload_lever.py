"""The activation offloading lever (:mod:`memfit.levers.activation_offloading`): what a plan tries,
its cost in time (the host link's copies the compute does not hide), the doctor's fix, the
estimate's line, and its TRL setting (apply_plan plans it only for arguments that have it)."""

from __future__ import annotations

from typing import Any

import pytest

from memfit.devices.catalog import find_gpu
from memfit.job import Job
from memfit.levers import BY_NAME
from memfit.levers.activation_offloading import LEVER, mode_problem, saved_bytes
from memfit.levers.base import Room
from memfit.levers.cure import Patient
from memfit.plan.cost import ModelShape

# Llama-3.1-8B's shape, roughly: 32 layers of 4096
SHAPE = ModelShape(
    matmul_parameters=7_500_000_000,
    trainable_parameters=8_000_000_000,
    layers=32,
    hidden=4096,
    vocab=128_256,
)


def _job(**knobs: Any) -> Job:
    return Job(model="m", task="causal-lm", **knobs)


def test_registered_by_name_with_its_flag() -> None:
    assert BY_NAME["activation-offloading"] is LEVER
    assert LEVER.tier == 0 and not LEVER.allow
    assert LEVER.flags({"activation_offloading": True}) == ["--activation-offloading"]
    assert LEVER.flags({"activation_offloading": False}) == ["--no-activation-offloading"]


def test_a_plan_tries_off_and_on_on_a_gpu_and_keeps_the_jobs_own() -> None:
    assert LEVER.plan_options(Room(job=_job(device="cuda"))) == (
        {"activation_offloading": False},
        {"activation_offloading": True},
    )
    # host and device memory are one on the CPU
    assert LEVER.plan_options(Room(job=_job(device="cpu"))) == ({"activation_offloading": False},)
    pinned = Room(job=_job(device="cuda", activation_offloading=False))
    assert LEVER.plan_options(pinned) == ({"activation_offloading": False},)
    frugal = LEVER.frugal(LEVER.plan_options(Room(job=_job(device="cuda"))))
    assert frugal is not None and frugal[0] == {"activation_offloading": True}
    assert LEVER.as_given({"activation_offloading": False}) == {"activation_offloading": None}


def test_the_copies_cost_time_only_where_the_compute_does_not_hide_them() -> None:
    gpu = find_gpu("h100")
    on = {"activation_offloading": True, "precision": "bf16", "gradient_checkpointing": True}
    assert LEVER.micro_seconds({**on, "activation_offloading": False}, SHAPE, gpu, 8192) == 0.0
    # with checkpointing each layer's input: 32 × 8192 × 4096 × 2 bytes = 2 GiB each way, well
    # under the time the 8B model's passes take
    assert saved_bytes(on, SHAPE, 8192) == 32 * 8192 * 4096 * 2
    assert LEVER.micro_seconds(on, SHAPE, gpu, 8192) == 0.0
    # without checkpointing ~17 times as much crosses the link: more than the forward hides
    off_checkpointing = {**on, "gradient_checkpointing": False}
    assert saved_bytes(off_checkpointing, SHAPE, 8192) == 17 * saved_bytes(on, SHAPE, 8192)
    slow = LEVER.micro_seconds(off_checkpointing, SHAPE, gpu, 8192)
    link = gpu.host_link_gbps * 1e9
    assert 0 < slow < 2 * saved_bytes(off_checkpointing, SHAPE, 8192) / link
    assert LEVER.time_words(on) and LEVER.time_words({}) is None


def test_the_host_link_is_the_gpus_and_none_known_charges_nothing() -> None:
    import dataclasses

    from memfit.devices.catalog import DEFAULT_HOST_LINK_GBPS

    gpu = find_gpu("h100")
    off_checkpointing = {"activation_offloading": True, "precision": "bf16"}
    slow = LEVER.micro_seconds(off_checkpointing, SHAPE, gpu, 8192)
    # a slower link costs more: the GPU's own figure is the one used
    slower = dataclasses.replace(gpu, host_link_gbps=gpu.host_link_gbps / 2)
    assert LEVER.micro_seconds(off_checkpointing, SHAPE, slower, 8192) > slow
    # a card the catalog builds without a link figure gets the catalog's one default
    assert dataclasses.replace(gpu, host_link_gbps=0).host_link_gbps == DEFAULT_HOST_LINK_GBPS

    class NoLink:
        def flops_per_second(self, precision: str) -> float:
            return gpu.flops_per_second(precision)

    assert LEVER.micro_seconds(off_checkpointing, SHAPE, NoLink(), 8192) == 0.0


def test_the_fused_losss_saved_gradients_cross_the_link_too() -> None:
    """Liger's fused loss runs inside the model's forward with the head's weight, not through
    the head module: TRL offloads the gradients it saves (the hidden states', tokens x hidden,
    and the head weight's, vocab x hidden in the trained dtype) and brings them back."""
    gpu = find_gpu("h100")
    on = {"activation_offloading": True, "precision": "bf16", "gradient_checkpointing": True}
    fused = {**on, "cross_entropy": "fused-linear"}
    tokens = 8192
    head = SHAPE.vocab * SHAPE.hidden * 4  # fp32 master weights: an fp32 gradient
    assert saved_bytes(fused, SHAPE, tokens) == saved_bytes(on, SHAPE, tokens) + (
        tokens * SHAPE.hidden * 2 + head
    )
    # pure 16-bit training: a 16-bit head gradient; LoRA: the head is frozen, no gradient
    pure = {**fused, "weights_dtype": "bf16"}
    assert saved_bytes(pure, SHAPE, tokens) == saved_bytes(fused, SHAPE, tokens) - head // 2
    lora = {**fused, "lora_rank": 16}
    assert saved_bytes(lora, SHAPE, tokens) == saved_bytes(on, SHAPE, tokens) + (
        tokens * SHAPE.hidden * 2
    )
    # at few tokens the head's gradient is most of what crosses: more than the compute hides
    assert LEVER.micro_seconds(on, SHAPE, gpu, 256) == 0.0
    assert LEVER.micro_seconds(fused, SHAPE, gpu, 256) > 0.0


def test_an_evaluation_refuses_it() -> None:
    said = mode_problem({"activation_offloading": True}, "eval")
    assert said is not None and "--activation-offloading" in said and "\n" not in said
    assert mode_problem({"activation_offloading": True}, "train") is None
    assert mode_problem({"activation_offloading": False}, "eval") is None


def test_the_doctor_proposes_it_on_a_gpu_only() -> None:
    notes: list[str] = []
    fix = LEVER.cure(Patient(job=_job(device="cuda"), price=lambda s: 123, notes=notes))
    assert fix is not None and fix.settings == {"activation_offloading": True}
    assert "--activation-offloading" in fix.change and fix.saves_bytes == 123
    already = Patient(job=_job(activation_offloading=True), price=lambda s: 1, notes=[])
    assert LEVER.cure(already) is None
    assert LEVER.cure(Patient(job=_job(), price=lambda s: 1, notes=notes, on_cpu=True)) is None
    assert any("activation offloading" in note for note in notes)


def test_the_estimate_line_and_the_trl_setting() -> None:
    details = {
        "host": {
            "total_bytes": 2**30,
            "parts": {"activations": 2**30},
            "activation_offloading": "trl",
        }
    }
    (line,) = LEVER.estimate_lines(details)
    assert "1.00 GiB" in line and "TRL" in line
    assert LEVER.estimate_lines({}) == []
    assert LEVER.trainer_args({"activation_offloading": True}) == {"activation_offloading": True}
    assert LEVER.trainer_args({"activation_offloading": False}) == {}
    assert not LEVER.in_training_arguments
    assert LEVER.argument_fields == ("activation_offloading",)


def test_apply_plan_plans_it_only_for_arguments_that_have_it(tmp_path: Any) -> None:
    pytest.importorskip("trl")
    from transformers import TrainingArguments
    from trl import SFTConfig

    from memfit.integrations.plan import _own_offloading

    def names(args: Any) -> set[str]:
        import dataclasses

        return {f.name for f in dataclasses.fields(args)}

    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert _own_offloading(plain, names(plain)) is False
    sft = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert _own_offloading(sft, names(sft)) is None  # the plan may choose it
    on = SFTConfig(output_dir=str(tmp_path), use_cpu=True, activation_offloading=True)
    assert _own_offloading(on, names(on)) is True
