"""The plan says which budget a configuration is over (issue 36): the budget less the safety
margin, the margin and ``--safety-margin``; a margin of 0 is the budget itself, and a need over
the whole budget is not told that the flag would help. No model is traced."""

from __future__ import annotations

import pytest

from memfit.devices import find_gpu
from memfit.plan.configuration import Plan
from memfit.plan.explain import budget_with_margin, over_budget
from memfit.units import format_bytes

T4 = find_gpu("t4").memory_bytes


def _plan(margin: float, budget: int = T4) -> Plan:
    return Plan(
        fits=False, budget_bytes=budget, predicted_peak_bytes=None, min_required_bytes=0,
        chosen=None, alternatives=[], explanation=[], suggestions=[], model="m",
        task="causal-lm", seq_len=64, effective_batch_size=8, gpu="t4", safety_margin=margin,
    )  # fmt: skip


@pytest.mark.parametrize(("margin", "said"), [(0.05, "5 %"), (0.025, "2.5 %"), (0.1, "10 %")])
def test_over_the_budget_left_after_the_margin(margin: float, said: str) -> None:
    usable = format_bytes(int(T4 * (1 - margin)))
    within = T4 - 1  # within the card, over what the margin leaves
    assert over_budget(_plan(margin), within) == (
        f"over the {usable} budget (a T4's {format_bytes(T4)} less the {said} safety margin; "
        "--safety-margin 0 to use it all)"
    )
    # over the whole card: the flag would not help, and the line does not offer it
    assert over_budget(_plan(margin), T4 + 1) == (
        f"over the {usable} budget (a T4's {format_bytes(T4)} less the {said} safety margin; "
        f"over the whole {format_bytes(T4)} too)"
    )
    assert budget_with_margin(_plan(margin)) == (
        f"a T4's {format_bytes(T4)} less the {said} safety margin, {usable}"
    )


def test_without_a_margin_the_budget_is_the_card() -> None:
    assert over_budget(_plan(0), T4 + 1) == f"over the budget, a T4's {format_bytes(T4)}"
    assert budget_with_margin(_plan(0)) == f"a T4's {format_bytes(T4)}"


def test_inside_parentheses_the_words_nest() -> None:
    words = over_budget(_plan(0.05), T4 - 1, nested=True)
    assert words.startswith("over the ") and "budget, a T4's" in words
    assert words.count("(") == words.count(")") == 0


def test_the_estimate_and_the_plan_share_one_default_margin() -> None:
    # the estimate's verdict names the plan's default margin without importing the planner
    from memfit.plan.configuration import SAFETY_MARGIN, Plan
    from memfit.report.console import PLAN_SAFETY_MARGIN

    assert PLAN_SAFETY_MARGIN == SAFETY_MARGIN
    assert Plan.__dataclass_fields__["safety_margin"].default == SAFETY_MARGIN
