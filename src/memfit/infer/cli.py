"""The ``memfit predict`` and ``memfit embed`` commands: flags to an :class:`InferConfig`, the
summary line to stderr (and, on a terminal, a status line there while they work). ``memfit.cli``
registers them; errors become its one-line messages and exit codes (2 for bad input or usage, 3
when a row does not fit even alone)."""

from __future__ import annotations

from typing import Annotated

import typer

from memfit import progress

Opt = typer.Option

ModelDir = Annotated[
    str, typer.Argument(help="A model folder, or a memfit train run folder (its model/).")
]
File = Annotated[
    str,
    Opt(help="The rows: .csv/.tsv/.jsonl/.json/.parquet (.gz for text), a folder, save_to_disk."),
]
TextColumn = Annotated[str, Opt(help="The column with the text.")]
IdColumn = Annotated[
    str | None, Opt(help="Copied to the output beside each row (default: id, when present).")
]
BatchSize = Annotated[
    int | None, Opt(help="Start at this batch instead of the planned one (still guarded).")
]
GpuMemory = Annotated[
    str | None, Opt(help="Plan the batch for this budget (default: the GPU's free memory).")
]
MemoryCap = Annotated[
    str | None, Opt(help="Behave as if the device had only this much memory (e.g. 2GiB).")
]
Device = Annotated[str | None, Opt(help="cuda | cpu (default: cuda if present).")]
MaxSeqLen = Annotated[
    int | None, Opt(help="Truncate rows to this many tokens (default: the model's limit).")
]
Precision = Annotated[str, Opt(help="fp32 | bf16 | fp16 (autocast).")]
Events = Annotated[
    str | None, Opt(help="Write plan/oom/backoff/done events to this file (JSON Lines).")
]
CacheDir = Annotated[
    str | None, Opt(help="Where the data reader caches Arrow files (default: datasets').")
]


def predict_command(
    model_dir: ModelDir,
    file: File,
    output: Annotated[str, Opt(help="OUT.jsonl: one line per input row, in input order.")],
    task: Annotated[
        str | None, Opt(help="classification | causal-lm (default: read from MODEL_DIR).")
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
) -> None:
    """Labels and probabilities (classifier) or per-row loss (causal LM), OOM-guarded."""
    # on screen before torch is imported; the run prints nothing until its summary line
    with progress.status("loading torch and transformers", subject=f"memfit predict {model_dir}"):
        from memfit.infer.predict import predict
        from memfit.infer.run import InferConfig

        progress.report(f"loading the model, predicting every row of {file}")
        result = predict(
            InferConfig(
                model=model_dir,
                file=file,
                output=output,
                task=task,
                text_column=text_column,
                text_pair_column=text_pair_column,
                id_column=id_column,
                batch_size=batch_size,
                gpu_memory=gpu_memory,
                memory_cap=memory_cap,
                device=device,
                max_seq_len=max_seq_len,
                precision=precision,
                events=events,
                cache_dir=cache_dir,
            )
        )
    typer.echo(result.summary(), err=True)


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
        str | None, Opt(help="A prompt of the model's prompts (default: its default prompt).")
    ] = None,
    normalize: Annotated[bool, Opt("--normalize", help="Unit-length embeddings.")] = False,
    events: Events = None,
    cache_dir: CacheDir = None,
) -> None:
    """Sentence embeddings of every row (sentence-transformers), OOM-guarded."""
    # on screen before torch is imported; the run prints nothing until its summary line
    with progress.status(
        "loading torch and sentence-transformers", subject=f"memfit embed {model_dir}"
    ):
        from memfit.infer.embed import embed
        from memfit.infer.run import InferConfig

        progress.report(f"loading the model, embedding every row of {file}")
        result = embed(
            InferConfig(
                model=model_dir,
                file=file,
                output=output,
                text_column=text_column,
                id_column=id_column,
                batch_size=batch_size,
                gpu_memory=gpu_memory,
                memory_cap=memory_cap,
                device=device,
                max_seq_len=max_seq_len,
                precision=precision,
                prompt_name=prompt_name,
                normalize=normalize,
                events=events,
                cache_dir=cache_dir,
            )
        )
    typer.echo(result.summary(), err=True)
