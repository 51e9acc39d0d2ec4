"""One verdict (issue 36): memfit estimate's and memfit plan's verdicts on the same step agree,
or the output says why. The plan keeps a safety margin of the budget free (5 % by default); a
step within the budget but not within the rest "fits" for the estimate and is "over the budget"
for the plan, so both name the margin, the budget left after it and ``--safety-margin``; with
``--safety-margin 0`` they agree.

The estimates are stated (the issue's QLoRA job as traced: Llama-3.1-8B, NF4, LoRA rank 16,
1 × 2560 tokens, checkpointing, on a T4) and stand in for the trace of a tiny GPT-2 config:
the verdicts, not the tracer, are under test."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest

import memfit.estimate
from cli_run import run_cli
from memfit.devices import find_gpu
from memfit.estimate import Estimate
from memfit.plan import planner, search
from memfit.units import format_bytes, parse_size

GiB = 1 << 30
T4 = find_gpu("t4")
# the job at micro-batch 1 with checkpointing, as memfit traced it for a T4: fp16 autocast
# keeps 16-bit copies beside the fp32 tensors, fp32 does not
PEAK = {"fp16": 15_073_280_000, "fp32": 14_018_412_544}
USABLE = int(T4.memory_bytes * 0.95)  # the T4 less the plan's 5 % margin
assert USABLE < PEAK["fp16"] <= T4.memory_bytes and PEAK["fp32"] <= USABLE  # the case at hand

STEP = ["--task", "causal-lm", "--seq-len", "64", "--cross-entropy", "standard"]
ESTIMATE = ["--batch-size", "1", "--precision", "fp16", "--gradient-checkpointing", "--gpu", "t4"]
PLAN = ["--effective-batch-size", "8", "--gpu", "t4"]


def _stated(real: Estimate) -> Any:
    """An ``estimate`` whose peaks are :data:`PEAK` (without checkpointing 8 GiB more, each
    further row 6 GiB more), its verdict against the budget as the real one gives it."""

    def stated(
        model: str,
        *,
        batch_size: int,
        precision: str | None = None,
        gradient_checkpointing: bool | None = None,
        gpu: str | None = None,
        gpu_memory: int | str | None = None,
        mode: str = "train",
        **knobs: Any,
    ) -> Estimate:
        precision = precision or "fp32"
        total = PEAK[precision] + (batch_size - 1) * 6 * GiB
        total += 0 if gradient_checkpointing else 8 * GiB
        budget = (
            parse_size(gpu_memory, name="--gpu-memory")
            if gpu_memory is not None
            else (find_gpu(gpu).memory_bytes if gpu else None)
        )
        breakdown = dict(real.breakdown)
        breakdown["activations"] += total - real.total_bytes  # the parts still sum to the peak
        spec = dataclasses.replace(
            real.spec,
            precision=precision,
            gradient_checkpointing=bool(gradient_checkpointing),
            mode=mode,
        )
        gpu_details = {**real.details["gpu"], "budget_is_gpu_memory": gpu_memory is None}
        return dataclasses.replace(
            real,
            total_bytes=total,
            breakdown=breakdown,
            budget_bytes=budget,
            fits=None if budget is None else total <= budget,
            spec=spec,
            batch_size=batch_size,
            details={**real.details, "gpu": gpu_details},
        )

    return stated


@pytest.fixture(scope="module")
def real(tiny_gpt2: str) -> Estimate:
    """A real estimate of the tiny model on a T4 (its details and spec for :func:`_stated`)."""
    return memfit.estimate.estimate(
        tiny_gpt2, task="causal-lm", batch_size=1, seq_len=64, gpu="t4", precision="fp16"
    )


@pytest.fixture
def stated(monkeypatch: pytest.MonkeyPatch, real: Estimate) -> Iterator[None]:
    """memfit estimate and memfit plan both read :func:`_stated`'s peaks."""
    fake = _stated(real)
    monkeypatch.setattr(memfit.estimate, "estimate", fake)  # memfit estimate's
    monkeypatch.setattr(search, "estimate", fake)  # the plan's search
    monkeypatch.setattr(planner, "prefetch", lambda model, ahead: 0)  # no worker tracing ahead
    yield


def _estimate(capsys: pytest.CaptureFixture[str], model: str, *extra: str) -> tuple[str, dict]:
    code, out, err = run_cli(capsys, "estimate", model, *STEP, *ESTIMATE, *extra)
    assert code == 0, err
    code, raw, err = run_cli(capsys, "estimate", model, *STEP, *ESTIMATE, *extra, "--json")
    assert code == 0, err
    return out, json.loads(raw)


def _plan(capsys: pytest.CaptureFixture[str], model: str, *extra: str) -> tuple[int, str, dict]:
    code, out, _ = run_cli(capsys, "plan", model, *STEP, *PLAN, *extra)
    json_code, raw, _ = run_cli(capsys, "plan", model, *STEP, *PLAN, *extra, "--json")
    assert code == json_code
    return code, " ".join(out.split()), json.loads(raw)


def test_the_estimate_names_the_plans_margin(
    capsys: pytest.CaptureFixture[str], stated: None, tiny_gpt2: str
) -> None:
    out, data = _estimate(capsys, tiny_gpt2)
    text = " ".join(out.split())
    spare = format_bytes(T4.memory_bytes - PEAK["fp16"])
    assert f"Fits in a T4's {format_bytes(T4.memory_bytes)}: {spare} to spare." in text
    # the same verdict says the usable budget, by how much the step is over it, and the flag
    over = format_bytes(PEAK["fp16"] - USABLE)
    assert (
        f"Over the {format_bytes(USABLE)} left after a 5 % safety margin by {over}: memfit plan "
        "(its default --safety-margin 0.05) will not choose this step as is; with "
        f"--safety-margin 0 it counts all {format_bytes(T4.memory_bytes)}."
    ) in text
    # --json: the budget's verdict as before, the margin's beside it
    assert data["fits"] is True and data["budget_bytes"] == T4.memory_bytes
    assert data["safety_margin"] == 0.05 and data["usable_bytes"] == USABLE
    assert data["fits_with_margin"] is False


def test_the_plan_names_its_margin(
    capsys: pytest.CaptureFixture[str], stated: None, tiny_gpt2: str
) -> None:
    code, text, data = _plan(capsys, tiny_gpt2)
    assert code == 0 and data["plan"]["precision"] == "fp32"
    budget = (
        f"over the {format_bytes(USABLE)} budget (a T4's {format_bytes(T4.memory_bytes)} less the "
        "5 % safety margin; --safety-margin 0 to use it all)"
    )
    fp16 = f"fp16 would need {format_bytes(PEAK['fp16'])} at this micro-batch"
    assert fp16 in text and budget in text
    # the JSON's explanation says the same
    line = next(x for x in data["explanation"] if x.startswith("fp32, not fp16"))
    assert fp16 in line and budget in line
    assert data["safety_margin"] == 0.05 and data["usable_bytes"] == USABLE
    # the next micro-batch is over the whole T4 too: the flag would not help it, and it says so
    assert (
        f"would need {format_bytes(PEAK['fp32'] + 6 * GiB)}: over the {format_bytes(USABLE)} "
        f"budget (a T4's {format_bytes(T4.memory_bytes)} less the 5 % safety margin; over the "
        f"whole {format_bytes(T4.memory_bytes)} too)."
    ) in text


@pytest.mark.parametrize("margin", ["0.05", "0"])
def test_estimate_and_plan_agree_on_the_step(
    capsys: pytest.CaptureFixture[str], stated: None, tiny_gpt2: str, margin: str
) -> None:
    flag = ["--safety-margin", margin]
    out, estimate = _estimate(capsys, tiny_gpt2, *flag)
    code, _, plan = _plan(capsys, tiny_gpt2, *flag)
    chosen = plan["plan"]
    took_the_step = code == 0 and (chosen["precision"], chosen["micro_batch_size"]) == ("fp16", 1)
    # the estimate's verdict with the margin is the plan's choice of that very step
    assert estimate["fits_with_margin"] is took_the_step
    assert took_the_step is (margin == "0")
    if took_the_step:
        assert plan["predicted_peak_bytes"] == estimate["total_bytes"]
        assert "safety margin" not in out  # nothing to explain
    else:
        assert "safety margin" in out


def test_nothing_fits_only_for_the_margin_says_so(
    capsys: pytest.CaptureFixture[str], stated: None, tiny_gpt2: str
) -> None:
    # a budget the least configuration (fp32) fits whole, but not less the 5 % margin
    budget = 14_500_000_000
    assert int(budget * 0.95) < PEAK["fp32"] <= budget
    code, text, data = _plan(capsys, tiny_gpt2, "--gpu-memory", "14.5GB")
    usable = format_bytes(int(budget * 0.95))
    assert code == 3 and data["fits"] is False
    assert (
        f"Nothing fits in {format_bytes(budget)} on a T4 less the 5 % safety margin, {usable}: "
        f"the least any configuration needs is {format_bytes(PEAK['fp32'])}."
    ) in text
    assert (
        f"within the whole {format_bytes(budget)}: --safety-margin 0 lets a plan use it all."
        in data["explanation"][-1]
    )
    # with the margin off, the plan fits it, as the estimate's verdict does
    code, _, data = _plan(capsys, tiny_gpt2, "--gpu-memory", "14.5GB", "--safety-margin", "0")
    assert code == 0 and data["predicted_peak_bytes"] == PEAK["fp32"]


@pytest.mark.parametrize("margin", ["1", "-0.1", "nan"])
def test_a_bad_margin_is_one_line(capsys: pytest.CaptureFixture[str], margin: str) -> None:
    code, out, err = run_cli(
        capsys, "estimate", "gpt2", *STEP, *ESTIMATE, "--safety-margin", margin
    )
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--safety-margin: must be in [0, 1)" in err
