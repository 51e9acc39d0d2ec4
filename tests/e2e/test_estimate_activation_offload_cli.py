"""`memfit estimate --activation-offloading --host-memory` (issue 33): an embedded Llama-style
config on a CUDA target prints the GPU breakdown and, under it, the host bytes and the host
budget's verdict; a budget too small is said, as the GPU budget's is (exit 0); a bad size is one
line naming the flag, exit 2; ``--json`` carries ``details.host``.
"""

from __future__ import annotations

import json

import pytest

from cli_run import run_cli

pytestmark = pytest.mark.slow  # traces a 30-layer model's shallow copies (seconds)

MODEL = "HuggingFaceTB/SmolLM2-135M"  # Llama's architecture, embedded in memfit
JOB = (
    "estimate",
    MODEL,
    "--task",
    "causal-lm",
    "--batch-size",
    "1",
    "--seq-len",
    "512",
    "--precision",
    "bf16",
    "--activation-offloading",
)


def test_host_bytes_are_printed_and_checked_against_the_host_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, *JOB, "--host-memory", "8GiB")
    assert code == 0, err
    assert "host memory: " in out and "activations" in out
    assert "host budget: 8.00 GiB: fits" in out
    assert "activation offloading: " in out  # the lever's own line: how much, by what
    code, out, err = run_cli(capsys, *JOB, "--host-memory", "1MiB")
    assert code == 0, err  # an estimate says it does not fit, as for the GPU budget
    assert "host budget: 1.00 MiB: does NOT fit" in out
    code, out, err = run_cli(capsys, *JOB, "--host-memory", "1MiB", "--json")
    host = json.loads(out)["details"]["host"]
    assert host["fits"] is False and host["budget_bytes"] == 2**20
    assert host["parts"]["activations"] == host["total_bytes"] > 0
    # the estimate's fits is both budgets': the host's failing makes it false
    assert json.loads(out)["fits"] is False
    # on CUDA the activations follow TRL's rules, whatever is installed here (memfit train runs
    # TRL's context on CUDA and refuses to run without it)
    assert host["activation_offloading"] == "trl"


def test_the_verdict_names_the_budget_that_fails(capsys: pytest.CaptureFixture[str]) -> None:
    gpu_fine = (*JOB, "--gpu-memory", "80GiB", "--host-memory", "1MiB")
    code, out, err = run_cli(capsys, *gpu_fine)
    assert code == 0, err
    # the GPU's memory holds it, the host's does not: said so, not "short" by a negative size
    assert "Fits in 80.00 GiB" in out and "the host memory does not" in out
    assert "Does not fit" not in out
    assert "host budget: 1.00 MiB: does NOT fit" in out
    code, out, err = run_cli(capsys, *gpu_fine, "--json")
    said = json.loads(out)
    assert said["fits"] is False and said["details"]["host"]["fits"] is False
    code, out, err = run_cli(
        capsys, *JOB, "--gpu-memory", "80GiB", "--host-memory", "8GiB", "--json"
    )
    assert json.loads(out)["fits"] is True


def test_a_bad_host_memory_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, *JOB, "--host-memory", "8 gigs")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--host-memory" in lines[0], err
    assert "Traceback" not in err


def test_an_evaluation_with_it_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    # an eval step saves nothing for a backward pass: refused, as --optimizer-offload cpu is
    code, _out, err = run_cli(capsys, *JOB, "--mode", "eval")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--activation-offloading" in lines[0] and "eval" in lines[0], err
