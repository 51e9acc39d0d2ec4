"""``memfit gpus``: the GPU catalog (:func:`memfit.devices.catalog`) that ``--gpu`` names."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from memfit import progress
from memfit.devices import catalog
from memfit.units import format_bytes


def gpus_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the GPUs --gpu knows: memory as CUDA reports it, bf16, peak rates."""
    with progress.status("loading the catalog", subject="memfit gpus"):
        gpus = catalog()
    rows = [
        {
            "id": g.id,
            "name": g.name,
            "memory_bytes": g.memory_bytes,
            "bf16": g.bf16,
            "tflops": g.tflops,
            "memory_bandwidth_gbps": g.memory_bandwidth_gbps,
        }
        for g in gpus.values()
    ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for g in gpus.values():
        mixed = g.mixed_precision()
        typer.echo(
            f"{g.id:<12} {g.name:<32} {format_bytes(g.memory_bytes):>11}  "
            f"bf16 {'yes' if g.bf16 else 'no ':<3}  {mixed} {g.tflops[mixed]:>6.0f} TFLOP/s"
        )
