"""``memfit models``: the models memfit knows offline (:func:`memfit.models.registry_names`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memfit import progress


def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the models memfit knows offline (architecture configs only, no weights)."""
    rows: list[dict[str, Any]] = []
    # transformers' config classes load first (seconds)
    with progress.status("loading transformers", subject="memfit models"):
        from memfit.models import registry_names, resolve_model

        names = registry_names()
        for k, name in enumerate(names, 1):
            progress.report(f"reading {name} ({k} of {len(names)})")
            spec = resolve_model(name)
            rows.append(
                {
                    "name": name,
                    "model_type": spec.config.model_type,
                    "max_positions": spec.max_positions,
                }
            )
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        typer.echo(f"{row['name']:<50} {row['model_type']:<12} {row['max_positions']}")
