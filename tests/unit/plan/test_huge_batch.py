"""A huge --effective-batch-size plans at once: the micro-batches are the divisors of the per-rank
batch, found from its prime factors (trying every number up to it took a minute at 10^9)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import pytest

from cli_run import run_cli
from memfit.plan import plan
from memfit.plan.planner import _divisors

# primes (checked with sympy.isprime) whose products no trial division up to N can reach
P12 = 999_999_999_989  # the largest prime below 10^12
M61 = 2**61 - 1  # a Mersenne prime
P9, Q9 = 999_999_937, 999_999_929  # the two largest primes below 10^9


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (the old divisor search never ends at these sizes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_divisors_of_small_numbers_are_every_divisor() -> None:
    for n in range(1, 400):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (6 * P12, [1, 2, 3, 6, P12, 2 * P12, 3 * P12, 6 * P12]),
        (M61, [1, M61]),
        # the hardest below 10^18: two primes of nine digits
        (P9 * Q9, [1, Q9, P9, P9 * Q9]),
        (P9 * P9, [1, P9, P9 * P9]),
    ],
)
def test_divisors_of_huge_batches(n: int, expected: list[int]) -> None:
    with _deadline(20):
        assert _divisors(n) == expected


def test_divisors_of_a_highly_composite_batch() -> None:
    n = 897_612_484_786_617_600  # the most divisors of any number up to 10^18
    with _deadline(20):
        found = _divisors(n)
    assert len(found) == 103_680 and found == sorted(set(found))
    assert found[0] == 1 and found[-1] == n and all(n % d == 0 for d in found[::997])
    with _deadline(20):
        ten = _divisors(10**18)
    assert len(ten) == 19 * 19 and ten[:6] == [1, 2, 4, 5, 8, 10]


@pytest.mark.slow
def test_a_plan_of_a_huge_effective_batch_returns(tiny_bert: str) -> None:
    """The whole plan path (the search, the explanation, the scale-out prices) at 6·(10^12 − 11)
    samples per step: a micro-batch that divides it, accumulation making it up exactly."""
    effective = 6 * P12
    with _deadline(120):
        result = plan(
            tiny_bert,
            task="classification",
            seq_len=16,
            effective_batch_size=effective,
            gpu_memory="1GiB",
        )
    chosen = result.plan
    assert result.fits and chosen is not None
    micro, steps = chosen["micro_batch_size"], chosen["gradient_accumulation_steps"]
    assert micro * steps == effective and micro in _divisors(effective)


@pytest.mark.slow
def test_an_18_digit_prime_batch_plans_at_micro_batch_1(tiny_gpt2: str) -> None:
    """A prime: micro-batch 1 (or the whole batch, which no memory holds), accumulated; the
    estimate is never asked for a micro-batch of 10^18 rows (its dims would pass 64 bits)."""
    prime = 999_999_999_999_999_989
    with _deadline(120):
        result = plan(
            tiny_gpt2, task="causal-lm", seq_len=64, effective_batch_size=prime, gpu_memory="2GiB"
        )
    assert result.plan is not None
    assert result.plan["micro_batch_size"] == 1
    assert result.plan["gradient_accumulation_steps"] == prime


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--task", "classification", "--effective-batch-size", str(10**18 + 1)],
            "--effective-batch-size: at most 10^18 samples per optimizer step",
        ),
        (
            ["--task", "sentence-embedding", "--effective-batch-size", str(10**12)],
            "--effective-batch-size: 1000000000000 pairs per GPU in one step; the "
            "in-batch-negatives loss mnrl holds them all at once",
        ),
    ],
)
def test_a_batch_beyond_what_can_be_planned_is_one_line(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, argv: list[str], expected: str
) -> None:
    with _deadline(60):
        code, out, err = run_cli(
            capsys, "plan", tiny_bert, "--seq-len", "16", "--gpu-memory", "1GiB", *argv
        )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert expected in err


def test_train_notes_a_short_last_step_of_a_huge_batch_at_once() -> None:
    """memfit train's note on the short last step of an epoch (in-batch negatives) suggests a
    step size near the asked one from the divisors of the data's rows, not by trying every
    number near a step size of 6·10^12."""
    from memfit.train.recipes.sentence_embedding import SentenceEmbeddingRecipe

    recipe = SentenceEmbeddingRecipe("unused", loss="mnrl")
    with _deadline(20):
        note = recipe.short_step_note(96, 6 * P12)
    assert note is not None and "96 of 5999999999934 pairs (96 rows)" in note
