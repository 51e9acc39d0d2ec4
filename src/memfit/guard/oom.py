"""Catching out-of-memory and cleaning up after it, for every guarded loop.

:class:`Guard` (``memfit train``, ``memfit predict``/``embed``) and the Trainer integrations
(:mod:`memfit.integrations`) run an attempt, catch an OOM (:func:`is_oom`; anything else goes
on up), let go of what the failed attempt holds (:func:`release`, :func:`drop_gradients`,
:func:`free_memory`) and retry smaller (:mod:`memfit.guard.policy` says how much smaller).
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType

import torch

from memfit.guard.cap import CAP_MESSAGE_PREFIX

# lowercase fragments of messages that mean out of memory, and only that
_OOM_MESSAGES = (
    "out of memory",  # CUDA, the CUDA caching allocator, and the memory cap
    "cublas_status_alloc_failed",
    "defaultcpuallocator: can't allocate memory",
    CAP_MESSAGE_PREFIX,
)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error, also when something wrapped it in a
    ``RuntimeError`` (its message or its ``__cause__`` then says so)."""
    return oom_in(exc) is not None


def oom_in(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in ``exc`` or its chain of causes (None: there is none). What a
    message quotes: a wrapper's own words may say nothing of memory (transformers' tokenizer
    turns an OOM while it makes its tensors into "Unable to create tensor, you should probably
    activate truncation and/or padding…")."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError | MemoryError):
            return current
        if isinstance(current, RuntimeError):
            message = str(current).lower()
            if any(fragment in message for fragment in _OOM_MESSAGES):
                return current
            if "cudnn_status_not_supported" in message and "memory" in message:
                return current
        current = current.__cause__
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none): what the
    events and messages quote of an OOM."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def release(exc: BaseException) -> None:
    """Drop what an exception keeps alive: its traceback's frames hold the failed graph."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__


class CatchOom:
    """A ``with`` block that swallows an out-of-memory error (and only that) from its body.

    After the block ``error`` is the OOM's first line (None: the body finished, or returned) and
    ``exception_type`` its type; the exception's frames, which hold the failed graph, are
    released already. ``on_oom`` sees the exception first (a CUDA memory snapshot); ``when``,
    asked only on an OOM, may decline to catch it (a batch that must not be split).
    """

    def __init__(
        self,
        on_oom: Callable[[BaseException], None] | None = None,
        *,
        when: Callable[[], bool] | None = None,
    ) -> None:
        self.on_oom = on_oom
        self.when = when
        self.error: str | None = None
        self.exception_type: type[BaseException] | None = None

    def __enter__(self) -> CatchOom:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if not isinstance(exc, Exception):
            return False
        oom = oom_in(exc)
        if oom is None:
            return False
        if self.when is not None and not self.when():
            return False
        # the OOM's own words, not those of a library that wrapped it
        self.error = first_line(oom)
        self.exception_type = type(exc)
        if self.on_oom is not None:
            self.on_oom(exc)
        release(exc)
        return True


def drop_gradients(params: Iterable[torch.Tensor]) -> None:
    """Drop every gradient of ``params``: a failed attempt's are partial (earlier chunks, a
    backward that died half-way), and the re-run accumulates the whole step again."""
    for param in params:
        param.grad = None


def free_memory(device: torch.device | None) -> None:
    """Collect the failed graph and hand CUDA's cached blocks back (``device`` None: whichever
    device ran), so that the smaller attempt starts from a defragmented pool."""
    # the failed graph may sit in reference cycles; collect it before the re-run allocates
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.empty_cache()
