"""The ``memfit`` command line: a thin layer over the Python API, one verb per module."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Annotated, Any, Literal

import typer

try:  # recent typer carries its own copy of click
    from typer._click.exceptions import ClickException as _ClickException
    from typer._click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp
except ImportError:  # pragma: no cover - typer built on click
    from click.exceptions import ClickException as _ClickException  # type: ignore[assignment]
    from click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp  # type: ignore[assignment,attr-defined]

from memfit import __version__, progress
from memfit.errors import MemfitError, UsageError

app = typer.Typer(
    name="memfit",
    help="Predict, plan and guard the memory of transformer fine-tuning.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# memfit estimate/plan --trace-depth: the choices, the help and the default in one place
TraceDepth = Annotated[
    Literal["auto", "full"],
    typer.Option(
        help="auto: trace a few layers and extrapolate the repeating block exactly (falls back to "
        "the whole model, and says so, where the model does not repeat); full: trace every layer."
    ),
]


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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memfit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Predict, plan and guard the memory of transformer fine-tuning."""


@app.command("estimate")
def estimate_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry name, Hub id in the local cache, model folder or config.json."
        ),
    ],
    task: Annotated[str, typer.Option(help="classification | causal-lm | sentence-embedding")],
    batch_size: Annotated[int, typer.Option(help="Samples per step (per micro-batch).")],
    seq_len: Annotated[int, typer.Option(help="Tokens per sample (padded length).")],
    num_labels: Annotated[int, typer.Option(help="Classes of a classification head.")] = 2,
    loss: Annotated[
        str | None,
        typer.Option(
            help="sentence-embedding: mnrl (default) | cached-mnrl | cosent | cosine | softmax"
        ),
    ] = None,
    precision: Annotated[
        str, typer.Option(help="fp32 | fp16 | bf16 (mixed precision: fp32 master weights).")
    ] = "fp32",
    optimizer: Annotated[str, typer.Option(help="adamw | adamw-8bit | adafactor | sgd")] = "adamw",
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="Recompute activations in backward.")
    ] = False,
    attn_implementation: Annotated[str, typer.Option(help="sdpa | eager")] = "sdpa",
    mode: Annotated[str, typer.Option(help="train | eval")] = "train",
    device: Annotated[
        str, typer.Option(help="cuda | cpu: the device whose memory to predict.")
    ] = "cuda",
    gpu_memory: Annotated[
        str | None, typer.Option(help="Budget to check against, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    mini_batch_size: Annotated[
        int | None,
        typer.Option(help="--loss cached-mnrl: rows embedded at once (default 32)."),
    ] = None,
    lora_rank: Annotated[
        int | None, typer.Option(help="Train LoRA adapters of this rank (peft) instead.")
    ] = None,
    lora_target_modules: Annotated[
        str | None,
        typer.Option(
            help="LoRA targets, comma-separated: attention, mlp, module names, all-linear."
        ),
    ] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(help="Truncate sequences to this many tokens.")
    ] = None,
    world_size: Annotated[
        int, typer.Option(help="Data-parallel ranks: the memory of one of them.")
    ] = 1,
    sharding: Annotated[
        str,
        typer.Option(
            help="How the ranks divide the model: none | zero1 | zero2 | zero3 (DeepSpeed) | fsdp."
        ),
    ] = "none",
    gpu: Annotated[
        str | None,
        typer.Option(help="A catalog GPU (memfit gpus): its memory is the budget."),
    ] = None,
    gradient_accumulation_steps: Annotated[
        int,
        typer.Option(
            help="Micro-batches per optimizer step: the later ones run beside the gradients."
        ),
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[
        str | None,
        typer.Option(help="Also draw the breakdown as a picture: FILE.png (or .svg, .pdf)."),
    ] = None,
    trace_depth: TraceDepth = "auto",
) -> None:
    """Predict the peak memory of one steady-state training (or eval) step, offline."""
    if plot is not None:
        from pathlib import Path

        # a bad path fails before the estimate's trace, not after it
        if Path(plot).suffix.lower() not in (".png", ".svg", ".pdf"):
            raise UsageError(f"--plot: {plot} must end in .png, .svg or .pdf")
        if not Path(plot).parent.is_dir():
            raise UsageError(f"--plot: the folder {Path(plot).parent} does not exist")

    # on screen before torch is imported (seconds); the estimator's report() calls refine it
    with progress.status("loading torch and transformers", subject=f"memfit estimate {model}"):
        from memfit.estimate import estimate

        progress.report(
            f"{mode} step, batch {batch_size} × {seq_len} tokens, {precision} on {device}"
        )
        result = estimate(
            model,
            task=task,
            batch_size=batch_size,
            seq_len=seq_len,
            precision=precision,
            optimizer=optimizer,
            gradient_checkpointing=gradient_checkpointing,
            attn_implementation=attn_implementation,
            mode=mode,
            device=device,
            gpu_memory=gpu_memory,
            num_labels=num_labels,
            loss=loss,
            mini_batch_size=mini_batch_size,
            lora_rank=lora_rank,
            lora_target_modules=[x for x in (lora_target_modules or "").split(",") if x.strip()],
            max_seq_len=max_seq_len,
            world_size=world_size,
            sharding=sharding,
            gpu=gpu,
            gradient_accumulation_steps=gradient_accumulation_steps,
            trace_depth=trace_depth,
        )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        from memfit.report.console import print_estimate

        print_estimate(result)
        depth_line = _trace_depth_line(result.details)
        if depth_line is not None:
            typer.echo(depth_line)
    if plot is not None:
        with progress.status(f"drawing {plot}", subject=f"memfit estimate {model}"):
            from memfit.report.plots import breakdown_plot, save_figure

            figure = breakdown_plot(
                result.breakdown,
                budget=result.budget_bytes,
                title=f"{model}: {task}, batch {batch_size} × {seq_len} tokens, {precision}, {device}",
            )
            save_figure(figure, plot, flag="--plot")
        # stdout stays one JSON object under --json
        typer.echo(f"wrote {plot}", err=as_json)


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Argument(help="A known name, a model folder or a config.json.")],
    task: Annotated[str, typer.Option(help="classification | causal-lm | sentence-embedding")],
    effective_batch_size: Annotated[
        int, typer.Option(help="Samples per optimizer step, over all GPUs: kept exactly.")
    ],
    seq_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens per sample (padded length); with --train-file, default: its longest sample."
        ),
    ] = None,
    gpu_memory: Annotated[
        str | None, typer.Option(help="The budget, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option(help="A catalog GPU (memfit gpus): its memory and speed.")
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="Pin fp32 | fp16 | bf16 (default: the plan chooses).")
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(help="sentence-embedding: mnrl (default) | cosent | cosine | softmax"),
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
            help="Levers that change the recipe, comma-separated: optimizer,truncation,lora"
        ),
    ] = None,
    train_file: Annotated[
        str | None,
        typer.Option(help="Training data (file or folder, as memfit train reads) for lengths."),
    ] = None,
    text_column: Annotated[
        str, typer.Option(help="Text column(s) of --train-file, comma-separated.")
    ] = "text",
    tokenizer: Annotated[
        str | None,
        typer.Option(help="A local tokenizer folder for --train-file (default: MODEL's folder)."),
    ] = None,
    safety_margin: Annotated[
        float, typer.Option(help="Share of the budget kept free (0.05 = 5 %).")
    ] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    write_config: Annotated[
        str | None, typer.Option(help="Write the plan as a YAML run config for memfit train.")
    ] = None,
    trace_depth: TraceDepth = "auto",
) -> None:
    """Fit a fine-tuning job into a memory budget, effective batch kept; exit 3 if nothing fits."""
    if write_config is not None:
        from memfit.paths import check_writable_file

        # a folder that is missing or read-only fails now, not after the plan's traces
        check_writable_file(write_config, "--write-config")
    levers = [a for a in (allow or "").split(",") if a.strip()]
    profile = None
    columns = [c.strip() for c in text_column.split(",") if c.strip()]
    if train_file is None and seq_len is None:
        raise UsageError(
            "--seq-len is required (or give --train-file to take it from the data's longest sample)"
        )
    if train_file is None and (tokenizer or text_column != "text"):
        raise UsageError("--text-column and --tokenizer describe --train-file: give it too")
    if train_file is not None and not columns:
        raise UsageError("--text-column: give at least one column name")
    # on screen before torch is imported; the estimates the plan runs refine it
    with progress.status("loading torch and transformers", subject=f"memfit plan {model}"):
        from memfit.plan import DataProfile, plan
        from memfit.plan.data_profile import tokenizer_folder

        if train_file is not None:
            progress.report(f"tokenizing {train_file} for its lengths")
            tokenizer = tokenizer_folder(model, tokenizer, model_flag="MODEL")
            profile = DataProfile.from_file(train_file, columns, tokenizer)
        seq_len_note = None
        if seq_len is None:
            assert profile is not None
            from memfit.models import resolve_model

            max_positions = resolve_model(model).max_positions
            # a multiple of 8 keeps tensor-core shapes; the model's positions are a hard limit
            seq_len = min(-(-profile.max_length // 8) * 8, max_positions)
            seq_len_note = (
                f"--seq-len {seq_len}: the longest sample of {train_file} has {profile.max_length} "
                f"tokens (p99 {profile.percentile(99)})"
                + (
                    f", capped at the model's {max_positions} positions"
                    if seq_len < profile.max_length
                    else (", rounded up to a multiple of 8" if seq_len > profile.max_length else "")
                )
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
        )
    if seq_len_note is not None:
        result.explanation.insert(0, seq_len_note)
    if write_config is not None and result.chosen is not None:
        from memfit.config import write_config as write

        settings = {k: v for k, v in result.chosen.settings().items()}
        config: dict[str, Any] = {
            "model": model,
            "task": task,
            "num_labels": num_labels if task == "classification" else None,
            "seq_len": seq_len,
            "effective_batch_size": effective_batch_size,
            "train_file": train_file,
            "text_column": None
            if train_file is None
            else (columns[0] if len(columns) == 1 else columns),
            "tokenizer": tokenizer,
            **settings,
            "gpu": result.gpu,
            "budget_bytes": result.budget_bytes,
            "safety_margin": safety_margin,
            "predicted_peak_bytes": result.predicted_peak_bytes,
        }
        write(write_config, {k: v for k, v in config.items() if v is not None})
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        from memfit.report.console import print_plan

        print_plan(result)
        if write_config is not None and result.chosen is not None:
            typer.echo(f"wrote {write_config}")
    if not result.fits:
        if write_config is not None:
            sys.stderr.write(f"memfit: nothing fits: {write_config} not written\n")
        raise typer.Exit(3)


@app.command("report")
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
    from memfit.report.html import PLOTS, write_report

    # matplotlib, and (unless --no-estimate) torch and the run's estimate: seconds
    doing = "drawing the plots" if no_estimate else "estimating the run's step, drawing the plots"
    with progress.status(doing, subject=f"memfit report {run_dir}"):
        path = write_report(run_dir, estimate=not no_estimate)
    typer.echo(f"wrote {path} (and {', '.join(PLOTS)} beside it)")


@app.command("gpus")
def gpus_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the GPUs --gpu knows: memory as CUDA reports it, bf16, peak rates."""
    from memfit.units import format_bytes

    with progress.status("loading the catalog", subject="memfit gpus"):  # memfit.plan imports torch
        from memfit.devices import catalog

    rows = [
        {
            "id": g.id,
            "name": g.name,
            "memory_bytes": g.memory_bytes,
            "bf16": g.bf16,
            "tflops": g.tflops,
            "memory_bandwidth_gbps": g.memory_bandwidth_gbps,
        }
        for g in catalog().values()
    ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for g in catalog().values():
        mixed = g.mixed_precision()
        typer.echo(
            f"{g.id:<12} {g.name:<32} {format_bytes(g.memory_bytes):>11}  "
            f"bf16 {'yes' if g.bf16 else 'no ':<3}  {mixed} {g.tflops[mixed]:>6.0f} TFLOP/s"
        )


@app.command("models")
def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the models memfit knows offline (architecture configs only, no weights)."""
    rows = []
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


data_app = typer.Typer(
    name="data",
    help="Look at training data before a run: its lengths in tokens.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data")


@data_app.command("profile")
def data_profile_command(
    file: Annotated[
        str,
        typer.Argument(
            help="CSV/TSV/JSONL/JSON/Parquet file (.gz for text formats), a folder of them, "
            "or a datasets save_to_disk folder."
        ),
    ],
    model: Annotated[
        str | None, typer.Option(help="A local model folder: its tokenizer is used.")
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="A local tokenizer folder.")] = None,
    text_column: Annotated[
        str, typer.Option(help="Text column(s), comma-separated: a row counts its longest.")
    ] = "text",
    max_seq_len: Annotated[
        int | None,
        typer.Option(help="Report what truncating (and padding) to this many tokens does."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Token lengths of a data set: percentiles, what truncation cuts, what padding wastes."""
    if model is not None and tokenizer is not None:
        raise UsageError("give --model or --tokenizer, not both (--tokenizer alone is enough)")
    if max_seq_len is not None and max_seq_len < 1:
        raise UsageError(f"--max-seq-len: {max_seq_len} is not a length (give 1 or more tokens)")
    with progress.status("loading transformers", subject=f"memfit data profile {file}"):
        from memfit.plan.data_profile import DataProfile, tokenizer_folder

        folder = tokenizer_folder(model, tokenizer, model_flag="--model")
        columns = [c.strip() for c in text_column.split(",") if c.strip()]
        progress.report("reading and tokenizing every row")
        profile = DataProfile.from_file(file, columns, folder, flag="FILE")
    if as_json:
        typer.echo(json.dumps(profile.to_dict(max_seq_len)))
    else:
        for line in profile.summary_lines(max_seq_len):
            typer.echo(line)


Opt = typer.Option


def _train_setup_status(message: str, subject: str) -> contextlib.AbstractContextManager[None]:
    """The status line of memfit train's setup, erased by the run's first line or step bar.

    The step bar is drawn by rich's default console, on stdout: where stdout is not a terminal it
    draws nothing before the run ends, and nothing would erase the line; no status line there.
    """
    try:
        interactive = sys.stdout.isatty()
    except (AttributeError, ValueError, OSError):
        interactive = False
    if not interactive:
        return contextlib.nullcontext()
    return progress.status(message, subject=subject, end_on_output=True)


# the seeds memfit train accepts: numpy's legacy seeding takes < 2**32, torch < 2**64 (and the
# run seeds its data order with seed × 1,000,003 + epoch, which must stay below 2**64 too)
MAX_SEED = 2**32 - 1


def _batch_settings(settings: dict[str, Any], default_effective: int) -> None:
    """Settle the batch keys in ``settings`` (flags, config file and environment merged): the
    micro-batch, the accumulation steps and the effective batch must agree where all are given
    (micro × accumulation × ranks = effective); a missing one follows from the others (the
    effective batch, else ``default_effective``). The accumulation steps then leave ``settings``:
    the run derives them from the other two."""
    from memfit.train.distributed import launched_world_size

    micro = settings.get("micro_batch_size")
    steps = settings.pop("gradient_accumulation_steps", None)
    effective = settings.get("effective_batch_size")
    world = settings.get("world_size") or launched_world_size()
    if steps is None:
        if effective is None and micro:
            # a planned config names the micro-batch; the effective batch follows from it
            settings["effective_batch_size"] = int(micro) * int(world)
        return
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UsageError(f"--gradient-accumulation-steps: must be ≥ 1, got {steps}")
    if not all(isinstance(x, int) for x in (micro or 0, effective or 0, world)):
        return  # a setting of the wrong kind: the run's own checks name it
    ranks = f" × {world} ranks (--world-size)" if world > 1 else ""
    if micro is None:
        # the accumulation steps pin the micro-batch: the effective batch ÷ (steps × ranks)
        total = effective if effective is not None else default_effective
        per_step = steps * world
        if total % per_step:
            raise UsageError(
                f"--gradient-accumulation-steps {steps}{ranks} does not divide "
                f"--effective-batch-size {total}; give an effective batch that is a multiple "
                f"of {per_step}, or leave --gradient-accumulation-steps out"
            )
        settings["micro_batch_size"] = total // per_step
        return
    product = micro * steps * world
    if effective is None:
        settings["effective_batch_size"] = product
    elif effective != product:
        raise UsageError(
            f"--micro-batch-size {micro} × --gradient-accumulation-steps {steps}{ranks} = "
            f"{product}, but --effective-batch-size is {effective}; make them agree, or leave "
            "one of the three out (it follows from the other two)"
        )


@app.command("train")
def train_command(
    config: Annotated[
        str | None,
        typer.Argument(help="A run config (memfit plan --write-config); flags override it."),
    ] = None,
    task: Annotated[str | None, Opt(help="classification | causal-lm | sentence-embedding")] = None,
    model: Annotated[
        str | None, Opt(help="A Hub id (cached), a model folder or a sentence-transformers folder.")
    ] = None,
    train_file: Annotated[str | None, Opt(help="Training data: .csv/.tsv/.jsonl/.json.")] = None,
    eval_file: Annotated[str | None, Opt(help="Eval data, same columns.")] = None,
    output_dir: Annotated[str | None, Opt(help="The run folder.")] = None,
    text_column: Annotated[str | None, Opt(help="Text column (classification, causal-lm).")] = None,
    label_column: Annotated[str | None, Opt(help="Label column (classification).")] = None,
    text_pair_column: Annotated[
        str | None, Opt(help="Second text column of sentence pairs (classification).")
    ] = None,
    anchor_column: Annotated[str | None, Opt(help="Anchor column (sentence-embedding).")] = None,
    positive_column: Annotated[
        str | None, Opt(help="Positive column (sentence-embedding).")
    ] = None,
    loss: Annotated[
        str | None, Opt(help="sentence-embedding: mnrl (default) | cached-mnrl")
    ] = None,
    packing: Annotated[bool | None, Opt(help="causal-lm: pack texts into full blocks.")] = None,
    effective_batch_size: Annotated[
        int | None, Opt(help="Samples per optimizer step (default 32).")
    ] = None,
    epochs: Annotated[int | None, Opt(help="Passes over the data (default 1).")] = None,
    max_steps: Annotated[int | None, Opt(help="Optimizer steps (instead of --epochs).")] = None,
    lr: Annotated[float | None, Opt(help="Peak learning rate (default 5e-5).")] = None,
    weight_decay: Annotated[float | None, Opt(help="AdamW weight decay (default 0).")] = None,
    warmup_ratio: Annotated[
        float | None, Opt(help="Share of steps warming up (default 0).")
    ] = None,
    lr_scheduler: Annotated[str | None, Opt(help="linear | cosine | constant")] = None,
    max_grad_norm: Annotated[
        float | None, Opt(help="Clip the whole step's gradient (default 1.0; 0: off).")
    ] = None,
    optimizer: Annotated[str | None, Opt(help="adamw | sgd | adamw-8bit | adafactor")] = None,
    seed: Annotated[int | None, Opt(help="Random seed (default 42).")] = None,
    gpu_memory: Annotated[str | None, Opt(help="Plan for this budget, e.g. 16GiB.")] = None,
    memory_cap: Annotated[
        str | None, Opt(help="Behave as if the device had only this much memory.")
    ] = None,
    save_every: Annotated[int | None, Opt(help="Checkpoint every N optimizer steps.")] = None,
    save_total_limit: Annotated[int | None, Opt(help="Keep the newest K checkpoints.")] = None,
    eval_every: Annotated[
        int | None, Opt(help="Evaluate every N optimizer steps (and at the end).")
    ] = None,
    resume: Annotated[bool, Opt(help="Continue from the newest complete checkpoint.")] = False,
    device: Annotated[str | None, Opt(help="cuda | cpu (default: cuda if present).")] = None,
    micro_batch_size: Annotated[int | None, Opt(help="Plan key: samples per micro-batch.")] = None,
    gradient_accumulation_steps: Annotated[
        int | None, Opt(help="Plan key (follows from the micro-batch).")
    ] = None,
    world_size: Annotated[
        int | None,
        Opt(help="Plan key: data-parallel ranks; must match what torchrun/accelerate launched."),
    ] = None,
    sharding: Annotated[
        str | None,
        Opt(help="Plan key: none | fsdp (PyTorch FSDP2) | zero1 | zero2 | zero3 (DeepSpeed)."),
    ] = None,
    precision: Annotated[str | None, Opt(help="Plan key: fp32 | fp16 | bf16.")] = None,
    gradient_checkpointing: Annotated[
        bool | None, Opt(help="Plan key: recompute activations.")
    ] = None,
    max_seq_len: Annotated[int | None, Opt(help="Plan key: truncate to this many tokens.")] = None,
    mini_batch_size: Annotated[int | None, Opt(help="Plan key: cached-mnrl mini-batch.")] = None,
    max_tokens_per_micro_batch: Annotated[
        int | None,
        Opt(help="Plan key: tokens per micro-batch, padding included (token-budget batches)."),
    ] = None,
    labels: Annotated[
        str | None,
        Opt(help="classification: the label set in id order, comma-separated (neg,pos)."),
    ] = None,
    num_labels: Annotated[
        int | None, Opt(help="classification: labels are the integers 0…N-1.")
    ] = None,
    skip_bad_rows: Annotated[
        bool,
        Opt(
            "--skip-bad-rows",
            help="Skip bad rows (listed in DIR/skipped_rows.jsonl) instead of refusing the data.",
        ),
    ] = False,
    cache_dir: Annotated[
        str | None, Opt(help="Where tokenized data is cached (default: the datasets cache).")
    ] = None,
    group_by_length: Annotated[
        bool | None, Opt(help="Steps of similar-length samples: less padding.")
    ] = None,
    probe: Annotated[
        bool | None,
        Opt(help="Run one step on the longest samples first (undone), so OOM comes at step 0."),
    ] = None,
    padding: Annotated[
        str | None, Opt(help="longest (dynamic, default) | max_length (pad to --max-seq-len).")
    ] = None,
    memory_snapshot: Annotated[
        bool,
        Opt(
            "--memory-snapshot",
            help="CUDA: dump the allocator's history at each OOM (DIR/memory-snapshots/).",
        ),
    ] = False,
    lora_rank: Annotated[
        int | None, Opt(help="Train peft LoRA adapters of this rank (the base stays frozen).")
    ] = None,
    lora_target_modules: Annotated[
        str | None,
        Opt(
            help="LoRA targets, comma-separated: attention (default), mlp, module names, or "
            "all-linear."
        ),
    ] = None,
    merge_lora: Annotated[
        bool,
        Opt(
            "--merge-lora",
            help="Save DIR/model as the merged model (loads without peft), not the adapter folder.",
        ),
    ] = False,
    report_to: Annotated[
        str | None,
        Opt(help="tensorboard | wandb | none (default): step, memory and guard figures there too."),
    ] = None,
) -> None:
    """Fine-tune under the OOM guard: same gradient, no restart, no lost sample."""
    # flags that are wrong whatever the config file says: refused before torch is imported
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed: must be a whole number from 0 to {MAX_SEED}, got {seed}")
    if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
        raise UsageError(
            f"--gradient-accumulation-steps: must be ≥ 1, got {gradient_accumulation_steps}"
        )
    if cache_dir is not None:
        from memfit.paths import check_writable_dir

        check_writable_dir(cache_dir, "--cache-dir")
    # torch, the model, tokenizing and the plan take seconds to minutes before step 1
    with _train_setup_status(
        "loading torch and transformers", subject=f"memfit train {model or config or ''}".strip()
    ):
        from memfit.train.lora import parse_target_modules
        from memfit.train.run import TrainConfig, train
        from memfit.train.sagemaker import environment_settings, publish_model
        from memfit.units import parse_size

        # on SageMaker-style services the job's channels, folders and hyperparameters are the
        # defaults; the config file and the flags below win over them
        settings: dict[str, Any] = environment_settings(os.environ, TrainConfig)
        if config is not None:
            from memfit.config import load_config

            loaded = load_config(config)
            for key in (
                "gpu",
                "budget_bytes",
                "safety_margin",
                "predicted_peak_bytes",
                "tokenizer",
                "num_labels",
            ):
                loaded.pop(key, None)
            if isinstance(loaded.get("lora_target_modules"), str):
                # "attention,mlp" in the file, as on the command line
                loaded["lora_target_modules"] = parse_target_modules(loaded["lora_target_modules"])
            settings.update(loaded)
        given: dict[str, Any] = {
            "task": task,
            "model": model,
            "train_file": train_file,
            "eval_file": eval_file,
            "output_dir": output_dir,
            "text_column": text_column,
            "label_column": label_column,
            "text_pair_column": text_pair_column,
            "anchor_column": anchor_column,
            "positive_column": positive_column,
            "loss": loss,
            "packing": packing,
            "effective_batch_size": effective_batch_size,
            "epochs": epochs,
            "max_steps": max_steps,
            "lr": lr,
            "weight_decay": weight_decay,
            "warmup_ratio": warmup_ratio,
            "lr_scheduler": lr_scheduler,
            "max_grad_norm": max_grad_norm,
            "optimizer": optimizer,
            "seed": seed,
            "save_every": save_every,
            "save_total_limit": save_total_limit,
            "eval_every": eval_every,
            "device": device,
            "micro_batch_size": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "world_size": world_size,
            "sharding": sharding,
            "precision": precision,
            "gradient_checkpointing": gradient_checkpointing,
            "max_seq_len": max_seq_len,
            "mini_batch_size": mini_batch_size,
            "max_tokens_per_micro_batch": max_tokens_per_micro_batch,
            "num_labels": num_labels,
            "cache_dir": cache_dir,
            "group_by_length": group_by_length,
            "probe": probe,
            "padding": padding,
            "memory_snapshot": memory_snapshot or None,
            "skip_bad_rows": skip_bad_rows or None,
            "lora_rank": lora_rank,
            "lora_target_modules": parse_target_modules(lora_target_modules),
            "merge_lora": merge_lora or None,
            "report_to": report_to,
        }
        if labels is not None:
            given["labels"] = [x.strip() for x in labels.split(",")]
        if gradient_accumulation_steps is None and any(
            given[k] is not None for k in ("micro_batch_size", "effective_batch_size", "world_size")
        ):
            # a flag that changes the batch overrides a planned config's accumulation steps (they
            # follow from the batch again); only steps given as a flag must agree with it
            settings.pop("gradient_accumulation_steps", None)
        settings.update({k: v for k, v in given.items() if v is not None})
        if gpu_memory is not None:
            settings["gpu_memory"] = parse_size(gpu_memory, name="--gpu-memory")
        if memory_cap is not None:
            settings["memory_cap"] = parse_size(memory_cap, name="--memory-cap")
        if settings.get("max_grad_norm") == 0:
            settings["max_grad_norm"] = None
        # (a dataclass field's default is its class attribute)
        _batch_settings(settings, TrainConfig.effective_batch_size)
        if settings.get("cache_dir") and cache_dir is None:
            from memfit.paths import check_writable_dir

            # from the config file or the environment: checked before the model loads too
            check_writable_dir(settings["cache_dir"], "--cache-dir")
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("task", "model", "train_file", "output_dir")
            if not settings.get(k)
        ]
        if missing:
            raise UsageError(
                f"memfit train needs {', '.join(missing)} (as flags or in the config file)"
            )
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(k for k in settings if k not in known)
        if unknown:
            raise UsageError(f"{config}: settings memfit train does not take: {', '.join(unknown)}")
        # --resume, or the environment's (a restarted managed job finds its run folder)
        resume = resume or bool(settings.pop("resume", False))
        progress.report(
            f"loading {settings['model']}, tokenizing {settings['train_file']}, "
            "planning the micro-batch"
        )
        result = train(TrainConfig(**settings, resume=resume))
    if os.environ.get("RANK", "0") not in ("", "0"):
        return  # several ranks: rank 0 reports the run
    if result.stopped in ("done", "finished"):
        # "finished": a --resume of a done run (a managed job started again) publishes it too
        published = publish_model(result.output_dir, os.environ)
        if published is not None:
            typer.echo(f"model copied to {published} (SM_MODEL_DIR)")
    if result.stopped == "signal":
        typer.echo(
            f"stopped by a signal after step {result.steps}; a checkpoint is in {result.output_dir}/checkpoints (memfit train ... --resume continues)"
        )
    else:
        metrics = "  ".join(f"{k} {v:.4g}" for k, v in result.eval_metrics.items())
        typer.echo(
            f"done: {result.steps} steps, {result.samples_seen} samples; model in {result.output_dir}/model"
            + (f"; eval: {metrics}" if metrics else "")
        )


@app.command("doctor")
def doctor_command(
    run_dir: Annotated[
        str | None, typer.Argument(help="A memfit train output folder (events.jsonl, run.json).")
    ] = None,
    message: Annotated[str | None, typer.Option(help="The out-of-memory message, pasted.")] = None,
    file: Annotated[
        str | None, typer.Option(help="A log file (or -, standard input): its last OOM message.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="The job's model (as memfit estimate takes it): fixes get saves_bytes."),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="With --model: classification | causal-lm | sentence-embedding"),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="With --model: the micro-batch that ran out of memory.")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="With --model: tokens per sample.")] = None,
    precision: Annotated[str, typer.Option(help="fp32 | fp16 | bf16")] = "fp32",
    optimizer: Annotated[str, typer.Option(help="adamw | adamw-8bit | adafactor | sgd")] = "adamw",
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="The job already recomputes.")
    ] = False,
    num_labels: Annotated[int, typer.Option(help="Classes of a classification head.")] = 2,
    loss: Annotated[str | None, typer.Option(help="sentence-embedding loss.")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="The job trains LoRA adapters.")] = None,
    gradient_accumulation_steps: Annotated[
        int, typer.Option(help="Micro-batches per optimizer step.")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Explain an out-of-memory error (a message, a log or a run folder) and rank the fixes."""
    from memfit.report import doctor

    given = [
        name
        for name, v in (("--message", message), ("--file", file), ("RUN_DIR", run_dir))
        if v is not None
    ]
    if len(given) != 1:
        raise UsageError(
            "give exactly one of --message TEXT, --file LOG or RUN_DIR"
            + (f" (got {', '.join(given)})" if given else "")
        )
    knobs = None
    if model is not None:
        missing = [
            f
            for f, v in (("--task", task), ("--batch-size", batch_size), ("--seq-len", seq_len))
            if v is None
        ]
        if missing:
            raise UsageError(f"--model: also give {', '.join(missing)} to price the fixes")
        if run_dir is not None:
            raise UsageError("--model: a run folder names its own model (run.json); drop --model")
        assert task is not None and batch_size is not None and seq_len is not None
        knobs = doctor.Knobs(
            model=model, task=task, batch_size=batch_size, seq_len=seq_len, precision=precision,
            gradient_checkpointing=gradient_checkpointing, optimizer=optimizer,
            num_labels=num_labels, loss=loss, lora_rank=lora_rank,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )  # fmt: skip
    # pricing the fixes runs memfit estimate (torch, traces: seconds), as a run folder's does;
    # reading a message alone is instant and shows no status line
    pricing = (
        progress.status(f"pricing the fixes with memfit estimate {model}", subject="memfit doctor")
        if knobs is not None
        else progress.status(
            "pricing the fixes with the run's model", subject=f"memfit doctor {run_dir}"
        )
        if run_dir is not None
        else contextlib.nullcontext()
    )
    with pricing:
        if message is not None:
            result = doctor.from_text(message, flag="--message", knobs=knobs)
        elif file is not None:
            result = doctor.from_file(file, knobs=knobs)
        else:
            assert run_dir is not None
            result = doctor.from_run_dir(run_dir)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        typer.echo(doctor.format_text(result))


@app.command("demo")
def demo_command() -> None:
    """Estimate a known fine-tuning job (bert-base-uncased on a 16 GiB GPU), then plan it into 4 GiB."""
    typer.echo(
        "memfit demo: fine-tuning bert-base-uncased for classification, batch 32 × 128 tokens, AdamW, fp32"
    )
    typer.echo(
        "$ memfit estimate bert-base-uncased --task classification --batch-size 32 --seq-len 128 --gpu-memory 16GiB"
    )
    # each slow step under a status line; the demo's next printed line erases it
    with progress.status("loading torch and transformers", subject="memfit demo"):
        from memfit.estimate import estimate
        from memfit.report.console import print_estimate

        progress.report("estimating bert-base-uncased, batch 32 × 128 tokens, fp32")
        result = estimate(
            "bert-base-uncased",
            task="classification",
            batch_size=32,
            seq_len=128,
            gpu_memory="16GiB",
        )
    print_estimate(result)
    with progress.status(
        "estimating bert-base-uncased, batch 32 × 128 tokens, bf16", subject="memfit demo"
    ):
        bf16 = estimate(
            "bert-base-uncased",
            task="classification",
            batch_size=32,
            seq_len=128,
            precision="bf16",
            gpu_memory="16GiB",
        )
    from memfit.units import format_bytes

    typer.echo(
        f"With --precision bf16 the same step needs {format_bytes(bf16.total_bytes)} "
        f"({(1 - bf16.total_bytes / result.total_bytes) * 100:.0f} % less)."
    )
    from memfit.plan import plan
    from memfit.report.console import print_plan

    typer.echo(
        "\nOn a 4 GiB budget, with 256 tokens and an effective batch of 64, the plan keeps the batch:"
    )
    typer.echo(
        "$ memfit plan bert-base-uncased --task classification --seq-len 256 "
        "--effective-batch-size 64 --gpu-memory 4GiB"
    )
    with progress.status("planning bert-base-uncased into 4 GiB", subject="memfit demo"):
        planned = plan(
            "bert-base-uncased",
            task="classification",
            seq_len=256,
            effective_batch_size=64,
            gpu_memory="4GiB",
        )
    print_plan(planned)
    _demo_train()


def _demo_train() -> None:
    """Fine-tune all-MiniLM-L6-v2 under a memory cap that makes the first step run out of memory."""
    import tempfile
    from pathlib import Path

    from memfit.train.demo import minilm_path, write_pairs
    from memfit.train.run import TrainConfig, train
    from memfit.units import format_bytes

    model = minilm_path()
    folder = Path(tempfile.mkdtemp(prefix="memfit-demo-"))
    train_file, eval_file = write_pairs(folder)

    def peak(name: str, **knobs: Any) -> int:
        # two steps (the second holds the AdamW state) with a cap that never bites: live bytes
        probe = train(
            TrainConfig(
                task="sentence-embedding",
                model=model,
                train_file=str(train_file),
                output_dir=str(folder / name),
                effective_batch_size=32,
                max_steps=2,
                memory_cap=1 << 40,
                max_seq_len=32,
                device="cpu",
                quiet=True,
                **knobs,
            )
        )
        lines = (probe.output_dir / "metrics.jsonl").read_text().splitlines()
        return max(int(json.loads(x)["peak_bytes"]) for x in lines)

    typer.echo("\nMeasuring what a training step of all-MiniLM-L6-v2 holds (two probe steps)…")
    with progress.status("two probe steps of all-MiniLM-L6-v2, batch 32", subject="memfit demo"):
        whole = peak("probe-32")
        progress.report("two probe steps of all-MiniLM-L6-v2, mini-batches of 4")
        cap = (whole + peak("probe-4", mini_batch_size=4)) // 2
    typer.echo(
        "Now a real fine-tuning run: all-MiniLM-L6-v2 (sentence-transformers, MNRL) on 36 embedded "
        f"paraphrase pairs, batch 32, on the CPU capped at {format_bytes(cap)} — less than the whole "
        "batch needs, so the guard must recover from a real out-of-memory error:"
    )
    out = folder / "run"
    typer.echo(
        f"$ memfit train --task sentence-embedding --model {model} --train-file {train_file} "
        f"--eval-file {eval_file} --effective-batch-size 32 --max-steps 4 --memory-cap {cap} "
        f"--max-seq-len 32 --lr 2e-5 --device cpu --output-dir {out}"
    )
    with _train_setup_status(
        "loading all-MiniLM-L6-v2, tokenizing the pairs", subject="memfit demo"
    ):
        result = train(
            TrainConfig(
                task="sentence-embedding",
                model=model,
                train_file=str(train_file),
                eval_file=str(eval_file),
                output_dir=str(out),
                effective_batch_size=32,
                max_steps=4,
                memory_cap=cap,
                max_seq_len=32,
                lr=2e-5,
                device="cpu",
            )
        )
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    ooms = sum(e["type"] == "oom" for e in events)
    metrics = "  ".join(f"{k} {v:.3f}" for k, v in result.eval_metrics.items())
    typer.echo(
        f"done: {result.steps} steps, {result.samples_seen} samples seen (none lost or repeated), "
        f"{ooms} out-of-memory error(s) survived; eval {metrics}"
    )
    typer.echo(f"run folder: {out} (model/, metrics.jsonl, events.jsonl, run.json)")
    from memfit.report.html import write_report

    typer.echo(f"\n$ memfit report {out}")
    with progress.status(
        f"estimating the run's step, drawing the plots of {out}", subject="memfit demo"
    ):
        page = write_report(out)
    typer.echo(
        f"wrote {page}: memory per step with the OOM and the back-off marked, the estimate "
        "beside the measured peak, loss and throughput (and the same plots as PNG beside it)"
    )


# guarded inference: the command functions live in memfit.infer.cli (imports typer only)
from memfit.infer.cli import embed_command, predict_command  # noqa: E402

app.command("predict")(predict_command)
app.command("embed")(embed_command)


def _fail(message: str, code: int) -> None:
    import os

    # several ranks (torchrun) reach the same verdict on the same input: rank 0 says it once
    if code in (2, 3) and os.environ.get("RANK", "0") not in ("", "0"):
        sys.exit(code)
    # one line per problem (bad data reports every bad row at once)
    for line in message.splitlines() or [""]:
        sys.stderr.write(f"memfit: error: {line}\n")
    sys.exit(code)


def _usage_message(exc: Any) -> str:
    message = " ".join(exc.format_message().split())
    # typer validates choices (Literal options) through pydantic, which prefixes its ValueError
    message = message.replace("Value error, ", "")
    param = getattr(exc, "param", None)
    if param is not None and getattr(param, "opts", None):
        flag = max(param.opts, key=len)
        if flag not in message:
            message = f"{flag}: {message}"
    return message


# verbs that only read and print: once they are done, nothing is left to tear down
_QUICK_EXIT_VERBS = frozenset({"estimate", "plan", "models", "gpus", "doctor"})


def main(argv: list[str] | None = None) -> Any:
    """Entry point: errors become one plain line on stderr with a meaningful exit code.

    Run as a program (``argv`` None), a read-only verb ends without the interpreter's teardown:
    freeing torch's and transformers' modules one by one takes a second or more, after the
    answer is printed. Exit handlers still run and both streams are flushed first.
    """
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if argv is not None or verb not in _QUICK_EXIT_VERBS:
        return _main(argv)
    import gc

    # importing torch and transformers makes millions of objects, and the collector's default
    # thresholds walk them again and again (about a second of a cold estimate): collect rarely
    gc.set_threshold(50_000, 20, 100)
    try:
        _main(None)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    _quick_exit(code)
    return None


def _quick_exit(code: int) -> None:
    import atexit
    import contextlib
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # a closed pipe: nothing more can be said on it
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None = None) -> Any:
    import os

    # transformers' advice for training scripts is noise for a planning tool
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="memfit", standalone_mode=False)
        # outside standalone mode click returns typer.Exit's code instead of exiting
        if isinstance(result, int) and not isinstance(result, bool) and result != 0:
            sys.exit(result)
        return result
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail("aborted", 130)
    except _NoArgsIsHelp:
        sys.exit(0)  # the help was printed
    except _ClickException as exc:
        # bad usage: one line naming the flag, no boxed panel
        _fail(_usage_message(exc), 2)
    except UsageError as exc:
        _fail(str(exc), 2)
    except MemfitError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except OSError as exc:
        from memfit.paths import is_user_os_error, os_error_line

        # the last resort for a path or disk the user gave (full, read-only, not there, a file
        # where a folder should be): one line, exit 2; the commands check their destinations
        # first, with the flag's name. Any other OSError is a bug: its traceback, exit 1
        if not is_user_os_error(exc):
            raise
        _fail(os_error_line(exc), 2)
    return None


if __name__ == "__main__":  # pragma: no cover
    main()
