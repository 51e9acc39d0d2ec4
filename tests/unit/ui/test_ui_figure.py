"""The page's curves as SVG (memfit.ui.figure): every point where its bytes say, the card's line
and the largest size that fits where the curve has them."""

from __future__ import annotations

import itertools
import math
from xml.etree import ElementTree

import pytest

from memfit.ui.answers import Curve
from memfit.ui.figure import HEIGHT, curve_svg, nice_ticks, tick_label

GIB = 1 << 30


def _curve(**changes: object) -> Curve:
    fields: dict[str, object] = {
        "axis": "batch_size",
        "points": [(1, 3 * GIB), (2, 5 * GIB), (4, 9 * GIB), (8, 17 * GIB)],
        "budget_bytes": 15 * GIB,
        "usable_bytes": 14 * GIB,
        "crossing": 6,
        "note": "",
    }
    fields.update(changes)
    return Curve(**fields)  # type: ignore[arg-type]


def _y(element: ElementTree.Element) -> float:
    return float(element.get("cy") or element.get("y1") or "nan")


def test_each_point_is_drawn_at_its_bytes_under_the_cards_line() -> None:
    curve = _curve()
    svg = ElementTree.fromstring(curve_svg(curve, "Memory against batch size (<128> tokens)"))
    assert svg.get("data-axis") == "batch_size"
    points = svg.findall("circle[@class='memfit-point']")
    assert [(int(p.get("data-x") or 0), int(p.get("data-bytes") or 0)) for p in points] == (
        curve.points
    )
    # more bytes, higher on the page (a smaller y); equal steps of bytes, equal steps of y
    ys = [_y(p) for p in points]
    assert ys == sorted(ys, reverse=True)
    per_gib = (ys[0] - ys[1]) / 2
    assert ys[2] == pytest.approx(ys[0] - 6 * per_gib, abs=0.11)
    # the budget line at 15 GiB, between the points of 9 and 17 GiB
    (budget,) = svg.findall("line[@class='memfit-budget']")
    assert int(budget.get("data-bytes") or 0) == 15 * GIB
    assert _y(budget) == pytest.approx(ys[0] - 12 * per_gib, abs=0.11)
    # the largest that fits: a vertical line at batch 6, from the axis up to the budget
    (fits,) = svg.findall("line[@class='memfit-fits']")
    assert fits.get("data-x") == "6" and fits.get("x1") == fits.get("x2")
    assert float(fits.get("y2") or 0) == pytest.approx(_y(budget))
    # the title is text (escaped), each point says its bytes
    assert svg.findtext("text") == "Memory against batch size (<128> tokens)"
    assert points[1].findtext("title") == "2 rows: 5.00 GiB"


def test_a_curve_without_a_card_or_a_crossing_draws_neither() -> None:
    svg = ElementTree.fromstring(curve_svg(_curve(budget_bytes=None, crossing=None), "t"))
    assert not svg.findall("line[@class='memfit-budget']")
    assert not svg.findall("line[@class='memfit-fits']")
    # the axis reaches the highest point (17 GiB): every point inside the drawing
    assert all(0 < _y(p) < HEIGHT for p in svg.findall("circle"))
    one = ElementTree.fromstring(curve_svg(_curve(points=[(128, GIB)], crossing=None), "t"))
    assert len(one.findall("circle")) == 1
    # no point yet (its kind of shape not traced): the figure says so, and draws nothing else
    empty = ElementTree.fromstring(curve_svg(_curve(points=[]), "t"))
    assert empty.get("class") == "memfit-curve" and not empty.findall("circle")
    assert not empty.findall("line") and empty.findtext("text[@class='memfit-empty']")


@pytest.mark.parametrize("high", [0.3, 1.0, 7.2, 14.56, 80.0, 1234.0])
def test_ticks_start_at_zero_and_cover_the_highest_value_in_round_steps(high: float) -> None:
    ticks = nice_ticks(high)
    steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
    assert ticks[0] == 0 and ticks[-1] >= high and len(steps) == 1
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1, 2, 5) and 3 <= len(ticks) <= 12


def test_ticks_from_a_low_end_start_at_the_first_round_value_above_it() -> None:
    assert nice_ticks(512, 6, 64) == [100, 200, 300, 400, 500, 600]
    assert nice_ticks(256, 6, 1) == [50, 100, 150, 200, 250, 300]


@pytest.mark.parametrize("high", [0.004, 0.02, 0.3, 14.56, 1234.0])
def test_every_tick_has_its_own_label(high: float) -> None:
    """Labels as precise as the step: a small model's axis (a few MiB, in GiB) is not a row of
    zeros."""
    ticks = nice_ticks(high)
    labels = [tick_label(t, ticks[1] - ticks[0]) for t in ticks]
    assert len(set(labels)) == len(labels) and labels[0] in ("0", "0.0", "0.00", "0.000")
    assert all(
        float(label.replace(",", "")) == pytest.approx(t)
        for label, t in zip(labels, ticks, strict=True)
    )


def test_a_small_models_curve_labels_its_axis_in_fractions_of_a_gib() -> None:
    mib = 1 << 20
    svg = ElementTree.fromstring(
        curve_svg(_curve(points=[(64, 2 * mib), (128, 3 * mib)], budget_bytes=None), "t")
    )
    labels = [t.text for t in svg.findall("text") if t.get("text-anchor") == "end"]
    assert len(set(labels)) == len(labels) >= 3 and labels[-1].startswith("0.00")
