"""The one back-off policy: halve what ran, grow back after clean steps, wait twice as long after a
failed grow, agree on the smallest proposal across ranks, and the events that report a back-off."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from memfit.guard.oom import CatchOom
from memfit.guard.policy import NO_LIMIT, BackOff, agree, back_off


def test_halving_takes_half_of_what_really_ran() -> None:
    assert BackOff.halve(8, 100) == 4
    assert BackOff.halve(8, 3) == 1  # a size above the rows there were ran them all at once
    assert BackOff.halve(1, 100) == 0  # nothing is smaller than one row
    assert BackOff.halve_tokens(1000, 300) == 150
    assert BackOff.halve_tokens(100, 300) == 50
    assert BackOff.halve_tokens(1, 1) == 1


def test_grows_after_clean_steps_and_waits_twice_as_long_after_a_failed_grow() -> None:
    policy = BackOff(grow_after=2)
    assert policy.grow(2, 8) is None  # no clean step yet
    policy.after_step(clean=True)
    policy.after_step(clean=True)
    assert policy.grow(2, 8) == 4 and policy.growing and policy.clean_steps == 0
    policy.after_oom()  # the grown size does not fit
    assert policy.grow_after == 4 and not policy.growing
    policy.after_step(clean=False)
    assert policy.clean_steps == 0
    for _ in range(4):
        policy.after_step(clean=True)
    assert policy.grow(6, 8) == 8  # never above the ceiling
    policy.after_step(clean=True)
    assert policy.grow_after == 4  # a grow that fits keeps the wait
    assert BackOff.doubled(8, 8) is None


def test_back_off_reports_the_oom_then_the_new_size_or_stops() -> None:
    events: list[dict[str, Any]] = []

    def stop(error: str) -> NoReturn:
        raise RuntimeError(f"stopped: {error}")

    assert back_off(6, 4, "OOM", emit=events.append, stop=stop, step=3) == 2
    assert events == [
        {"type": "oom", "step": 3, "micro_batch_size": 6, "error": "OOM"},
        {"type": "backoff", "step": 3, "from": 6, "to": 2},
    ]
    events.clear()
    with pytest.raises(RuntimeError, match="stopped: OOM"):
        back_off(1, 4, "OOM", emit=events.append, stop=stop, step=None, phase="eval")
    assert events == [
        {"type": "oom", "step": None, "micro_batch_size": 1, "phase": "eval", "error": "OOM"}
    ]


def test_ranks_adopt_the_smallest_proposal() -> None:
    class Ranks:
        def __init__(self, others: tuple[int, int]) -> None:
            self.others = others
            self.seen: tuple[int, ...] = ()

        def least(self, *values: int) -> tuple[int, ...]:
            self.seen = values
            return tuple(min(a, b) for a, b in zip(values, self.others, strict=True))

    ranks = Ranks((2, NO_LIMIT))
    assert agree(ranks, 4, None) == (2, NO_LIMIT)
    assert ranks.seen == (4, NO_LIMIT)  # no budget: never the smallest
    assert agree(Ranks((8, 500)), 4, 0) == (4, 0)


def test_catch_oom_swallows_out_of_memory_only() -> None:
    seen: list[BaseException] = []
    with CatchOom(seen.append) as caught:
        raise MemoryError("out of memory: 8 bytes\nmore")
    assert caught.error == "out of memory: 8 bytes" and caught.exception_type is MemoryError
    assert len(seen) == 1 and seen[0].__traceback__ is None
    with pytest.raises(ValueError), CatchOom():
        raise ValueError("not memory")
    with pytest.raises(MemoryError), CatchOom(when=lambda: False):
        raise MemoryError("declined")
    with CatchOom() as clean:
        pass
    assert clean.error is None
