"""``memfit models``: the models memfit knows offline (:func:`memfit.models.registry_names`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memfit import progress

_HEADER = {
    "name": "NAME",
    "model_type": "MODEL TYPE",
    "max_positions": "MAX POSITIONS",
    "parameters": "PARAMETERS",
}


def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the models memfit knows offline (architecture configs only, no weights), each with
    the parameter count of its checkpoint, counted from the architecture."""
    rows: list[dict[str, Any]] = []
    # transformers' config and model classes load first (seconds)
    with progress.status("loading transformers", subject="memfit models"):
        from memfit.models import parameter_count, registry_names, resolve_model

        names = registry_names()
        for k, name in enumerate(names, 1):
            progress.report(f"counting the parameters of {name} ({k} of {len(names)})")
            spec = resolve_model(name)
            rows.append(
                {
                    "name": name,
                    "model_type": spec.config.model_type,
                    "max_positions": spec.max_positions,
                    "parameters": parameter_count(spec),
                }
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
