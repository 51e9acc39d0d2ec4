"""Rich console output for estimates and plans; their lines as plain text too (``memfit ui``
shows what the CLI prints: :func:`verdict_lines`, :func:`note_lines`, :func:`plan_rows`,
:func:`plan_lines`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from memfit import levers
from memfit.devices.catalog import catalog
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.estimate import Estimate
    from memfit.plan import Plan

# memfit plan's --safety-margin default (memfit estimate's verdict says when a step is within the
# budget but not within what the margin leaves): memfit.plan.configuration.SAFETY_MARGIN, not
# imported, so that the quick verbs do not load the planner (and torch) at start-up
PLAN_SAFETY_MARGIN = 0.05

# the estimate's breakdown keys in words (the console table, the report page)
PART_LABELS = {
    "parameters": "parameters",
    "buffers": "buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "transient": "transient buffers",
    "allocator_overhead": "allocator overhead (cache, rounding)",
    "runtime_overhead": "runtime (CUDA context, cuBLAS)",
}


def print_estimate(
    estimate: Estimate, console: Console | None = None, safety_margin: float | None = None
) -> None:
    """The breakdown as a table, the verdict against the budget and the biggest part named.
    ``safety_margin``: the share of the budget memfit plan keeps free (default its own, 5 %);
    a step within the budget but not within the budget less it says so (:func:`margin_line`)."""
    safety_margin = PLAN_SAFETY_MARGIN if safety_margin is None else safety_margin
    console = console or Console(highlight=False)
    spec = estimate.spec
    knobs = (
        f"{spec.task}, batch {estimate.batch_size} × {estimate.seq_len} tokens, {spec.precision}, {spec.optimizer}"
        + (", gradient checkpointing" if spec.gradient_checkpointing else "")
        + f", {spec.attn_implementation} attention, {spec.mode} on {spec.device}"
    )
    table = Table(title=f"{estimate.model}: {knobs}", title_justify="left")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for key, value in estimate.breakdown.items():
        share = value / estimate.total_bytes * 100 if estimate.total_bytes else 0.0
        table.add_row(PART_LABELS.get(key, key), format_bytes(value), f"{share:.1f} %")
    table.add_row(
        "[bold]peak[/bold]", f"[bold]{format_bytes(estimate.total_bytes)}[/bold]", "100.0 %"
    )
    console.print(table)
    for line in verdict_lines(estimate, safety_margin):
        # the margin's line is long: one line, wrapped by the terminal (it is copied whole)
        console.print(line.markup, soft_wrap=line.soft_wrap)


@dataclass(frozen=True)
class VerdictLine:
    """A line of the estimate's verdict: ``markup`` (rich's, as the CLI colours it), ``plain``."""

    markup: str
    soft_wrap: bool = False

    @property
    def plain(self) -> str:
        return Text.from_markup(self.markup).plain


def verdict_lines(estimate: Estimate, safety_margin: float | None = None) -> list[VerdictLine]:
    """The lines under the breakdown's table (``memfit estimate``'s, and ``memfit ui``'s): the
    peak's phase and biggest part, the verdict against the budget naming the card, and the line
    of a step within the budget but not within the budget less ``safety_margin``
    (:func:`margin_line`; default: memfit plan's own margin, 5 %)."""
    safety_margin = PLAN_SAFETY_MARGIN if safety_margin is None else safety_margin
    lines = [
        VerdictLine(
            f"Peak in the {estimate.peak_phase.replace('_', ' ')} phase; the biggest part is "
            f"{PART_LABELS.get(estimate.biggest_part, estimate.biggest_part)} "
            f"({format_bytes(estimate.breakdown[estimate.biggest_part])})."
        )
    ]
    if estimate.budget_bytes is not None:
        budget = budget_words(estimate.budget_bytes, estimate.details.get("gpu"))
        # the GPU's verdict; an offloading step's host memory has its own (``fits`` is both)
        host = estimate.details.get("host")
        host_short = isinstance(host, dict) and host.get("fits") is False
        if estimate.total_bytes <= estimate.budget_bytes:
            lines.append(
                VerdictLine(
                    f"[green]Fits[/green] in {budget}: "
                    f"{format_bytes(estimate.budget_bytes - estimate.total_bytes)} to spare"
                    + ("; [red]the host memory does not[/red] (below)." if host_short else ".")
                )
            )
            line = margin_line(estimate, safety_margin)
            if line is not None:
                lines.append(VerdictLine(line, soft_wrap=True))
        else:
            lines.append(
                VerdictLine(
                    f"[red]Does not fit[/red] in {budget}: "
                    f"{format_bytes(estimate.total_bytes - estimate.budget_bytes)} short."
                )
            )
    return lines


def note_lines(
    estimate: Estimate, optimizer: str | None = None, device: str | None = None
) -> list[str]:
    """The plain lines ``memfit estimate`` prints after the verdict (and ``memfit ui`` shows):
    each lever's (:meth:`memfit.levers.base.Lever.estimate_lines`: the weights, LoRA,
    quantization, offloading, ...), a paged optimizer's state, how deep the trace went, the
    card's attention kernels and what offloading keeps in host memory. ``optimizer`` and
    ``device``: as the job gave them (default: the step's)."""
    optimizer = estimate.spec.optimizer if optimizer is None else optimizer
    device = estimate.spec.device if device is None else device
    lines = [line for lever in levers.LEVERS for line in lever.estimate_lines(estimate.details)]
    for said in (
        _paged_line(estimate.details, optimizer, device),
        trace_depth_line(estimate.details),
    ):
        if said is not None:
            lines.append(said)
    lines += _gpu_lines(estimate.details, device)
    lines += _host_lines(estimate.details)
    return lines


def trace_depth_line(details: dict[str, Any]) -> str | None:
    """One line on how many layers the estimate traced (``details["trace_depth"]``), if it says."""
    info = details.get("trace_depth")
    if not isinstance(info, dict):
        return None
    depth = info.get("depth")
    of = f" of {depth}" if depth is not None else ""
    if info.get("mode") == "extrapolated":
        # traced_depths: the depths of the shallow copies of the model that were traced
        traced = [str(x) for x in info.get("traced_depths") or ()]
        which = " and ".join([", ".join(traced[:-1]), traced[-1]] if len(traced) > 1 else traced)
        period = info.get("period")
        block = f", a block of {period} layers repeating" if period and period > 1 else ""
        return f"traced {which or 'a few'}{of} layers, extrapolated exactly{block}"
    if info.get("mode") == "full":
        reason = info.get("reason")
        layers = f"all {depth} layers" if depth is not None else "every layer"
        return f"traced {layers}" + (f": {reason}" if reason else "")
    return f"trace depth: {info.get('mode')}{of}" if info.get("mode") else None


def _gpu_lines(details: dict[str, Any], device: str) -> list[str]:
    """What the ``--gpu`` card's generation runs (``details["gpu"]``) and what to know about it."""
    info = details.get("gpu")
    if not isinstance(info, dict) or device != "cuda":
        return []
    kernels = list(info.get("attention_kernels") or ())
    sm = str(info.get("compute_capability", "")).replace(".", "")
    missing = "" if "flash" in kernels else " (no flash attention before sm80)"
    lines = [f"attention kernels on the {info['name']} (sm{sm}): {', '.join(kernels)}{missing}"]
    if info.get("support_note"):
        lines.append(f"note: {info['support_note']}")
    return lines


def _paged_line(details: dict[str, Any], optimizer: str, device: str) -> str | None:
    """One line on a paged optimizer's state (``details["paged_optimizer_state_bytes"]``)."""
    paged = details.get("paged_optimizer_state_bytes")
    if paged is None:
        return None
    if device != "cuda":
        return (
            f"{optimizer}: nothing is paged on the CPU; its state is in the optimizer state above"
        )
    return (
        f"{optimizer}: {format_bytes(int(paged))} of optimizer state in CUDA unified memory, not "
        "in the peak above (the driver pages it out to host memory when the GPU runs short)"
    )


def _host_lines(details: dict[str, Any]) -> list[str]:
    """What an offloading step holds in host memory (``details["host"]``), against its budget."""
    info = details.get("host")
    if not isinstance(info, dict):
        return []
    parts = ", ".join(
        f"{name.replace('_', ' ')} {format_bytes(int(size))}"
        for name, size in (info.get("parts") or {}).items()
        if size
    )
    total, budget = int(info.get("total_bytes") or 0), info.get("budget_bytes")
    line = f"host memory: {format_bytes(total)}" + (f" ({parts})" if parts else "")
    line += ", not in the GPU peak above"
    if budget is None:
        return [line]
    verdict = "fits" if info.get("fits") else "does NOT fit"
    return [line, f"host budget: {format_bytes(int(budget))}: {verdict}"]


def percent(share: float) -> str:
    """A share as the verdicts say it: ``5 %``, ``2.5 %``."""
    return f"{share * 100:.4g} %"


def usable_bytes(budget_bytes: int, safety_margin: float) -> int:
    """The budget less the safety margin, as memfit plan counts it (its ``Search.usable``)."""
    return int(budget_bytes * (1 - safety_margin))


def margin_keys(estimate: Estimate, safety_margin: float) -> dict[str, Any]:
    """The estimate's verdict against the budget less ``safety_margin`` (memfit plan's view), for
    ``--json``: ``safety_margin``, ``usable_bytes`` (None: no budget) and ``fits_with_margin``
    (``fits`` with the GPU budget less the margin; None where ``fits`` is None)."""
    if estimate.budget_bytes is None:
        return {"safety_margin": safety_margin, "usable_bytes": None, "fits_with_margin": None}
    usable = usable_bytes(estimate.budget_bytes, safety_margin)
    # the host's verdict (an offloading step) is the same: the margin is the GPU's
    host = estimate.details.get("host")
    host_fits = not (isinstance(host, dict) and host.get("fits") is False)
    return {
        "safety_margin": safety_margin,
        "usable_bytes": usable,
        "fits_with_margin": estimate.total_bytes <= usable and host_fits,
    }


def margin_line(estimate: Estimate, safety_margin: float) -> str | None:
    """What the verdict of a step that fits the budget but not the budget less ``safety_margin``
    means for memfit plan, which keeps that margin free (None: the step fits both, or there is
    no budget). memfit plan plans training steps only: an eval step's line does not name it."""
    budget = estimate.budget_bytes
    if budget is None or not safety_margin:
        return None
    usable = usable_bytes(budget, safety_margin)
    if not usable < estimate.total_bytes <= budget:
        return None
    words = (
        f"[yellow]Over the {format_bytes(usable)} left after a {percent(safety_margin)} safety "
        f"margin[/yellow] by {format_bytes(estimate.total_bytes - usable)}"
    )
    if estimate.spec.mode != "train":
        return words + f" (--safety-margin 0 counts all {format_bytes(budget)})."
    plan = (
        f"memfit plan (its default --safety-margin {PLAN_SAFETY_MARGIN:g})"
        if safety_margin == PLAN_SAFETY_MARGIN
        else f"memfit plan --safety-margin {safety_margin:g}"
    )
    return (
        f"{words}: {plan} will not choose this step as is; with --safety-margin 0 it counts "
        f"all {format_bytes(budget)}."
    )


def budget_words(budget_bytes: int, gpu: dict[str, Any] | None) -> str:
    """The budget of a verdict, naming the ``--gpu`` card: ``a T4's 14.56 GiB`` (its memory),
    ``12.00 GiB on a T4`` (--gpu-memory with it), ``16.00 GiB`` (--gpu-memory alone)."""
    size = format_bytes(budget_bytes)
    card = catalog().get(str(gpu.get("id"))) if gpu else None
    if card is None:
        return size
    return card.budget_words(size, is_its_memory=bool(gpu and gpu.get("budget_is_gpu_memory")))


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """The chosen configuration, the alternatives, why, and what would make it fit."""
    console = console or Console(highlight=False)
    if plan.chosen is not None:
        table = Table(title="memfit plan", show_header=True)
        table.add_column("setting")
        table.add_column("value", justify="right")
        for key, value in plan_rows(plan):
            table.add_row(key, escape(value) if key == "budget" else value)
        console.print(table)
    for line in plan_lines(plan):
        console.print(line.markup, soft_wrap=line.soft_wrap)


def plan_rows(plan: Plan) -> list[tuple[str, str]]:
    """The rows of ``memfit plan``'s table (plain text): the chosen settings, the predicted peak,
    the budget and what its safety margin leaves, the cost model's rate. None: nothing fits."""
    if plan.chosen is None:
        return []
    rows = [(key, str(value)) for key, value in plan.chosen.settings().items() if value is not None]
    rows.append(("predicted peak", format_bytes(plan.chosen.predicted_peak_bytes)))
    rows.append(("budget", plan.budget_words()))
    if plan.safety_margin:
        usable = usable_bytes(plan.budget_bytes, plan.safety_margin)
        rows.append((f"usable ({percent(plan.safety_margin)} safety margin)", format_bytes(usable)))
    rate = plan.chosen.predicted_samples_per_second
    rows.append(("samples/s (cost model)", f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"))
    return rows


def plan_lines(plan: Plan) -> list[VerdictLine]:
    """The lines ``memfit plan`` prints besides its table: nothing fits (where nothing does), the
    explanation's bullets, the alternatives that fit, the suggestions' arrows."""
    # start-up: memfit.plan is loaded (the plan ran); this module is imported before torch is
    from memfit.plan.explain import budget_with_margin

    lines = []
    if plan.chosen is None:
        lines.append(
            VerdictLine(
                f"[bold red]Nothing fits[/] in {escape(budget_with_margin(plan))}: "
                f"the least any configuration needs is {format_bytes(plan.min_required_bytes)}."
            )
        )
    # [brackets] are not markup
    lines += [VerdictLine(f"• {escape(line)}", soft_wrap=True) for line in plan.explanation]
    if plan.alternatives:
        lines.append(VerdictLine("Alternatives that fit:"))
        for alt in plan.alternatives:
            # each lever's settings in its own words, in the plan's order
            s = alt.settings()
            words = [w for lever in levers.LEVERS if (w := lever.describe(s)) is not None]
            lines.append(
                VerdictLine(
                    f"  {', '.join(words)}: {format_bytes(alt.predicted_peak_bytes)}, "
                    f"{alt.predicted_samples_per_second:.1f} samples/s",
                    soft_wrap=True,
                )
            )
    lines += [VerdictLine(f"→ {escape(line)}", soft_wrap=True) for line in plan.suggestions]
    return lines
