"""The command line: JSON contracts, exit codes, one-line errors, the written run config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.config import load_config


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_estimate_json_with_plan_knobs(capsys: pytest.CaptureFixture[str], tiny_bert: str) -> None:
    code, out, _ = run(
        capsys,
        "estimate", tiny_bert, "--task", "sentence-embedding", "--batch-size", "32",
        "--seq-len", "64", "--loss", "cached-mnrl", "--mini-batch-size", "8",
        "--lora-rank", "4", "--max-seq-len", "48", "--world-size", "2", "--gpu", "a10g", "--json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert sum(d["breakdown"].values()) == d["total_bytes"]
    assert d["budget_bytes"] == 23_687_987_200 or d["budget_bytes"] > 20 << 30
    assert d["details"]["mini_batch_size"] == 8 and d["details"]["lora_rank"] == 4
    assert d["details"]["effective_seq_len"] == 48 and d["details"]["world_size"] == 2


def test_estimate_sharded_json(capsys: pytest.CaptureFixture[str], tiny_bert: str) -> None:
    code, out, _ = run(
        capsys,
        "estimate", tiny_bert, "--task", "classification", "--batch-size", "4", "--seq-len", "64",
        "--precision", "bf16", "--world-size", "4", "--sharding", "zero3", "--json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert sum(d["breakdown"].values()) == d["total_bytes"]
    details = d["details"]
    assert details["sharding"] == "zero3" and details["world_size"] == 4
    state = details["model_state"]
    P = details["num_parameters"]
    assert state["paper_formula_bytes"] == 16 * P // 4
    assert state["deepspeed_formula_bytes"] > 0 and details["deepspeed"]["zero_optimization"]


@pytest.mark.parametrize("verb", ["estimate", "plan"])
def test_unknown_sharding_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, verb: str
) -> None:
    base = [verb, tiny_bert, "--task", "classification", "--seq-len", "64"]
    if verb == "estimate":
        base += ["--batch-size", "2"]
    else:
        base += ["--effective-batch-size", "8", "--gpu-memory", "16GiB"]
    code, out, err = run(capsys, *base, "--world-size", "2", "--sharding", "zero4")
    assert code == 2 and out == ""
    assert err.startswith("memfit: error:") and "--sharding" in err and err.count("\n") == 1


def test_sharded_plan_writes_its_scheme(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    code, out, _ = run(
        capsys,
        "plan", tiny_bert, "--task", "classification", "--seq-len", "64",
        "--effective-batch-size", "32", "--gpu", "a10g", "--world-size", "2", "--sharding",
        "fsdp", "--json", "--write-config", str(config),
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert d["plan"]["sharding"] == "fsdp" and d["plan"]["world_size"] == 2
    loaded = load_config(config)
    assert loaded["sharding"] == "fsdp" and loaded["world_size"] == 2
    assert any("--sharding fsdp" in line for line in d["explanation"] if "Re-check" in line)


@pytest.mark.slow
def test_plan_json_and_config_round_trip(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    code, out, _ = run(
        capsys,
        "plan", tiny_bert, "--task", "classification", "--seq-len", "64",
        "--effective-batch-size", "32", "--gpu", "t4", "--json", "--write-config", str(config),
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert d["fits"] and d["plan"]["precision"] == "fp16"  # a T4 has no bf16
    loaded = load_config(config)
    assert loaded["model"] == tiny_bert and loaded["task"] == "classification"
    for key, value in d["plan"].items():
        if value is not None:
            assert loaded[key] == value


# a causal LM's plan tries both losses (cross-entropy lever): over 10 s here
@pytest.mark.slow
def test_plan_nothing_fits_exits_3_with_json(
    capsys: pytest.CaptureFixture[str], tiny_gpt2: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    code, out, err = run(
        capsys,
        "plan", tiny_gpt2, "--task", "causal-lm", "--seq-len", "64", "--effective-batch-size",
        "8", "--gpu-memory", "100MB", "--json", "--write-config", str(config),
    )  # fmt: skip
    assert code == 3
    d = json.loads(out)
    assert d["fits"] is False and d["plan"] is None and d["suggestions"]
    assert not config.exists()  # nothing half-written
    assert "not written" in err
    # scale-out priced per GPU for 2, 4 and 8 GPUs and each scheme (a CUDA context each: none fits)
    rows = d["scale_out"]
    assert {(r["world_size"], r["sharding"]) for r in rows} >= {(8, "fsdp"), (2, "zero2")}
    assert all(r["predicted_peak_bytes"] > 100e6 and r["fits"] is False for r in rows)
    assert any(line.startswith("On 8 GPUs") for line in d["suggestions"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--gpu-memory", "-1GiB"], "--gpu-memory"),
        (["--gpu-memory", "16GiB", "--allow", "teleport"], "--allow"),
        (["--gpu", "potato"], "--gpu"),
        (["--gpu-memory", "16GiB", "--effective-batch-size", "0"], "--effective-batch-size"),
        (["--gpu-memory", "16GiB", "--train-file", "x.csv"], "--tokenizer"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, argv: list[str], flag: str
) -> None:
    base = ["plan", tiny_bert, "--task", "classification", "--seq-len", "64"]
    if "--effective-batch-size" not in argv:
        base += ["--effective-batch-size", "8"]
    code, out, err = run(capsys, *base, *argv)
    assert code == 2 and out == ""
    assert err.startswith("memfit: error:") and flag in err and err.count("\n") == 1


# plans with nothing fitting and with truncation: over 10 s here
@pytest.mark.slow
def test_plan_truncation_reports_tokens_lost(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, tmp_path: Path
) -> None:
    from memfit.plan import DataProfile
    from memfit.plan.planner import plan

    profile = DataProfile(tuple([20] * 90 + [120] * 10))
    assert profile.tokens_lost(64, 128) == pytest.approx(10 * 56 / (90 * 20 + 10 * 120))
    job = {"task": "classification", "seq_len": 128, "effective_batch_size": 16}
    without = plan(tiny_bert, gpu_memory="64MiB", **job).min_required_bytes
    p = plan(
        tiny_bert,
        gpu_memory=int(without * 0.999 / 0.95),
        allow=["truncation"],
        data_profile=profile,
        **job,
    )
    if p.fits and p.plan["max_seq_len"] < 128:
        assert any("cuts" in line and "%" in line for line in p.explanation)


def test_gpus_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0
    ids = {g["id"] for g in json.loads(out)}
    for required in ("t4", "v100-16gb", "v100-32gb", "a10g", "l4", "a100-40gb", "a100-80gb",
                     "h100-80gb", "rtx3090", "rtx4090"):  # fmt: skip
        assert required in ids


def _flags(verb: str) -> dict[str, list[str]]:
    """``memfit VERB``'s options: parameter name → its flags."""
    import typer.main

    from memfit.cli import app

    group = typer.main.get_command(app)
    ctx = group.make_context("memfit", ["--help"], resilient_parsing=True)
    command = group.get_command(ctx, verb)
    assert command is not None
    return {p.name or "": [*p.opts, *p.secondary_opts] for p in command.params}


def test_every_knob_a_step_prices_is_a_flag_of_estimate_and_doctor() -> None:
    from memfit.job import STEP_FIELDS, Job, flag_of

    fields = {f.name: f for f in dataclasses.fields(Job)}
    for verb in ("estimate", "doctor"):
        flags = _flags(verb)
        for name in STEP_FIELDS:
            # the micro-batch is both verbs' --batch-size
            flag = "--batch-size" if name == "micro_batch_size" else flag_of(fields[name])
            assert flag in flags.get(name, []), (verb, name)
    # the help line is the field's, written once
    assert _flags("plan")["double_quant"] == _flags("estimate")["double_quant"]


def test_doctor_takes_the_attention_kernel_it_prices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """memfit estimate takes --attn-implementation; memfit doctor refused it ("No such
    option"): its flags are the job's now, and the failed job it prices carries it."""
    from memfit.report import doctor

    seen: dict[str, object] = {}

    def from_text(message: str, *, flag: str, knobs: object) -> object:
        seen["knobs"] = knobs
        raise SystemExit(0)

    monkeypatch.setattr(doctor, "from_text", from_text)
    code, _, err = run(
        capsys, "doctor", "--message", "CUDA out of memory. Tried to allocate 2.00 GiB",
        "--model", "bert-base-uncased", "--task", "classification", "--batch-size", "8",
        "--seq-len", "128", "--attn-implementation", "eager", "--lora-rank", "8",
        "--lora-target-modules", "mlp,attention",
    )  # fmt: skip
    assert code == 0, err
    job = seen["knobs"]
    assert job.attn_implementation == "eager"  # type: ignore[attr-defined]
    assert job.lora_target_modules == ["mlp", "attention"]  # type: ignore[attr-defined]
    code, _, err = run(
        capsys, "doctor", "--message", "x", "--model", "bert-base-uncased", "--task",
        "classification", "--batch-size", "8", "--seq-len", "128", "--attn-implementation", "fast",
    )  # fmt: skip
    assert code == 2 and "--attn-implementation: unknown value 'fast'" in err
