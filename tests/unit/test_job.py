"""The job's vocabulary and checks (memfit.job), and that the other layers take theirs from it."""

from __future__ import annotations

import dataclasses

import pytest

from memfit import job
from memfit.job import Job


def test_every_problem_at_once_each_naming_its_flag() -> None:
    bad = Job(
        model="m",
        task="translation",
        micro_batch_size=0,
        seq_len=-3,
        precision="fp8",
        optimizer="lion",
        sharding="zero4",
        lora_rank=-1,
        attn_implementation="flash",
        quantization="nf2",
    )
    problems = bad.problems(flags={"micro_batch_size": "--batch-size"})
    assert problems == [
        "--task: unknown value 'translation'; choose one of classification, causal-lm, "
        "sentence-embedding",
        "--sharding: unknown value 'zero4'; choose one of none, zero1, zero2, zero3, fsdp",
        "--precision: unknown value 'fp8'; choose one of fp32, fp16, bf16",
        "--optimizer: unknown value 'lion'; choose one of adamw, adamw-8bit, paged-adamw-8bit, "
        "paged-adamw-32bit, adafactor, sgd",
        "--attn-implementation: unknown value 'flash'; choose one of sdpa, eager, "
        "flash_attention_2",
        "--quantization: unknown value 'nf2'; choose one of none, nf4, fp4, int8",
        "--seq-len: must be a whole number ≥ 1, got -3",
        "--batch-size: must be a whole number ≥ 1, got 0",
        "--lora-rank: must be a whole number ≥ 0, got -1",
    ]


def test_a_good_job_has_no_problem_and_none_means_not_given() -> None:
    assert Job(model="m", task="classification").problems() == []
    assert Job(model="m", task="causal-lm", micro_batch_size=4, seq_len=128).problems() == []
    required = ("micro_batch_size",)
    assert Job(model="m", task="classification").problems(required=required) == [
        "--micro-batch-size: must be a whole number ≥ 1, got None"
    ]


def test_typed_values_name_only_the_bound_of_a_count() -> None:
    bad = Job(model="m", task="classification", effective_batch_size=-4, lora_rank=-1)
    assert bad.problems(typed=True) == [
        "--effective-batch-size: must be ≥ 1, got -4",
        "--lora-rank: must be a whole number ≥ 0, got -1",
    ]
    assert Job(model="m", task="classification", seq_len=True).problems(typed=True) == [
        "--seq-len: must be a whole number ≥ 1, got True"
    ]


@pytest.mark.parametrize(
    ("knobs", "problem"),
    [
        ({"task": "classification", "loss": "triplet"}, "--loss: 'triplet' is not a loss"),
        ({"task": "classification", "mini_batch_size": 8}, "--mini-batch-size: only the cached"),
        (
            {"task": "sentence-embedding", "loss": "mnrl", "mini_batch_size": 8},
            "--mini-batch-size: only the cached",
        ),
        ({"task": "classification", "lora_target_modules": ["q"]}, "only with --lora-rank"),
        (
            {"task": "classification", "effective_batch_size": 6, "world_size": 4},
            "--effective-batch-size: 6 does not split evenly over --world-size 4",
        ),
        # pure 16-bit training without loss scaling: pure fp16, bf16 weights under fp16 autocast
        ({"task": "causal-lm", "weights_dtype": "fp16"}, "--weights-dtype fp16: pure fp16"),
        (
            {"task": "classification", "weights_dtype": "bf16", "precision": "fp16"},
            "--weights-dtype bf16 with --precision fp16:",
        ),
    ],
)
def test_the_checks_between_knobs(knobs: dict[str, object], problem: str) -> None:
    problems = Job(model="m", **knobs).problems()  # type: ignore[arg-type]
    assert len(problems) == 1 and problem in problems[0], problems


def test_the_cached_loss_and_an_undecided_embedding_loss_take_a_mini_batch() -> None:
    cached = Job(model="m", task="sentence-embedding", loss="cached-mnrl", mini_batch_size=8)
    assert cached.problems() == [] and cached.resolved_loss == "cached-mnrl"
    # memfit train with no --loss: the plan may still choose the cached loss
    assert Job(model="m", task="sentence-embedding", mini_batch_size=8).problems() == []
    assert Job(model="m", task="sentence-embedding", loss="CachedMNRL").resolved_loss == (
        "cached-mnrl"
    )


def test_every_field_is_a_documented_flag() -> None:
    for f in dataclasses.fields(Job):
        assert f.metadata.get("help"), f.name
        assert job.flag_of(f).startswith("--") and " " not in job.flag_of(f)
    assert tuple(f.name for f in dataclasses.fields(Job)) == job.JOB_FIELDS


def test_the_optimizer_table_is_the_vocabulary() -> None:
    assert job.OPTIMIZERS == (
        "adamw",
        "adamw-8bit",
        "paged-adamw-8bit",
        "paged-adamw-32bit",
        "adafactor",
        "sgd",
    )
    assert job.SWAP_OPTIMIZERS == (
        "adamw-8bit",
        "paged-adamw-8bit",
        "paged-adamw-32bit",
        "adafactor",
    )
    names = [n for o in job.OPTIMIZER_TABLE.values() for n in o.hf_names]
    assert len(names) == len(set(names)), "an HF optim value names two optimizers"


def test_round_seq_len_and_positions() -> None:
    assert [job.round_seq_len(n) for n in (1, 8, 9, 127, 128)] == [8, 8, 16, 128, 128]
    assert job.positions_problem("--seq-len", 512, 512, "bert") is None
    assert job.positions_problem("--seq-len", 513, 512, "bert") == (
        "--seq-len: 513 is beyond the 512 positions bert can use; use --seq-len 512 or less"
    )


def test_config_files_accept_every_knob_with_its_type() -> None:
    from memfit import config

    assert set(job.JOB_FIELDS) <= set(config.KNOWN_KEYS)
    assert {"micro_batch_size", "lora_rank", "world_size"} <= config._INT_KEYS
    assert "gradient_checkpointing" in config._BOOL_KEYS
    assert "lora_target_modules" in config._TEXT_OR_LIST_KEYS


def test_quantized_base_weights_only_under_lora() -> None:
    qlora = Job(model="m", task="causal-lm", lora_rank=8, quantization="nf4", double_quant=True)
    assert qlora.problems() == []
    assert Job(model="m", task="causal-lm", quantization="none").problems() == []
    assert Job(model="m", task="causal-lm", quantization="int8").problems() == [
        "--quantization int8: only with --lora-rank R (QLoRA: quantized base weights are frozen; "
        "only LoRA adapters train on them)"
    ]
    assert Job(
        model="m", task="causal-lm", lora_rank=8, quantization="int8", double_quant=True
    ).problems() == ["--double-quant: only with --quantization nf4 or fp4 (4-bit weights)"]
