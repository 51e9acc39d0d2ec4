"""``memfit plan``: fit a job into a memory budget, its effective batch kept
(:func:`memfit.plan.plan`); the plan printed, as JSON, or written as a run config for
``memfit train``."""

from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import Overwrite, TraceDepth, given_knobs, job_options
from memfit.config import write_config as write_run_config
from memfit.data.columns import ANCHOR_COLUMN, POSITIVE_COLUMN, TEXT_COLUMN, text_columns
from memfit.data.instructions import flag_problems
from memfit.data.packing import packing_figures
from memfit.data.sources import resolve_sources
from memfit.errors import UsageError
from memfit.job import STEP_DEFAULTS, round_seq_len
from memfit.levers import ALLOWABLE
from memfit.levers.packing import packing_strategy
from memfit.models.hub import locate_config
from memfit.paths import (
    Kind,
    check_writable_file,
    data_inputs,
    destination_problems,
    model_inputs,
    starts_with,
)
from memfit.report.console import PLAN_SAFETY_MARGIN, print_plan

if TYPE_CHECKING:
    from memfit.plan import DataProfile


# what the plan chooses itself, so no flag of memfit plan sets it: the micro-batch and its
# accumulation (or token budget), the cached loss's mini-batch, checkpointing, the attention
# kernel, the optimizer and truncation (the last two when --allow names them), LoRA's targets
# and the device; the job's other knobs are the job (or pins the plan keeps)
PLANNED = (
    "micro_batch_size",
    "gradient_accumulation_steps",
    "max_tokens_per_micro_batch",
    "mini_batch_size",
    "gradient_checkpointing",
    "attn_implementation",
    "optimizer",
    "max_seq_len",
    "lora_target_modules",
    "device",
)


@job_options(
    exclude=("model", *PLANNED),
    defaults={name: STEP_DEFAULTS[name] for name in ("num_labels", "world_size")},
    required=("task", "effective_batch_size"),
    helps={
        "world_size": "The budget is per GPU.",
        "precision": "Pins it.",
        "weights_dtype": "Pins it (pure bf16 otherwise only with --allow pure-16bit).",
        "cross_entropy": "Pins it.",
    },
    shown_defaults={
        "seq_len": "with --train-file, its longest sample",
        "precision": "the plan chooses",
        "cross_entropy": "causal-lm: the plan chooses",
    },
)
def plan_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry name, any Hub id (its config.json fetched when online), model folder or config.json."
        ),
    ],
    *,
    gpu_memory: Annotated[
        str | None, typer.Option(help="The budget, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option(help="A catalog GPU (memfit gpus): its memory and speed.")
    ] = None,
    allow: Annotated[
        str | None,
        typer.Option(
            help="Levers that change the recipe, comma-separated: "
            + ",".join(ALLOWABLE)
            + " (quantization needs lora or --lora-rank)"
        ),
    ] = None,
    train_file: Annotated[
        str | None,
        typer.Option(help="Training data (file or folder, as memfit train reads) for lengths."),
    ] = None,
    text_column: Annotated[
        str | None,
        typer.Option(
            help="Text column(s) of --train-file, comma-separated.",
            show_default=f"{TEXT_COLUMN}; sentence-embedding: the pair's "
            f"{ANCHOR_COLUMN},{POSITIVE_COLUMN}, as memfit train reads them",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="A local tokenizer folder for --train-file.", show_default="MODEL's folder"
        ),
    ] = None,
    prompt_column: Annotated[
        str | None,
        typer.Option(help="Prompt/completion rows of --train-file: the prompt column."),
    ] = None,
    completion_column: Annotated[
        str | None,
        typer.Option(help="Prompt/completion rows of --train-file: the completion column."),
    ] = None,
    messages_column: Annotated[
        str | None,
        typer.Option(help="Chat rows of --train-file, rendered with the chat template."),
    ] = None,
    safety_margin: Annotated[
        float, typer.Option(help="Share of the budget kept free (0.05 = 5 %).")
    ] = PLAN_SAFETY_MARGIN,
    host_memory: Annotated[
        str | None,
        typer.Option(
            help="Host-memory budget for what offloading moves there.",
            show_default="this machine's memory",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    write_config: Annotated[
        str | None, typer.Option(help="Write the plan as a YAML run config for memfit train.")
    ] = None,
    overwrite: Overwrite = False,
    trace_depth: TraceDepth = "auto",
    **knobs: Any,
) -> None:
    """Fit a fine-tuning job into a memory budget, effective batch kept; exit 3 if nothing fits."""
    if write_config is not None:
        # a folder that is missing or read-only fails now, not after the plan's traces
        check_writable_file(write_config, "--write-config")
        _check_config_destination(write_config, model, train_file, tokenizer, overwrite)
    knobs = given_knobs(knobs)
    task, seq_len = knobs["task"], knobs.pop("seq_len")
    levers = [a for a in (allow or "").split(",") if a.strip()]
    # the columns memfit train reads for the task, unless --text-column names others
    columns = (
        text_columns(task)
        if text_column is None
        else [c.strip() for c in text_column.split(",") if c.strip()]
    )
    if train_file is None and seq_len is None:
        raise UsageError(
            "--seq-len is required (or give --train-file to take it from the data's longest sample)"
        )
    # the task's own column named without a file is what plan reads anyway: nothing to refuse
    if train_file is None and (tokenizer or text_column not in (None, TEXT_COLUMN)):
        raise UsageError("--text-column and --tokenizer describe --train-file: give it too")
    if train_file is not None and not columns:
        raise UsageError("--text-column: give at least one column name")
    instructions = {
        "prompt_column": prompt_column,
        "completion_column": completion_column,
        "messages_column": messages_column,
    }
    if any(v is not None for v in instructions.values()):
        if train_file is None:
            raise UsageError(
                "--prompt-column/--completion-column/--messages-column describe --train-file: "
                "give it too"
            )
        problems = flag_problems(
            task=task,
            packing=packing_strategy(knobs),
            text_column=text_column or TEXT_COLUMN,
            **instructions,
        )
        if problems:
            raise UsageError(problems[0])
    # on screen before torch is imported; the estimates the plan runs refine it
    with progress.status("loading torch and transformers", subject=f"memfit plan {model}"):
        # a model found nowhere is refused before torch loads (seconds); a Hub fetch shows here
        progress.report("looking up the model's config.json")
        locate_config(model)
        progress.report("loading torch and transformers")
        # start-up: torch and transformers load only when the plan runs
        from memfit.plan import plan

        profile, tokenizer, seq_len, seq_len_note = _data_lengths(
            model, train_file, columns, tokenizer, seq_len, instructions
        )
        budget = gpu_memory or gpu or "this machine's GPU"
        effective_batch_size = knobs["effective_batch_size"]
        progress.report(f"fitting batch {effective_batch_size} × {seq_len} tokens into {budget}")
        result = plan(
            model,
            seq_len=seq_len,
            gpu_memory=gpu_memory,
            gpu=gpu,
            allow=levers,
            data_profile=profile,
            safety_margin=safety_margin,
            trace_depth=trace_depth,
            host_memory=host_memory,
            **knobs,
        )
    if seq_len_note is not None:
        result.explanation.insert(0, seq_len_note)
    if profile is not None and packing_strategy(knobs) == "bfd":
        # what a packed step holds: the rows of the data packed into sequences of seq_len
        micro = result.chosen.micro_batch_size if result.chosen is not None else None
        figures = packing_figures(profile.lengths.tolist(), seq_len)
        result.explanation.insert(0, figures.plan_line(micro))
    if train_file is not None and result.chosen is not None:
        # the memfit train command names the data the plan read
        result.train_file = train_file
        result.data_flags = _data_flags(text_column, instructions)
        result.explanation = [
            f"Train: {result.train_command()}" if line.startswith("Train: ") else line
            for line in result.explanation
        ]
    if write_config is not None and result.chosen is not None:
        job = {"model": model, "task": task, "num_labels": knobs["num_labels"], "seq_len": seq_len}
        # the columns a sentence-embedding run reads by default need no key
        named = text_column is not None or task != "sentence-embedding"
        data = {
            "train_file": train_file,
            "columns": columns if named else [],
            "tokenizer": tokenizer,
        }
        data |= instructions
        _write_plan(write_config, result, job, effective_batch_size, data, safety_margin)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        print_plan(result)
        if write_config is not None and result.chosen is not None:
            typer.echo(f"wrote {write_config}")
    if not result.fits:
        # start-up: memfit.plan is loaded (the plan ran)
        from memfit.plan.explain import budget_with_margin

        where = budget_with_margin(result)
        if write_config is not None:
            sys.stderr.write(f"memfit: nothing fits in {where}: {write_config} not written\n")
        elif as_json:  # stdout holds the JSON: the verdict goes to stderr
            sys.stderr.write(f"memfit: nothing fits in {where}\n")
        raise typer.Exit(3)


# a run config memfit wrote starts with this line (memfit.config.write_config): a later plan
# replaces it without --overwrite
CONFIG_KIND = Kind(starts_with(b"# memfit run configuration"), "a memfit run config")


def _check_config_destination(
    path: str, model: str, train_file: str | None, tokenizer: str | None, overwrite: bool
) -> None:
    """--write-config is never the model, its data or its tokenizer, and replaces an existing
    file memfit did not write only with --overwrite (memfit.paths.destination_problems)."""
    inputs = model_inputs(model, "MODEL")
    if train_file is not None:
        try:
            files = [source.path for source in resolve_sources(train_file, "--train-file")]
        except UsageError:
            files = []  # the reader says what is wrong with --train-file, in its own words
        inputs += data_inputs(train_file, "--train-file", files)
    if tokenizer is not None:
        inputs += model_inputs(tokenizer, "--tokenizer")
    problems = destination_problems(
        path, "--write-config", CONFIG_KIND, inputs=inputs, overwrite=overwrite
    )
    if problems:
        raise UsageError("\n".join(problems))


def _data_lengths(
    model: str,
    train_file: str | None,
    columns: list[str],
    tokenizer: str | None,
    seq_len: int | None,
    instructions: dict[str, str | None],
) -> tuple[DataProfile | None, str | None, int, str | None]:
    """With --train-file: its length profile (instruction rows as rendered) and the tokenizer
    folder that counted them. The sequence length: --seq-len, else the data's longest sample
    (and a line saying so)."""
    # start-up: memfit.plan loads torch
    from memfit.plan.data_profile import DataProfile, tokenizer_folder

    profile = None
    if train_file is not None:
        progress.report(f"tokenizing {train_file} for its lengths")
        tokenizer = tokenizer_folder(model, tokenizer, model_flag="MODEL")
        profile = DataProfile.from_file(
            train_file,
            columns,
            tokenizer,
            prompt_column=instructions["prompt_column"],
            completion_column=instructions["completion_column"],
            messages_column=instructions["messages_column"],
        )
    if seq_len is not None:
        return profile, tokenizer, seq_len, None
    assert profile is not None
    # start-up: resolving a model loads transformers (memfit.models.registry)
    from memfit.models import resolve_model

    max_positions = resolve_model(model).max_positions
    # a multiple of 8 keeps tensor-core shapes; the model's positions are a hard limit
    seq_len = min(round_seq_len(profile.max_length), max_positions)
    note = (
        f"--seq-len {seq_len}: the longest sample of {train_file} has {profile.max_length} "
        f"tokens (p99 {profile.percentile(99)})"
        + (
            f", capped at the model's {max_positions} positions"
            if seq_len < profile.max_length
            else (", rounded up to a multiple of 8" if seq_len > profile.max_length else "")
        )
    )
    return profile, tokenizer, seq_len, note


def _data_flags(text_column: str | None, instructions: dict[str, str | None]) -> str:
    """How memfit train reads --train-file, as flags: the instruction columns, or a text column
    other than the default."""
    given = {k: v for k, v in instructions.items() if v is not None}
    if given:
        return " ".join(f"--{k.replace('_', '-')} {shlex.quote(v)}" for k, v in given.items())
    if text_column is None or text_column == TEXT_COLUMN:
        return ""
    return f"--text-column {shlex.quote(text_column)}"


def _write_plan(
    path: str,
    result: Any,
    job: dict[str, Any],
    effective_batch_size: int,
    data: dict[str, Any],
    safety_margin: float,
) -> None:
    """The chosen plan as a run config for memfit train: the job, the data and the plan's
    settings, then what it was planned for (memfit train ignores those keys)."""
    train_file, columns = data["train_file"], data["columns"]
    config: dict[str, Any] = {
        "model": job["model"],
        "task": job["task"],
        "num_labels": job["num_labels"] if job["task"] == "classification" else None,
        "seq_len": job["seq_len"],
        "effective_batch_size": effective_batch_size,
        "train_file": train_file,
        "text_column": None
        if train_file is None or not columns
        else (columns[0] if len(columns) == 1 else columns),
        "tokenizer": data["tokenizer"],
        "prompt_column": data.get("prompt_column"),
        "completion_column": data.get("completion_column"),
        "messages_column": data.get("messages_column"),
        **result.chosen.settings(),
        "gpu": result.gpu,
        "budget_bytes": result.budget_bytes,
        "safety_margin": safety_margin,
        "predicted_peak_bytes": result.predicted_peak_bytes,
    }
    write_run_config(path, {k: v for k, v in config.items() if v is not None})
