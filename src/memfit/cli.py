"""The ``memfit`` command line: a thin layer over the Python API, one verb per module."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

try:  # recent typer carries its own copy of click
    from typer._click.exceptions import ClickException as _ClickException
    from typer._click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp
except ImportError:  # pragma: no cover - typer built on click
    from click.exceptions import ClickException as _ClickException  # type: ignore[assignment]
    from click.exceptions import NoArgsIsHelpError as _NoArgsIsHelp  # type: ignore[assignment,attr-defined]

from memfit import __version__
from memfit.errors import MemfitError, UsageError

app = typer.Typer(
    name="memfit",
    help="Predict, plan and guard the memory of transformer fine-tuning.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


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
    max_seq_len: Annotated[
        int | None, typer.Option(help="Truncate sequences to this many tokens.")
    ] = None,
    world_size: Annotated[
        int, typer.Option(help="Data-parallel ranks (DDP): the memory of one rank.")
    ] = 1,
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
) -> None:
    """Predict the peak memory of one steady-state training (or eval) step, offline."""
    from memfit.estimate import estimate

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
        max_seq_len=max_seq_len,
        world_size=world_size,
        gpu=gpu,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        from memfit.report.console import print_estimate

        print_estimate(result)


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Argument(help="A known name, a model folder or a config.json.")],
    task: Annotated[str, typer.Option(help="classification | causal-lm | sentence-embedding")],
    seq_len: Annotated[int, typer.Option(help="Tokens per sample (padded length).")],
    effective_batch_size: Annotated[
        int, typer.Option(help="Samples per optimizer step, over all GPUs: kept exactly.")
    ],
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
    world_size: Annotated[int, typer.Option(help="Data-parallel GPUs.")] = 1,
    allow: Annotated[
        str | None,
        typer.Option(
            help="Levers that change the recipe, comma-separated: optimizer,truncation,lora"
        ),
    ] = None,
    train_file: Annotated[
        str | None, typer.Option(help="Training data (.csv/.tsv/.jsonl/.json) for lengths.")
    ] = None,
    text_column: Annotated[
        str | None, typer.Option(help="Text column(s) of --train-file, comma-separated.")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="A local tokenizer folder for --train-file.")
    ] = None,
    safety_margin: Annotated[
        float, typer.Option(help="Share of the budget kept free (0.05 = 5 %).")
    ] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    write_config: Annotated[
        str | None, typer.Option(help="Write the plan as a YAML run config for memfit train.")
    ] = None,
) -> None:
    """Fit a fine-tuning job into a memory budget, effective batch kept; exit 3 if nothing fits."""
    from memfit.plan import DataProfile, plan

    levers = [a for a in (allow or "").split(",") if a.strip()]
    profile = None
    columns = [c.strip() for c in (text_column or "").split(",") if c.strip()]
    if train_file is not None:
        missing = [f for f, v in (("--text-column", columns), ("--tokenizer", tokenizer)) if not v]
        if missing:
            raise UsageError(f"--train-file needs {' and '.join(missing)}")
        assert tokenizer is not None
        profile = DataProfile.from_file(train_file, columns, tokenizer)
    elif columns or tokenizer:
        raise UsageError("--text-column and --tokenizer describe --train-file: give it too")
    result = plan(
        model,
        task=task,
        seq_len=seq_len,
        effective_batch_size=effective_batch_size,
        gpu_memory=gpu_memory,
        gpu=gpu,
        loss=loss,
        world_size=world_size,
        allow=levers,
        precision=precision,
        data_profile=profile,
        safety_margin=safety_margin,
        num_labels=num_labels,
    )
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
            "text_column": columns[0] if len(columns) == 1 else (columns or None),
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


@app.command("gpus")
def gpus_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the GPUs --gpu knows: memory as CUDA reports it, bf16, peak rates."""
    from memfit.plan import catalog
    from memfit.units import format_bytes

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
    from memfit.models import registry_names, resolve_model

    rows = []
    for name in registry_names():
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


@app.command("demo")
def demo_command() -> None:
    """Estimate a known fine-tuning job (bert-base-uncased on a 16 GiB GPU), then plan it into 4 GiB."""
    from memfit.estimate import estimate
    from memfit.report.console import print_estimate

    typer.echo(
        "memfit demo: fine-tuning bert-base-uncased for classification, batch 32 × 128 tokens, AdamW, fp32"
    )
    typer.echo(
        "$ memfit estimate bert-base-uncased --task classification --batch-size 32 --seq-len 128 --gpu-memory 16GiB"
    )
    result = estimate(
        "bert-base-uncased", task="classification", batch_size=32, seq_len=128, gpu_memory="16GiB"
    )
    print_estimate(result)
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
    print_plan(
        plan(
            "bert-base-uncased",
            task="classification",
            seq_len=256,
            effective_batch_size=64,
            gpu_memory="4GiB",
        )
    )


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"memfit: error: {message}\n")
    sys.exit(code)


def _usage_message(exc: Any) -> str:
    message = " ".join(exc.format_message().split())
    param = getattr(exc, "param", None)
    if param is not None and getattr(param, "opts", None):
        flag = max(param.opts, key=len)
        if flag not in message:
            message = f"{flag}: {message}"
    return message


def main(argv: list[str] | None = None) -> Any:
    """Entry point: errors become one plain line on stderr with a meaningful exit code."""
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
    return None


if __name__ == "__main__":  # pragma: no cover
    main()
