"""Rich console output for estimates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit import levers
from memfit.devices.catalog import catalog
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.estimate import Estimate
    from memfit.plan import Plan

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


def print_estimate(estimate: Estimate, console: Console | None = None) -> None:
    """The breakdown as a table, the verdict against the budget and the biggest part named."""
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
    console.print(
        f"Peak in the {estimate.peak_phase.replace('_', ' ')} phase; the biggest part is "
        f"{PART_LABELS.get(estimate.biggest_part, estimate.biggest_part)} "
        f"({format_bytes(estimate.breakdown[estimate.biggest_part])})."
    )
    if estimate.budget_bytes is not None:
        budget = budget_words(estimate.budget_bytes, estimate.details.get("gpu"))
        # the GPU's verdict; an offloading step's host memory has its own (``fits`` is both)
        host = estimate.details.get("host")
        host_short = isinstance(host, dict) and host.get("fits") is False
        if estimate.total_bytes <= estimate.budget_bytes:
            console.print(
                f"[green]Fits[/green] in {budget}: "
                f"{format_bytes(estimate.budget_bytes - estimate.total_bytes)} to spare"
                + ("; [red]the host memory does not[/red] (below)." if host_short else ".")
            )
        else:
            console.print(
                f"[red]Does not fit[/red] in {budget}: "
                f"{format_bytes(estimate.total_bytes - estimate.budget_bytes)} short."
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
    if plan.chosen is None:
        console.print(
            f"[bold red]Nothing fits[/] in {escape(plan.budget_words())}: "
            f"the least any configuration needs is {format_bytes(plan.min_required_bytes)}."
        )
    else:
        table = Table(title="memfit plan", show_header=True)
        table.add_column("setting")
        table.add_column("value", justify="right")
        for key, value in plan.chosen.settings().items():
            if value is not None:
                table.add_row(key, str(value))
        table.add_row("predicted peak", format_bytes(plan.chosen.predicted_peak_bytes))
        table.add_row("budget", escape(plan.budget_words()))
        rate = plan.chosen.predicted_samples_per_second
        table.add_row("samples/s (cost model)", f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}")
        console.print(table)
    for line in plan.explanation:
        console.print(f"• {escape(line)}", soft_wrap=True)  # [brackets] are not markup
    if plan.alternatives:
        console.print("Alternatives that fit:")
        for alt in plan.alternatives:
            # each lever's settings in its own words, in the plan's order
            s = alt.settings()
            words = [w for lever in levers.LEVERS if (w := lever.describe(s)) is not None]
            console.print(
                f"  {', '.join(words)}: {format_bytes(alt.predicted_peak_bytes)}, "
                f"{alt.predicted_samples_per_second:.1f} samples/s",
                soft_wrap=True,
            )
    for line in plan.suggestions:
        console.print(f"→ {escape(line)}", soft_wrap=True)
