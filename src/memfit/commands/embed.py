"""``memfit embed``: sentence embeddings of every row (:func:`memfit.infer.embed.embed`),
OOM-guarded; the summary line to stderr. Errors become :mod:`memfit.cli`'s one-line messages and
exit codes (2 for bad input or usage, 3 when a row does not fit even alone)."""

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


def embed_command(
    model_dir: ModelDir,
    file: File,
    output: Annotated[
        str, Opt(help="OUT.npy (float32 matrix) or OUT.parquet (row, id, embedding).")
    ],
    text_column: TextColumn = "text",
    id_column: IdColumn = None,
    batch_size: BatchSize = None,
    gpu_memory: GpuMemory = None,
    memory_cap: MemoryCap = None,
    device: Device = None,
    max_seq_len: MaxSeqLen = None,
    precision: Precision = "fp32",
    prompt_name: Annotated[
        str | None, Opt(help="A prompt of the model's prompts.", show_default="its default prompt")
    ] = None,
    normalize: Annotated[bool, Opt("--normalize", help="Unit-length embeddings.")] = False,
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
    """Sentence embeddings of every row (sentence-transformers), OOM-guarded."""
    flags = dict(locals())  # the parameters, and nothing else yet: InferConfig's fields
    flags["model"] = flags.pop("model_dir")
    run_inference(
        "embed",
        "torch and sentence-transformers",
        f"loading the model, embedding every row of {file}",
        flags,
    )
