"""The events of a run folder as one story, also when several ranks wrote them.

With several ranks every rank appends its own lines to ``events.jsonl`` (each with its ``rank``).
The guard's decisions (back-off, grow, the probe's verdict, stop) are agreed, so every rank logs
the same one; a report shows it once, from rank 0. Out-of-memory errors are each rank's own and
are all kept (with the rank that hit them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# what only one rank's line is needed of: agreed by all ranks, logged by each
_AGREED = ("backoff", "grow", "probe", "stop", "resume")


def agreed_events(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with the agreed decisions of ranks other than 0 dropped; single-process runs
    (no ``rank`` key) pass unchanged."""
    out = []
    for event in events:
        rank = event.get("rank")
        if rank not in (None, 0) and event.get("type") in _AGREED:
            continue
        out.append(dict(event))
    return out
