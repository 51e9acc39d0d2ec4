"""Destinations the user names (``--output``, ``--write-config``, ``--cache-dir``, ...), checked
before any long work: a missing folder, a file where a folder should be, a folder where a file
should be, a read-only or otherwise unwritable folder is a :class:`~memfit.errors.UsageError`
naming the flag and the path, before a model is loaded or a plan is run.

The check writes a probe file in the folder and removes it at once: it leaves nothing behind, and
it answers for root (whom permission bits do not stop) and for read-only mounts alike.

:func:`os_error_line` and :data:`USER_ERRNOS` are the last resort of ``memfit.cli``: an
``OSError`` a user's disk or path can cause (full, read-only, not there) is one line, exit 2.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from memfit.errors import UsageError

# what a user's path or disk can do: full, over quota, read-only, not allowed, not there, a file
# where a folder should be (and the other way round), a name too long
USER_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENOENT,
        errno.ENAMETOOLONG,
    }
)


def is_user_os_error(exc: BaseException) -> bool:
    """An ``OSError`` the user's disk or path caused (see :data:`USER_ERRNOS`), not a bug."""
    return isinstance(exc, OSError) and exc.errno in USER_ERRNOS


def os_error_line(exc: OSError) -> str:
    """``FILE: reason`` (``A -> B: reason`` for a rename), or the reason alone."""
    reason = exc.strerror or str(exc)
    if exc.filename is not None and exc.filename2 is not None:
        return f"{os.fsdecode(exc.filename)} -> {os.fsdecode(exc.filename2)}: {reason}"
    if exc.filename is not None:
        return f"{os.fsdecode(exc.filename)}: {reason}"
    return reason


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``.`` for a relative path's root)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _probe(folder: Path) -> str | None:
    """Why nothing can be written in ``folder`` (None: a probe file was made and removed)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".memfit-probe-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


def file_problem(path: str | os.PathLike[str], flag: str) -> str | None:
    """Why ``path`` cannot be written as a file (its folder must exist), or None."""
    target = Path(path)
    try:
        if target.is_dir():
            return f"{flag}: {target} is a folder; give a file name"
        folder = target.parent
        if not folder.is_dir():
            found = _nearest_existing(folder)
            if found.exists() and not found.is_dir():
                return f"{flag}: {target}: {found} is a file, not a folder"
            return f"{flag}: the folder {folder} does not exist"
        why = _probe(folder)
    except OSError as exc:  # a name too long, a loop of links, ...
        return f"{flag}: {target}: {exc.strerror or exc}"
    if why is not None:
        return f"{flag}: {target}: cannot write in {folder} ({why})"
    return None


def dir_problem(path: str | os.PathLike[str], flag: str, *, create: bool = True) -> str | None:
    """Why ``path`` cannot be used as a folder to write in, or None. With ``create`` a folder
    that does not exist yet is fine where it could be made (its nearest existing ancestor is a
    folder that can be written in)."""
    target = Path(path)
    try:
        if target.exists() and not target.is_dir():
            return f"{flag}: {target} is a file, not a folder"
        if target.is_dir():
            where = target
        else:
            if not create:
                return f"{flag}: the folder {target} does not exist"
            where = _nearest_existing(target)
            if not where.is_dir():
                return f"{flag}: {target}: {where} is a file, not a folder"
        why = _probe(where)
    except OSError as exc:
        return f"{flag}: {target}: {exc.strerror or exc}"
    if why is not None:
        return f"{flag}: {target}: cannot write in {where} ({why})"
    return None


def check_writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a :class:`Path`; a UsageError naming ``flag`` when it cannot be written."""
    problem = file_problem(path, flag)
    if problem is not None:
        raise UsageError(problem)
    return Path(path)


def check_writable_dir(path: str | os.PathLike[str], flag: str, *, create: bool = True) -> Path:
    """``path`` as a :class:`Path`; a UsageError naming ``flag`` when it cannot be written in."""
    problem = dir_problem(path, flag, create=create)
    if problem is not None:
        raise UsageError(problem)
    return Path(path)
