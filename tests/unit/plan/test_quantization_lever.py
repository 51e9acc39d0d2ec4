"""The plan's quantization lever (QLoRA) and its paged optimizers: chosen only when allowed and
needed, priced in time and memory, said in words, and runnable as a memfit train command."""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

import pytest

from memfit.cli import main
from memfit.devices.catalog import ASSUMED_GPU, find_gpu
from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.job import Job
from memfit.levers import quantization
from memfit.levers.base import Room
from memfit.plan import PLAN_KEYS, cost, plan
from memfit.plan.configuration import QLORA, TIERS, Candidate, Levers, Plan
from memfit.plan.planner import Space

JOB = {"task": "causal-lm", "seq_len": 64, "effective_batch_size": 4}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama config whose matmul weights outweigh its embeddings (as in a real LLM),
    so that 4-bit base weights save memory."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    config.save_pretrained(folder)
    return str(folder)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _least(model: str, budget: str, allow: list[str]) -> int:
    """The least memory any configuration with these levers needs (the search is skipped)."""
    return plan(model, gpu_memory=budget, allow=allow, **JOB).min_required_bytes


def _between(low: int, high: int) -> int:
    """A budget whose usable part (5 % margin) lies halfway between two peaks."""
    return int((low + high) / 2 / 0.95)


# --- the cost model ----------------------------------------------------------------------------------
def _shape() -> cost.ModelShape:
    return cost.ModelShape(
        matmul_parameters=7_000_000_000,
        trainable_parameters=8_000_000_000,
        layers=32,
        hidden=4096,
        quantizable_parameters=6_900_000_000,
        lora_fixed=0,
        lora_per_rank=850_000,
    )


def _speed(**changes: Any) -> float:
    knobs: dict[str, Any] = dict(
        precision="fp16",
        micro_batch_size=1,
        accumulation_steps=16,
        seq_len=2048,
        gradient_checkpointing=True,
        optimizer="adamw",
        lora=True,
        cached_loss=False,
        lora_rank=8,
    )
    return cost.samples_per_second(_shape(), find_gpu("t4"), **(knobs | changes))


def _dequantization(shape: cost.ModelShape, gpu: str, kind: str, double: bool) -> float:
    values = {"quantization": kind, "double_quant": double}
    return quantization.LEVER.dequantization_seconds(values, shape, find_gpu(gpu))


def test_dequantization_is_charged_per_pass_over_the_weights() -> None:
    t4, shape = find_gpu("t4"), _shape()
    plain, nf4 = _speed(), _speed(values={"quantization": "nf4"})
    double = _speed(values={"quantization": "nf4", "double_quant": True})
    assert nf4 < plain and double < nf4
    one_pass = _dequantization(shape, "t4", "nf4", False)
    assert one_pass == pytest.approx(
        shape.quantizable_parameters
        * quantization.DEQUANT_BYTES_PER_PARAMETER
        / (t4.memory_bandwidth_gbps * 1e9)
    )
    # 16 micro-batches × (forward, backward, recomputed forward): the step's extra seconds
    extra = 16 / nf4 - 16 / plain
    assert extra == pytest.approx(16 * 3 * one_pass)
    # the cost model charges what the lever says a pass costs, through the levers' loop
    assert quantization.LEVER.pass_seconds({"quantization": "nf4"}, shape, t4) == one_pass
    # no dequantization without quantization; a faster memory dequantizes faster
    assert _dequantization(shape, "t4", "none", True) == 0
    assert _dequantization(shape, "a100-80gb", "nf4", False) < one_pass


def test_paged_optimizers_cost_paging_and_adapters_only_under_lora() -> None:
    t4, shape = find_gpu("t4"), _shape()
    for paged, (twin, _state) in cost.PAGED_OPTIMIZERS.items():
        assert cost.is_paged(paged) and not cost.is_paged(twin)
        # resident, the update streams the twin's bytes; paging only adds to it
        assert cost.optimizer_seconds(shape, t4, paged) > cost.optimizer_seconds(shape, t4, twin)
        assert _speed(optimizer=paged, lora=False) < _speed(optimizer=twin, lora=False)
    # the 8-bit state pages a quarter of the 32-bit state's bytes
    paging = {
        name: cost.optimizer_seconds(shape, t4, name) - cost.optimizer_seconds(shape, t4, twin)
        for name, (twin, _state) in cost.PAGED_OPTIMIZERS.items()
    }
    assert paging["paged-adamw-32bit"] == pytest.approx(4 * paging["paged-adamw-8bit"])
    # under LoRA only the adapters are stepped (and paged)
    assert shape.trainable(8) == 8 * shape.lora_per_rank < shape.trainable(None)
    lora = cost.optimizer_seconds(shape, t4, "paged-adamw-8bit", 8)
    assert lora < cost.optimizer_seconds(shape, t4, "paged-adamw-8bit") / 100
    # a newer host link pages faster
    assert cost.host_link_bytes_per_second(find_gpu("h100-80gb")) > cost.host_link_bytes_per_second(
        t4
    )


def test_model_shape_counts_what_bitsandbytes_quantizes_and_the_adapters(tiny_llama: str) -> None:
    from memfit.estimate import workload
    from memfit.models import resolve_model

    config = resolve_model(tiny_llama).config
    spec = workload.StepSpec(task="causal-lm")
    shape = cost.model_shape(config, spec, lora=True)
    # every matmul weight but the untied LM head (512 × 256)
    assert shape.quantizable_parameters == shape.matmul_parameters - 512 * 256
    # rank 8 adapters: what peft trains on a rank-8 model
    import torch

    with torch.device("meta"):
        model = workload.build_model(config, dataclasses.replace(spec, lora_rank=8))
    assert shape.trainable(8) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert cost.model_shape(config, spec).lora_per_rank == 0  # not counted unless asked


# --- the search space and its order --------------------------------------------------------------------
def test_quantization_goes_only_with_a_lora_rank_and_is_the_last_tier() -> None:
    job = Job(model="m", task="causal-lm", seq_len=64, precision="fp16")
    space = Space.of(Room(job=job, allowed=("lora", "quantization")))
    combos = space.combos()
    assert all(k.lora_rank for k in combos if k.quantization != "none")
    assert {(k.lora_rank, k.quantization) for k in combos} == {(0, "none"), (8, "none"), (8, "nf4")}
    assert {(k.quantization, k.values["double_quant"]) for k in space.frugal()} == {
        ("none", False),
        QLORA,
    }
    qlora = Levers.of(_levers("fp16", True, "adamw", 64, 8, *QLORA))
    assert TIERS[qlora.tier("adamw", 64)] == "quantization"
    assert TIERS[dataclasses.replace(qlora, quantization="none").tier("adamw", 64)] == "lora"
    # the job's own rank and quantization are no lever
    assert qlora.tier("adamw", 64, base_rank=8, base_quantization="nf4") == 0


def test_paged_optimizer_is_searched_after_the_plain_swaps_of_its_tier() -> None:
    eight_bit = Levers.of(_levers("fp16", True, "adamw-8bit", 64, 0))
    paged = dataclasses.replace(eight_bit, optimizer="paged-adamw-8bit")
    assert eight_bit.tier("adamw", 64) == paged.tier("adamw", 64) == TIERS.index("optimizer")
    assert not eight_bit.paged_swap("adamw") and paged.paged_swap("adamw")
    # a job that runs a paged optimizer itself: no swap
    assert not paged.paged_swap("paged-adamw-8bit")


# --- the plan's input ----------------------------------------------------------------------------------
def test_quantization_without_lora_is_refused_naming_allow(tiny_llama: str) -> None:
    with pytest.raises(UsageError, match=r"--allow quantization: .*--allow lora,quantization"):
        plan(tiny_llama, gpu_memory="16GiB", allow=["quantization"], **JOB)
    with pytest.raises(UsageError, match="--quantization nf4: only with --lora-rank"):
        plan(tiny_llama, gpu_memory="16GiB", quantization="nf4", **JOB)
    with pytest.raises(UsageError, match="--double-quant: only with --quantization nf4 or fp4"):
        plan(tiny_llama, gpu_memory="16GiB", lora_rank=8, double_quant=True, **JOB)


def test_cli_quantization_without_lora_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_llama: str
) -> None:
    code, out, err = _run(
        capsys, "plan", tiny_llama, "--task", "causal-lm", "--seq-len", "64",
        "--effective-batch-size", "4", "--gpu-memory", "16GiB", "--allow", "quantization",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("memfit: error:") and "--allow" in err and err.count("\n") == 1


# --- the memfit train command --------------------------------------------------------------------------
def _levers(
    precision: str,
    checkpointing: bool,
    optimizer: str,
    max_seq_len: int,
    lora_rank: int,
    kind: str = "none",
    double: bool = False,
) -> dict[str, Any]:
    """A configuration's lever values, as the plan's search merges them."""
    return {
        "precision": precision,
        "gradient_checkpointing": checkpointing,
        "optimizer": optimizer,
        "max_seq_len": max_seq_len,
        "lora_rank": lora_rank,
        "quantization": kind,
        "double_quant": double,
    }


def _plan_with(knobs: Levers, **fields: Any) -> Plan:
    chosen = Candidate(
        knobs=knobs,
        micro_batch_size=2,
        gradient_accumulation_steps=8,
        world_size=1,
        loss="cross-entropy",
        mini_batch_size=None,
        predicted_peak_bytes=12 << 30,
        predicted_samples_per_second=1.0,
    )
    return Plan(
        fits=True,
        budget_bytes=16 << 30,
        predicted_peak_bytes=12 << 30,
        min_required_bytes=10 << 30,
        chosen=chosen,
        alternatives=[],
        explanation=[],
        suggestions=[],
        model="meta-llama/Llama-3.1-8B",
        task="causal-lm",
        seq_len=2048,
        effective_batch_size=16,
        **fields,
    )


def _train_settings(command: str) -> dict[str, Any]:
    """``command``'s flags as memfit train parses and merges them (nothing runs)."""
    import typer

    from memfit.cli import app
    from memfit.commands.train import _settings

    argv = shlex.split(command)
    assert argv[:2] == ["memfit", "train"]
    group = typer.main.get_command(app)
    with group.make_context("memfit", ["train", "--help"], resilient_parsing=True) as ctx:
        train = group.get_command(ctx, "train")
    assert train is not None
    with train.make_context("train", argv[2:]) as parsed:
        params = dict(parsed.params)
    params.pop("config")
    return _settings(None, params)


@pytest.mark.parametrize(
    ("values", "flags"),
    [
        (_levers("fp16", True, "adamw", 2048, 8, "nf4", True), "--quantization nf4 --double-quant"),
        (_levers("bf16", False, "paged-adamw-8bit", 1024, 0), "--optimizer paged-adamw-8bit"),
        (_levers("fp16", True, "adamw", 2048, 16, "fp4", False), "--quantization fp4"),
    ],
)
def test_train_command_parses_as_memfit_train_flags(values: dict[str, Any], flags: str) -> None:
    from memfit.train.config import TrainConfig, config_problems

    knobs = Levers.of(values)
    double = values["double_quant"]
    p = _plan_with(knobs)
    command = p.train_command()
    assert command is not None and flags in command
    assert ("--double-quant" in command) == double
    settings = _train_settings(command)
    s = p.chosen.settings() if p.chosen else {}
    for key in ("micro_batch_size", "precision", "optimizer", "gradient_checkpointing"):
        assert settings[key] == s[key]
    assert settings["max_seq_len"] == knobs.max_seq_len
    assert settings["effective_batch_size"] == 16
    assert settings.get("quantization", "none") == knobs.quantization
    assert bool(settings.get("double_quant")) == double
    assert settings.get("lora_rank") == (knobs.lora_rank or None)
    # the flags make a run config memfit train accepts (its files aside)
    config = TrainConfig(**settings)
    problems = [x for x in config_problems(config) if "TRAIN_FILE" not in x]
    assert problems == []
    # JSON: the new keys beside every plan key, and the command
    d = p.to_dict()
    assert set(PLAN_KEYS) | {"quantization", "double_quant", "lora_rank"} <= set(d["plan"])
    assert d["plan"]["quantization"] == knobs.quantization
    assert d["plan"]["double_quant"] is double
    assert d["train_command"] == command


def test_train_command_names_the_data_and_quotes_paths() -> None:
    p = _plan_with(
        Levers.of(_levers("fp16", True, "adamw", 2048, 8, *QLORA)), train_file="my data.jsonl"
    )
    command = p.train_command()
    assert command is not None and "--train-file 'my data.jsonl'" in command
    assert _train_settings(command)["train_file"] == "my data.jsonl"
    assert _plan_with(Levers.of(_levers("fp16", True, "adamw", 2048, 8))).train_command()
    assert dataclasses.replace(p, chosen=None).train_command() is None


# --- the search's order, on a stated memory model (no tracing) --------------------------------------
MiB = 1 << 20
# what a fake step holds: base weights (plain or 4-bit), full fine-tuning's gradients and
# optimizer state by optimizer (paged state is outside PyTorch's allocator), LoRA's adapters,
# and activations per row (with or without checkpointing)
WEIGHTS = {"none": 100 * MiB, "nf4": 25 * MiB}
STATE = {
    "adamw": 400 * MiB,
    "adamw-8bit": 200 * MiB,
    "adafactor": 250 * MiB,
    "paged-adamw-8bit": 100 * MiB,
    "paged-adamw-32bit": 120 * MiB,
}


@dataclasses.dataclass
class FakeEstimate:
    total_bytes: int
    details: dict[str, Any]
    breakdown: dict[str, int]


def fake_estimate(model: str, **kwargs: Any) -> FakeEstimate:
    state = 2 * MiB if kwargs["lora_rank"] else STATE[kwargs["optimizer"]]
    rows = kwargs["batch_size"] * (10 if kwargs["gradient_checkpointing"] else 40) * MiB
    weights = WEIGHTS[kwargs.get("quantization") or "none"]
    held = weights + state
    breakdown = {"parameters": weights, "buffers": 0}
    return FakeEstimate(held + rows, {"model_state": {"total_bytes": held}}, breakdown)


@pytest.fixture
def stated_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's estimates from :func:`fake_estimate` (and no tracing workers)."""
    import memfit.plan.planner as planner
    import memfit.plan.search as search

    monkeypatch.setattr(search, "estimate", fake_estimate)
    monkeypatch.setattr(planner, "prefetch", lambda model, kwargs: None)


def _usable(mib: int) -> int:
    """The budget whose usable part (5 % margin) is ``mib`` MiB."""
    return -(-mib * MiB * 100 // 95)


@pytest.mark.usefixtures("stated_memory")
def test_quantization_only_when_allowed_and_needed(tiny_llama: str) -> None:
    allow = ["lora", "quantization"]
    # full fine-tuning fits (510 MiB at micro-batch 1): no lever
    p = plan(tiny_llama, gpu_memory=_usable(600), allow=allow, **JOB)
    assert p.plan is not None and p.plan["lora_rank"] is None and p.plan["quantization"] == "none"
    # LoRA fits (112 MiB): quantization, though allowed, is not used
    p = plan(tiny_llama, gpu_memory=_usable(200), allow=allow, **JOB)
    assert p.plan is not None and p.plan["lora_rank"] == 8
    assert (p.plan["quantization"], p.plan["double_quant"]) == ("none", False)
    # only QLoRA fits (37 MiB): chosen where allowed...
    p = plan(tiny_llama, gpu_memory=_usable(80), allow=allow, **JOB)
    assert p.plan is not None and (p.plan["quantization"], p.plan["double_quant"]) == QLORA
    assert p.plan["lora_rank"] == 8 and "--quantization nf4 --double-quant" in p.train_command()
    text = "\n".join(p.explanation)
    assert "nf4 with double quantization (allowed; QLoRA)" in text
    assert "more time per step" in text and "arXiv:2305.14314" in text
    assert "unquantized weights needs 112" in text  # why: LoRA's least is over the budget
    # ...and priced where it is not: nothing fits, the suggestion says what it would need
    p = plan(tiny_llama, gpu_memory=_usable(80), allow=["lora"], **JOB)
    assert not p.fits
    line = next(x for x in p.suggestions if x.startswith("--allow lora,quantization "))
    assert "37" in line and "(fits)" in line
    p = plan(tiny_llama, gpu_memory=_usable(80), **JOB)
    assert any(x.startswith("--allow lora,quantization ") for x in p.suggestions)
    # below QLoRA's least nothing fits at all
    assert not plan(tiny_llama, gpu_memory=_usable(30), allow=allow, **JOB).fits


@pytest.mark.usefixtures("stated_memory")
def test_paged_optimizer_only_where_no_plain_swap_fits(tiny_llama: str) -> None:
    from memfit.estimate import workload
    from memfit.models import resolve_model

    # 8-bit AdamW fits only at micro-batch 1 with checkpointing (310 MiB), a paged AdamW the
    # whole batch at once (140 MiB): faster by the cost model, yet not preferred
    p = plan(tiny_llama, gpu_memory=_usable(315), allow=["optimizer"], **JOB)
    assert p.plan is not None and p.plan["optimizer"] == "adamw-8bit"
    assert p.plan["micro_batch_size"] == 1
    shape = cost.model_shape(resolve_model(tiny_llama).config, workload.StepSpec(task="causal-lm"))
    paged_whole_batch = cost.samples_per_second(
        shape,
        find_gpu(ASSUMED_GPU),  # the GPU a plan with only --gpu-memory ranks on
        precision=p.plan["precision"],
        micro_batch_size=4,
        accumulation_steps=1,
        seq_len=64,
        gradient_checkpointing=True,
        optimizer="paged-adamw-8bit",
        lora=False,
        cached_loss=False,
    )
    assert paged_whole_batch > p.predicted_samples_per_second
    # only a paged one fits (adafactor's least is 260 MiB): it is chosen and said
    p = plan(tiny_llama, gpu_memory=_usable(250), allow=["optimizer"], **JOB)
    assert p.plan is not None and cost.is_paged(p.plan["optimizer"])
    line = next(x for x in p.explanation if x.startswith(f"Optimizer {p.plan['optimizer']}"))
    assert "unified memory" in line and "host link" in line
    assert f"--optimizer {p.plan['optimizer']}" in (p.train_command() or "")


# --- the lever with real estimates --------------------------------------------------------------------
@pytest.mark.slow
def test_qlora_plan_is_what_memfit_estimate_says(
    capsys: pytest.CaptureFixture[str], tiny_llama: str
) -> None:
    job = ["--task", "causal-lm", "--seq-len", "64", "--effective-batch-size", "4"]
    job += ["--precision", "fp32"]  # one precision: half the traces
    lora = plan(tiny_llama, gpu_memory="1MiB", allow=["lora"], precision="fp32", **JOB)
    qlora = plan(
        tiny_llama, gpu_memory="1MiB", allow=["lora", "quantization"], precision="fp32", **JOB
    )
    assert qlora.min_required_bytes < lora.min_required_bytes
    budget = str(_between(qlora.min_required_bytes, lora.min_required_bytes))
    code, out, _ = _run(
        capsys, "plan", tiny_llama, *job, "--gpu-memory", budget, "--allow", "lora", "--json"
    )
    assert code == 3 and any(
        x.startswith("--allow lora,quantization ") and "(fits)" in x
        for x in json.loads(out)["suggestions"]
    )
    code, out, _ = _run(
        capsys, "plan", tiny_llama, *job, "--gpu-memory", budget, "--allow", "lora,quantization",
        "--json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    s = d["plan"]
    assert d["fits"] and (s["quantization"], s["double_quant"]) == QLORA and s["lora_rank"] == 8
    assert set(PLAN_KEYS) <= set(s)
    assert (
        d["predicted_peak_bytes"]
        == estimate(
            tiny_llama,
            task="causal-lm",
            batch_size=s["micro_batch_size"],
            seq_len=64,
            precision=s["precision"],
            optimizer=s["optimizer"],
            gradient_checkpointing=s["gradient_checkpointing"],
            lora_rank=8,
            quantization="nf4",
            double_quant=True,
            gradient_accumulation_steps=s["gradient_accumulation_steps"],
        ).total_bytes
    )
    assert "--quantization nf4 --double-quant" in d["train_command"]
    assert f"Train: {d['train_command']}" in d["explanation"]
    recheck = next(x for x in d["explanation"] if x.startswith("Re-check: "))
    assert "--lora-rank 8 --quantization nf4 --double-quant" in recheck


@pytest.mark.slow
def test_pinned_quantization_is_kept(tiny_llama: str) -> None:
    p = plan(
        tiny_llama, gpu_memory="16GiB", precision="fp32", lora_rank=16, quantization="nf4", **JOB
    )
    assert p.plan is not None
    assert (p.plan["quantization"], p.plan["double_quant"], p.plan["lora_rank"]) == (
        "nf4",
        False,
        16,
    )
    assert any("nf4 (as given; QLoRA)" in line for line in p.explanation)
    command = p.estimate_command()
    assert command is not None and "--lora-rank 16 --quantization nf4" in command
    assert "--double-quant" not in command
    assert "--lora-rank 16 --quantization nf4" in p.plan_command(2, "none")


# --- memfit doctor ---------------------------------------------------------------------------------
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    "capacity of 14.56 GiB of which 8.00 MiB is free. Including non-PyTorch memory, this process "
    "has 14.55 GiB memory in use. Of the allocated memory 14.20 GiB is allocated by PyTorch, and "
    "40.00 MiB is reserved by PyTorch but unallocated."
)


@pytest.mark.slow
def test_doctor_offers_qlora_the_planner_accepts(
    capsys: pytest.CaptureFixture[str], tiny_llama: str
) -> None:
    job = ["--model", tiny_llama, "--task", "causal-lm", "--batch-size", "4", "--seq-len", "64"]
    code, out, _ = _run(capsys, "doctor", "--message", CUDA_OOM, *job, "--lora-rank", "8", "--json")
    assert code == 0
    d = json.loads(out)
    fix = next(f for f in d["fixes"] if f["lever"] == "quantization")
    base = estimate(tiny_llama, task="causal-lm", batch_size=4, seq_len=64, lora_rank=8)
    qlora = estimate(
        tiny_llama,
        task="causal-lm",
        batch_size=4,
        seq_len=64,
        lora_rank=8,
        quantization=QLORA[0],
        double_quant=QLORA[1],
    )
    assert fix["saves_bytes"] == base.total_bytes - qlora.total_bytes > 0
    assert "--quantization nf4 --double-quant" in fix["change"] and "dequantizes" in fix["cost"]
    levers = [f["lever"] for f in d["fixes"]]
    assert levers.index("quantization") == len(levers) - 2  # the most harmful cure, then the plan
    # the planner takes the fix as it is written: the job pinned so, and the lever it names
    fp32 = {"gpu_memory": "16GiB", "precision": "fp32", "lora_rank": 8}  # one precision: faster
    pinned = plan(tiny_llama, quantization="nf4", double_quant=True, **fp32, **JOB)
    assert pinned.plan is not None and pinned.plan["quantization"] == "nf4"
    assert "--allow quantization" in fix["change"]
    assert plan(tiny_llama, allow=["quantization"], **fp32, **JOB).fits
    # a job already quantized is not offered it again, and its record says how it ran
    code, out, _ = _run(
        capsys, "doctor", "--message", CUDA_OOM, *job, "--lora-rank", "8",
        "--quantization", "nf4", "--double-quant", "--json",
    )  # fmt: skip
    d = json.loads(out)
    assert code == 0 and "quantization" not in [f["lever"] for f in d["fixes"]]
    assert (d["knobs"]["quantization"], d["knobs"]["double_quant"]) == QLORA
    assert "--lora-rank 8 --quantization nf4 --double-quant" in d["fixes"][-1]["change"]


def test_apply_plan_says_quantization_is_not_a_training_argument() -> None:
    from memfit.integrations.plan import apply_plan

    # refused before the arguments or the model are read
    with pytest.raises(UsageError, match=r"BitsAndBytesConfig.*--allow lora,quantization"):
        apply_plan(None, "unused", seq_len=64, allow=["lora", "quantization"])


def test_train_command_reads_the_data_as_the_plan_did() -> None:
    from memfit.commands.plan import _data_flags

    instructions = {"prompt_column": "q", "completion_column": "a b", "messages_column": None}
    flags = _data_flags("text", instructions)
    assert flags == "--prompt-column q --completion-column 'a b'"
    assert _data_flags("body", dict.fromkeys(instructions)) == "--text-column body"
    assert _data_flags("text", dict.fromkeys(instructions)) == ""
    p = _plan_with(Levers.of(_levers("fp16", True, "adamw", 2048, 8)), train_file="d.jsonl")
    command = dataclasses.replace(p, data_flags=flags).train_command()
    assert command is not None
    settings = _train_settings(command)
    assert (settings["prompt_column"], settings["completion_column"]) == ("q", "a b")
