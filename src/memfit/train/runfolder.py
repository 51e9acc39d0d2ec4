"""The run folder (``--output-dir``): memfit writes only into folders that are its own.

A folder is a run folder when it holds ``run.lock`` (made before anything else is written) or
``run.json`` (every run folder of every memfit version has one). An output folder that holds
anything else, and neither of them, is refused: it may be the model being fine-tuned, or a user's
work, and a run would replace its ``model/`` folder. Hidden entries (``.gitkeep``) and a volume's
``lost+found`` do not count: a folder holding only them is empty.

``run.lock`` is also the run's lock: the running process holds an exclusive ``flock`` on it for its
whole life, so a second run on the same folder is refused at once (with the first one's process
id). The kernel drops the lock when the process ends, however it ends (``kill -9`` included): there
is never a stale lock to clean up. Where the file system cannot lock (some network mounts), the run
goes on unlocked and says so in ``events.jsonl``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import UsageError

if TYPE_CHECKING:
    import torch

LOCK_FILE = "run.lock"
RUN_FILE = "run.json"
MARKERS = (LOCK_FILE, RUN_FILE)
SHOWN_NAMES = 3

try:  # POSIX; elsewhere runs are not locked
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def is_run_folder(folder: Path) -> bool:
    return any((folder / name).exists() for name in MARKERS)


def folder_problems(folder: Path, *, resume: bool, check_lock: bool = True) -> list[str]:
    """What stops a run from writing into ``folder``, checked without writing anything."""
    if folder.exists() and not folder.is_dir():
        return [f"--output-dir: {folder} exists and is not a folder"]
    if not folder.exists():
        parent = _nearest_existing(folder)
        if not parent.is_dir():
            return [f"--output-dir: {folder}: {parent} is a file, not a folder"]
        if not os.access(parent, os.W_OK | os.X_OK):
            return [f"--output-dir: {folder}: {parent} is not writable"]
        return []
    try:
        names = _names(folder)
    except OSError as exc:
        return [f"--output-dir: {folder}: {exc.strerror or exc}"]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [f"--output-dir: {folder} is not writable"]
    if names and not is_run_folder(folder):
        shown = ", ".join(names[:SHOWN_NAMES]) + (", …" if len(names) > SHOWN_NAMES else "")
        return [
            f"--output-dir: {folder} already holds files memfit did not write ({shown}); a run "
            "would write its model/ and logs over them: choose a new or empty folder"
        ]
    if is_run_folder(folder) and (linked := link_problems(folder)):
        return linked
    if check_lock and (holder := lock_holder(folder)) is not None:
        return [_in_use(folder, holder)]
    if not resume and (folder / RUN_FILE).exists():
        return [
            f"--output-dir: {folder} already holds a run; add --resume to continue it, "
            "or choose another folder"
        ]
    return []


# what an empty folder may hold: hidden files (.gitkeep, .DS_Store, .ipynb_checkpoints) and the
# lost+found of a volume's root (a mounted disk given as --output-dir)
def _names(folder: Path) -> list[str]:
    """The entries of ``folder`` that make it non-empty, sorted."""
    return sorted(
        child.name
        for child in folder.iterdir()
        if not child.name.startswith(".") and child.name != "lost+found"
    )


def link_problems(folder: Path) -> list[str]:
    """The symbolic links in a run folder that memfit would write through, each a line.

    memfit appends to its logs and writes its files in place: through a link at the folder's
    top (``events.jsonl``, ``run.lock``) it would write into a file outside the folder (an
    ``events.jsonl`` linked elsewhere gets the run's lines). A link to a folder is followed: a
    run's ``checkpoints/`` (or ``model/``) on a scratch disk is a user's choice, and memfit writes
    in it only new files (a checkpoint is a fresh temporary folder renamed into place). In
    ``checkpoints/``, linked or not, memfit renames and removes whole step folders: a link there
    is refused. A run folder on another disk is the link of the whole ``--output-dir``, which is
    followed."""
    problems = []
    for parent in (folder, folder / "checkpoints"):
        try:
            children = sorted(parent.iterdir()) if parent.is_dir() else []
        except OSError:
            continue
        for child in children:
            # a link to a folder at the top is followed; one to a file (or to nothing: an append
            # would create its target) never is
            if child.is_symlink() and (parent != folder or not child.is_dir()):
                problems.append(
                    f"--output-dir: {child} is a symbolic link (to {os.readlink(child)}); memfit "
                    "writes a run's files only inside its folder, never through a link: remove "
                    "it (or put a copy of what it points to in its place) and run again"
                )
    return problems


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _in_use(folder: Path, holder: str) -> str:
    return (
        f"--output-dir: {folder} is in use by another memfit train ({holder}); wait for it to "
        "end or choose another folder"
    )


def lock_holder(folder: Path) -> str | None:
    """Who holds the folder's lock now ("process 1234"), or None when nobody does."""
    path = folder / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(path)
    except OSError:
        return None  # a file system that cannot lock
    finally:
        os.close(fd)
    return None


def _holder_text(path: Path) -> str:
    try:
        pid = json.loads(path.read_text(encoding="utf-8")).get("pid")
    except (OSError, ValueError, AttributeError):
        pid = None
    return f"process {pid}" if pid else "another process"


class RunLock:
    """The exclusive lock on ``folder/run.lock`` for the run's lifetime (``release`` ends it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.note: str | None = None
        self._fd: int | None = None

    def acquire(self, *, resume: bool) -> None:
        """Make the folder (parents too), take the lock, and check the folder again under it.

        Raises UsageError naming --output-dir when the folder cannot be made, is in use or (for a
        new run) already holds a run that finished while this one was starting.
        """
        try:
            existed = self.folder.is_dir() and bool(_names(self.folder))
            if existed and not is_run_folder(self.folder):
                raise UsageError(folder_problems(self.folder, resume=resume)[0])
            self.folder.mkdir(parents=True, exist_ok=True)
            if linked := link_problems(self.folder):
                raise UsageError(linked[0])
            # never through a link (one made since the check above included)
            no_follow = getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | no_follow, 0o644)
        except OSError as exc:
            raise UsageError(f"--output-dir: {self.folder}: {exc.strerror or exc}") from None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(
                    _in_use(self.folder, _holder_text(self.folder / LOCK_FILE))
                ) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise UsageError(f"--output-dir: {self.folder}: {exc.strerror}") from None
                self.note = f"{self.folder} cannot be locked ({exc.strerror}): the run is unlocked"
        self._fd = fd
        if not resume and (self.folder / RUN_FILE).exists():
            self.release()
            raise UsageError(folder_problems(self.folder, resume=False, check_lock=False)[0])
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# torch.save's writer (caffe2's inline_container.cc) on a short write: no errno in its message
_TORCH_WRITE = re.compile(
    r"PytorchStreamWriter failed writing|unexpected pos \d+|file write failed"
)
# less than this free after a write failed: the disk is full (a failed write leaves it at ~0)
FULL_BELOW = 1 << 20


def as_os_error(exc: BaseException, path: Path) -> OSError | None:
    """The OSError inside a library's own error, or None when it is none: safetensors reports a
    full disk as ``SafetensorError: ... (os error 28)``, torch.save as ``RuntimeError: [enforce
    fail at inline_container.cc:…] . unexpected pos …`` with no errno (then the disk holding
    ``path`` says whether it is full: call this before freeing anything on it)."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    match = _OS_ERROR.search(text)
    if match is not None:
        number = int(match.group(1))
        return OSError(number, os.strerror(number), str(path))
    if isinstance(exc, RuntimeError) and _TORCH_WRITE.search(text):
        free = free_bytes(path)
        if free is not None and free < FULL_BELOW:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        cause = _TORCH_WRITE.search(text)
        assert cause is not None
        return OSError(
            errno.EIO,
            f"the write failed (torch: {cause.group(0)}); the disk may be full, over its quota "
            "or failing",
            str(path),
        )
    return None


def free_bytes(path: Path) -> int | None:
    """The bytes an unprivileged write may still use on the disk holding ``path`` (or None)."""
    try:
        stats = os.statvfs(_nearest_existing(path))
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return stats.f_bavail * stats.f_frsize


@contextlib.contextmanager
def removed_on_failure(tmp: Path) -> Iterator[None]:
    """Whatever goes wrong while ``tmp`` is written (a full disk half-way, a kill's signal), the
    half-written ``tmp`` goes; a library's wrapped disk error comes out as the OSError it is."""
    try:
        yield
    except BaseException as exc:
        disk = as_os_error(exc, tmp)  # first: what is free before the half-written files go
        shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None and disk is not exc:
            raise disk from None
        raise


def finished(folder: Path) -> dict[str, Any] | None:
    """The result a finished run recorded in run.json ("stopped": "done"), else None."""
    try:
        result = json.loads((folder / RUN_FILE).read_text(encoding="utf-8")).get("result")
    except (OSError, ValueError, AttributeError):
        return None
    return result if isinstance(result, dict) and result.get("stopped") == "done" else None


def model_present(folder: Path) -> bool:
    """Whether the run folder's ``model/`` holds a model (a weights file in it)."""
    model = folder / "model"
    return model.is_dir() and any(
        p.suffix in (".safetensors", ".bin") and p.is_file() for p in model.rglob("*")
    )


def run_config(folder: Path) -> dict[str, Any] | None:
    """The settings of the run in ``folder`` (run.json's ``config``), or None."""
    try:
        config = json.loads((folder / RUN_FILE).read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a JSON file whole or not at all (a temporary beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


_MODEL_TEMP = re.compile(r"^\.(tmp|old)-(model|best)-\d+$")


def clean_temporaries(folder: Path) -> None:
    """Remove the half-written model folders a killed run left (``.tmp-model-PID``), and put back
    a model folder a kill caught between its two renames (only ``.old-model-PID`` is left)."""
    if not folder.is_dir():
        return
    for child in sorted(folder.iterdir()):
        match = _MODEL_TEMP.match(child.name)
        if match is None:
            continue
        final = folder / match.group(2)
        if match.group(1) == "old" and not final.exists():
            os.rename(child, final)
        else:
            _remove(child)
    for child in folder.glob(f".{RUN_FILE}.tmp-*"):
        with contextlib.suppress(OSError):
            child.unlink()


def save_model_folder(
    recipe: Any,
    folder: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    *,
    merge_lora: bool = False,
) -> None:
    """The recipe's saved model, written beside and renamed into place.

    A LoRA model is saved as a peft adapter folder, or with ``merge_lora`` merged (from a copy:
    training goes on with the adapters) into a plain folder (``memfit.train.lora.save_lora``).
    ``state_dict``: the whole model's weights gathered from FSDP shards.
    """
    # memfit.train.config, which the CLI builds its options from, imports this module: for the
    # CLI's start-up time, memfit.train.lora (torch) loads here
    from memfit.train.lora import is_lora, save_lora

    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # a full disk half-way: the folder in place (if any) stays, the half-written one goes
    with removed_on_failure(tmp):
        if is_lora(recipe.model):
            save_lora(recipe, tmp, merge=merge_lora)
        elif state_dict is not None:
            recipe.save(tmp, state_dict=state_dict)
        else:
            recipe.save(tmp)
    old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
    if folder.exists():
        os.rename(folder, old)
    os.rename(tmp, folder)
    _remove(old)


def _remove(path: Path) -> None:
    """Remove a replaced folder; a link to one (a ``model/`` linked to another disk) loses the
    link only, what it pointed to is left where it is (rmtree refuses a link, it would stay)."""
    if path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
