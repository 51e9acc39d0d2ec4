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
from memfit.levers import LEVERS
from memfit.models.hub import locate_config
from memfit.paths import Kind, destination_problems, holds_mark, model_inputs
from memfit.report.console import PLAN_SAFETY_MARGIN, margin_keys, print_estimate
from memfit.units import format_bytes


def _trace_depth_line(details: dict[str, Any]) -> str | None:
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
        for lever in LEVERS:
            for line in lever.estimate_lines(result.details):
                typer.echo(line)
        for said in (
            _paged_line(result.details, knobs["optimizer"], device),
            _trace_depth_line(result.details),
        ):
            if said is not None:
                typer.echo(said)
        for line in _gpu_lines(result.details, device):
            typer.echo(line)
        for line in _host_lines(result.details):
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
