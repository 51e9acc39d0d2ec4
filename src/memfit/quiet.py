"""Third-party log lines and warnings that say nothing to a memfit user, dropped in one place.

memfit calls transformers, peft, bitsandbytes and torch for the user; a few of their messages are
about a package no memfit job needs or a default memfit chose, and would be the first lines a user
reads. Each filter below names the logger (or the warning's category and module) and the start of
the one message it drops, and says why: every other record of that logger and every other warning
passes as before. Nothing here sets a logger's level or verbosity.

:func:`install` puts the log filters in place, on the library loggers that write those records.
``import memfit`` calls it (a few milliseconds: it imports :mod:`logging`, :mod:`re` and
:mod:`warnings` only), so they are there before memfit imports a library whose message they drop —
bitsandbytes logs its line while it is imported, and transformers, peft and TRL import it (a
script that imports them before memfit sees that one line). The CLI's entry, each function of
memfit's Python API and the Trainer integrations call it again (it adds nothing twice).

The warnings are dropped only inside :func:`calls`, around memfit's own calls of the libraries (a
guarded Trainer's ``train``, the estimator's LoRA build): a warning is reported from the library
module that raises it whoever made the call, so a process-wide filter would also hide the same
warning from the user's own code.

Written by hand: neither :mod:`logging` nor transformers' logging utilities drop one message of a
logger and keep the others (transformers' verbosity is per level, for the whole library).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import NamedTuple


class LogNoise(NamedTuple):
    """A log record that says nothing: ``logger``'s records whose message starts with
    ``message`` (a regular expression)."""

    logger: str
    message: str
    why: str


class WarningNoise(NamedTuple):
    """A warning that says nothing: ``category`` warned from a module whose name starts with
    ``module`` with a message that starts with ``message`` (regular expressions, as
    :func:`warnings.filterwarnings` takes them)."""

    category: type[Warning]
    module: str
    message: str
    why: str


LOG_NOISE: tuple[LogNoise, ...] = (
    LogNoise(
        "bitsandbytes.backends.cpu.ops",
        r"Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'",
        "logged as bitsandbytes is imported (peft imports it, and transformers imports peft) on "
        "a CPU with AVX512-BF16 when the optional `kernels` package, which fetches a faster "
        "4-bit CPU kernel from the Hugging Face Hub, is not installed; bitsandbytes falls back "
        "to its own kernel, and the user asked for neither",
    ),
    LogNoise(
        "transformers.modeling_utils",
        r"`loss_type=None` was set in the config but it is unrecognized",
        "logged the first time a causal LM computes its own loss (a Trainer passes labels) "
        "when its config names no `loss_type` (GPT-2's, most Hub configs): transformers then "
        "uses the default causal-LM loss, the right one",
    ),
    LogNoise(
        "DeepSpeed",
        r"Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to "
        r"detect it",
        "logged as DeepSpeed is imported (accelerate imports it, where installed, as a Trainer "
        "is built) on a machine where torch sees no GPU: the run is on the CPU, which its "
        "device says already",
    ),
)

WARNING_NOISE: tuple[WarningNoise, ...] = (
    WarningNoise(
        UserWarning,
        r"torch\.utils\.data\.dataloader",
        r"'pin_memory' argument is set as true but no accelerator is found",
        "the Trainer's dataloader pins memory by default; on a machine without a GPU there is "
        "nothing to pin for, and torch says so once per dataloader",
    ),
    WarningNoise(
        FutureWarning,
        r"transformers\.modeling_utils",
        r"`is_gradient_checkpointing` is deprecated",
        "peft reads transformers' old name for it as it wraps a model in LoRA adapters (and as "
        "it prepares a quantized one): the deprecated call is peft's, not the user's",
    ),
)


class _DropNoise(logging.Filter):
    """Drops a logger's records whose message starts with one of ``patterns``."""

    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: logging's to report
            return True
        return not any(p.match(message) for p in self.patterns)


def install() -> None:
    """Put the log filters above in place (the ones already there are left as they are)."""
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for log_noise in LOG_NOISE:
        by_logger.setdefault(log_noise.logger, []).append(re.compile(log_noise.message))
    for name, patterns in by_logger.items():
        # a filter on the logger that logs the record: its other records, and those of every
        # other logger (children included), pass untouched
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(patterns))


@contextlib.contextmanager
def calls() -> Iterator[None]:
    """Around memfit's own calls of the libraries: the log filters, and the warnings above
    dropped until the block ends (``warnings.catch_warnings`` restores the filters after it)."""
    install()
    with warnings.catch_warnings():
        for warning_noise in WARNING_NOISE:
            warnings.filterwarnings(
                "ignore",
                message=warning_noise.message,
                category=warning_noise.category,
                module=warning_noise.module,
            )
        yield
