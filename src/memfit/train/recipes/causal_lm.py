"""Causal language modelling: next-token prediction on one text column.

The tokenizer is loaded when the data is read: a row's weight in a step is its number of target
tokens (tokens after truncation to ``max_seq_len``, minus the first, which nothing predicts), and a
text too short to have one is an error at its line, before any model is loaded.

Without packing, a row is a text; each chunk is padded on the right to its longest row and the
padding positions are no targets (-100).

``packing`` (``--packing``) packs with ``packing_strategy`` (``--packing-strategy``, TRL's names):

- ``bfd`` (the default): padding-free packing. The rows are read as without packing (tokenized,
  truncated to ``max_seq_len``, bad rows refused or skipped), then packed whole, best fit
  decreasing (:func:`memfit.data.packing.best_fit_decreasing`), into sequences of at most
  ``max_seq_len`` tokens; those sequences are the steps' rows. Each packed row keeps its loss
  mask and gets position ids restarting at 0, and no attention mask is passed, so transformers
  keeps the rows apart (a block-diagonal causal mask on SDPA and eager attention; on flash
  attention a micro-batch is fed as one flattened row, whose variable-length path takes the rows'
  boundaries from the positions); the first token of each packed row is no target, as a row's
  first token never is. The loss of a packed step is the loss of its rows unpacked, and the
  guard's weight is still the step's target tokens.
- ``wrapped``: all texts are tokenized, each followed by the end-of-sequence token, concatenated
  and cut into blocks of ``max_seq_len`` tokens; the rows are then those blocks (``input_ids``
  plus where they came from), the last one possibly shorter, and no text is truncated (a long
  text runs over several blocks). Blocks attend across document boundaries, as in Hugging
  Face's ``run_clm``: continued pre-training on plain text.

Instruction rows (:mod:`memfit.data.instructions`, TRL's SFT conventions): with
``prompt_column``/``completion_column`` a row is prompt + completion + EOS and the loss covers the
completion tokens only; with ``messages_column`` a row is a chat rendered with the tokenizer's
chat template and the loss covers the assistant turns only. Both are cut to ``max_seq_len`` from
the right; a row with no token left to learn from is a bad row at its line (refused, or skipped
with ``--skip-bad-rows``), and a tokenizer without a chat template refuses ``messages_column``
for the whole run. Both pack with ``bfd``; ``wrapped`` blocks are refused (they would cut rows
and their loss masks).

The loss is the summed token cross-entropy over the step's target-token count, so chunks of
different lengths weigh by their tokens (the contract in ``base.py``): a target token is one
whose label is not -100 after the shift (the first token, padding, prompts and non-assistant
turns are none), so a chunk of long prompts and short completions weighs by its completions.
With ``cross_entropy="fused-linear"`` (``--cross-entropy``) the loss is computed from the last
hidden states and the head's weight chunk by chunk (:func:`memfit.step.causal_lm_loss`): neither
a training step nor an eval pass builds the full logits.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from memfit import step
from memfit.data.instructions import (
    IGNORE_INDEX,
    VERSION,
    InstructionColumns,
    Tokenized,
    chat_template_problem,
    flag_problems,
    has_generation_markers,
    labels_of,
    messages_of,
    parse_messages,
    template_key,
    tokenize_chat,
    tokenize_prompt_completion,
)
from memfit.data.packing import best_fit_decreasing, packed_positions
from memfit.data.rows import (
    LENGTH,
    WHERE,
    Column,
    DataError,
    RowTable,
    problem_at,
    read_rows,
    row_error,
    text_of,
    tokenizer_key,
)
from memfit.errors import UsageError
from memfit.levers.packing import DEFAULT_PACKING_STRATEGY, PACKING_STRATEGIES
from memfit.metrics import perplexity
from memfit.train.recipes.base import Recipe, Row
from memfit.train.recipes.loading import load_pretrained

# the key under which ``read`` keeps a row's tokens (truncated to ``max_seq_len``)
TOKENS = "__tokens__"
# instruction rows: 1 where a token is a target (completion, assistant), 0 where it is context
TARGETS = "__targets__"
# instruction rows: why a row cannot be trained on ("" when it can), found while tokenizing
PROBLEM = "__problem__"
# bfd packing: the lengths of the rows packed into a sequence, in order
SEGMENTS = "__segments__"


class CausalLMRecipe(Recipe):
    task: ClassVar[str] = "causal-lm"
    metric: ClassVar[str] = "loss"
    greater_is_better: ClassVar[bool] = False

    model: Any  # a transformers PreTrainedModel (an nn.Module)

    @classmethod
    def config_options(cls, cfg: Any) -> dict[str, Any]:
        return {
            "text_column": cfg.text_column,
            "packing": cfg.packing,
            # bfd when not given; a resumed run's own (TrainConfig resolves it)
            "packing_strategy": cfg.packing_strategy,
            "attn_implementation": cfg.attn_implementation,
            "max_seq_len": cfg.max_seq_len or cfg.seq_len or 512,
            "prompt_column": cfg.prompt_column,
            "completion_column": cfg.completion_column,
            "messages_column": cfg.messages_column,
            # the plan may choose it when not given (the run sets it again once planned)
            "cross_entropy": cfg.cross_entropy or "standard",
        }

    def __init__(
        self,
        model: str,
        *,
        text_column: str = "text",
        max_seq_len: int = 512,
        packing: bool = False,
        packing_strategy: str | None = None,
        attn_implementation: str | None = None,
        prompt_column: str | None = None,
        completion_column: str | None = None,
        messages_column: str | None = None,
        cross_entropy: str = "standard",
    ) -> None:
        if max_seq_len < 2:
            raise UsageError(f"--max-seq-len: must be ≥ 2 for causal LM, got {max_seq_len}")
        strategy = (packing_strategy or DEFAULT_PACKING_STRATEGY) if packing else None
        if strategy is not None and strategy not in PACKING_STRATEGIES:
            raise UsageError(
                f"--packing-strategy: unknown value {strategy!r}; one of "
                f"{', '.join(PACKING_STRATEGIES)}"
            )
        problems = flag_problems(
            task=self.task,
            prompt_column=prompt_column,
            completion_column=completion_column,
            messages_column=messages_column,
            packing=strategy,
            text_column=text_column,
        )
        if problems:
            raise UsageError("\n".join(problems))
        self.model_name = str(model)
        self.text_column = text_column
        self.instruction = InstructionColumns(prompt_column, completion_column, messages_column)
        self.max_seq_len = max_seq_len
        # the packing strategy ("bfd", "wrapped"), None without packing
        self.packing = strategy
        self.attn_implementation = attn_implementation
        # "standard" (the full logits) or "fused-linear" (chunks of them, from the hidden states)
        self.cross_entropy = cross_entropy
        self.device = torch.device("cpu")
        self.tokenizer: Any = None

    # -- data ----------------------------------------------------------------------------------
    def _load_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # start-up: loaded when a run reads data

            self.tokenizer = load_pretrained(AutoTokenizer.from_pretrained, self.model_name)
            if self.tokenizer.pad_token is None:
                # GPT-2 has no pad token; padded positions are masked and no targets, so eos does
                self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.instruction.messages:
            # a whole-run error: no row of the run could be rendered
            problem = chat_template_problem(self.tokenizer, self.model_name)
            if problem is not None:
                raise UsageError(problem)
        return self.tokenizer

    def _tokenize(self, batch: dict[str, list[Any]], limit: int | None) -> list[Tokenized]:
        """Instruction rows' tokens and targets (a batch of column values), cut to ``limit``."""
        tokenizer, columns = self._load_tokenizer(), self.instruction
        if columns.messages:
            markers = has_generation_markers(tokenizer)
            return [
                tokenize_chat(tokenizer, messages_of(value), limit, markers=markers)
                for value in batch[columns.messages]
            ]
        assert columns.prompt is not None and columns.completion is not None
        return tokenize_prompt_completion(
            tokenizer, batch[columns.prompt], batch[columns.completion], limit
        )

    def _tokens(self, row: Row) -> tuple[list[int], list[int] | None]:
        """The row's tokens and targets (None: every token): its packed block, what ``read``
        kept, or the row tokenized and truncated now (rows made elsewhere)."""
        if "input_ids" in row and self.packing == "wrapped":
            return list(row["input_ids"]), None
        if TOKENS in row:
            targets = row.get(TARGETS)
            return list(row[TOKENS]), (list(targets) if targets is not None else None)
        if self.instruction.kind != "text":
            names = self.instruction.names
            if self.instruction.kind == "prompt-completion":
                values: list[Any] = [text_of(row, name) for name in names]
            else:
                messages, why = parse_messages(row.get(names[0]), names[0])
                if messages is None:
                    raise row_error(row, why or "not a list of messages")
                values = [messages]
            batch = {name: [value] for name, value in zip(names, values, strict=True)}
            tokenized = self._tokenize(batch, self.max_seq_len)[0]
            if tokenized.problem is not None:
                raise row_error(row, tokenized.problem)
            return tokenized.ids, tokenized.targets
        ids = self._load_tokenizer()(
            text_of(row, self.text_column), truncation=True, max_length=self.max_seq_len
        )["input_ids"]
        return list(ids), None

    def _token_ids(self, row: Row) -> list[int]:
        return self._tokens(row)[0]

    def read(self, path: Path, flag: str = "--train-file") -> Sequence[Row]:
        # the rows are tokenized (and truncated) here, before build: check the length first
        self.fit_folder_positions()
        if self.instruction.kind != "text":
            return self._packed(self._read_instructions(path, flag))
        table = read_rows(path, [Column(self.text_column)], flag=flag, options=self.data_options)
        tokenizer = self._load_tokenizer()
        column = self.text_column
        wrapped = self.packing == "wrapped"
        limit = None if wrapped else self.max_seq_len

        def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            ids = tokenizer(batch[column], truncation=limit is not None, max_length=limit)
            return {TOKENS: ids["input_ids"], LENGTH: [len(x) for x in ids["input_ids"]]}

        # tokenized once, cached beside the data: units() and the loss of every step read these
        key = f"causal-lm|{tokenizer_key(tokenizer)}|{limit}|{column}"
        table = table.map_rows(tokenize, key, cache_dir=self.data_options.cache_dir)
        if not wrapped:
            reason = (
                f"column {self.text_column!r} is a single token: nothing to predict "
                "(a causal LM row needs at least 2 tokens)"
            )
            lengths = [int(n) for n in table.dataset[LENGTH]]
            return self._packed(
                self._drop_bad_rows(table, [reason if n < 2 else "" for n in lengths])
            )
        if tokenizer.eos_token_id is None:
            raise UsageError(f"--packing: the tokenizer of {self.model_name!r} has no eos token")
        stream: list[int] = []
        starts: list[int] = []  # where each row's tokens begin in the stream
        wheres: list[str] = []
        for batch in table.dataset.select_columns([TOKENS, WHERE]).iter(batch_size=1000):
            for ids, at in zip(batch[TOKENS], batch[WHERE], strict=True):
                starts.append(len(stream))
                wheres.append(at)
                stream.extend(ids)
                stream.append(tokenizer.eos_token_id)
        blocks: list[Row] = []
        for begin in range(0, len(stream), self.max_seq_len):
            block = stream[begin : begin + self.max_seq_len]
            if len(block) < 2:
                # a lone last token has no target; it is the eos of the last text
                continue
            first = where_at(wheres, starts, begin)
            last = where_at(wheres, starts, begin + len(block) - 1)
            where = first if first == last else f"{first} to {last.rsplit(' line ', 1)[-1]}"
            blocks.append({"input_ids": block, WHERE: where})
        return blocks

    def _packed(self, table: RowTable) -> Sequence[Row]:
        """With ``bfd`` packing, the rows of ``table`` (tokenized and truncated to
        ``max_seq_len``, bad rows refused or skipped) packed whole into sequences of at most
        ``max_seq_len`` tokens, best fit decreasing: each a row of the steps, its tokens and
        targets the packed rows' in order (each packed row's first token no target: nothing of
        its own predicts it) and :data:`SEGMENTS` their lengths. Without it, ``table``."""
        if self.packing != "bfd":
            return table
        columns = [c for c in (TOKENS, TARGETS, WHERE) if c in table.dataset.column_names]
        data = table.dataset.select_columns(columns).to_dict()
        ids: list[list[int]] = data[TOKENS]
        targets: list[list[int] | None] = data.get(TARGETS) or [None] * len(ids)
        wheres: list[str] = data[WHERE]
        packed: list[Row] = []
        for members in best_fit_decreasing([len(x) for x in ids], self.max_seq_len):
            tokens: list[int] = []
            mask: list[int] = []
            for i in members:
                row_targets = targets[i]
                tokens.extend(ids[i])
                mask.append(0)
                mask.extend(row_targets[1:] if row_targets is not None else [1] * (len(ids[i]) - 1))
            packed.append(
                {
                    TOKENS: tokens,
                    TARGETS: mask,
                    SEGMENTS: [len(ids[i]) for i in members],
                    LENGTH: len(tokens),
                    WHERE: _wheres([wheres[i] for i in members]),
                }
            )
        return packed

    def _read_instructions(self, path: Path, flag: str) -> RowTable:
        """Prompt/completion or chat rows, tokenized with their targets (cached beside the
        data); rows with nothing to learn from refused, or skipped."""
        # a tokenizer without a chat template fails the run before any row is read
        tokenizer = self._load_tokenizer()
        kind = "messages" if self.instruction.messages else "text"
        columns = [Column(name, kind) for name in self.instruction.names]
        table = read_rows(path, columns, flag=flag, options=self.data_options)
        limit = self.max_seq_len

        def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            rows = self._tokenize(batch, limit)
            return {
                TOKENS: [r.ids for r in rows],
                TARGETS: [r.targets for r in rows],
                LENGTH: [len(r.ids) for r in rows],
                PROBLEM: [r.problem or "" for r in rows],
            }

        key = "|".join(
            [
                f"causal-lm-{VERSION}",
                tokenizer_key(tokenizer),
                str(tokenizer.eos_token_id),
                template_key(tokenizer) if self.instruction.messages else "",
                str(limit),
                *self.instruction.names,
            ]
        )
        table = table.map_rows(tokenize, key, cache_dir=self.data_options.cache_dir)
        return self._drop_bad_rows(table, [str(x) for x in table.dataset[PROBLEM]])

    def _drop_bad_rows(self, table: RowTable, reasons: list[str]) -> RowTable:
        """The rows whose reason is not empty are bad rows found while tokenizing: refused at
        their lines, or (``--skip-bad-rows``) skipped and listed."""
        bad = [i for i, reason in enumerate(reasons) if reason]
        if not bad:
            return table
        wheres = table.dataset.select(bad)[WHERE]
        problems = [problem_at(at, reasons[i]) for at, i in zip(wheres, bad, strict=True)]
        if not self.data_options.skip_bad_rows:
            raise DataError(problems)
        self.data_options.skipped.extend(problems)
        keep = sorted(set(range(len(reasons))) - set(bad))
        if not keep:
            raise DataError([*problems, problem_at(wheres[0].rsplit(" line ", 1)[0], "no rows")])
        return RowTable(
            table.dataset.select(keep),
            skipped=[*table.skipped, *problems],
            labels=table.label_texts,
        )

    def lengths(self, rows: Sequence[Row]) -> list[int]:
        return [int(row[LENGTH]) if LENGTH in row else len(self._token_ids(row)) for row in rows]

    # -- model ---------------------------------------------------------------------------------
    def build(self, train_rows: Sequence[Row]) -> None:
        from transformers import AutoModelForCausalLM  # start-up: loaded when a run builds a model

        self._load_tokenizer()
        kwargs: dict[str, Any] = {}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        self.model = load_pretrained(
            AutoModelForCausalLM.from_pretrained, self.model_name, **kwargs
        )
        if self.packing == "bfd":
            problem = packing_problem(self.model)
            if problem is not None:
                raise UsageError(problem)

    def units(self, rows: Sequence[Row]) -> int:
        # the step's target tokens: labels that are not -100 after the shift (the guard's weight)
        return sum(_target_count(*self._tokens(row)) for row in rows)

    def _batch(
        self, rows: Sequence[Row]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The chunk's input ids, attention mask, labels (per position, not shifted) and position
        ids (None: the model's own) on the device."""
        if rows and SEGMENTS in rows[0]:
            return self._packed_batch(rows)
        tokens = [self._tokens(row) for row in rows]
        # dynamic padding: the chunk's longest row, rounded up to the device's multiple
        width = self.padded_width(max(len(ids) for ids, _ in tokens))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        # padding is no target by position, not by id: a real eos (packing) stays a target;
        # prompts and non-assistant turns are none either (instruction rows' targets)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, (ids, mask) in enumerate(tokens):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.tensor(labels_of(ids, mask), dtype=torch.long)
        input_ids, attention_mask, labels = (
            self.on_device(t) for t in (input_ids, attention_mask, labels)
        )
        return input_ids, attention_mask, labels, None

    def _packed_batch(
        self, rows: Sequence[Row]
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor]:
        """A chunk of ``bfd``-packed sequences: input ids, no attention mask, labels and the
        position ids that keep the packed rows apart (see :mod:`memfit.data.packing`)."""
        tokens = [self._tokens(row) for row in rows]
        labels_list = [labels_of(ids, mask) for ids, mask in tokens]
        segments = [[int(n) for n in row[SEGMENTS]] for row in rows]
        if "flash" in str(self.attn_implementation or ""):
            # flash attention's variable-length path reads the rows' boundaries from the
            # positions of a single row only: the chunk's sequences flattened, no padding at all
            ids_flat = [t for ids, _ in tokens for t in ids]
            labels_flat = [t for labels in labels_list for t in labels]
            positions = [p for lengths in segments for p in packed_positions(lengths, 0)]
            built = [
                torch.tensor([x], dtype=torch.long) for x in (ids_flat, labels_flat, positions)
            ]
            input_ids, labels, position_ids = (self.on_device(t) for t in built)
            return input_ids, None, labels, position_ids
        width = self.padded_width(max(len(ids) for ids, _ in tokens))
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        # the padding after a sequence's rows counts from 0 again: a row of its own to the mask
        position_ids = torch.tensor(
            [packed_positions(lengths, width) for lengths in segments], dtype=torch.long
        )
        for i, ((ids, _), row_labels) in enumerate(zip(tokens, labels_list, strict=True)):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            labels[i, : len(ids)] = torch.tensor(row_labels, dtype=torch.long)
        input_ids, labels, position_ids = (
            self.on_device(t) for t in (input_ids, labels, position_ids)
        )
        # no attention mask: transformers then reads the packing from the position ids
        return input_ids, None, labels, position_ids

    def loss(
        self, rows: Sequence[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        # summed over target tokens, divided by the step's: chunks add up to the step's mean;
        # the loss the estimator traces (memfit.step)
        input_ids, attention_mask, labels, position_ids = self._batch(rows)
        return step.causal_lm_loss(
            self.model,
            input_ids,
            attention_mask,
            labels,
            units=total_units,
            cross_entropy=self.cross_entropy,
            position_ids=position_ids,
        )

    # -- eval ----------------------------------------------------------------------------------
    def eval_partial(self, rows: Sequence[Row]) -> tuple[float, int]:
        input_ids, attention_mask, labels, position_ids = self._batch(rows)
        # the same loss as training's (fused-linear: no full logits in an eval pass either)
        summed = step.causal_lm_loss(
            self.model,
            input_ids,
            attention_mask,
            labels,
            units=1,
            cross_entropy=self.cross_entropy,
            position_ids=position_ids,
        )
        return float(summed), step.target_count(labels)

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        tokens = sum(part[1] for part in partials)
        loss = sum(part[0] for part in partials) / max(tokens, 1)
        return {"loss": loss, "perplexity": perplexity(loss)}

    def save(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)


# transformers' mask builders (masking_utils), which find packed rows in the position ids when no
# attention mask is given
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for")


def packing_problem(model: Any) -> str | None:
    """Why ``--packing-strategy bfd`` cannot keep ``model``'s packed rows apart (one line), or
    None: a model whose modelling code builds no mask with transformers' masking utilities
    (a state-space or recurrent model, whose state runs on from one row into the next, or a
    model with a mask of its own) would let each packed row see the rows before it."""
    module = inspect.getmodule(type(model))
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return None  # no source to read (a frozen build): transformers' own classes have it
    if any(name in source for name in _MASK_BUILDERS):
        return None
    return (
        f"--packing-strategy bfd: {type(model).__name__} does not build its attention mask with "
        "transformers' masking utilities (it has a recurrent state or a mask of its own), so "
        "packed rows would see each other; use --packing-strategy wrapped for plain text, or "
        "leave --packing out"
    )


def _target_count(ids: list[int], targets: list[int] | None) -> int:
    """A row's target tokens: every token but the first, or its targets but the first's."""
    return len(ids) - 1 if targets is None else sum(targets[1:])


def _wheres(wheres: list[str]) -> str:
    """Where a packed sequence's rows come from: ``train.jsonl lines 3, 17, 20`` (the rows of
    one file), else each row's place."""
    if len(wheres) == 1:
        return wheres[0]
    parts = [w.rsplit(" line ", 1) for w in wheres]
    files = {p[0] for p in parts}
    if len(files) == 1 and all(len(p) == 2 for p in parts):
        return f"{parts[0][0]} lines {', '.join(p[1] for p in parts)}"
    return "; ".join(wheres)


def where_at(wheres: list[str], starts: list[int], offset: int) -> str:
    """The WHERE of the row whose tokens hold stream position ``offset``."""
    return wheres[bisect.bisect_right(starts, offset) - 1]
