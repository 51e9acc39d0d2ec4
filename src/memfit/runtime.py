"""What a run needs from its machine, shared by ``train`` and ``infer``: the device, the autocast
context of a precision, and JSON Lines logs that a killed process leaves readable up to its end.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the CLI reads the launcher's settings before torch loads


def launched_world_size() -> int:
    """The number of ranks the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def resolve_device(device: str | None) -> torch.device:
    """``--device`` as given, else CUDA where a GPU is visible, else the CPU."""
    import torch  # start-up: the CLI's quick verbs read this module without torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(
    device: torch.device, precision: str
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A factory of the autocast context for ``precision`` (fp32: no autocast); the weights stay
    in their own dtype, the matmuls run in the lower one."""
    import torch  # start-up: the CLI's quick verbs read this module without torch

    if precision not in ("fp16", "bf16"):
        return contextlib.nullcontext
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return lambda: torch.autocast(device.type, dtype=dtype)


class JsonlLog:
    """Append-only JSON Lines, flushed line by line (a killed run keeps what it logged).

    The file is opened at the first line, in ``mode`` (``a``: append, ``w``: start afresh), so a
    caller may rewrite the file (a resume cuts a killed run's last lines) after the log exists
    but before it writes. ``stamp``: each record gets a ``time`` key first. ``keep``: the records
    are also kept in ``records`` (for a caller that reports them at the end). ``open_now``: create
    the file at once (an empty log is then a file that says "nothing happened").
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        mode: str = "a",
        stamp: bool = False,
        keep: bool = False,
        open_now: bool = False,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self._mode = mode
        self._stamp = stamp
        self._keep = keep
        self._handle: Any = None
        self.records: list[dict[str, Any]] = []
        if open_now and self.path is not None:
            self._open()

    def _open(self) -> None:
        assert self.path is not None
        self._handle = open(self.path, self._mode, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._stamp:
            import time

            record = {"time": round(time.time(), 3), **record}
        if self._keep:
            self.records.append(record)
        if self.path is None:
            return
        if self._handle is None:
            self._open()
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class NoLog:
    """A log that writes nowhere (ranks other than 0: rank 0 logs the whole step)."""

    path = None

    def write(self, record: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def _below_error(record: Any) -> bool:
    import logging

    return bool(record.levelno >= logging.ERROR)


def quiet_deepspeed() -> None:
    """DeepSpeed's logger passes errors only: transformers imports DeepSpeed, wherever it is
    installed, to check it as a model loads, and DeepSpeed then warns how it found the
    accelerator. A filter, not a level: DeepSpeed sets its logger's level as it creates it."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    if _below_error not in logger.filters:
        logger.addFilter(_below_error)
