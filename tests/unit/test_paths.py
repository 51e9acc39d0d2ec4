"""memfit.paths: destinations checked before long work, with the flag's name; nothing left."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from memfit.errors import UsageError
from memfit.paths import (
    check_writable_dir,
    check_writable_file,
    dir_problem,
    file_problem,
    is_user_os_error,
    os_error_line,
)


def test_a_file_that_can_be_written(tmp_path: Path) -> None:
    assert file_problem(tmp_path / "out.jsonl", "--output") is None
    assert check_writable_file(tmp_path / "out.jsonl", "--output") == tmp_path / "out.jsonl"
    assert list(tmp_path.iterdir()) == []  # the probe is gone


def test_file_problems(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert (
        file_problem(tmp_path, "--output") == f"--output: {tmp_path} is a folder; give a file name"
    )
    assert file_problem(tmp_path / "no" / "o", "--output") == (
        f"--output: the folder {tmp_path / 'no'} does not exist"
    )
    assert file_problem(tmp_path / "f" / "deeper" / "o", "--x") == (
        f"--x: {tmp_path / 'f' / 'deeper' / 'o'}: {tmp_path / 'f'} is a file, not a folder"
    )
    assert file_problem(tmp_path / ("n" * 300), "--x") == (
        f"--x: {tmp_path / ('n' * 300)}: File name too long"
    )
    with pytest.raises(UsageError, match=r"^--output: .* is a folder"):
        check_writable_file(tmp_path, "--output")


def test_dir_problems(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert dir_problem(tmp_path, "--cache-dir") is None
    assert dir_problem(tmp_path / "new" / "deeper", "--cache-dir") is None  # can be made
    assert not (tmp_path / "new").exists()
    assert dir_problem(tmp_path / "f", "--cache-dir") == (
        f"--cache-dir: {tmp_path / 'f'} is a file, not a folder"
    )
    assert dir_problem(tmp_path / "f" / "sub", "--cache-dir") == (
        f"--cache-dir: {tmp_path / 'f' / 'sub'}: {tmp_path / 'f'} is a file, not a folder"
    )
    assert dir_problem(tmp_path / "new", "--d", create=False) == (
        f"--d: the folder {tmp_path / 'new'} does not exist"
    )
    with pytest.raises(UsageError, match=r"^--cache-dir: "):
        check_writable_dir(tmp_path / "f", "--cache-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_os_error_lines() -> None:
    assert os_error_line(OSError(errno.ENOSPC, "No space left on device", "/a")) == (
        "/a: No space left on device"
    )
    assert os_error_line(OSError(errno.EISDIR, "Is a directory", "/a", None, "/b")) == (
        "/a -> /b: Is a directory"
    )
    assert os_error_line(OSError(errno.EROFS, "Read-only file system")) == "Read-only file system"
    assert is_user_os_error(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_user_os_error(OSError(errno.EIO, "Input/output error"))
    assert not is_user_os_error(ValueError("x"))
