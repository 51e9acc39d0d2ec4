"""The status line end to end (on a terminal's stderr within a second, never in stdout or
``--json``) and ``--trace-depth`` on the command line."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main
from memfit.commands.estimate import _trace_depth_line
from memfit.errors import UsageError

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

MODEL = "distilbert-base-uncased"
ESTIMATE = ["estimate", MODEL, "--task", "classification", "--batch-size", "2", "--seq-len", "16"]
PLAN = ["plan", MODEL, "--task", "classification", "--seq-len", "16", "--effective-batch-size", "2"]
# the promise: the command says what it is doing within a second of starting
FIRST_STATUS_WITHIN_S = 1.0


def _env(tmp_path: Path) -> dict[str, str]:
    """The test's environment less whatever would switch the status line off."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "MEMFIT_NO_PROGRESS", "RANK", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    }
    env.update(MEMFIT_CACHE_DIR=str(tmp_path / "cache"), TERM="xterm-256color", HF_HUB_OFFLINE="1")
    return env


@pytest.mark.slow
def test_estimate_json_on_a_terminal_shows_the_status_on_stderr_only(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", *ESTIMATE, "--device", "cpu", "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=_env(tmp_path),
    )
    os.close(slave)
    terminal, seen_after = b"", None
    try:
        # drain the terminal until the process is done (a full pty would block it)
        while time.monotonic() - start < 300:
            ready, _, _ = select.select([master], [], [], 0.05)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal's last end
                break
            if not chunk:
                break
            terminal += chunk
            if seen_after is None and MODEL.encode() in terminal:
                seen_after = time.monotonic() - start
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, terminal.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert seen_after is not None, terminal.decode(errors="replace")
    assert seen_after < FIRST_STATUS_WITHIN_S, f"first status after {seen_after:.2f} s"
    assert b"loading torch and transformers" in terminal
    assert terminal.endswith(b"\x1b[2K")  # the line is erased at the end
    # stdout is the one JSON object: no spinner, no escape codes, no status text
    result = json.loads(out)
    assert result["total_bytes"] > 0
    text = out.decode()
    assert "\x1b" not in text and "loading" not in text
    assert not any("\u2800" <= c <= "\u28ff" for c in text)


@pytest.mark.parametrize("argv", [ESTIMATE, PLAN], ids=["estimate", "plan"])
def test_bad_trace_depth_is_exit_2_with_one_line(tmp_path: Path, argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memfit", *argv, "--trace-depth", "bogus"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("memfit: error: ") and "--trace-depth" in line
    assert "'bogus' is not one of 'auto', 'full'" in line


def _calls(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    module: str,
    argv: list[str],
) -> dict[str, Any]:
    """The keyword arguments memfit.<module>.<module>() gets from the command line."""
    import importlib

    seen: dict[str, Any] = {}

    def record(model: str, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise UsageError("recorded")  # exit 2 before any work

    monkeypatch.setattr(importlib.import_module(f"memfit.{module}"), module, record)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "recorded" in capsys.readouterr().err
    return seen


@pytest.mark.parametrize("module, argv", [("estimate", ESTIMATE), ("plan", PLAN)])
def test_trace_depth_reaches_the_api(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    module: str,
    argv: list[str],
) -> None:
    assert _calls(monkeypatch, capsys, module, argv)["trace_depth"] == "auto"
    full = _calls(monkeypatch, capsys, module, [*argv, "--trace-depth", "full"])
    assert full["trace_depth"] == "full"


@pytest.mark.parametrize(
    "details, line",
    [
        (
            {"mode": "extrapolated", "depth": 12, "traced_depths": [3, 4], "period": 1},
            "traced 3 and 4 of 12 layers, extrapolated exactly",
        ),
        (
            {"mode": "extrapolated", "depth": 24, "traced_depths": [6, 8], "period": 2},
            "traced 6 and 8 of 24 layers, extrapolated exactly, a block of 2 layers repeating",
        ),
        (
            {"mode": "full", "depth": 12, "reason": "12 layers are few enough to trace whole"},
            "traced all 12 layers: 12 layers are few enough to trace whole",
        ),
        ({"mode": "full", "depth": 6}, "traced all 6 layers"),
        ({}, None),
    ],
)
def test_the_trace_depth_line(details: dict[str, Any], line: str | None) -> None:
    assert _trace_depth_line({"trace_depth": details} if details else {}) == line
    assert _trace_depth_line({"trace_depth": "not a dict"}) is None
