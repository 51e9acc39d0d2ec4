"""`memfit doctor` reads impossible figures as impossible, never prints a `memfit plan` command
that plan refuses, and names the flags the user gave."""

from __future__ import annotations

import re
import shlex

import pytest

from cli_run import run_cli
from memfit.report.doctor import from_text
from memfit.report.oom_message import parse_oom
from memfit.units import parse_size

GiB = 2**30

NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of {cap} of which {free} is free. Including non-PyTorch memory, this process has "
    "{used} memory in use. Of the allocated memory 10.25 GiB is allocated by PyTorch, and 4.02 "
    "GiB is reserved by PyTorch but unallocated."
)
OLD = (
    "CUDA out of memory. Tried to allocate 256.00 MiB (GPU 0; {cap} total capacity; {allocated} "
    "already allocated; 117.81 MiB free; {reserved} reserved in total by PyTorch)"
)

IMPOSSIBLE = {
    # the issue's: no device at all, and more free than any device has
    "capacity 0": NEW.format(cap="0 GiB", free="99999999999999 GiB", used="14.69 GiB"),
    "free over capacity": NEW.format(cap="15.77 GiB", free="99.00 GiB", used="14.69 GiB"),
    "in use over capacity": NEW.format(cap="15.77 GiB", free="1.06 GiB", used="140.69 GiB"),
    "reserved over capacity": NEW.format(cap="8.00 GiB", free="1.06 GiB", used="7.00 GiB"),
    "capacity of an exbibyte": NEW.format(cap="1073741824 GiB", free="1 GiB", used="14.69 GiB"),
    "a 400-digit capacity": NEW.format(cap="9" * 400 + " GiB", free="1 GiB", used="1 GiB"),
    "allocated over reserved": OLD.format(
        cap="11.17 GiB", allocated="10.21 GiB", reserved="1.45 GiB"
    ),
    "old capacity 0": OLD.format(cap="0.00 GiB", allocated="10.21 GiB", reserved="10.45 GiB"),
    "cap of 0": "memfit memory cap: tried to hold 440.75 MiB, the cap is 0 B (simulated)",
}


def _plan_command(text: str) -> list[str]:
    """The `memfit plan …` command a doctor output prints, as its words."""
    (command,) = re.findall(r"`(memfit plan [^`]*)`", text)
    return shlex.split(command)


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_figures_are_not_used(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = parse_oom(IMPOSSIBLE[case])
    assert report is not None and report.impossible
    assert report.capacity_bytes is None and report.free_bytes is None
    code, out, err = run_cli(capsys, "doctor", "--message", IMPOSSIBLE[case])
    assert code == 0 and "Traceback" not in err
    assert "cannot be true" in out and "none of the device's figures is used" in out
    if case != "cap of 0":  # the CPU cap's fixes name no plan (it plans a GPU)
        words = _plan_command(out)
        assert "--gpu-memory" not in words and words[-2:] == ["--gpu", "NAME"]


def test_the_issue_message_prints_no_gpu_memory_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "doctor", "--message", IMPOSSIBLE["capacity 0"])
    assert code == 0 and "--gpu-memory 0" not in out
    assert "a capacity of 0 B" in out


def test_true_figures_are_still_used(capsys: pytest.CaptureFixture[str]) -> None:
    text = NEW.format(cap="15.77 GiB", free="1.06 GiB", used="14.69 GiB")
    report = parse_oom(text)
    assert report is not None and not report.impossible
    assert report.capacity_bytes == round(15.77 * GiB) and report.free_bytes == round(1.06 * GiB)
    code, out, _ = run_cli(capsys, "doctor", "--message", text)
    words = _plan_command(out)
    assert code == 0 and words[words.index("--gpu-memory") + 1] == "15.77GiB"
    assert "cannot be true" not in out


@pytest.mark.parametrize("case", ["capacity 0", "free over capacity", "true"])
def test_a_priced_command_is_one_plan_accepts(tiny_bert: str, case: str) -> None:
    """With the job's knobs the command names them all: plan's own checks accept every flag."""
    from memfit.plan.planner import plan_problems
    from memfit.report.doctor import failed_job

    text = IMPOSSIBLE.get(case) or NEW.format(cap="15.77 GiB", free="1.06 GiB", used="14.69 GiB")
    knobs = failed_job(
        model=tiny_bert, task="classification", batch_size=8, seq_len=32, num_labels=3
    )
    fix = from_text(text, flag="--message", knobs=knobs).fixes[-1]
    words = _plan_command(fix.change)
    assert words[2] == tiny_bert and "N" not in words and "LEN" not in words
    flags = dict(zip(words[3::2], words[4::2], strict=False))
    assert flags["--effective-batch-size"] == "8" and flags["--num-labels"] == "3"
    assert (
        plan_problems(
            words[2],
            task=flags["--task"],
            seq_len=int(flags["--seq-len"]),
            effective_batch_size=int(flags["--effective-batch-size"]),
            num_labels=int(flags["--num-labels"]),
            gpu_memory=flags.get("--gpu-memory"),
        )
        == []
    )
    if case == "true":
        assert parse_size(flags["--gpu-memory"]) > 0
    else:
        assert "--gpu-memory" not in flags and words[-2:] == ["--gpu", "NAME"]


@pytest.mark.parametrize(
    ("flag", "value", "also"),
    [
        ("--batch-size", "-1", []),
        ("--batch-size", "0", []),
        ("--gradient-accumulation-steps", "0", []),
        ("--gradient-accumulation-steps", "-3", ["--batch-size", "-2"]),
    ],
)
def test_a_bad_count_names_the_flag_given(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, flag: str, value: str, also: list[str]
) -> None:
    argv = ["doctor", "--message", IMPOSSIBLE["free over capacity"], "--model", tiny_bert]
    argv += ["--task", "classification", "--seq-len", "32"]
    given = {"--batch-size": "8", flag: value, **dict(zip(also[::2], also[1::2], strict=True))}
    for name, number in given.items():
        argv += [name, number]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"{flag}: must be ≥ 1, got {value}" in err
    for other in also[::2]:
        assert f"{other}: must be ≥ 1" in err
    # doctor has no such flags: the micro-batch is --batch-size, the effective batch follows
    assert "--effective-batch-size" not in err and "--micro-batch-size" not in err
