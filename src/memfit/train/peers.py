"""Several ranks on several hosts: what a rank does when another is gone, and what it checks.

- **A rank that dies** (``kill -9``, a crash, a host that goes away) closes its sockets: every other
  rank's next collective fails at once (gloo: "Connection reset by peer"). Each survivor then ends
  with one line, :class:`RankLostError` (exit 5), naming the newest checkpoint and ``--resume``,
  instead of a traceback. On one host torchrun's agent also stops the survivors (SIGTERM); on
  several hosts each host's ranks find out by themselves, from their own collectives.
- **A rank that hangs** (alive but never joining: a stopped process, a deadlocked data loader, a
  host that stops answering without closing its connections) is noticed only by the collectives'
  timeout: ``MEMFIT_RANK_TIMEOUT`` (seconds, or ``90s``, ``10m``, ``1h``; 30 minutes by default,
  torch's own for gloo). Every wait of one rank for another counts, rank 0 writing a checkpoint
  or tokenizing a large file while the others wait included: keep it above the longest of those.
- **One run folder.** Rank 0 writes the run folder (model, checkpoints, metrics); every rank
  appends its events to it and reads the checkpoint back on ``--resume``. On several hosts
  ``--output-dir`` must therefore be one shared folder (NFS, a cluster file system) that every
  host sees at the same path: :func:`check_shared_folder` refuses a run whose ranks do not see
  rank 0's folder before the first step, in one line (exit 2).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, UsageError
from memfit.runtime import launched_rank, launched_world_size

RANK_TIMEOUT_ENV = "MEMFIT_RANK_TIMEOUT"
DEFAULT_RANK_TIMEOUT = datetime.timedelta(minutes=30)
# a file that rank 0 writes and every other rank must read back: hidden (not a "foreign" file),
# named anew each run (a name no host looked up before: no network file system has it cached as
# missing)
SHARED_MARKER = ".memfit-ranks-"
# how long another host may take to see rank 0's new file; only a folder that is not shared
# waits it out in full
SHARED_WAIT_SECONDS = 10.0


class RankLostError(MemfitError):
    """This rank lost contact with another (it died, was killed, or did not answer in time)."""

    exit_code = 5
    # the run's files are closed and its lock released before this reaches the CLI: it ends the
    # process at once (the interpreter's teardown of torch and transformers takes seconds)
    quick_exit = True


_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|m|min|h)?\s*$", re.IGNORECASE)


def rank_timeout(environ: Mapping[str, str] = os.environ) -> datetime.timedelta:
    """How long a rank waits for another in a collective: ``MEMFIT_RANK_TIMEOUT``, else 30 min."""
    value = environ.get(RANK_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_RANK_TIMEOUT
    match = _DURATION.match(value)
    seconds = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()] if match else 0.0
    if seconds <= 0:
        raise UsageError(
            f"{RANK_TIMEOUT_ENV}={value!r}: give how long a rank waits for another, in seconds "
            "(600) or with a unit (90s, 10m, 1h)"
        )
    return datetime.timedelta(seconds=seconds)


def describe_timeout(timeout: datetime.timedelta) -> str:
    seconds = timeout.total_seconds()
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


# what gloo, NCCL and the c10d store say when the other end of a connection is gone, or silent
_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "socket closed",
    "failed to recv",
    "failed to send",
)
_SILENT = ("timed out", "timeout")
# gloo's words for a wait past the timeout that closed the connection (a pending collective of
# either rank then fails with them; seen on a loaded machine instead of "Timed out waiting")
_GLOO_TIMEOUTS = ("application timeout caused pair closure",)
_LOCATION = re.compile(r"^\[[^\]]*\]\s*")


def lost_contact(exc: BaseException, output_dir: Path) -> RankLostError | None:
    """``exc`` as a :class:`RankLostError` when it says that another rank is gone or silent
    (a collective's error, several ranks), else None (then it is something else: re-raised)."""
    # start-up time: torch loads only when a run failed (memfit train's CLI reads this module)
    import torch.distributed as dist

    # joined, or launched as several ranks (joining itself can time out: a rank that never came)
    joined = dist.is_available() and dist.is_initialized()
    if not isinstance(exc, RuntimeError) or not (joined or launched_world_size() > 1):
        return None
    text = str(exc)
    lowered = text.lower()
    gone = next((phrase for phrase in _GONE if phrase in lowered), None)
    # a timeout counts only where the collectives' own libraries report it (not any timeout)
    from_library = isinstance(exc, dist.DistError) or any(
        name in lowered for name in ("gloo", "c10d", "nccl", "processgroup")
    )
    silent = gone is None and (
        (from_library and any(phrase in lowered for phrase in _SILENT))
        or any(phrase in lowered for phrase in _GLOO_TIMEOUTS)
    )
    if gone is None and not silent and not isinstance(exc, dist.DistError):
        return None
    rank = dist.get_rank() if joined else launched_rank()
    timeout = rank_timeout()
    if silent:
        what = (
            f"rank {rank} waited {describe_timeout(timeout)} for another rank that did not answer "
            f"(stuck or too slow; {RANK_TIMEOUT_ENV} sets the wait)"
        )
    else:
        what = (
            f"rank {rank} lost contact with another rank (it died, was killed or failed: see its "
            "output)"
        )
    return RankLostError(f"{what}: {_reason(text, gone)}; {_next_step(output_dir)}")


def _reason(text: str, phrase: str | None) -> str:
    """The library's message, short: its first line without the source location, or the phrase."""
    first = _LOCATION.sub("", text.strip().splitlines()[0] if text.strip() else "")
    first = first.split(". This is typically")[0].strip()
    if len(first) > 160:
        first = phrase or first[:157] + "..."
    return first or (phrase or "no message")


def _next_step(output_dir: Path) -> str:
    """Where the run can go on from: the newest checkpoint, and the command."""
    # start-up time: memfit.train.checkpoint loads torch (memfit train's CLI reads this module)
    from memfit.train import checkpoint as ck

    steps = ck.completed_steps(output_dir / "checkpoints")
    if not steps and not (output_dir / "run.json").exists():
        return "no step was run: run the same command again"
    if steps:
        newest = output_dir / "checkpoints" / f"step-{steps[-1]}"
        return f"the newest checkpoint is {newest}: run the same command again with --resume"
    return (
        "no checkpoint was written (--save-every N keeps one every N steps): run the same "
        "command again"
    )


def check_shared_folder(ranks: Any, out: Path) -> None:
    """Every rank sees rank 0's run folder (one shared folder on several hosts), or every rank
    stops with one line (exit 2) before the first step. Rank 0 writes a fresh token into the
    folder; the others read it back (waiting out a network file system's cache, at most
    :data:`SHARED_WAIT_SECONDS`), and all learn who did not see it."""
    if ranks is None:
        return
    token = secrets.token_hex(8) if ranks.is_main else ""
    if ranks.is_main:
        for stale in out.glob(SHARED_MARKER + "*"):  # a killed run's
            stale.unlink(missing_ok=True)
        (out / (SHARED_MARKER + token)).write_text(token, encoding="utf-8")
    # after rank 0's write: every rank holds the token it must find in the file
    token = ranks.broadcast_object(token)
    marker = out / (SHARED_MARKER + token)
    seen = ranks.is_main
    deadline = time.monotonic() + SHARED_WAIT_SECONDS
    while not seen:
        with contextlib.suppress(OSError):
            seen = marker.read_text(encoding="utf-8") == token
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    views = ranks.gather_object((seen, socket.gethostname()))
    if ranks.is_main:
        with contextlib.suppress(OSError):
            marker.unlink()
    blind = [f"rank {r} ({host})" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise UsageError(
            f"--output-dir: {out} is rank 0's folder, but {', '.join(blind)} cannot see it: on "
            "several hosts the run folder must be one shared folder (NFS or a cluster file "
            "system) at the same path on every host (rank 0 writes the checkpoints, every rank "
            "reads them back on --resume)"
        )
