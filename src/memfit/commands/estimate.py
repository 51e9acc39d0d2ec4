"""``memfit estimate``: the peak memory of one step, without the weights or a GPU (:func:`memfit.estimate.estimate`),
printed as a breakdown, one JSON object, or a picture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import Overwrite, TraceDepth, given_knobs, job_options
from memfit.errors import UsageError
from memfit.extras import is_installed, missing_line
from memfit.job import STEP_DEFAULTS, STEP_FIELDS
from memfit.models.hub import locate_config
from memfit.paths import Kind, destination_problems, holds_mark, model_inputs
from memfit.report.console import (
    PLAN_SAFETY_MARGIN,
    margin_keys,
    note_lines,
    print_estimate,
    trace_depth_line,
)

# the name its tests know (tests/e2e/test_progress_cli.py): the line is memfit.report.console's
_trace_depth_line = trace_depth_line

# memfit estimate's own spelling: the step's micro-batch is its --batch-size
FLAGS = {"micro_batch_size": "--batch-size"}


@job_options(
    fields=STEP_FIELDS,
    flags=FLAGS,
    defaults=STEP_DEFAULTS,
    required=("task", "micro_batch_size", "seq_len"),
    helps={
        "world_size": "The estimate is the memory of one of them.",
        "gradient_accumulation_steps": "The later ones run beside the gradients.",
    },
)
def estimate_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry name, any Hub id (its config.json fetched when online), model folder or config.json."
        ),
    ],
    *,
    mode: Annotated[str, typer.Option(help="train | eval")] = "train",
    gpu_memory: Annotated[
        str | None, typer.Option(help="Budget to check against, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="A catalog GPU (memfit gpus): its memory is the budget."),
    ] = None,
    host_memory: Annotated[
        str | None,
        typer.Option(
            help="Host-memory budget for what offloading moves there, e.g. 64GiB.",
            show_default="this machine's memory",
        ),
    ] = None,
    safety_margin: Annotated[
        float,
        typer.Option(
            help="Share of the budget memfit plan keeps free (0.05 = 5 %): the verdict says "
            "when the step fits the budget but not the budget less this share."
        ),
    ] = PLAN_SAFETY_MARGIN,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[
        str | None,
        typer.Option(help="Also draw the breakdown as a picture: FILE.png (or .svg, .pdf)."),
    ] = None,
    overwrite: Overwrite = False,
    trace_depth: TraceDepth = "auto",
    **knobs: Any,
) -> None:
    """Predict the peak memory of one steady-state training (or eval) step, from the model's
    config alone (a Hub id's config.json is fetched when online)."""
    # memfit plan's own check, before the trace
    if not 0 <= safety_margin < 1:
        raise UsageError(f"--safety-margin: must be in [0, 1), got {safety_margin!r}")
    if plot is not None:
        _check_plot(plot, model, overwrite)
    knobs = given_knobs(knobs)
    batch_size = knobs.pop("micro_batch_size")
    task, seq_len, precision, device = (
        knobs["task"], knobs["seq_len"], knobs["precision"], knobs["device"]
    )  # fmt: skip

    # on screen before torch is imported (seconds); the estimator's report() calls refine it
    with progress.status("loading torch and transformers", subject=f"memfit estimate {model}"):
        # a model found nowhere is refused before torch loads (seconds); a Hub fetch shows here
        progress.report("looking up the model's config.json")
        locate_config(model)
        progress.report("loading torch and transformers")
        # start-up: torch and transformers load only when the estimate runs
        from memfit.estimate import estimate

        progress.report(
            f"{mode} step, batch {batch_size} × {seq_len} tokens, {precision} on {device}"
        )
        result = estimate(
            model,
            batch_size=batch_size,
            mode=mode,
            gpu_memory=gpu_memory,
            gpu=gpu,
            trace_depth=trace_depth,
            host_memory=host_memory,
            **knobs,
        )
    if as_json:
        # the verdict with memfit plan's margin beside the budget's own (``fits``)
        typer.echo(json.dumps(result.to_dict() | margin_keys(result, safety_margin)))
    else:
        print_estimate(result, safety_margin=safety_margin)
        # the levers' lines, a paged optimizer's, the trace's depth, the card's, the host's
        for line in note_lines(result, knobs["optimizer"], device):
            typer.echo(line)
    if plot is not None:
        title = f"{model}: {task}, batch {batch_size} × {seq_len} tokens, {precision}, {device}"
        _draw(result, plot, title, subject=f"memfit estimate {model}")
        # stdout stays one JSON object under --json
        typer.echo(f"wrote {plot}", err=as_json)


def _check_plot(plot: str, model: str, overwrite: bool) -> None:
    """A bad --plot path fails before the estimate's trace, not after it: the wrong suffix, a
    missing folder, the model's own file, an existing picture memfit did not draw without
    --overwrite (memfit.paths.destination_problems)."""
    # optional: memfit.report.plots loads matplotlib (the [plot] extra)
    from memfit.report.plots import PLOT_MARKS

    if Path(plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"--plot: {plot} must end in .png, .svg or .pdf")
    if not Path(plot).parent.is_dir():
        raise UsageError(f"--plot: the folder {Path(plot).parent} does not exist")
    kind = Kind(holds_mark(*PLOT_MARKS), "a picture memfit drew")
    problems = destination_problems(
        plot, "--plot", kind, inputs=model_inputs(model, "MODEL"), overwrite=overwrite
    )
    if problems:
        raise UsageError("\n".join(problems))
    if not is_installed("matplotlib"):
        raise UsageError(missing_line("matplotlib", "--plot"))


def _draw(result: Any, plot: str, title: str, *, subject: str) -> None:
    """The estimate's breakdown as a picture in ``plot`` (matplotlib loads: a status line)."""
    with progress.status(f"drawing {plot}", subject=subject):
        # optional: matplotlib (the [plot] extra)
        from memfit.report.plots import breakdown_plot, save_figure

        figure = breakdown_plot(result.breakdown, budget=result.budget_bytes, title=title)
        save_figure(figure, plot, flag="--plot")
