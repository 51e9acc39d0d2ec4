"""``memfit models``: the models memfit knows offline (:func:`memfit.models.catalog.listing`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.models.catalog import listing

_HEADER = {
    "name": "NAME",
    "model_type": "MODEL TYPE",
    "max_positions": "MAX POSITIONS",
    "parameters": "PARAMETERS",
}


def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the models memfit knows offline, with their parameter counts.

    Architecture configs only, no weights: each count is the checkpoint's, counted from its
    architecture (stored beside the configs, recounted for a config that changed since).
    """
    with progress.status("reading the registry", subject="memfit models"):
        rows: list[dict[str, Any]] = listing(
            # an entry without a stored count: transformers builds it on the meta device (seconds)
            on_compute=lambda name: progress.report(f"counting the parameters of {name}")
        )
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = [_HEADER] + [{**row, "parameters": f"{row['parameters']:,}"} for row in rows]
    name_width = max(len(str(row["name"])) for row in table)
    for row in table:
        typer.echo(
            f"{row['name']:<{name_width}}  {row['model_type']:<12} "
            f"{row['max_positions']:>13}  {row['parameters']:>15}"
        )
