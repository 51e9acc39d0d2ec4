"""``memfit estimate``: the peak memory of one step, offline (:func:`memfit.estimate.estimate`),
printed as a breakdown, one JSON object, or a picture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import KNOB, Overwrite, TraceDepth, job_knobs
from memfit.errors import UsageError
from memfit.extras import is_installed, missing_line
from memfit.report.console import print_estimate
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


def _quantization_line(details: dict[str, Any]) -> str | None:
    """One line on the quantized base weights (``details["quantization"]``), if any."""
    info = details.get("quantization")
    if not isinstance(info, dict):
        return None
    scheme = str(info.get("scheme"))
    double = " with double quantization" if info.get("double_quant") else ""
    kept = ", ".join(info.get("kept_modules") or ()) or "none"
    compute = f", computing in {info['compute_dtype']}" if scheme != "int8" else ""
    return (
        f"base weights: {scheme}{double} (bitsandbytes){compute}: "
        f"{format_bytes(int(info.get('quantized_bytes') or 0))} for "
        f"{int(info.get('quantized_parameters') or 0):,} quantized parameters; "
        f"kept unquantized (fp32): {kept}"
    )


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


@job_knobs
def estimate_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry name, Hub id in the local cache, model folder or config.json."
        ),
    ],
    *,
    task: str = KNOB,
    batch_size: Annotated[int, typer.Option(help="Samples per step (per micro-batch).")],
    seq_len: Annotated[int, typer.Option(help="Tokens per sample (padded length).")],
    num_labels: Annotated[int, typer.Option(help="Classes of a classification head.")] = 2,
    loss: Annotated[
        str | None,
        typer.Option(
            help="sentence-embedding: mnrl | cached-mnrl | cosent | cosine | softmax",
            show_default="mnrl",
        ),
    ] = None,
    precision: Annotated[
        str, typer.Option(help="fp32 | fp16 | bf16 (mixed precision: fp32 master weights).")
    ] = "fp32",
    optimizer: str = KNOB,
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="Recompute activations in backward.")
    ] = False,
    attn_implementation: Annotated[
        str, typer.Option(help="sdpa | eager | flash_attention_2 (CUDA, sm80+, fp16/bf16)")
    ] = "sdpa",
    mode: Annotated[str, typer.Option(help="train | eval")] = "train",
    device: Annotated[
        str, typer.Option(help="cuda | cpu: the device whose memory to predict.")
    ] = "cuda",
    gpu_memory: Annotated[
        str | None, typer.Option(help="Budget to check against, e.g. 16GiB (2^30) or 16GB (10^9).")
    ] = None,
    mini_batch_size: Annotated[
        int | None,
        typer.Option(help="--loss cached-mnrl: rows embedded at once.", show_default="32"),
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
    max_seq_len: int | None = KNOB,
    quantization: str | None = KNOB,
    double_quant: bool | None = KNOB,
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
    overwrite: Overwrite = False,
    trace_depth: TraceDepth = "auto",
) -> None:
    """Predict the peak memory of one steady-state training (or eval) step, offline."""
    if plot is not None:
        _check_plot(plot, model, overwrite)

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
            quantization=quantization or "none",
            double_quant=bool(double_quant),
        )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        print_estimate(result)
        lines = (
            _quantization_line(result.details),
            _paged_line(result.details, optimizer, device),
            _trace_depth_line(result.details),
        )
        for line in lines:
            if line is not None:
                typer.echo(line)
        for line in _gpu_lines(result.details, device):
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
    from memfit.paths import Kind, destination_problems, holds_mark, model_inputs
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
        from memfit.report.plots import breakdown_plot, save_figure

        figure = breakdown_plot(result.breakdown, budget=result.budget_bytes, title=title)
        save_figure(figure, plot, flag="--plot")
