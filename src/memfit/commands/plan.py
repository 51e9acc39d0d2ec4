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
from memfit.commands._options import KNOB, Overwrite, TraceDepth, job_knobs
from memfit.config import write_config as write_run_config
from memfit.errors import UsageError
from memfit.job import round_seq_len
from memfit.paths import (
    Kind,
    check_writable_file,
    data_inputs,
    destination_problems,
    model_inputs,
    starts_with,
)
from memfit.report.console import print_plan

if TYPE_CHECKING:
    from memfit.plan import DataProfile


@job_knobs
def plan_command(
    model: Annotated[str, typer.Argument(help="A known name, a model folder or a config.json.")],
    *,
    task: str = KNOB,
    effective_batch_size: Annotated[
        int, typer.Option(help="Samples per optimizer step, over all GPUs: kept exactly.")
    ],
    seq_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens per sample (padded length).",
            show_default="with --train-file, its longest sample",
        ),
    ] = None,
    gpu_memory: Annotated[
        str | None, typer.Option(help="The budget, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option(help="A catalog GPU (memfit gpus): its memory and speed.")
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="Pin fp32 | fp16 | bf16.", show_default="the plan chooses")
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(
            help="sentence-embedding: mnrl | cosent | cosine | softmax", show_default="mnrl"
        ),
    ] = None,
    num_labels: Annotated[int, typer.Option(help="Classes of a classification head.")] = 2,
    world_size: Annotated[
        int, typer.Option(help="GPUs sharing the effective batch (the budget is per GPU).")
    ] = 1,
    sharding: Annotated[
        str,
        typer.Option(
            help="How the GPUs divide the model: none | zero1 | zero2 | zero3 (DeepSpeed) | fsdp."
        ),
    ] = "none",
    allow: Annotated[
        str | None,
        typer.Option(
            help="Levers that change the recipe, comma-separated: optimizer,truncation,lora,"
            "quantization (quantization needs lora or --lora-rank)"
        ),
    ] = None,
    lora_rank: int | None = KNOB,
    quantization: str | None = KNOB,
    double_quant: bool | None = KNOB,
    train_file: Annotated[
        str | None,
        typer.Option(help="Training data (file or folder, as memfit train reads) for lengths."),
    ] = None,
    text_column: Annotated[
        str, typer.Option(help="Text column(s) of --train-file, comma-separated.")
    ] = "text",
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
    ] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    write_config: Annotated[
        str | None, typer.Option(help="Write the plan as a YAML run config for memfit train.")
    ] = None,
    overwrite: Overwrite = False,
    trace_depth: TraceDepth = "auto",
) -> None:
    """Fit a fine-tuning job into a memory budget, effective batch kept; exit 3 if nothing fits."""
    if write_config is not None:
        # a folder that is missing or read-only fails now, not after the plan's traces
        check_writable_file(write_config, "--write-config")
        _check_config_destination(write_config, model, train_file, tokenizer, overwrite)
    levers = [a for a in (allow or "").split(",") if a.strip()]
    columns = [c.strip() for c in text_column.split(",") if c.strip()]
    if train_file is None and seq_len is None:
        raise UsageError(
            "--seq-len is required (or give --train-file to take it from the data's longest sample)"
        )
    if train_file is None and (tokenizer or text_column != "text"):
        raise UsageError("--text-column and --tokenizer describe --train-file: give it too")
    if train_file is not None and not columns:
        raise UsageError("--text-column: give at least one column name")
    instructions = {
        "prompt_column": prompt_column,
        "completion_column": completion_column,
        "messages_column": messages_column,
    }
    if any(v is not None for v in instructions.values()):
        from memfit.data.instructions import flag_problems

        if train_file is None:
            raise UsageError(
                "--prompt-column/--completion-column/--messages-column describe --train-file: "
                "give it too"
            )
        problems = flag_problems(task=task, packing=False, text_column=text_column, **instructions)
        if problems:
            raise UsageError(problems[0])
    # on screen before torch is imported; the estimates the plan runs refine it
    with progress.status("loading torch and transformers", subject=f"memfit plan {model}"):
        from memfit.plan import plan

        profile, tokenizer, seq_len, seq_len_note = _data_lengths(
            model, train_file, columns, tokenizer, seq_len, instructions
        )
        budget = gpu_memory or gpu or "this machine's GPU"
        progress.report(f"fitting batch {effective_batch_size} × {seq_len} tokens into {budget}")
        result = plan(
            model,
            task=task,
            seq_len=seq_len,
            effective_batch_size=effective_batch_size,
            gpu_memory=gpu_memory,
            gpu=gpu,
            loss=loss,
            world_size=world_size,
            sharding=sharding,
            allow=levers,
            precision=precision,
            data_profile=profile,
            safety_margin=safety_margin,
            num_labels=num_labels,
            trace_depth=trace_depth,
            lora_rank=lora_rank,
            quantization=quantization,
            double_quant=double_quant,
        )
    if seq_len_note is not None:
        result.explanation.insert(0, seq_len_note)
    if train_file is not None and result.chosen is not None:
        # the memfit train command names the data the plan read
        result.train_file = train_file
        result.data_flags = _data_flags(text_column, instructions)
        result.explanation = [
            f"Train: {result.train_command()}" if line.startswith("Train: ") else line
            for line in result.explanation
        ]
    if write_config is not None and result.chosen is not None:
        job = {"model": model, "task": task, "num_labels": num_labels, "seq_len": seq_len}
        data = {"train_file": train_file, "columns": columns, "tokenizer": tokenizer}
        data |= instructions
        _write_plan(write_config, result, job, effective_batch_size, data, safety_margin)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        print_plan(result)
        if write_config is not None and result.chosen is not None:
            typer.echo(f"wrote {write_config}")
    if not result.fits:
        where = result.budget_words()
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
    from memfit.data.sources import resolve_sources

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


def _data_flags(text_column: str, instructions: dict[str, str | None]) -> str:
    """How memfit train reads --train-file, as flags: the instruction columns, or a text column
    other than the default."""
    given = {k: v for k, v in instructions.items() if v is not None}
    if given:
        return " ".join(f"--{k.replace('_', '-')} {shlex.quote(v)}" for k, v in given.items())
    return "" if text_column == "text" else f"--text-column {shlex.quote(text_column)}"


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
        if train_file is None
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
