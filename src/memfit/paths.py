"""Destinations the user names (``--output``, ``--write-config``, ``--cache-dir``, ...), checked
before any long work: a missing folder, a file where a folder should be, a folder where a file
should be, a read-only or otherwise unwritable folder is a :class:`~memfit.errors.UsageError`
naming the flag and the path, before a model is loaded or a plan is run.

The check writes a probe file in the folder and removes it at once: it leaves nothing behind, and
it answers for root (whom permission bits do not stop) and for read-only mounts alike.

:func:`os_error_line` and :data:`USER_ERRNOS` are the last resort of ``memfit.cli``: an
``OSError`` a user's disk or path can cause (full, read-only, not there) is one line, exit 2.

:func:`destination_problems`: an output is never an input, and replaces an existing file memfit
cannot tell it wrote only with ``--overwrite`` (memfit knows its own files by what they hold).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


# --- outputs: never over an input, nor over a file memfit cannot tell it wrote ----------------
# ``predict``/``embed`` ``--output`` and ``--events``, ``plan --write-config``, ``estimate --plot``:
# :func:`destination_problems` is checked with the other flags, before anything is read or loaded.
#
# - an input, never (``--overwrite`` or not): the same file as one the run reads, by
#   os.path.samefile (so a symbolic or a hard link to an input is that input) or by its resolved
#   path; a file inside a data folder the run reads (a new one too: the next read of the folder
#   would take it as data); a file inside a model folder the run loads (a new one too, memfit's
#   own too: a run's model/ is replaced whole when it is published again);
# - another output of the same run (``--events`` and ``--output`` one file): never;
# - an existing file memfit cannot tell it wrote: only with ``--overwrite``. memfit knows its
#   files by what they hold (a recognizer per kind: its first records, a mark in the metadata);
#   a file it does not recognize is one it "cannot tell" it wrote, never one it "did not write"
#   (an older memfit's Parquet has no mark). A format with no room for a mark (``.npy``) always
#   needs ``--overwrite`` over an existing file.
#
# The writers replace the file atomically (a temporary beside it, renamed at the end), so the old
# file stays whole until the new one is.

# how much of a file the recognizers read: their marks sit in the first record or the metadata
HEAD_BYTES = 1 << 16

Recognizer = Callable[[Path], bool]


@dataclass(frozen=True)
class Input:
    """Something a run reads: a file, a data folder (every file in it is read) or a model
    folder (its files are loaded). ``flag`` names it in messages (``--file``, ``MODEL_DIR``)."""

    flag: str
    path: Path
    kind: Literal["file", "data", "model"] = "file"


@dataclass(frozen=True)
class Kind:
    """What an output holds: ``ours`` tells a file memfit wrote of this kind (False: it cannot
    tell); ``what`` names it in the refusal (``a memfit predict output``)."""

    ours: Recognizer
    what: str


def never(_path: Path) -> bool:
    """The recognizer of a format with no room for a mark: memfit cannot tell its own files."""
    return False


def data_inputs(path: str | Path, flag: str, files: Iterable[Path]) -> list[Input]:
    """The inputs a data flag stands for: the file, or the folder and ``files``, each file read
    from it (:func:`memfit.data.sources.resolve_sources`'s; a link in the folder reads a file
    outside it)."""
    given = Path(path)
    if given.is_dir():
        return [Input(flag, given, "data")] + [
            Input(flag, f, "data" if f.is_dir() else "file") for f in files
        ]
    return [Input(flag, given)] if given.is_file() else []


def model_inputs(path: str | Path, flag: str) -> list[Input]:
    """The input a model argument stands for where it is a local path: a folder (its files), or
    a file (a ``config.json``); nothing for a name (the hub, a known model)."""
    given = Path(path).expanduser()
    if given.is_dir():
        return [Input(flag, given, "model")]
    if given.is_file():
        return [Input(flag, given)]
    return []


def same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file: the same inode (through links, hard or symbolic), or the same
    resolved path (where one of them does not exist yet)."""
    try:
        if os.path.samefile(a, b):
            return True
    except (OSError, ValueError):
        pass
    return _real(a) == _real(b)


def _real(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


def _inside(path: Path, folder: Path) -> bool:
    """``path`` lies in ``folder`` (at any depth), links resolved."""
    real, root = _real(path), _real(folder)
    return real != root and real.startswith(root.rstrip(os.sep) + os.sep)


def _the_input(given: Path, source: Input) -> str:
    """The input as the message names it: its path too where ``given`` is another name for it
    (a link, a hard link, another spelling of the path)."""
    if os.path.abspath(given) == os.path.abspath(source.path):
        return f"the input of {source.flag}"
    return f"the input {source.path} of {source.flag} (the same file under another name)"


def destination_problems(
    path: str | Path,
    flag: str,
    kind: Kind,
    *,
    inputs: Iterable[Input] = (),
    overwrite: bool = False,
    others: Iterable[tuple[str, str | Path]] = (),
    renamed: bool = True,
) -> list[str]:
    """Why memfit must not write ``path`` (given as ``flag``), one line each; empty when it may.

    ``inputs``: what the run reads; ``others``: the run's other outputs, as (flag, path);
    ``overwrite``: the user allows an existing file memfit cannot tell it wrote to be replaced.
    ``renamed``: the writer renames a new file over ``path`` (never over a device or a FIFO);
    else it opens ``path`` and writes through (a log: a device or a FIFO takes it as it is)."""
    target = Path(path)
    if target.is_dir():
        return []  # memfit.paths.file_problem says it: a folder where the file should be
    give = f"give another {flag}"
    special = os.path.exists(target) and not os.path.isfile(target)
    if special and renamed:
        # a device, a FIFO, a socket (or a link to one): the rename would put a file in its place
        return [f"{flag}: {target} is not a regular file; {give}"]
    for source in inputs:
        if source.kind == "file":
            if same_file(target, source.path):
                return [
                    f"{flag}: {target} is {_the_input(target, source)}: memfit never writes "
                    f"over what it reads; {give}"
                ]
        elif _inside(target, source.path):
            if source.kind == "data":
                return [
                    f"{flag}: {target} is inside {source.path}, the data folder of {source.flag}: "
                    f"memfit reads every file there as data; {give}"
                ]
            # any file, memfit's own too: a run's model/ is replaced whole when it is published
            # again; a new one too (written once, it would be a file of the folder on the rerun)
            return [
                f"{flag}: {target} is inside the model folder {source.path} ({source.flag}): "
                f"memfit never writes in what it loads; {give}"
            ]
    for other_flag, other in others:
        if same_file(target, Path(other)):
            return [f"{flag}: {target} is also {other_flag}: give them different files"]
    if special:
        return []  # written through (--events /dev/stderr): nothing there to lose
    if os.path.lexists(target) and not overwrite and not _recognized(kind, target):
        # "cannot tell", never "it is not": a file memfit wrote before it marked its files (an
        # older memfit's Parquet) is memfit's, and memfit has no way to know it
        if kind.ours is never:
            why = f"{kind.what} carries no mark"
        else:
            why = f"nothing in it marks it as {kind.what}"
        return [
            f"{flag}: {target} exists and memfit cannot tell whether it wrote it ({why}); add "
            f"--overwrite to replace it, or {give}"
        ]
    return []


def _recognized(kind: Kind, path: Path) -> bool:
    """``kind.ours(path)``, False where the file cannot be read (a folder, no permission...)."""
    if not os.path.isfile(path):
        return False
    try:
        return bool(kind.ours(path))
    except Exception:  # a recognizer reads a file it does not know: any failure means "not ours"
        return False


# --- recognizers of what memfit writes --------------------------------------------------------
def first_json_record(path: Path) -> dict[str, Any] | None:
    """The first line of a JSON Lines file as an object (None: not one)."""
    with open(path, "rb") as handle:
        line = handle.readline(HEAD_BYTES)
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def starts_with(prefix: bytes) -> Recognizer:
    """A file that begins with ``prefix`` (a header line memfit writes)."""

    def ours(path: Path) -> bool:
        with open(path, "rb") as handle:
            return handle.read(len(prefix)) == prefix

    return ours


def holds_mark(*marks: bytes) -> Recognizer:
    """A file with one of ``marks`` in its first or last :data:`HEAD_BYTES` (where formats keep
    their metadata: a PNG's text chunks come first, a PDF's document information last)."""

    def ours(path: Path) -> bool:
        with open(path, "rb") as handle:
            head = handle.read(HEAD_BYTES)
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - HEAD_BYTES))
            tail = handle.read(HEAD_BYTES)
        return any(mark in head or mark in tail for mark in marks)

    return ours
