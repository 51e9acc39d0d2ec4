"""``lora_dropout``: the estimator traces the adapters' dropout the job asks for.

peft puts ``nn.Dropout`` on each adapted layer's input when the dropout is above 0 (its output,
a copy of the input, and its mask stay alive for backward) and ``nn.Identity`` at 0 (nothing
kept), so a step with ``--lora-dropout 0`` holds fewer activations than one with the default
0.1. The knob is a flag of estimate and plan, a keyword of their Python API, a config-file key
and a pin a plan keeps (``memfit plan --lora-rank 8 --lora-dropout 0`` prints it back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

import memfit
from memfit import config as run_config
from memfit.cli import main
from memfit.errors import UsageError
from memfit.estimate.workload import StepSpec, build_model
from memfit.job import Job
from memfit.plan.planner import _pinned, plan_problems
from memfit.report.run_files import LEVER_KNOBS, lever_settings

_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(**_LLAMA).save_pretrained(folder)
    return str(folder)


def _dropouts(model: nn.Module) -> list[nn.Module]:
    """The dropout module of every LoRA layer (peft's ``lora_dropout`` ModuleDict)."""
    return [
        m["default"]
        for name, m in model.named_modules()
        if name.endswith("lora_dropout") and isinstance(m, nn.ModuleDict)
    ]


def test_the_default_is_peft_s_usual_recipe() -> None:
    # what memfit always traced and trained: caches and plans of before mean the same step
    assert StepSpec(task="causal-lm").lora_dropout == 0.1


@pytest.mark.parametrize(("dropout", "kind"), [(0.0, nn.Identity), (0.05, nn.Dropout)])
def test_the_estimator_s_model_carries_the_dropout(dropout: float, kind: type) -> None:
    from transformers import LlamaConfig

    spec = StepSpec(task="causal-lm", device="cpu", lora_rank=4, lora_dropout=dropout)
    model = build_model(LlamaConfig(**_LLAMA), spec)
    modules = _dropouts(model)
    # one per adapted layer (peft's LoRA layers hold an A and a B each)
    assert len(modules) == sum("lora_A" in n for n, _ in model.named_parameters()) > 0
    assert all(type(m) is kind for m in modules)
    if kind is nn.Dropout:
        assert all(m.p == dropout for m in modules)


def _estimate(folder: str, **knobs: Any) -> Any:
    return memfit.estimate(
        folder, task="causal-lm", batch_size=2, seq_len=32, device="cpu", lora_rank=4, **knobs
    )


def test_no_dropout_holds_fewer_activations_than_the_default(tiny_llama: str) -> None:
    default, given, off = (
        _estimate(tiny_llama),
        _estimate(tiny_llama, lora_dropout=0.1),
        _estimate(tiny_llama, lora_dropout=0.0),
    )
    assert default.total_bytes == given.total_bytes
    assert default.spec.lora_dropout == given.spec.lora_dropout == 0.1
    assert off.spec.lora_dropout == 0.0
    assert (off.details["lora_dropout"], given.details["lora_dropout"]) == (0.0, 0.1)
    # each adapted layer's dropped input (batch × tokens × hidden, fp32) is no longer kept
    assert off.breakdown["activations"] < given.breakdown["activations"]
    assert off.total_bytes <= given.total_bytes
    # the adapters themselves are the same
    assert off.details["trainable_parameters"] == given.details["trainable_parameters"]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"lora_rank": 4, "lora_dropout": 1.5}, r"--lora-dropout: must be a number in \[0, 1\)"),
        ({"lora_rank": 4, "lora_dropout": 1.0}, r"--lora-dropout: must be a number in \[0, 1\)"),
        ({"lora_rank": 4, "lora_dropout": -0.1}, r"--lora-dropout: must be a number in \[0, 1\)"),
        ({"lora_rank": 4, "lora_dropout": "0.1"}, r"--lora-dropout: must be a number in \[0, 1\)"),
        ({"lora_dropout": 0.05}, r"--lora-dropout: only with --lora-rank R"),
    ],
)
def test_the_api_refuses_a_dropout_that_is_none(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        memfit.estimate("gpt2", task="causal-lm", batch_size=1, seq_len=8, **knobs)


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """memfit's exit code for ``argv`` (0: it returned) and what it wrote to stderr."""
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


_ESTIMATE = ["estimate", "gpt2", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "8"]
_PLAN = ["plan", "gpt2", "--task", "causal-lm", "--seq-len", "8", "--effective-batch-size", "4"]


@pytest.mark.parametrize(
    "verb", [_ESTIMATE, [*_PLAN, "--gpu-memory", "8GiB"]], ids=["estimate", "plan"]
)
def test_the_cli_refuses_a_dropout_of_1_5_in_one_line(
    verb: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit([*verb, "--lora-rank", "4", "--lora-dropout", "1.5"], capsys)
    assert code == 2
    assert err.strip() == "memfit: error: --lora-dropout: must be a number in [0, 1), got 1.5"


def test_a_plan_keeps_the_job_s_dropout_and_says_it(
    tiny_llama: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert plan_problems("gpt2", task="causal-lm", seq_len=8, effective_batch_size=4) == []
    assert (
        plan_problems(
            "gpt2",
            task="causal-lm",
            seq_len=8,
            effective_batch_size=4,
            lora_rank=8,
            lora_dropout=0.0,
        )
        == []
    )
    # a dropout of 0 is a value given, not the plain "none" a rank of 0 is
    pinned = _pinned(Job(model="m", task="causal-lm", lora_rank=8, lora_dropout=0.0))
    assert (pinned["lora_rank"], pinned["lora_dropout"]) == (8, 0.0)
    assert _pinned(Job(model="m", task="causal-lm", lora_rank=8))["lora_dropout"] is None

    written = tmp_path / "run.yaml"
    args = ["plan", tiny_llama, "--task", "causal-lm", "--seq-len", "32"]
    args += ["--effective-batch-size", "4", "--gpu-memory", "4GiB"]
    args += ["--lora-rank", "4", "--lora-dropout", "0", "--write-config", str(written)]
    main(args)
    out = capsys.readouterr().out
    # the re-check and the train command carry the dropout the plan was estimated with
    assert "--lora-rank 4 --lora-dropout 0.0" in out.split("Re-check:")[1].splitlines()[0]
    assert "--lora-rank 4 --lora-dropout 0.0" in out.split("Train:")[1].splitlines()[0]
    loaded = run_config.load_config(written)
    assert (loaded["lora_rank"], loaded["lora_dropout"]) == (4, 0.0)


def test_a_config_file_and_run_json_take_a_dropout_in_0_1(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    base = "model: m\ntask: causal-lm\nseq_len: 8\nmicro_batch_size: 1\n"
    base += "gradient_accumulation_steps: 1\nlora_rank: 4\n"
    path.write_text(base + "lora_dropout: 0.05\n")
    assert run_config.load_config(path)["lora_dropout"] == 0.05
    path.write_text(base + "lora_dropout: 0\n")
    assert run_config.load_config(path)["lora_dropout"] == 0
    path.write_text(base + "lora_dropout: some\n")
    with pytest.raises(UsageError, match="lora_dropout must be a number"):
        run_config.load_config(path)
    # run.json's config: a fraction, and an edited one out of range is left out
    check = LEVER_KNOBS["lora_dropout"]
    assert check(0.05) is None and check(0) is None
    assert check(1.5) is not None and check("0.1") is not None
    assert lever_settings({"lora_rank": 4, "lora_dropout": 0.0}) == {
        "lora_rank": 4,
        "lora_dropout": 0.0,
    }
    assert lever_settings({"lora_rank": 4, "lora_dropout": 1.5}) == {"lora_rank": 4}
