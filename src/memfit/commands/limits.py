"""``memfit limits``: the longest sequence and the largest micro-batch a job fits into a budget
(:func:`memfit.plan.limits.limits`), as given and with the levers a plan may use.

Its own verb, not a flag of ``estimate`` (one step at one shape) or ``plan`` (an effective batch
at one length, kept): it asks the reverse question of both, how far a shape can grow."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import TraceDepth, given_knobs, job_options
from memfit.job import STEP_DEFAULTS, STEP_FIELDS
from memfit.levers import ALLOWABLE
from memfit.levers import flags as lever_flags
from memfit.models.hub import locate_config
from memfit.units import format_bytes

# the job's sequence length is a question here (--seq-len only sets the micro-batch question's)
FIELDS = tuple(name for name in STEP_FIELDS if name != "max_seq_len")

# the shortest length the longest-sequence question starts from (memfit.plan.limits.SEQ_LEN_STEP,
# not imported: that module loads torch)
SHORTEST = 8

BOUNDS = {
    "memory": "the GPU budget",
    "host-memory": "the host-memory budget",
    "positions": "the model's positions",
    "rows": "the most rows a micro-batch is tried with",
    "tokens": "the most tokens a micro-batch is tried with",
}


@job_options(
    fields=FIELDS,
    flags={"micro_batch_size": "--batch-size"},
    defaults={**STEP_DEFAULTS, "micro_batch_size": 1},
    required=("task",),
    helps={
        "micro_batch_size": "The micro-batch the longest sequence is found at.",
        "seq_len": "The length the largest micro-batch is found at (left out: not asked).",
        "world_size": "The budget is per GPU.",
    },
)
def limits_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry name, any Hub id (its config.json fetched when online), model folder or config.json."
        ),
    ],
    *,
    gpu_memory: Annotated[
        str | None, typer.Option(help="The budget, e.g. 24GiB (2^30) or 24GB (10^9).")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option(help="A catalog GPU (memfit gpus): its memory and kernels.")
    ] = None,
    host_memory: Annotated[
        str | None,
        typer.Option(
            help="Host-memory budget for what offloading moves there.",
            show_default="this machine's memory",
        ),
    ] = None,
    safety_margin: Annotated[
        float, typer.Option(help="Share of the budget kept free (0.05 = 5 %), as memfit plan.")
    ] = 0.05,
    levers: Annotated[
        bool,
        typer.Option(
            "--levers",
            help="Also answer with the exact levers a plan may use (checkpointing, fused "
            "cross-entropy, precision, offloading).",
        ),
    ] = False,
    allow: Annotated[
        str | None,
        typer.Option(
            help="With the levers, also these (as memfit plan --allow; implies --levers): "
            + ",".join(a for a in ALLOWABLE if a != "truncation")
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trace_depth: TraceDepth = "auto",
    **knobs: Any,
) -> None:
    """Find the longest sequence and the largest micro-batch that fit a budget; exit 3 if none."""
    knobs = given_knobs(knobs)
    batch_size = knobs.pop("micro_batch_size")
    task = knobs.pop("task")
    seq_len = knobs.pop("seq_len")
    allowed = [a for a in (allow or "").split(",") if a.strip()]
    # on screen before torch is imported (seconds); the solver's report() calls refine it
    with progress.status("loading torch and transformers", subject=f"memfit limits {model}"):
        # a model found nowhere is refused before torch loads (seconds); a Hub fetch shows here
        progress.report("looking up the model's config.json")
        locate_config(model)
        progress.report("loading torch and transformers")
        # start-up: torch and transformers load only when the limits are solved
        from memfit.plan.limits import limits

        result = limits(
            model,
            task=task,
            batch_size=batch_size,
            seq_len=seq_len,
            gpu_memory=gpu_memory,
            gpu=gpu,
            host_memory=host_memory,
            safety_margin=safety_margin,
            levers=levers,
            allow=allowed,
            trace_depth=trace_depth,
            **knobs,
        )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        for line in lines(result):
            typer.echo(line)
    if not result.fits:
        if as_json:  # stdout holds the JSON: the verdict goes to stderr
            typer.echo(f"memfit: nothing fits in {format_bytes(result.usable_bytes)}", err=True)
        raise typer.Exit(3)


def lines(result: Any) -> list[str]:
    """The answers, one line per question (and per question again with the levers)."""
    usable = format_bytes(result.usable_bytes)
    out = [
        f"Budget: {format_bytes(result.budget_bytes)}, {usable} usable after the "
        f"{result.safety_margin * 100:g} % safety margin; host memory {format_bytes(result.host_budget_bytes)}.",
        *result.notes,
    ]
    asked = [("max_seq_len", result.max_seq_len), ("max_micro_batch", result.max_micro_batch)]
    for name, answer in asked:
        if answer is not None:
            out.append(_line(result, name, answer, "As given"))
    if result.levers is not None:
        which = "the exact levers" + (
            f" and those allowed ({', '.join(result.allow)})" if result.allow else ""
        )
        for name, answer in result.levers.items():
            out.append(_line(result, name, answer, f"With {which}"))
    return out


def _line(result: Any, name: str, answer: Any, prefix: str) -> str:
    """One answer: the value, the peak there, one step past it, and what bounds it."""
    longest = name == "max_seq_len"
    question = (
        f"the longest sequence at micro-batch {result.batch_size}"
        if longest
        else f"the largest micro-batch at {result.seq_len:,} tokens"
    )
    unit = " tokens" if longest else ""
    if answer.value is None:
        smallest = (
            f"micro-batch {result.batch_size} at {SHORTEST} tokens"
            if longest
            else f"micro-batch 1 at {result.seq_len:,} tokens"
        )
        if answer.bound == "host-memory" and answer.host_bytes is not None:
            # the host budget bounds it: what the node's ranks keep there, not the GPU peak
            over = (
                f"{_host(result, answer, answer.host_bytes)} of the "
                f"{format_bytes(result.host_budget_bytes)} host memory"
            )
        elif answer.peak_bytes is not None:
            over = f"{format_bytes(answer.peak_bytes)} of {format_bytes(result.usable_bytes)}"
        else:
            over = "more than the budgets"
        return f"{prefix}, {question}: nothing fits; {smallest} needs {over}."
    said = f"{prefix}, {question}: {answer.value:,}{unit} ({format_bytes(answer.peak_bytes)}"
    if answer.host_bytes is not None:
        said += f", {_host(result, answer, answer.host_bytes)} in host memory"
    said += ")"
    if answer.next_value is not None and answer.next_peak_bytes is not None:
        said += (
            f"; {answer.next_value:,}{unit} would need {format_bytes(answer.next_peak_bytes)}"
            + (
                f" and {_host(result, answer, answer.next_host_bytes)} of host memory"
                if answer.bound == "host-memory" and answer.next_host_bytes is not None
                else ""
            )
        )
    bound = BOUNDS.get(answer.bound, answer.bound)
    if answer.bound == "positions":
        bound = f"{bound} ({result.max_positions:,})"
    said += f"; bound by {bound}."
    if answer.settings:
        said += " Levers: " + " ".join(lever_flags(answer.settings)) + "."
    return said


def _host(result: Any, answer: Any, per_rank: int) -> str:
    """Host bytes as limits prints them: one rank's, said so on several ranks, with the node's
    total when ranks share it (the figure the host budget bounds)."""
    ranks = getattr(answer, "host_ranks", 1) or 1
    if ranks > 1:
        return f"{format_bytes(per_rank)} per rank ({format_bytes(per_rank * ranks)} for {ranks} ranks)"
    if result.world_size > 1:
        return f"{format_bytes(per_rank)} per rank"
    return format_bytes(per_rank)
