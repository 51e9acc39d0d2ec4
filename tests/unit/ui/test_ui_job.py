"""memfit ui's job (:mod:`memfit.ui.job`): the link carries every job and back, refuses a key or
value that is not one in one line naming it, the knobs come from memfit.job's fields in groups
that cover each once, and the CLI lines are the flags memfit estimate and plan take."""

from __future__ import annotations

import base64
import dataclasses
import random
import zlib
from typing import Any

import pytest

from memfit.errors import UsageError
from memfit.job import STEP_FIELDS, Job
from memfit.ui.job import (
    KNOB_DEFAULTS,
    KNOB_FIELDS,
    KNOB_GROUPS,
    MAX_CONFIG,
    PLAN_FIELDS,
    PageJob,
    command_line,
    decode_config,
    encode_config,
    estimate_argv,
    from_query,
    knob_widget,
    parse_query,
    plan_argv,
    to_query,
)

_FIELDS = {f.name: f for f in dataclasses.fields(Job)}
CONFIG = '{\n  "model_type": "bert",\n  "hidden_size": 64,\n  "note": "ü & = ?"\n}\n'


def _random_value(rng: random.Random, name: str) -> Any:
    widget = knob_widget(name)
    if widget.kind == "choice":
        assert widget.choices is not None
        return rng.choice(widget.choices)
    if widget.kind == "bool":
        return rng.choice((True, False))
    if widget.kind == "int":
        return rng.randint(widget.minimum or 1, 64)
    if widget.kind == "float":
        return rng.choice((0.0, 0.05, 0.1, 0.123456789, 0.5))
    return tuple(rng.sample(["attention", "mlp", "q_proj", "v_proj"], rng.randint(1, 3)))


def _random_job(rng: random.Random) -> PageJob:
    knobs = {n: _random_value(rng, n) for n in rng.sample(KNOB_FIELDS, rng.randint(0, 8))}
    return PageJob(
        model=rng.choice(("bert-base-uncased", "gpt2", "meta-llama/Llama-3.1-8B", "./my model")),
        config_json=rng.choice((None, None, CONFIG)),
        task=rng.choice(("classification", "causal-lm", "sentence-embedding")),
        gpu=rng.choice(("t4", "a100-80gb", None)),
        gpu_memory=rng.choice((None, "16GiB", "12.5GB")),
        batch_size=rng.randint(1, 512),
        seq_len=rng.randint(1, 8192),
        knobs=knobs,
        mode=rng.choice(("train", "eval")),
        safety_margin=rng.choice((0.05, 0.0, 0.1, 0.07)),
        effective_batch_size=rng.choice((None, 32, 256)),
        allow=tuple(rng.sample(["lora", "quantization", "optimizer", "truncation"], 2))
        if rng.random() < 0.5
        else (),
    )


def test_every_job_goes_through_its_link_and_back() -> None:
    rng = random.Random(37)
    for _ in range(400):
        job = _random_job(rng)
        query = to_query(job)
        assert parse_query(query) == job, query
        assert parse_query("?" + query) == job
    # the default job's link names the model, task, card and shape, and nothing else
    assert to_query(PageJob()) == (
        "model=bert-base-uncased&task=classification&gpu=t4&batch-size=8&seq-len=128"
    )


def test_a_link_names_knobs_by_their_flags_and_an_upload_travels_compressed() -> None:
    job = PageJob(knobs={"lora_rank": 16, "quantization": "nf4", "gradient_checkpointing": True})
    query = to_query(job)
    assert "lora-rank=16" in query and "quantization=nf4" in query
    assert "gradient-checkpointing=true" in query
    uploaded = PageJob(config_json=CONFIG)
    query = to_query(uploaded)
    assert "model=" not in query and "config=" in query
    assert decode_config(encode_config(CONFIG)) == CONFIG


def test_knobs_at_their_default_are_not_given() -> None:
    job = PageJob(
        task="causal-lm",
        knobs={
            "precision": "fp32",
            "lora_rank": 0,
            "quantization": "none",
            "loss": "cross-entropy",
        },
    )
    assert job.knobs == {}
    assert to_query(job) == to_query(PageJob(task="causal-lm"))
    with pytest.raises(TypeError, match="model"):
        PageJob(knobs={"model": "gpt2"})  # not a knob of the page


@pytest.mark.parametrize(
    ("query", "line"),
    [
        ("seq-len=abc", "link: seq-len: must be a whole number ≥ 1, got 'abc'"),
        ("batch-size=0", "link: batch-size: must be a whole number ≥ 1, got 0"),
        ("lora-rank=-1", "link: lora-rank: must be a whole number ≥ 0, got -1"),
        ("precision=fp8", "link: precision: unknown value 'fp8'; choose one of fp32, fp16, bf16"),
        ("task=regression", "link: task: unknown value 'regression'; choose one of"),
        ("gradient-checkpointing=maybe", "link: gradient-checkpointing: must be true or false"),
        ("safety-margin=1.5", "link: safety-margin: must be a number in [0, 1), got '1.5'"),
        ("lora-dropout=x", "link: lora-dropout: must be a number in [0, 1), got 'x'"),
        ("allow=teleport", "link: allow: unknown lever 'teleport'; choose from"),
        ("config=!!!", "link: config: not a config.json this page encoded"),
        ("seq_len=128", "link: seq_len: unknown key; the keys are model, config, task"),
        ("colour=red", "link: colour: unknown key"),
        ("seq-len=8&seq-len=16", "link: seq-len: given twice"),
    ],
)
def test_a_bad_link_is_one_line_naming_its_key(query: str, line: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_query(query)
    message = str(caught.value)
    assert message.startswith(line) and "\n" not in message


def test_the_frameworks_own_keys_are_left_alone() -> None:
    assert from_query({"__theme": "dark", "seq-len": "64"}) == PageJob(seq_len=64)


def test_every_knob_is_in_exactly_one_group() -> None:
    grouped = [name for names in KNOB_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(KNOB_FIELDS)
    assert len(grouped) == len(set(grouped))
    assert set(KNOB_FIELDS) == set(STEP_FIELDS) - {"task", "seq_len", "micro_batch_size"}


def test_a_knobs_widget_is_its_fields_metadata() -> None:
    for name in KNOB_FIELDS:
        widget = knob_widget(name)
        metadata = _FIELDS[name].metadata
        assert widget.help == metadata["help"]
        if name != "loss":
            assert widget.choices == metadata["choices"]
        assert widget.minimum == metadata["minimum"]
        assert widget.elem_id == widget.flag.removeprefix("--")
        if widget.kind == "choice":
            assert widget.default is None or widget.default in (widget.choices or ())
    assert knob_widget("micro_batch_size").flag == "--batch-size"
    assert knob_widget("gradient_checkpointing").kind == "bool"
    assert knob_widget("lora_target_modules").kind == "text"


def test_a_knob_at_its_page_default_is_the_step_the_estimate_takes_without_it() -> None:
    # the page leaves a knob at its default out of the job: the step must be the same
    from memfit.estimate.api import step_job, step_spec

    plain = step_spec(step_job("gpt2", batch_size=2, task="causal-lm", seq_len=64))
    for name, default in KNOB_DEFAULTS.items():
        if default is None:
            continue
        given = step_job("gpt2", batch_size=2, task="causal-lm", seq_len=64, **{name: default})
        assert step_spec(given) == plain, name


def test_the_plans_knobs_are_the_flags_memfit_plan_has() -> None:
    from memfit.commands.plan import PLANNED

    assert list(PLAN_FIELDS) == [name for name in KNOB_FIELDS if name not in PLANNED]


def test_the_cli_lines_hold_the_job() -> None:
    job = PageJob(
        model="gpt2",
        task="causal-lm",
        gpu="t4",
        gpu_memory="12GiB",
        batch_size=4,
        seq_len=512,
        knobs={
            "lora_rank": 16,
            "lora_target_modules": "attention,mlp",
            "gradient_checkpointing": True,
            "double_quant": True,
            "quantization": "nf4",
            "precision": "fp16",
            "gradient_accumulation_steps": 8,
        },
        mode="eval",
        safety_margin=0.1,
        allow=("optimizer",),
    )
    assert estimate_argv(job, "gpt2") == [
        *("estimate", "gpt2", "--task", "causal-lm", "--batch-size", "4", "--seq-len", "512"),
        *("--gpu", "t4", "--gpu-memory", "12GiB", "--gradient-accumulation-steps", "8"),
        *("--precision", "fp16", "--gradient-checkpointing", "--lora-rank", "16"),
        *("--lora-target-modules", "attention,mlp", "--quantization", "nf4", "--double-quant"),
        *("--mode", "eval", "--safety-margin", "0.1"),
    ]
    # the plan: the effective batch is the micro-batch's accumulation; it chooses checkpointing,
    # the accumulation and LoRA's targets itself
    assert plan_argv(job, "gpt2") == [
        *("plan", "gpt2", "--task", "causal-lm", "--seq-len", "512"),
        *("--effective-batch-size", "32", "--gpu", "t4", "--gpu-memory", "12GiB"),
        *("--allow", "optimizer", "--precision", "fp16", "--lora-rank", "16"),
        *("--quantization", "nf4", "--double-quant", "--safety-margin", "0.1"),
    ]
    off = PageJob(knobs={"packing": True, "activation_offloading": False})
    assert "--packing" in estimate_argv(off, "m")
    assert command_line(["estimate", "./my model", "--task", "causal-lm"]) == (
        "memfit estimate './my model' --task causal-lm"
    )


def test_a_link_whose_config_unpacks_past_1_mib_is_refused_unpacked_no_further() -> None:
    # 64 KiB of link that unpacks to 64 MiB
    bomb = base64.urlsafe_b64encode(zlib.compress(b" " * (64 * 2**20), 9)).decode("ascii")
    assert len(bomb) < 100_000
    with pytest.raises(UsageError) as caught:
        parse_query("config=" + bomb)
    assert str(caught.value) == "link: config: larger than 1 MiB"
    # 1 MiB itself is taken, a byte more is not
    largest = '{"a": "' + "x" * (MAX_CONFIG - 9) + '"}'
    assert len(largest) == MAX_CONFIG == 2**20
    assert decode_config(encode_config(largest)) == largest
    with pytest.raises(UsageError, match=r"^link: config: larger than 1 MiB$"):
        decode_config(encode_config(largest + " "))
    # a link cut short is still no config
    with pytest.raises(UsageError, match=r"not a config\.json this page encoded"):
        decode_config(encode_config(CONFIG)[:-6])
