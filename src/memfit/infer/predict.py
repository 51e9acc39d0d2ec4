"""``memfit predict``: a classifier's labels or a language model's per-row loss, guarded.

One JSON object per input row, in input order (``row`` is the 0-based row of the input; files of a
folder count in name order), plus the id column where the input has one:

- classification: ``{"row": 0, "label": "pos", "label_id": 1, "probabilities": {"neg": 0.1,
  "pos": 0.9}}``, names from the config's ``id2label``; a multi-label model
  (``problem_type: multi_label_classification``) gives sigmoid probabilities and ``labels`` (those
  ≥ 0.5), a regression head (one label, or ``problem_type: regression``) ``score``/``scores``;
- causal LM: ``{"row": 0, "loss": 3.2, "perplexity": 24.5, "tokens": 11}``: the mean negative
  log-likelihood (nats) of the row's ``tokens`` predicted tokens (the row's tokens after
  truncation, special tokens as the tokenizer adds them, minus the first, which nothing predicts).
  A corpus's loss is ``Σ loss·tokens / Σ tokens``. A row of one token has nothing to predict:
  ``"loss": null, "perplexity": null, "tokens": 0`` (reported, never dropped).

Each chunk is padded to its own longest row, on the right; padding is masked, so a row's output
does not depend on the rows it ran beside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memfit._callable_module import make_callable
from memfit.data.batching import padded_width
from memfit.data.sources import resolve_sources
from memfit.errors import UsageError
from memfit.infer.inputs import FLAG, Input, read_input
from memfit.infer.model import (
    adapter_problems,
    load_predict_model,
    load_tokenizer,
    model_folder,
    plan_folder,
    predict_task,
)
from memfit.infer.output import JsonlOutput, check_output, destination_problems
from memfit.infer.run import (
    InferConfig,
    InferResult,
    Item,
    check_max_seq_len,
    config_from,
    config_problems,
    run,
)
from memfit.metrics import perplexity
from memfit.models import usable_positions

IGNORE_INDEX = -100

# keys the records use: an id column of the same name would be overwritten
RESERVED = ("row", "label", "label_id", "labels", "probabilities", "score", "scores")
RESERVED_LM = ("row", "loss", "perplexity", "tokens")


def model_limit(tokenizer: Any, config: Any) -> int:
    """The most tokens a row can have: the position embeddings, or the tokenizer's smaller
    ``model_max_length`` (tokenizers without one say 10^30)."""
    positions = usable_positions(config)
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < positions:
        return declared
    return positions


class _TextModel:
    """What both tasks share: tokenizer, device, truncation, chunk widths."""

    task: str
    model: Any
    max_seq_len: int
    num_labels: int = 2

    def __init__(self, folder: Path, cfg: InferConfig) -> None:
        self.tokenizer = load_tokenizer(folder, cfg.base_model)
        self.model = load_predict_model(folder, self.task, cfg.base_model)
        self.positions = model_limit(self.tokenizer, self.model.config)
        self.max_seq_len = check_max_seq_len(cfg, self.positions, str(folder))
        specials = self.tokenizer.num_special_tokens_to_add(pair=cfg.text_pair_column is not None)
        if self.max_seq_len <= specials:
            # the tokenizer cannot truncate below its special tokens (it would not truncate)
            raise UsageError(
                f"--max-seq-len: {self.max_seq_len} leaves no room for text: the tokenizer of "
                f"{folder} adds {specials} special tokens; give at least {specials + 1}"
            )
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> None:
        self.device = device
        self.model.to(device)

    def _pad_multiple(self, longest: int) -> int | None:
        """8 on GPUs (aligned shapes for tensor cores), where that stays within the positions."""
        if self.device.type != "cuda" or padded_width(longest, 8) > self.positions:
            return None
        return 8

    def _encode(self, texts: list[tuple[str, ...]]) -> Any:
        firsts = [t[0] for t in texts]
        pairs = [t[1] for t in texts] if texts and len(texts[0]) > 1 else None
        return self.tokenizer(firsts, pairs, truncation=True, max_length=self.max_seq_len)

    def lengths(self, texts: list[tuple[str, ...]]) -> list[int]:
        return [len(ids) for ids in self._encode(texts)["input_ids"]]


class Classifier(_TextModel):
    """A sequence classifier: probabilities over ``id2label``."""

    task = "classification"

    def __init__(self, folder: Path, cfg: InferConfig) -> None:
        super().__init__(folder, cfg)
        config = self.model.config
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise UsageError(
                    f"MODEL_DIR: the tokenizer of {folder} has no pad and no eos token, so rows "
                    "cannot be batched; add a pad token to it"
                )
            # decoder backbones (GPT-2) have no pad token; padding is masked, any id will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(config, "pad_token_id", None) is None:
            # a decoder's classification head finds each row's last real token by pad_token_id
            config.pad_token_id = self.tokenizer.pad_token_id
        self.num_labels = int(config.num_labels)
        self.names = [str(config.id2label.get(k, k)) for k in range(self.num_labels)]
        problem = getattr(config, "problem_type", None)
        # one label and no problem type reads as regression (transformers' rule), but not in
        # the model of a memfit train run of --task classification: its run says what it is
        if problem == "regression" or (
            problem is None and self.num_labels == 1 and _run_task(folder) != "classification"
        ):
            self.kind = "regression"
        elif problem == "multi_label_classification":
            self.kind = "multi_label"
        else:
            self.kind = "single_label"

    def run_chunk(self, items: list[Item]) -> list[Any]:
        longest = max(item.length for item in items)
        firsts = [item.texts[0] for item in items]
        pairs = [item.texts[1] for item in items] if len(items[0].texts) > 1 else None
        batch = self.tokenizer(
            firsts,
            pairs,
            truncation=True,
            max_length=self.max_seq_len,
            # dynamic padding: the chunk is as wide as its longest row, not max_seq_len
            padding="longest",
            pad_to_multiple_of=self._pad_multiple(longest),
            return_tensors="pt",
        )
        batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        logits = self.model(**batch).logits.float()
        if self.kind == "single_label":
            scores = torch.softmax(logits, dim=-1)
        elif self.kind == "multi_label":
            scores = torch.sigmoid(logits)
        else:
            scores = logits
        # to host memory as a copy: finished chunks must hold no device memory (and not count
        # against the cap) while the later chunks run
        return list(scores.cpu().numpy().copy())

    def record(self, scores: np.ndarray[Any, Any]) -> dict[str, Any]:
        values = [float(x) for x in scores]
        if self.kind == "regression":
            if len(values) == 1:
                return {"score": values[0]}
            return {"scores": dict(zip(self.names, values, strict=True))}
        best = int(np.argmax(scores))
        out: dict[str, Any] = {"label": self.names[best], "label_id": best}
        if self.kind == "multi_label":
            out["labels"] = [n for n, p in zip(self.names, values, strict=True) if p >= 0.5]
        out["probabilities"] = dict(zip(self.names, values, strict=True))
        return out


def _run_task(folder: Path) -> str | None:
    """The ``--task`` of the memfit train run whose ``model/`` is ``folder`` (its ``run.json``),
    or None when ``folder`` is not such a run's model or its run.json does not say."""
    if folder.name != "model":
        return None
    try:
        run = json.loads((folder.parent / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = run.get("config") if isinstance(run, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    return task if isinstance(task, str) else None


class LanguageModel(_TextModel):
    """A causal LM: each row's mean next-token loss."""

    task = "causal-lm"

    def __init__(self, folder: Path, cfg: InferConfig) -> None:
        super().__init__(folder, cfg)
        # the padding id: any will do (positions past a row's end are masked and no targets)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    def run_chunk(self, items: list[Item]) -> list[Any]:
        sequences = self._encode([item.texts for item in items])["input_ids"]
        outputs: list[Any] = [(None, 0)] * len(items)
        # a row of one token has no target: nothing to run
        scored = [k for k, ids in enumerate(sequences) if len(ids) >= 2]
        if not scored:
            return outputs
        longest = max(len(sequences[k]) for k in scored)
        width = padded_width(longest, self._pad_multiple(longest) or 1)
        input_ids = torch.full((len(scored), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(scored), width), dtype=torch.long)
        for row, k in enumerate(scored):
            # right padding: a row's tokens sit at positions 0…n-1 whatever the chunk
            input_ids[row, : len(sequences[k])] = torch.tensor(sequences[k], dtype=torch.long)
            attention_mask[row, : len(sequences[k])] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        # position t predicts token t+1; padding is masked by position, not by id
        targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
        # (rows, vocab, positions): a view, no copy of the logits; fp32 sums under autocast
        nll = F.cross_entropy(
            logits[:, :-1, :].float().transpose(1, 2),
            targets,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        # drop the logits before the per-row sums: they are the largest tensor here
        del logits
        counts = (targets != IGNORE_INDEX).sum(dim=1)
        means = (nll.sum(dim=1) / counts).cpu().numpy().copy()
        for row, k in enumerate(scored):
            outputs[k] = (float(means[row]), int(counts[row]))
        return outputs

    @staticmethod
    def record(output: tuple[float | None, int]) -> dict[str, Any]:
        loss, tokens = output
        if loss is None:
            return {"loss": None, "perplexity": None, "tokens": 0}
        return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens}


def predict(config: InferConfig | None = None, /, **knobs: Any) -> InferResult:
    """Run every row of ``--file`` through the classifier or causal LM in MODEL_DIR, in the
    largest batch that fits, under the guard's OOM back-off; write ``--output`` (JSON Lines, one
    line per input row, in input order) atomically. See :mod:`memfit.infer.run` for the flow."""
    cfg = config_from(config, knobs)
    problems = config_problems(cfg) + check_output(cfg.output, (".jsonl",))
    if cfg.prompt_name is not None or cfg.normalize:
        problems.append("--prompt-name and --normalize are options of memfit embed")
    folder: Path | None = None
    task: str | None = None
    try:
        folder = model_folder(cfg.model)
        task = predict_task(folder, cfg.task)
    except UsageError as exc:
        problems.append(str(exc))
    problems += adapter_problems(folder, cfg.base_model)
    try:
        resolve_sources(cfg.file, FLAG)
    except UsageError as exc:
        problems.append(str(exc))
    if task == "causal-lm" and cfg.text_pair_column is not None:
        problems.append("--text-pair-column: a causal LM scores one text per row; drop it")
    reserved = RESERVED_LM if task == "causal-lm" else RESERVED
    if cfg.id_column in reserved:
        problems.append(f"--id-column: {cfg.id_column!r} is a key memfit predict writes; rename it")
    problems += destination_problems(
        output=cfg.output,
        events=cfg.events,
        file=cfg.file,
        model=folder,
        overwrite=cfg.overwrite,
    )
    if problems:
        raise UsageError("\n".join(problems))
    assert folder is not None and task is not None
    columns = (cfg.text_column,) + ((cfg.text_pair_column,) if cfg.text_pair_column else ())
    data = read_input(
        cfg.file,
        columns,
        id_column=cfg.id_column or "id",
        id_required=cfg.id_column is not None,
        cache_dir=cfg.cache_dir,
    )
    runner: Classifier | LanguageModel = (
        Classifier(folder, cfg) if task == "classification" else LanguageModel(folder, cfg)
    )
    with JsonlOutput(cfg.output) as out:

        def write(indices: list[int], outputs: list[Any]) -> None:
            out.write([_record(data, runner, i, o) for i, o in zip(indices, outputs, strict=True)])

        return run(cfg, "predict", runner, data, plan_folder(folder, cfg.base_model), write)


def _record(
    data: Input, runner: Classifier | LanguageModel, index: int, output: Any
) -> dict[str, Any]:
    head: dict[str, Any] = {"row": index}
    if data.ids is not None and data.id_column is not None:
        head[data.id_column] = data.ids[index]
    return head | runner.record(output)


# importing this module binds memfit.infer.predict to it: calling it still runs predict()
make_callable(__name__, "predict")
