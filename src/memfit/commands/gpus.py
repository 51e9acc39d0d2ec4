"""``memfit gpus``: the GPU catalog (:func:`memfit.devices.catalog`) that ``--gpu`` names."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from memfit import progress
from memfit.devices import catalog
from memfit.units import format_bytes

_COLUMNS = ("id", "name", "memory", "sm", "bf16", "attention", "mixed", "TFLOP/s")


def gpus_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the GPUs --gpu knows: memory as CUDA reports it, compute capability, bf16,
    the attention kernels PyTorch runs on them, peak rates."""
    with progress.status("loading the catalog", subject="memfit gpus"):
        gpus = catalog()
    rows = [
        {
            "id": g.id,
            "name": g.name,
            "memory_bytes": g.memory_bytes,
            "compute_capability": ".".join(str(x) for x in g.compute_capability),
            "bf16": g.bf16,
            "attention_kernels": list(g.attention_kernels),
            "tflops": g.tflops,
            "memory_bandwidth_gbps": g.memory_bandwidth_gbps,
            "aliases": list(g.aliases),
            "support_note": g.support_note or None,
        }
        for g in gpus.values()
    ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = [
        (
            g.id,
            g.short_name,
            format_bytes(g.memory_bytes),
            g.capability,
            "yes" if g.bf16 else "no",
            "/".join(g.attention_kernels),
            g.mixed_precision(),
            f"{g.tflops[g.mixed_precision()]:.0f}",
        )
        for g in gpus.values()
    ]
    widths = [max(len(str(r[i])) for r in [_COLUMNS, *table]) for i in range(len(_COLUMNS))]
    right = {2, 7}  # sizes and rates line up on the right
    for row in [_COLUMNS, *table]:
        cells = [
            f"{cell:>{w}}" if i in right else f"{cell:<{w}}"
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        typer.echo("  ".join(cells).rstrip())
    notes = [g for g in gpus.values() if g.support_note]
    for g in notes:
        typer.echo(f"{g.id}: {g.support_note}")
    typer.echo(
        "memory: as CUDA reports it (torch.cuda total_memory), below the marketing figure; "
        "attention: the SDPA kernels PyTorch has for the generation (no flash before sm80); "
        "TFLOP/s: dense, in the mixed precision the GPU trains in"
    )
