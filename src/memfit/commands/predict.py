"""``memfit predict``: labels and probabilities, or per-row losses, of every row
(:func:`memfit.infer.predict.predict`), OOM-guarded; the summary line to stderr. Errors become
:mod:`memfit.cli`'s one-line messages and exit codes (2 for bad input or usage, 3 when a row does
not fit even alone)."""

from __future__ import annotations

from typing import Annotated

from memfit.commands._options import (
    BatchSize,
    CacheDir,
    Device,
    Events,
    File,
    GpuMemory,
    IdColumn,
    MaxSeqLen,
    MemoryCap,
    ModelDir,
    Opt,
    Overwrite,
    Precision,
    TextColumn,
    run_inference,
)


def predict_command(
    model_dir: ModelDir,
    file: File,
    output: Annotated[str, Opt(help="OUT.jsonl: one line per input row, in input order.")],
    task: Annotated[
        str | None, Opt(help="classification | causal-lm", show_default="read from MODEL_DIR")
    ] = None,
    text_column: TextColumn = "text",
    text_pair_column: Annotated[
        str | None, Opt(help="The second text of a sentence-pair classifier.")
    ] = None,
    id_column: IdColumn = None,
    batch_size: BatchSize = None,
    gpu_memory: GpuMemory = None,
    memory_cap: MemoryCap = None,
    device: Device = None,
    max_seq_len: MaxSeqLen = None,
    precision: Precision = "fp32",
    events: Events = None,
    cache_dir: CacheDir = None,
    base_model: Annotated[
        str | None,
        Opt(
            help="The folder of the model whose LoRA adapters MODEL_DIR holds.",
            show_default="the base their adapter_config.json names",
        ),
    ] = None,
    overwrite: Overwrite = False,
) -> None:
    """Labels and probabilities (classifier) or per-row loss (causal LM), OOM-guarded."""
    flags = dict(locals())  # the parameters, and nothing else yet: InferConfig's fields
    flags["model"] = flags.pop("model_dir")
    run_inference(
        "predict",
        "torch and transformers",
        f"loading the model, predicting every row of {file}",
        flags,
    )
