"""Sentence embeddings: (anchor, positive) pairs, multiple-negatives ranking loss.

Every other positive in the step is a negative for an anchor (in-batch negatives), so the loss
does not split over samples: ``splittable = False`` and the guard hands over the whole step with a
``mini_batch_size``. Below the step's size the recipe uses GradCache
(``CachedMultipleNegativesRankingLoss``): embed all mini-batches without a graph, take the loss and
its gradient at the embeddings, then re-embed one mini-batch at a time with a graph when the caller
calls ``.backward()`` on the returned loss (a hook on that tensor). Memory is one mini-batch of
activations; the gradient is the whole batch's.

On several ranks (``ranks`` set by the loop) every rank embeds its share of the step's pairs and
the positives are gathered across ranks (:func:`ranked_mnrl_loss`): each anchor is scored against
every positive of the global batch, as in one process, and each rank's loss is its anchors' summed
loss over the whole step's pairs, so the ranks' losses and gradients add up to the one-process ones.
The gradient at the embeddings is computed (and all-reduced) inside ``loss``; ``.backward()`` then
back-propagates it through the model, as GradCache does, and ends with a sync point.

MODEL is a sentence-transformers folder or a plain Hugging Face one (wrapped with mean pooling).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from memfit import step
from memfit.data.columns import ANCHOR_COLUMN, POSITIVE_COLUMN, text_columns
from memfit.data.rows import LENGTH, Column, RowTable, read_rows, text_of, tokenizer_key
from memfit.errors import UsageError
from memfit.train.recipes.base import Recipe, Row
from memfit.train.recipes.loading import load_pretrained

LOSSES = ("mnrl", "cached-mnrl")

# the GradCache mini-batch of --loss cached-mnrl when the guard gives none
DEFAULT_MINI_BATCH_SIZE = 32
# the losses whose negatives are the other pairs of the step (all of them, for now)
IN_BATCH_NEGATIVES = frozenset(LOSSES)


def batch_problems(loss: str, effective_batch_size: int) -> list[str]:
    """The problems of a step size for ``loss``: with in-batch negatives one pair per step has no
    negative, so its loss is 0 and nothing is learnt (for ``config_problems``)."""
    if loss in IN_BATCH_NEGATIVES and effective_batch_size == 1:
        return [
            f"--effective-batch-size: 1 pair per step leaves --loss {loss} no in-batch "
            "negatives (its loss is 0); use 2 or more"
        ]
    return []


def retrieval_accuracy(anchors: torch.Tensor, positives: torch.Tensor) -> float:
    """Share of anchors whose most cosine-similar positive (among all) is their own (row i's).

    The eval's ``retrieval_accuracy`` is :func:`information_retrieval`'s ``accuracy@1``: the same
    figure where anchors and positives are unique, and well posed where they are not."""
    if len(anchors) == 0:
        return 0.0
    a = torch.nn.functional.normalize(anchors.float(), dim=-1)
    p = torch.nn.functional.normalize(positives.float(), dim=-1)
    best = (a @ p.T).argmax(dim=-1)
    return float((best == torch.arange(len(a))).float().mean())


# the figures the eval reports, as sentence-transformers' InformationRetrievalEvaluator names them
IR_CUTOFFS = {"accuracy@k": 1, "mrr@k": 10, "ndcg@k": 10}


def information_retrieval(
    anchors: Sequence[str],
    positives: Sequence[str],
    anchor_embeddings: torch.Tensor,
    positive_embeddings: torch.Tensor,
) -> dict[str, float]:
    """The eval pairs as sentence-transformers' ``InformationRetrievalEvaluator`` sees them:
    the queries are the distinct anchors, the corpus the distinct positives, a query's relevant
    documents every positive it is paired with; documents ranked by cosine similarity (ties by
    corpus order). Returns ``accuracy@1``, ``mrr@10`` and ``ndcg@10``, computed by the
    evaluator's own ``compute_metrics``."""
    from sentence_transformers.util import cos_sim  # optional: sentence-transformers

    queries: dict[str, int] = {}  # text -> the row of its first occurrence
    corpus: dict[str, int] = {}
    relevant: dict[str, set[str]] = {}
    for row, (anchor, positive) in enumerate(zip(anchors, positives, strict=True)):
        queries.setdefault(anchor, row)
        corpus.setdefault(positive, row)
    # ids whose string order is the corpus order (the evaluator breaks ties by id)
    width = len(str(len(corpus)))
    corpus_ids = {text: f"{i:0{width}d}" for i, text in enumerate(corpus)}
    query_ids = {text: f"{i:0{width}d}" for i, text in enumerate(queries)}
    for anchor, positive in zip(anchors, positives, strict=True):
        relevant.setdefault(query_ids[anchor], set()).add(corpus_ids[positive])
    if not queries:
        return {f"{name.split('@')[0]}@{k}": 0.0 for name, k in IR_CUTOFFS.items()}
    scores = cos_sim(
        anchor_embeddings[list(queries.values())].float(),
        positive_embeddings[list(corpus.values())].float(),
    )
    top_k = min(max(IR_CUTOFFS.values()), len(corpus))
    # a stable sort: equal scores keep the corpus order
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
    ids = list(corpus_ids.values())
    hits = [
        [{"corpus_id": ids[j], "score": float(scores[i, j])} for j in row.tolist()]
        for i, row in enumerate(order)
    ]
    evaluator = _ir_evaluator_class()(
        queries={qid: text for text, qid in query_ids.items()},
        corpus={cid: text for text, cid in corpus_ids.items()},
        relevant_docs=relevant,
        accuracy_at_k=[IR_CUTOFFS["accuracy@k"]],
        precision_recall_at_k=[IR_CUTOFFS["accuracy@k"]],
        mrr_at_k=[IR_CUTOFFS["mrr@k"]],
        ndcg_at_k=[IR_CUTOFFS["ndcg@k"]],
        map_at_k=[IR_CUTOFFS["ndcg@k"]],
        write_csv=False,
    )
    result = evaluator.compute_metrics(hits)
    return {f"{name.split('@')[0]}@{k}": float(result[name][k]) for name, k in IR_CUTOFFS.items()}


def _ir_evaluator_class() -> Any:
    """``InformationRetrievalEvaluator`` (``sentence_transformers.evaluation`` in v3-5, under
    ``sentence_transformer`` in v6)."""
    try:
        module = importlib.import_module("sentence_transformers.sentence_transformer.evaluation")
    except ImportError:
        module = importlib.import_module("sentence_transformers.evaluation")
    return module.InformationRetrievalEvaluator


def _losses_module() -> Any:
    """``sentence_transformers.losses`` (v3-5), moved under ``sentence_transformer`` in v6."""
    return step.sentence_losses()


# -- several ranks -------------------------------------------------------------------------------
# The invariant of memfit.train.distributed: every collective is preceded by a sync point
# (ranks.check()) with no allocation in between, so that a rank that ran out of memory anywhere
# meets the others at a sync point, never inside a collective. Below, each collective's buffers
# are allocated first, then the sync point, then the collective.


def _row_counts(ranks: Any, rows: int) -> list[int]:
    """Every rank's number of rows in this step, in rank order (shares may differ, even be 0)."""
    # a sync point: the all-gather of the counts follows; it writes into buffers allocated once
    ranks.check()
    return [int(values[0] or 0) for values in ranks.gather_floats([rows])]


class _GatherRows(torch.autograd.Function):
    """Every rank's rows of ``local`` (``counts[r]`` from rank ``r``), concatenated in rank order.

    Forward: an all-gather, each rank's rows padded to the largest share. Backward: the gradient
    at every rank's rows is summed over the ranks (an all-reduce, since every rank's loss read every
    row), and this rank keeps its own rows'. A sync point comes before each collective."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ranks: Any, counts: list[int]) -> torch.Tensor:
        ctx.ranks, ctx.counts = ranks, counts
        # collectives want one shape from every rank: pad this rank's rows to the largest share
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: len(local)] = local
        parts = [torch.empty_like(padded) for _ in counts]
        ranks.check()  # nothing is allocated between the sync point and the all-gather
        dist.all_gather(parts, padded)
        del padded  # the sent copy: no longer needed
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ranks, counts = ctx.ranks, ctx.counts
        # this rank's gradient at every rank's rows, in the padded layout of the forward
        padded = grad.new_zeros((len(counts), max(counts), *grad.shape[1:]))
        start = 0
        for rank, count in enumerate(counts):
            padded[rank, :count] = grad[start : start + count]
            start += count
        ranks.check()  # nothing is allocated between the sync point and the all-reduce
        dist.all_reduce(padded, op=dist.ReduceOp.SUM)
        return padded[ranks.rank, : counts[ranks.rank]], None, None


def ranked_mnrl_loss(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    *,
    ranks: Any,
    step_pairs: int,
    scale: float,
    similarity_fct: Any,
    anchors_per_chunk: int | None = None,
    with_backward: bool = False,
) -> torch.Tensor:
    """The multiple-negatives ranking loss of this rank's pairs over the whole step, on several
    ranks: every anchor is scored against every positive of every rank (the in-batch negatives
    of the global batch), its label is its own positive's index in that global list, and the
    anchors' summed loss is divided by the step's pairs (``step_pairs``, the same on every
    rank): the ranks' losses add up to sentence-transformers' ``MultipleNegativesRankingLoss``
    over the global batch (its default ``query_to_doc`` direction).

    ``with_backward``: also back-propagate to ``anchors`` and ``positives`` (leaves: their
    ``.grad`` is the gradient of the *sum over ranks* of the loss) and return the loss detached.
    Anchors are then scored ``anchors_per_chunk`` at a time (GradCache's mini-batch: one chunk's
    score matrix at a time). Every rank must call this once per step, rows or not: it joins the
    ranks' collectives (an all-gather of the counts, one of the positives and, when
    ``with_backward``, an all-reduce of the positives' gradient; a sync point before each)."""
    counts = _row_counts(ranks, len(anchors))
    offset = sum(counts[: ranks.rank])
    # gathered in fp32: every rank sends the same dtype (a rank without rows has no embeddings
    # to take it from) and the scores are the one-process ones
    gathered = _GatherRows.apply(positives.float(), ranks, counts)
    candidates = gathered.detach().requires_grad_() if with_backward else gathered
    labels = torch.arange(offset, offset + len(anchors), device=anchors.device)
    chunk = anchors_per_chunk or max(len(anchors), 1)
    total = anchors.new_zeros((), dtype=torch.float32)
    for begin in range(0, len(anchors), chunk):
        rows = slice(begin, begin + chunk)
        scores = similarity_fct(anchors[rows].float(), candidates) * scale
        own = scores.gather(1, labels[rows, None]).squeeze(1)
        # sentence-transformers' form: -(positive score - log-sum-exp over every candidate)
        part = (torch.logsumexp(scores, dim=1) - own).sum() / step_pairs
        if with_backward:
            part.backward()
            part = part.detach()
        # the chunk's score matrix is freed before the next
        del scores, own
        total = total + part
    if with_backward:
        grad = candidates.grad if candidates.grad is not None else torch.zeros_like(candidates)
        # through the all-reduce: each rank's positives get every rank's gradient at them
        gathered.backward(grad)
    return total


def _embedding_dimension(model: Any) -> int:
    """The sentence embedding's width (``get_embedding_dimension`` in sentence-transformers 6)."""
    get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(get())


def _ends_with_sync_point(loss: torch.Tensor, ranks: Any) -> torch.Tensor:
    """``loss`` whose backward ends with a sync point (a hook registered after any other): the
    guard's gradient reduction follows it, and a rank that ran out of memory in its backward
    must find the others at a sync point, not in the reduction's first collective."""

    def sync(grad: torch.Tensor) -> None:
        ranks.check()

    loss.register_hook(sync)
    return loss


def _cached_loss_class() -> type:
    cached_loss: Any = _losses_module().CachedMultipleNegativesRankingLoss

    class AutocastCachedMNRL(cached_loss):  # type: ignore[misc,valid-type]
        """GradCache whose replay (inside ``.backward()``, after the caller's autocast block has
        closed) runs under the autocast of the first pass, so the cached gradients match the
        embeddings they are applied to. With ``ranks`` set, the loss and the gradients it caches
        are :func:`ranked_mnrl_loss`'s (over ``step_pairs``, the whole step's pairs)."""

        autocast_state: tuple[str, bool, torch.dtype] = ("cpu", False, torch.float32)
        ranks: Any = None
        step_pairs: int = 0

        def calculate_loss(
            self, reps: list[list[torch.Tensor]], labels: Any = None, *, with_backward: bool = False
        ) -> torch.Tensor:
            if self.ranks is None:
                return super().calculate_loss(reps, labels, with_backward=with_backward)
            if len(reps) != 2:
                raise ValueError("several ranks: (anchor, positive) pairs only")
            return ranked_mnrl_loss(
                torch.cat(reps[0]),
                torch.cat(reps[1]),
                ranks=self.ranks,
                step_pairs=self.step_pairs,
                scale=self.scale,
                similarity_fct=self.similarity_fct,
                anchors_per_chunk=self.mini_batch_size,
                with_backward=with_backward,
            )

        def forward(self, sentence_features: Any, labels: Any) -> torch.Tensor:
            device_type = self.model.device.type
            self.autocast_state = (
                device_type,
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
            )
            return super().forward(sentence_features, labels)

        def embed_minibatch(self, *args: Any, **kwargs: Any) -> Any:
            device_type, enabled, dtype = self.autocast_state
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                return super().embed_minibatch(*args, **kwargs)

    return AutocastCachedMNRL


class SentenceEmbeddingRecipe(Recipe):
    task: ClassVar[str] = "sentence-embedding"
    metric: ClassVar[str] = "retrieval_accuracy"
    greater_is_better: ClassVar[bool] = True
    splittable: ClassVar[bool] = False

    model: Any  # a SentenceTransformer (an nn.Module)

    @classmethod
    def config_options(cls, cfg: Any) -> dict[str, Any]:
        return {
            "anchor_column": cfg.anchor_column,
            "positive_column": cfg.positive_column,
            "loss": cfg.loss or "mnrl",
            "max_seq_len": cfg.max_seq_len or cfg.seq_len or 128,
        }

    def __init__(
        self,
        model: str,
        *,
        anchor_column: str = ANCHOR_COLUMN,
        positive_column: str = POSITIVE_COLUMN,
        loss: str = "mnrl",
        max_seq_len: int = 128,
    ) -> None:
        if loss not in LOSSES:
            raise UsageError(f"--loss: unknown value {loss!r}; one of {', '.join(LOSSES)}")
        self.model_name = str(model)
        self.anchor_column = anchor_column
        self.positive_column = positive_column
        self.loss_name = loss
        self.max_seq_len = max_seq_len
        self.device = torch.device("cpu")
        self._losses: dict[int | None, torch.nn.Module] = {}

    def short_step_note(self, rows: int, per_step: int) -> str | None:
        """What the short last step of an epoch (``rows`` not a multiple of ``per_step``) does to
        in-batch negatives, and how to avoid it; None when every step is full. The step is kept:
        dropping its pairs (``dataloader_drop_last``) would leave them untrained every epoch."""
        left = rows % per_step
        if not left or self.loss_name not in IN_BATCH_NEGATIVES:
            return None
        negatives = (
            "no in-batch negative: its loss is 0 and it learns nothing"
            if left == 1
            else f"{left - 1} in-batch negatives instead of {per_step - 1}: its loss is lower "
            "and its gradient weaker than a full step's"
        )
        # a step size near this one that leaves no short step
        # (the divisors of the data's rows, not every number near a step size that may be huge)
        divisors = {
            d for k in range(1, math.isqrt(rows) + 1) if rows % k == 0 for d in (k, rows // k)
        }
        near = sorted(d for d in divisors if max(2, per_step // 2) <= d <= per_step * 2)
        cure = (
            f"--effective-batch-size {min(near, key=lambda d: abs(d - per_step))} or "
            if near
            else ""
        )
        return (
            f"the last step of each epoch holds only {left} of {per_step} pairs ({rows} rows): "
            f"--loss {self.loss_name} gives its anchors {negatives}. Every pair is still trained "
            f"on; for full steps use {cure}a multiple of {per_step} rows"
        )

    def read(self, path: Path, flag: str = "--train-file") -> Sequence[Row]:
        pair = text_columns(
            "sentence-embedding",
            anchor_column=self.anchor_column,
            positive_column=self.positive_column,
        )
        rows = read_rows(path, [Column(c) for c in pair], flag=flag, options=self.data_options)
        if flag == "--train-file" and len(rows) < 2 and self.loss_name in IN_BATCH_NEGATIVES:
            left = " left after skipping bad rows" if rows.skipped else ""
            raise UsageError(
                f"{flag}: {path}: {len(rows)} pair{left}: --loss {self.loss_name} needs 2 or "
                "more (the other pairs of a step are its negatives)"
            )
        return rows

    def prepare(self, rows: Sequence[Row]) -> Sequence[Row]:
        if not isinstance(rows, RowTable):
            return rows
        tokenizer = self.model.tokenizer
        anchor, positive, limit = self.anchor_column, self.positive_column, self.max_seq_len

        def measure(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            # the longer text of a pair, as the model will see it (truncated to max_seq_len)
            a = tokenizer(batch[anchor], truncation=True, max_length=limit)["input_ids"]
            p = tokenizer(batch[positive], truncation=True, max_length=limit)["input_ids"]
            return {LENGTH: [max(len(x), len(y)) for x, y in zip(a, p, strict=True)]}

        key = f"sentence-embedding|{tokenizer_key(tokenizer)}|{limit}|{anchor}|{positive}"
        return rows.map_rows(measure, key, cache_dir=self.data_options.cache_dir)

    def lengths(self, rows: Sequence[Row]) -> list[int] | None:
        if rows and all(LENGTH in row for row in rows):
            return [int(row[LENGTH]) for row in rows]
        return None

    def build(self, train_rows: Sequence[Row]) -> None:
        from sentence_transformers import SentenceTransformer  # optional: sentence-transformers

        # device="cpu": the loop moves it with to(); ST would otherwise pick a GPU on its own
        self.model = load_pretrained(SentenceTransformer, self.model_name, device="cpu")
        self.model.max_seq_length = self.max_seq_len
        self._losses.clear()

    def to(self, device: torch.device) -> None:
        super().to(device)
        self._losses.clear()

    def units(self, rows: Sequence[Row]) -> int:
        return len(rows)

    def _features(self, rows: Sequence[Row], column: str) -> dict[str, torch.Tensor]:
        texts = [text_of(row, column) for row in rows]
        # preprocess() replaced tokenize() in sentence-transformers 6 (tokenize still warns)
        prepare = getattr(self.model, "preprocess", None) or self.model.tokenize
        features = prepare(texts)
        return {
            name: self.on_device(value) if isinstance(value, torch.Tensor) else value
            for name, value in features.items()
        }

    def _loss_module(self, mini_batch_size: int | None, rows: int) -> torch.nn.Module:
        if self.loss_name == "cached-mnrl":
            key: int | None = mini_batch_size or DEFAULT_MINI_BATCH_SIZE
        elif mini_batch_size is None or mini_batch_size >= rows:
            key = None  # the whole batch fits at once: plain MNRL, no second forward
        else:
            key = mini_batch_size
        if key not in self._losses:
            self._losses[key] = (
                # the loss the estimator traces (memfit.step)
                step.sentence_loss_module("mnrl", self.model)
                if key is None
                else _cached_loss_class()(self.model, mini_batch_size=key)
            )
        return self._losses[key]

    def loss(
        self, rows: Sequence[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        if self.ranks is not None:
            return self._loss_across_ranks(rows, total_units, mini_batch_size)
        module = self._loss_module(mini_batch_size, len(rows))
        features = [
            self._features(rows, self.anchor_column),
            self._features(rows, self.positive_column),
        ]
        # the mean over these rows, reweighted to the contract's sum / total_units (memfit.step)
        return step.sentence_embedding_loss(module, features, None, len(rows), total_units)

    def _loss_across_ranks(
        self, rows: Sequence[Row], total_units: int, mini_batch_size: int | None
    ) -> torch.Tensor:
        """This rank's part of the step's loss (see :func:`ranked_mnrl_loss`): the gradient at
        the embeddings is taken, and all-reduced, here; ``.backward()`` carries it through the
        model (the cached loss re-embeds mini-batch by mini-batch) and ends with a sync point."""
        ranks = self.ranks
        if not rows:
            # no pairs this step: join every collective with nothing of its own to add
            width = _embedding_dimension(self.model)
            empty = torch.zeros((0, width), device=self.device, requires_grad=True)
            # no anchor of its own: no score is computed (the scale and similarity go unused)
            value = ranked_mnrl_loss(
                empty, empty, ranks=ranks, step_pairs=total_units, scale=1.0,
                similarity_fct=None, with_backward=True,
            )  # fmt: skip
            return _ends_with_sync_point(value.detach().requires_grad_(), ranks)
        module: Any = self._loss_module(mini_batch_size, len(rows))
        features = [
            self._features(rows, self.anchor_column),
            self._features(rows, self.positive_column),
        ]
        if isinstance(module, _losses_module().MultipleNegativesRankingLoss):
            # the whole share at once, with its graph (kept until .backward(), as in one process)
            embeds = [self.model(part)["sentence_embedding"] for part in features]
            # the loss's own graph starts at detached copies: its gradient at the embeddings is
            # taken (and all-reduced) now, the model's backward waits for .backward()
            leaves = [embed.detach().float().requires_grad_() for embed in embeds]
            value = ranked_mnrl_loss(
                *leaves,
                ranks=ranks,
                step_pairs=total_units,
                scale=module.scale,
                similarity_fct=module.similarity_fct,
                with_backward=True,
            )

            def replay(grad_output: torch.Tensor) -> None:
                # the embeddings' gradients (the caller's factor, a loss scale, applied) through
                # the graph kept since the forward
                grads = [
                    (leaf.grad * grad_output).to(embed.dtype)  # type: ignore[operator]
                    for leaf, embed in zip(leaves, embeds, strict=True)
                ]
                torch.autograd.backward(embeds, grads)

            loss = value.detach().requires_grad_()
            loss.register_hook(replay)
            return _ends_with_sync_point(loss, ranks)
        # GradCache: sentence-transformers embeds, caches and replays; the loss is the ranks' one
        module.ranks, module.step_pairs = ranks, total_units
        return _ends_with_sync_point(module(features, None), ranks)

    def eval_partial(
        self, rows: Sequence[Row]
    ) -> tuple[list[str], list[str], torch.Tensor, torch.Tensor]:
        anchors = self.model(self._features(rows, self.anchor_column))["sentence_embedding"]
        positives = self.model(self._features(rows, self.positive_column))["sentence_embedding"]
        # on the CPU: the eval set's embeddings are kept until eval_reduce, not on the GPU; the
        # texts say which rows share a query or a document
        return (
            [text_of(row, self.anchor_column) for row in rows],
            [text_of(row, self.positive_column) for row in rows],
            anchors.float().cpu(),
            positives.float().cpu(),
        )

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        """Retrieval over the eval set (:func:`information_retrieval`); ``retrieval_accuracy``
        (the name metrics.jsonl has always had) is its ``accuracy@1``."""
        if not partials:
            return {}
        metrics = information_retrieval(
            [text for part in partials for text in part[0]],
            [text for part in partials for text in part[1]],
            torch.cat([part[2] for part in partials]),
            torch.cat([part[3] for part in partials]),
        )
        return {"retrieval_accuracy": metrics["accuracy@1"], **metrics}

    def save(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        if state_dict is not None:
            raise ValueError("a sentence-transformers folder is saved from the model itself")
        self.model.save(str(folder))
