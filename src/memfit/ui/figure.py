"""A curve of the page (:class:`memfit.ui.answers.Curve`) as one inline SVG: the estimates, the
card's line and the largest size that fits, with axes in GiB.

Drawn here, not by Gradio's LinePlot (Vega): a slider's move redraws a curve, and with the two
curves as LinePlots a move took a median of 220 ms to every figure against 142 ms as these SVGs
(bench/ui_speed.py, bert-base-uncased on a T4, 2 cores without a GPU), where a move may take
100 ms; an SVG of a few dozen elements is drawn by the browser at once. Each point carries its
exact bytes (``data-x``, ``data-bytes``) and a tooltip (``<title>``).
"""

from __future__ import annotations

import html
import math

from memfit.ui.answers import Curve
from memfit.units import format_bytes

_GIB = float(1 << 30)
# the drawing's own units (the SVG scales to its box: viewBox)
WIDTH, HEIGHT = 480, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 18, 34, 44
_ESTIMATE, _BUDGET, _FITS = "#1f77b4", "#d62728", "#2ca02c"
_AXIS_LABELS = {"seq_len": "sequence length (tokens)", "batch_size": "batch size"}


def nice_ticks(high: float, count: int = 5, low: float = 0.0) -> list[float]:
    """Ticks from ``low`` (or the first round value above it) to at least ``high``, a round step
    apart (1, 2 or 5 times a power of ten), about ``count`` of them."""
    if high <= low:
        return [low, low + 1.0]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9)
    last = math.ceil(high / step - 1e-9)
    return [i * step for i in range(first, last + 1)]


def tick_label(value: float, step: float) -> str:
    """A tick's label, with as many decimals as the ticks' ``step`` needs (0, 0.5, 12, 1,024;
    0.002, 0.004 where the step is a thousandth)."""
    if float(value).is_integer() and float(step).is_integer():
        return f"{int(value):,}"
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:,.{digits}f}"


def curve_svg(curve: Curve, title: str) -> str:
    """``curve`` as an SVG (where it has no point yet, its title and that)."""
    if not curve.points:
        # its kind of shape not traced yet (the note says which): the title and that, in the
        # figure's place
        return _svg(
            curve,
            title,
            f'<text x="{WIDTH / 2:.0f}" y="18" text-anchor="middle" font-weight="600">'
            f"{html.escape(title)}</text>"
            f'<text class="memfit-empty" x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" '
            f'text-anchor="middle" fill="#888">no point of this curve is traced yet</text>',
        )
    xs = [x for x, _ in curve.points]
    lowest, highest = min(xs), max(xs)
    if highest == lowest:
        lowest, highest = max(0, lowest - 1), highest + 1
    top = max(total for _, total in curve.points) / _GIB
    if curve.budget_bytes is not None:
        top = max(top, curve.budget_bytes / _GIB)
    y_ticks = nice_ticks(top * 1.05)
    x_ticks = [x for x in nice_ticks(highest, 6, lowest) if x <= highest] or [lowest, highest]
    y_step = y_ticks[1] - y_ticks[0]
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1
    inner_w, inner_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def at_x(x: float) -> float:
        return _LEFT + (x - lowest) / (highest - lowest) * inner_w

    def at_y(gib: float) -> float:
        return _TOP + inner_h - gib / y_ticks[-1] * inner_h

    unit = "tokens" if curve.axis == "seq_len" else "rows"
    parts = [
        f'<text x="{WIDTH / 2:.0f}" y="18" text-anchor="middle" font-weight="600">'
        f"{html.escape(title)}</text>"
    ]
    for tick in y_ticks:
        y = at_y(tick)
        parts.append(
            f'<line x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{tick_label(tick, y_step)}</text>"
        )
    for tick in x_ticks:
        x = at_x(tick)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP + inner_h}" y2="{_TOP + inner_h + 4}" '
            f'stroke="#888"/><text x="{x:.1f}" y="{_TOP + inner_h + 17}" '
            f'text-anchor="middle">{tick_label(tick, x_step)}</text>'
        )
    parts.append(
        f'<text x="{_LEFT + inner_w / 2:.0f}" y="{HEIGHT - 6}" text-anchor="middle">'
        f"{_AXIS_LABELS.get(curve.axis, curve.axis)}</text>"
        f'<text transform="translate(14 {_TOP + inner_h / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">GiB</text>'
    )
    if curve.budget_bytes is not None:
        y = at_y(curve.budget_bytes / _GIB)
        parts.append(
            f'<line class="memfit-budget" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="{_BUDGET}" stroke-width="2" stroke-dasharray="6 4" '
            f'data-bytes="{curve.budget_bytes}"><title>the budget: '
            f"{format_bytes(curve.budget_bytes)}</title></line>"
        )
        if curve.crossing is not None:
            x = at_x(curve.crossing)
            parts.append(
                f'<line class="memfit-fits" x1="{x:.1f}" x2="{x:.1f}" y1="{at_y(0):.1f}" '
                f'y2="{y:.1f}" stroke="{_FITS}" stroke-width="2" stroke-dasharray="3 3" '
                f'data-x="{curve.crossing}"><title>the largest that fits: '
                f"{curve.crossing:,} {unit}</title></line>"
            )
    line = " ".join(f"{at_x(x):.1f},{at_y(total / _GIB):.1f}" for x, total in curve.points)
    parts.append(
        f'<polyline class="memfit-estimate" points="{line}" fill="none" stroke="{_ESTIMATE}" '
        f'stroke-width="2"/>'
    )
    for x, total in curve.points:
        parts.append(
            f'<circle class="memfit-point" cx="{at_x(x):.1f}" cy="{at_y(total / _GIB):.1f}" '
            f'r="3.5" fill="{_ESTIMATE}" data-x="{x}" data-bytes="{total}">'
            f"<title>{x:,} {unit}: {format_bytes(total)}</title></circle>"
        )
    return _svg(curve, title, "".join(parts))


def _svg(curve: Curve, title: str, body: str) -> str:
    return (
        f'<svg class="memfit-curve" data-axis="{curve.axis}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="100%" font-size="11" font-family="sans-serif" role="img" '
        f'aria-label="{html.escape(title)}">{body}</svg>'
    )


__all__ = ["curve_svg", "nice_ticks", "tick_label"]
