"""``memfit report``: a run folder's page and plots (:func:`memfit.report.html.write_report`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from memfit import progress
from memfit.report.html import PLOTS, write_report


def report_command(
    run_dir: Annotated[
        str, typer.Argument(metavar="RUN_DIR", help="The --output-dir of a memfit train run.")
    ],
    no_estimate: Annotated[
        bool,
        typer.Option("--no-estimate", help="Do not ask memfit.estimate for the breakdown."),
    ] = False,
) -> None:
    """Write RUN_DIR/report.html (self-contained) and its plots as PNG files beside it."""
    # matplotlib, and (unless --no-estimate) torch and the run's estimate: seconds
    doing = "drawing the plots" if no_estimate else "estimating the run's step, drawing the plots"
    with progress.status(doing, subject=f"memfit report {run_dir}"):
        # what of the run files was left out, file and line, on stderr (the page says it too)
        path = write_report(
            run_dir,
            estimate=not no_estimate,
            on_note=lambda note: sys.stderr.write(f"memfit: {note}\n"),
        )
    typer.echo(f"wrote {path} (and {', '.join(PLOTS)} beside it)")
