"""memfit limits: the longest sequence and the largest micro-batch that fit, solved from the shape
fit and checked by real estimates (the answer fits, one step past it does not)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from cli_run import run_cli
from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.plan import limits as limits_module
from memfit.plan.limits import SEQ_LEN_STEP, limits

JOB = {"task": "causal-lm", "precision": "bf16"}


def _peak(model: str, batch: int, length: int, **knobs: Any) -> int:
    return estimate(model, batch_size=batch, seq_len=length, **{**JOB, **knobs}).total_bytes


@pytest.mark.slow
def test_the_answers_fit_and_one_step_past_them_does_not(tiny_gpt2: str) -> None:
    # a budget the micro-batch outgrows at a few rows of the model's 128 positions
    budget = _peak(tiny_gpt2, 12, 64) + 1
    got = limits(tiny_gpt2, batch_size=20, seq_len=64, gpu_memory=budget, safety_margin=0, **JOB)
    longest, largest = got.max_seq_len, got.max_micro_batch
    assert largest is not None and longest.value is not None and largest.value is not None
    # the answers are checked estimates: each fits, the next step does not (by memory)
    assert longest.value % SEQ_LEN_STEP == 0 and longest.bound == "memory"
    assert longest.peak_bytes == _peak(tiny_gpt2, 20, longest.value) <= budget
    assert longest.next_value == longest.value + SEQ_LEN_STEP
    assert longest.next_peak_bytes == _peak(tiny_gpt2, 20, longest.next_value) > budget
    assert largest.value >= 12 and largest.bound == "memory"
    assert largest.peak_bytes == _peak(tiny_gpt2, largest.value, 64) <= budget
    assert _peak(tiny_gpt2, largest.value + 1, 64) > budget
    # a fit and its checks, not a walk over the range
    assert largest.estimates <= 12 and longest.estimates <= 12


def test_the_positions_bound_the_length_and_json_keys_are_stable(
    capsys: pytest.CaptureFixture[str], tiny_gpt2: str
) -> None:
    code, out, _ = run_cli(
        capsys, "limits", tiny_gpt2, "--task", "causal-lm", "--gpu-memory", "4GiB",
        "--seq-len", "128", "--json",
    )  # fmt: skip
    assert code == 0
    got = json.loads(out)
    assert got["max_seq_len"]["value"] == 128 == got["max_positions"]
    assert got["max_seq_len"]["bound"] == "positions"
    assert got["max_seq_len"]["next_value"] is None
    assert set(got["max_micro_batch"]) >= {"value", "peak_bytes", "bound", "next_peak_bytes"}
    assert got["levers"] is None and got["fits"] is True


def test_nothing_fits_exits_3_and_says_so(
    capsys: pytest.CaptureFixture[str], tiny_gpt2: str
) -> None:
    code, out, _ = run_cli(
        capsys, "limits", tiny_gpt2, "--task", "causal-lm", "--gpu-memory", "64MiB",
        "--seq-len", "64",
    )  # fmt: skip
    assert code == 3
    from memfit.commands.limits import SHORTEST

    assert SHORTEST == SEQ_LEN_STEP
    assert f"nothing fits; micro-batch 1 at {SHORTEST} tokens needs " in out
    assert "nothing fits; micro-batch 1 at 64 tokens needs " in out


@pytest.mark.slow
def test_levers_go_further_and_say_which(
    capsys: pytest.CaptureFixture[str], tiny_gpt2: str
) -> None:
    budget = _peak(tiny_gpt2, 12, 64) + 1
    code, out, _ = run_cli(
        capsys, "limits", tiny_gpt2, "--task", "causal-lm", "--precision", "bf16",
        "--gpu-memory", str(budget), "--safety-margin", "0", "--seq-len", "64", "--levers",
    )  # fmt: skip
    assert code == 0
    batch = [line for line in out.splitlines() if "largest micro-batch" in line]
    assert len(batch) == 2 and batch[1].startswith("With the exact levers")
    # the fused loss never builds the logits, which dominate this model: more rows fit
    assert "--cross-entropy fused-linear" in batch[1]
    got = limits(tiny_gpt2, seq_len=64, gpu_memory=budget, safety_margin=0, levers=True, **JOB)
    assert got.levers is not None and got.max_micro_batch is not None
    given, levered = got.max_micro_batch, got.levers["max_micro_batch"]
    assert levered.value is not None and given.value is not None and levered.value > given.value
    # the answer with its levers is a checked estimate too
    settings = levered.settings
    assert _peak(tiny_gpt2, levered.value, 64, **settings) == levered.peak_bytes <= budget
    assert _peak(tiny_gpt2, levered.value + 1, 64, **settings) > budget


def test_the_host_budget_bounds_what_offloading_moves_there(
    monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    # a stand-in for an offloading estimate: 1 MiB of host memory per token of the micro-batch
    def offloading(model: str, **kwargs: Any) -> Any:
        result = estimate(model, **kwargs)
        host = kwargs["batch_size"] * kwargs["seq_len"] << 20
        return dataclasses.replace(
            result, details={**result.details, "host": {"total_bytes": host, "parts": {}}}
        )

    monkeypatch.setattr(limits_module, "estimate", offloading)
    got = limits(tiny_gpt2, batch_size=1, seq_len=64, gpu_memory="4GiB", host_memory="40MiB", **JOB)
    longest, largest = got.max_seq_len, got.max_micro_batch
    assert largest is not None
    assert (longest.value, longest.bound, longest.host_bytes) == (40, "host-memory", 40 << 20)
    # not even one row of 64 tokens: 64 MiB of host memory
    assert (largest.value, largest.bound) == (None, "host-memory")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_seq_len": 32}, "--max-seq-len"),
        ({"allow": ["truncation"]}, "--allow: truncation"),
        ({"gpu_memory": None}, "--gpu-memory SIZE"),
        ({"host_memory": "lots"}, "--host-memory"),
        ({"seq_len": 4096}, "--seq-len"),
        ({"precision": "bf17", "host_memory": "lots"}, "--precision: .*; .*--host-memory"),
    ],
)
def test_bad_input_is_one_clear_error(tiny_gpt2: str, kwargs: dict, message: str) -> None:
    given = {"task": "causal-lm", "gpu_memory": "4GiB", **kwargs}
    with pytest.raises(UsageError, match=message):
        limits(tiny_gpt2, **given)


def _host_stub(ranks_per_node: int | None) -> Any:
    """A stand-in for an offloading estimate: 1 MiB of host memory per token of the micro-batch,
    per rank, and (when given) how many ranks share the node's memory."""

    def offloading(model: str, **kwargs: Any) -> Any:
        result = estimate(model, **kwargs)
        host: dict[str, Any] = {"total_bytes": kwargs["batch_size"] * kwargs["seq_len"] << 20}
        if ranks_per_node is not None:
            host["ranks_per_node"] = ranks_per_node
        return dataclasses.replace(result, details={**result.details, "host": host})

    return offloading


def test_nothing_fits_by_host_memory_says_the_host_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    monkeypatch.setattr(limits_module, "estimate", _host_stub(None))
    code, out, _ = run_cli(
        capsys, "limits", tiny_gpt2, "--task", "causal-lm", "--gpu-memory", "4GiB",
        "--host-memory", "4MiB",
    )  # fmt: skip
    assert code == 3
    # 8 tokens keep 8 MiB in host memory: that is what is over, not the GPU peak
    assert (
        "nothing fits; micro-batch 1 at 8 tokens needs 8.00 MiB of the 4.00 MiB host memory." in out
    )


def test_the_host_budget_is_the_node_s_ranks_together(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    # four ranks on the node, 1 MiB per token each: 160 MiB holds 40 tokens, not 160
    monkeypatch.setattr(limits_module, "estimate", _host_stub(4))
    got = limits(tiny_gpt2, gpu_memory="4GiB", host_memory="160MiB", **JOB)
    longest = got.max_seq_len
    assert (longest.value, longest.bound, longest.host_bytes) == (40, "host-memory", 40 << 20)
    assert longest.host_ranks == 4 and got.to_dict()["max_seq_len"]["host_ranks"] == 4
    code, out, _ = run_cli(
        capsys, "limits", tiny_gpt2, "--task", "causal-lm", "--precision", "bf16",
        "--gpu-memory", "4GiB", "--host-memory", "160MiB",
    )  # fmt: skip
    assert code == 0
    assert "40 tokens (" in out and "40.00 MiB per rank (160.00 MiB for 4 ranks) in host" in out
    # without ranks_per_node an estimate's figure is the node's own
    monkeypatch.setattr(limits_module, "estimate", _host_stub(None))
    assert (
        limits(tiny_gpt2, gpu_memory="4GiB", host_memory="160MiB", **JOB).max_seq_len.value == 128
    )


@pytest.mark.slow
def test_the_levers_named_are_the_levers_needed(tiny_gpt2: str) -> None:
    from memfit.levers import LEVERS

    budget = _peak(tiny_gpt2, 12, 64) + 1
    got = limits(tiny_gpt2, seq_len=64, gpu_memory=budget, safety_margin=0, levers=True, **JOB)
    assert got.levers is not None
    named = 0
    for name, answer in got.levers.items():
        assert answer.value is not None
        batch, length = (1, answer.value) if name == "max_seq_len" else (answer.value, 64)
        assert _peak(tiny_gpt2, batch, length, **answer.settings) == answer.peak_bytes <= budget
        for lever in LEVERS:
            if not any(f in answer.settings for f in lever.fields):
                continue
            named += 1
            # without it (the job's own values), the answer no longer fits: a direct estimate
            rest = {k: v for k, v in answer.settings.items() if k not in lever.fields}
            assert _peak(tiny_gpt2, batch, length, **rest) > budget, (name, lever.name)
    assert named
