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
        typer.Option(help="sentence-embedding: mnrl (default) | cosent | cosine | softmax"),
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
    )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        from memfit.report.console import print_estimate

        print_estimate(result)


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
    """Estimate a known fine-tuning job: bert-base-uncased, batch 32 × 128 tokens, on a 16 GiB GPU."""
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
    command = typer.main.get_command(app)
    try:
        return command.main(args=argv, prog_name="memfit", standalone_mode=False)
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
