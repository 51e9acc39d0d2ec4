"""``memfit embed``: sentence embeddings of every row, guarded.

MODEL_DIR is a sentence-transformers folder (or a plain transformers encoder, which
sentence-transformers wraps with mean pooling). A row's embedding is what
``SentenceTransformer.encode`` gives for it with its defaults: the model's modules (pooling,
``Normalize`` where the model has one), its default prompt (``--prompt-name`` picks another) and
its ``truncate_dim``; ``--normalize`` makes them unit length, as ``normalize_embeddings=True``.

Outputs, rows in input order: ``.npy``, a float32 matrix (row i is input row i; ids are not kept:
use ``.parquet`` for them), or ``.parquet`` with the columns ``row`` (0-based), the id column where
the input has one, and ``embedding`` (a list of float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit._callable_module import make_callable
from memfit.data.sources import resolve_sources
from memfit.errors import UsageError
from memfit.extras import problems as missing_packages
from memfit.infer.inputs import FLAG, id_type, read_input
from memfit.infer.model import (
    adapter_problems,
    load_sentence_transformer,
    model_folder,
    plan_folder,
)
from memfit.infer.output import (
    EMBED_SUFFIXES,
    AtomicOutput,
    NpyOutput,
    ParquetOutput,
    check_output,
    destination_problems,
)
from memfit.infer.run import (
    InferConfig,
    InferResult,
    Item,
    check_max_seq_len,
    config_from,
    config_problems,
    run,
)
from memfit.models import resolve_model


class Embedder:
    """A SentenceTransformer, run chunk by chunk as ``encode`` would run it."""

    task = "sentence-embedding"
    num_labels = 2  # no head: the estimate's default

    def __init__(self, folder: Path, cfg: InferConfig) -> None:
        self.model: Any = load_sentence_transformer(folder, cfg.base_model)
        positions = resolve_model(str(plan_folder(folder, cfg.base_model))).max_positions
        declared = self.model.max_seq_length
        limit = (
            min(declared, positions) if isinstance(declared, int) and declared > 0 else positions
        )
        if cfg.max_seq_len is not None:
            limit = positions  # --max-seq-len may go past the saved limit, up to the positions
        self.max_seq_len = check_max_seq_len(cfg, limit, str(folder))
        specials = self.model.tokenizer.num_special_tokens_to_add()
        if self.max_seq_len <= specials:
            # the tokenizer cannot truncate below its special tokens (it would not truncate)
            raise UsageError(
                f"--max-seq-len: {self.max_seq_len} leaves no room for text: the tokenizer of "
                f"{folder} adds {specials} special tokens; give at least {specials + 1}"
            )
        # the Transformer module truncates to this
        self.model.max_seq_length = self.max_seq_len
        prompts = dict(getattr(self.model, "prompts", None) or {})
        if cfg.prompt_name is not None:
            if cfg.prompt_name not in prompts:
                known = ", ".join(sorted(prompts)) or "none"
                raise UsageError(
                    f"--prompt-name: {cfg.prompt_name!r} is not a prompt of {folder} "
                    f"(its prompts: {known})"
                )
            self.prompt: str | None = prompts[cfg.prompt_name]
        else:
            default = getattr(self.model, "default_prompt_name", None)
            self.prompt = prompts.get(default) if default is not None else None
        self.prompt = self.prompt or None
        self.truncate_dim = getattr(self.model, "truncate_dim", None)
        self.normalize = cfg.normalize
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> None:
        self.device = device
        self.model.to(device)

    def lengths(self, texts: list[tuple[str, ...]]) -> list[int]:
        prefix = self.prompt or ""
        encoded = self.model.tokenizer(
            [prefix + t[0] for t in texts], truncation=True, max_length=self.max_seq_len
        )
        return [len(ids) for ids in encoded["input_ids"]]

    def run_chunk(self, items: list[Item]) -> list[Any]:
        # padded to the chunk's longest row by the model's own preprocessing
        features = self.model.preprocess([item.texts[0] for item in items], prompt=self.prompt)
        features = {
            name: value.to(self.device) if isinstance(value, torch.Tensor) else value
            for name, value in features.items()
        }
        embeddings = self.model(features)["sentence_embedding"]
        # the forward wrote the token embeddings into features: drop them before the next chunk
        del features
        if self.truncate_dim is not None:
            embeddings = embeddings[:, : self.truncate_dim]
        if self.normalize:
            embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
        # to host memory as a float32 copy: finished chunks must hold no device memory (and not
        # count against the cap) while the later chunks run
        return list(embeddings.float().cpu().numpy().copy())


def embed(config: InferConfig | None = None, /, **knobs: Any) -> InferResult:
    """Embed every row of ``--file`` with the sentence-transformers model in MODEL_DIR, in the
    largest batch that fits, under the guard's OOM back-off; write ``--output`` (``.npy`` or
    ``.parquet``, rows in input order) atomically. See :mod:`memfit.infer.run` for the flow."""
    cfg = config_from(config, knobs)
    problems = config_problems(cfg) + check_output(cfg.output, EMBED_SUFFIXES)
    problems += missing_packages([("sentence_transformers", "memfit embed")])
    if cfg.task is not None:
        problems.append("--task: memfit embed always embeds; --task is for memfit predict")
    if cfg.text_pair_column is not None:
        problems.append("--text-pair-column: memfit embed embeds one text per row; drop it")
    if cfg.id_column in ("row", "embedding"):
        problems.append(
            f"--id-column: {cfg.id_column!r} is a column memfit embed writes; rename it"
        )
    folder: Path | None = None
    try:
        folder = model_folder(cfg.model)
    except UsageError as exc:
        problems.append(str(exc))
    problems += adapter_problems(folder, cfg.base_model)
    try:
        resolve_sources(cfg.file, FLAG)
    except UsageError as exc:
        problems.append(str(exc))
    problems += destination_problems(
        output=cfg.output,
        events=cfg.events,
        file=cfg.file,
        model=folder,
        overwrite=cfg.overwrite,
    )
    if problems:
        raise UsageError("\n".join(problems))
    assert folder is not None
    data = read_input(
        cfg.file,
        (cfg.text_column,),
        id_column=cfg.id_column or "id",
        id_required=cfg.id_column is not None,
        cache_dir=cfg.cache_dir,
    )
    runner = Embedder(folder, cfg)
    out: AtomicOutput
    if Path(cfg.output).suffix.lower() == ".npy":
        matrix_out = NpyOutput(cfg.output, len(data))
        out = matrix_out

        def write(indices: list[int], outputs: list[Any]) -> None:
            matrix_out.write(np.stack(outputs))

    else:
        table_out = ParquetOutput(
            cfg.output,
            id_column=data.id_column,
            id_kind=id_type(data.ids) if data.ids is not None else None,
        )
        out = table_out

        def write(indices: list[int], outputs: list[Any]) -> None:
            ids = [data.ids[i] for i in indices] if data.ids is not None else None
            table_out.write(indices, ids, np.stack(outputs))

    with out:
        return run(cfg, "embed", runner, data, plan_folder(folder, cfg.base_model), write)


# importing this module binds memfit.infer.embed to it: calling it still runs embed()
make_callable(__name__, "embed")
