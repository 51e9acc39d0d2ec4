"""How long the training texts are, in tokens: what truncation would cut, what padding would waste.

``DataProfile.from_file`` reads any input memfit reads (CSV/TSV/JSON Lines/JSON/Parquet files,
CSV/TSV/JSON Lines gzipped, a folder of them, a ``datasets`` save_to_disk folder) through
:func:`memfit.data.rows.read_rows`, so a bad row is refused exactly as ``memfit train`` refuses
it: every problem at once, each naming the file and line. It tokenizes one or more text columns
in batches with a local tokenizer (special tokens included, nothing truncated; a sentence pair
counts its longest text) and keeps only each sample's length.

Instruction rows are measured as ``memfit train --task causal-lm`` renders them
(:mod:`memfit.data.instructions`): with ``prompt_column``/``completion_column`` a row's length is
prompt + completion + EOS, with ``messages_column`` the chat rendered with the tokenizer's chat
template; nothing truncated (the profile reports what ``--max-seq-len`` would cut). A row that
cannot be rendered is refused at its line, as ``memfit train`` refuses it.

``memfit data profile FILE`` prints :meth:`DataProfile.to_dict`; ``memfit plan --train-file``
takes its sequence length and truncation choices from the same profile.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.data.instructions import (
    InstructionColumns,
    chat_template_problem,
    has_generation_markers,
    messages_of,
    tokenize_chat,
    tokenize_prompt_completion,
)
from memfit.data.rows import WHERE, Column, DataError, DataOptions, problem_at, read_rows
from memfit.errors import UsageError

# texts per tokenizer call: large enough for the fast tokenizer's parallelism, small in memory
TOKENIZE_BATCH = 1000
# files that make a folder a tokenizer folder (fast, WordPiece, BPE, SentencePiece)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


@dataclass(frozen=True, eq=False)
class DataProfile:
    """Token lengths of the training samples (special tokens included), one per row.

    ``lengths`` is kept as a numpy ``int64`` array whatever sequence it is given as.
    """

    lengths: Any
    source: str = ""
    # where the lengths came from, for the report (empty when built from bare lengths)
    text_columns: tuple[str, ...] = ()
    tokenizer: str = ""
    # how a row's columns make its sequence: "longest" (the longest text column),
    # "prompt + completion + eos", "chat template"
    rendering: str = "longest"
    # bad rows left out (``skip_bad_rows``), as memfit train --skip-bad-rows leaves them out
    skipped_rows: int = 0

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths, dtype=np.int64).reshape(-1)
        if lengths.size == 0:
            raise UsageError(f"{self.source or 'data profile'}: no samples")
        if (lengths < 0).any():
            raise UsageError(f"{self.source or 'data profile'}: a length is negative")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "text_columns", tuple(self.text_columns))

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def percentile(self, q: float) -> int:
        """The ``q``-th percentile of the lengths (numpy's linear interpolation), rounded up."""
        return int(np.ceil(np.percentile(self.lengths, q)))

    def tokens_lost(self, max_seq_len: int, seq_len: int) -> float:
        """Share of the tokens a run at ``seq_len`` sees that truncating to ``max_seq_len`` cuts."""
        lengths = np.minimum(self.lengths, seq_len)
        kept = lengths.sum()
        if kept == 0:
            return 0.0
        return float(np.maximum(lengths - max_seq_len, 0).sum() / kept)

    def samples_truncated(self, max_seq_len: int) -> float:
        """Share of the rows longer than ``max_seq_len``."""
        return float((self.lengths > max_seq_len).mean())

    def truncated_token_share(self, max_seq_len: int | None) -> float:
        """Share of all tokens that truncating every sample to ``max_seq_len`` cuts:
        ``sum(max(len - L, 0)) / sum(len)`` (0.0 without a limit)."""
        total = int(self.lengths.sum())
        if max_seq_len is None or total == 0:
            return 0.0
        return float(np.maximum(self.lengths - max_seq_len, 0).sum() / total)

    def padding_share_fixed(self, padded_len: int | None = None) -> float:
        """Share of a fixed-length batch that is padding when every sample is truncated or
        padded to ``padded_len`` (default: the longest sample): ``1 - sum(min(len, P)) / (rows·P)``."""
        padded = self.max_length if padded_len is None else padded_len
        if padded <= 0:
            return 0.0
        real = int(np.minimum(self.lengths, padded).sum())
        return float(1.0 - real / (self.rows * padded))

    def to_dict(self, max_seq_len: int | None = None) -> dict[str, Any]:
        """The ``memfit data profile --json`` contract: ``rows``, ``tokens`` (p50, p90, p99, max,
        mean), ``truncated_token_share`` at ``max_seq_len`` and ``padding_share_fixed`` (padded to
        ``max_seq_len``, or to the longest sample without it); the other keys describe the input."""
        _check_max_seq_len(max_seq_len)
        return {
            "source": self.source,
            "text_columns": list(self.text_columns),
            "rendering": self.rendering,
            "skipped_rows": self.skipped_rows,
            "tokenizer": self.tokenizer,
            "rows": self.rows,
            "tokens": {
                "p50": self.percentile(50),
                "p90": self.percentile(90),
                "p99": self.percentile(99),
                "max": self.max_length,
                "mean": round(float(self.lengths.mean()), 2),
            },
            "total_tokens": int(self.lengths.sum()),
            "max_seq_len": max_seq_len,
            "truncated_token_share": round(self.truncated_token_share(max_seq_len), 6),
            "truncated_row_share": round(
                0.0 if max_seq_len is None else self.samples_truncated(max_seq_len), 6
            ),
            "padded_len": self.max_length if max_seq_len is None else max_seq_len,
            "padding_share_fixed": round(self.padding_share_fixed(max_seq_len), 6),
        }

    def summary_lines(self, max_seq_len: int | None = None) -> list[str]:
        """A short readable table of :meth:`to_dict` (what ``memfit data profile`` prints)."""
        d = self.to_dict(max_seq_len)
        t = d["tokens"]
        columns = ", ".join(d["text_columns"]) or "-"
        how = {"longest": "a row counts its longest column"}.get(
            self.rendering, f"a row is its {self.rendering}"
        )
        lines = [
            f"source        {d['source'] or '-'}",
            f"text columns  {columns}  ({how})",
            f"tokenizer     {d['tokenizer'] or '-'}",
            f"rows          {d['rows']:,}",
            f"tokens        p50 {t['p50']}  p90 {t['p90']}  p99 {t['p99']}  max {t['max']}  "
            f"mean {t['mean']:.2f}  (special tokens included)",
        ]
        if max_seq_len is not None:
            cut_rows = int((self.lengths > max_seq_len).sum())
            lines.append(
                f"truncation    at {max_seq_len} tokens cuts {d['truncated_token_share']:.2%} of "
                f"the tokens ({cut_rows:,} {'row' if cut_rows == 1 else 'rows'} longer)"
            )
        lines.append(
            f"padding       every row padded to {d['padded_len']}: "
            f"{d['padding_share_fixed']:.2%} of a batch is padding"
        )
        return lines

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        text_columns: Sequence[str],
        tokenizer: Any,
        *,
        flag: str = "--train-file",
        prompt_column: str | None = None,
        completion_column: str | None = None,
        messages_column: str | None = None,
        skip_bad_rows: bool = False,
    ) -> DataProfile:
        """Profile ``path``: ``tokenizer`` is a local tokenizer folder (or a loaded tokenizer);
        ``flag`` names the input in error messages (``--train-file``, ``FILE``). With
        ``prompt_column``/``completion_column`` or ``messages_column`` the rows are instruction
        rows, measured as rendered (``text_columns`` is then not read). ``skip_bad_rows``: leave
        out the rows memfit train --skip-bad-rows would leave out (counted in ``skipped_rows``)."""
        instruction = InstructionColumns(prompt_column, completion_column, messages_column)
        name = str(tokenizer) if isinstance(tokenizer, (str, Path)) else ""
        tok = tokenizer if not isinstance(tokenizer, (str, Path)) else load_tokenizer(tokenizer)
        name = name or _tokenizer_name(tok)
        if instruction.kind != "text":
            lengths, skipped = _instruction_lengths(
                path, instruction, tok, flag, name, skip_bad_rows
            )
            rendering = "chat template" if instruction.messages else "prompt + completion + eos"
            return cls(
                lengths,
                source=str(path),
                text_columns=tuple(instruction.names),
                tokenizer=name,
                rendering=rendering,
                skipped_rows=skipped,
            )
        columns = [c.strip() for c in text_columns if c.strip()]
        if not columns:
            raise UsageError("--text-column: give at least one column name")
        options = DataOptions(skip_bad_rows=skip_bad_rows)
        dataset = _read(path, columns, flag, options=options)
        lengths = np.concatenate(list(_lengths(dataset, columns, tok)))
        return cls(
            lengths,
            source=str(path),
            text_columns=tuple(columns),
            tokenizer=name,
            skipped_rows=len(options.skipped),
        )


def _check_max_seq_len(max_seq_len: int | None) -> None:
    if max_seq_len is not None and max_seq_len < 1:
        raise UsageError(f"--max-seq-len: {max_seq_len} is not a length (give 1 or more tokens)")


def _read(
    path: str | Path,
    columns: list[str],
    flag: str,
    kind: str = "text",
    *,
    where: bool = False,
    options: Any = None,
) -> Any:
    """The checked rows as a ``datasets.Dataset`` of the columns (and, with ``where``, of
    where each row is: ``WHERE``)."""
    folder = Path(path)
    # a DatasetDict: profile its training split, whatever flag names the input (read_rows
    # prefers the eval splits for any flag but --train-file)
    if flag != "--train-file" and (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))
            if "train" in splits.get("splits", []) and (folder / "train").is_dir():
                folder = folder / "train"
        except (OSError, ValueError, AttributeError):
            pass  # read_rows reports the unreadable index
    table = read_rows(folder, [Column(c, kind) for c in columns], flag=flag, options=options)
    return table.dataset.select_columns([*columns, WHERE] if where else columns)


def _instruction_lengths(
    path: str | Path, instruction: Any, tok: Any, flag: str, name: str, skip_bad_rows: bool
) -> tuple[np.ndarray, int]:
    """Each instruction row's rendered length, untruncated, and how many bad rows were left out;
    a row that cannot be rendered is refused at its line (every such row at once), or left out
    with ``skip_bad_rows``."""
    if instruction.messages:
        # no chat template: a whole-run error, before any row is read
        problem = chat_template_problem(tok, name)
        if problem is not None:
            raise UsageError(problem)
    kind = "messages" if instruction.messages else "text"
    options = DataOptions(skip_bad_rows=skip_bad_rows)
    dataset = _read(path, instruction.names, flag, kind, where=True, options=options)
    markers = has_generation_markers(tok) if instruction.messages else False
    lengths: list[int] = []
    problems = []
    for batch in dataset.iter(batch_size=TOKENIZE_BATCH):
        if instruction.messages:
            rows = [
                tokenize_chat(tok, messages_of(value), None, markers=markers)
                for value in batch[instruction.messages]
            ]
        else:
            rows = tokenize_prompt_completion(
                tok, batch[instruction.prompt], batch[instruction.completion]
            )
        for row, where in zip(rows, batch[WHERE], strict=True):
            if row.problem is not None:
                problems.append(problem_at(where, row.problem))
            else:
                lengths.append(len(row.ids))
    if problems and not skip_bad_rows:
        raise DataError(problems)
    return np.asarray(lengths, dtype=np.int64), len(options.skipped) + len(problems)


def _lengths(dataset: Any, columns: list[str], tok: Any) -> Iterator[np.ndarray]:
    """Per batch of rows, the longest of each row's columns, in tokens."""
    for batch in dataset.iter(batch_size=TOKENIZE_BATCH):
        longest: np.ndarray | None = None
        for column in columns:
            encoded = tok(
                list(batch[column]),
                add_special_tokens=True,
                truncation=False,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            lengths = np.fromiter((len(ids) for ids in encoded["input_ids"]), dtype=np.int64)
            longest = lengths if longest is None else np.maximum(longest, lengths)
        if longest is not None:
            yield longest


def _tokenizer_name(tok: Any) -> str:
    return str(getattr(tok, "name_or_path", "") or type(tok).__name__)


def load_tokenizer(name: str | Path, *, flag: str = "--tokenizer") -> Any:
    """A tokenizer from a local folder, offline; a UsageError naming ``flag`` otherwise."""
    # optional: transformers loads only to tokenize (memfit's quick verbs never need it)
    from transformers import AutoTokenizer

    # "Token indices sequence length is longer than ...": measuring long texts is the point
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/... for bad folders
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{flag}: cannot load a tokenizer from {name}: {first}") from None


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds tokenizer files."""
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).is_file() for f in _TOKENIZER_FILES)


def tokenizer_folder(model: str | None, tokenizer: str | None, *, model_flag: str) -> str:
    """Where the tokenizer is: ``tokenizer`` when given, else the folder of ``model`` (or, for a
    sentence-transformers folder, its Transformer module's folder). ``model_flag`` names the model
    in messages (``--model``, ``MODEL``). A registry name or Hub id has no local tokenizer: a
    UsageError saying to pass ``--tokenizer``."""
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise UsageError(
                f"--tokenizer: {tokenizer}: not a folder (give a local tokenizer folder)"
            )
        return tokenizer
    if model is None:
        raise UsageError(
            "no tokenizer: give --tokenizer a local tokenizer folder (or --model a local model "
            "folder that holds its tokenizer)"
        )
    folder = Path(model).expanduser()
    if not folder.is_dir():
        cached = _cached_tokenizer_folder(model)
        if cached is not None:
            return cached
        raise UsageError(
            f"{model_flag} {model}: not a local folder, and no tokenizer for it in the local "
            "Hugging Face cache (memfit never downloads one): pass --tokenizer a local tokenizer "
            "folder"
        )
    candidates = [folder]
    try:
        # start-up: resolving a model folder loads transformers (memfit.models.registry)
        from memfit.models import resolve_model

        spec_path = resolve_model(str(folder)).path
        if spec_path is not None:
            candidates.append(Path(spec_path))
    except UsageError:
        pass  # a tokenizer folder without config.json is fine: only the tokenizer is needed
    for candidate in candidates:
        if has_tokenizer(candidate):
            return str(candidate)
    raise UsageError(
        f"{model_flag} {model}: the folder holds no tokenizer files (tokenizer.json, "
        "vocab.txt, ...): pass --tokenizer a local tokenizer folder"
    )


def _cached_tokenizer_folder(name: str) -> str | None:
    """The snapshot folder of Hub id ``name`` in the local Hugging Face cache when it holds
    tokenizer files; never downloads."""
    try:
        # optional: the Hugging Face cache's reader (transformers' own dependency)
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    for filename in _TOKENIZER_FILES:
        try:
            found = try_to_load_from_cache(name.strip(), filename)
        except Exception:  # an invalid repo id, an unreadable cache
            return None
        if isinstance(found, str):
            return str(Path(found).parent)
    return None


__all__ = ["DataProfile", "has_tokenizer", "load_tokenizer", "tokenizer_folder"]
