"""Run ``memfit ARGV`` in the test's process, as a user would type it."""

from __future__ import annotations

import pytest

from memfit.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``memfit ARGV``: (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def run_ok(*argv: str) -> None:
    """``memfit ARGV`` in the test's process (its output left to pytest), which must exit 0."""
    try:
        main(list(argv))
    except SystemExit as exc:
        assert not exc.code, f"memfit {' '.join(argv)} exited with {exc.code}"
