"""GuardedSentenceTransformerTrainer: per-sample losses split exactly, in-batch negatives switch
to GradCache with the same gradient, and losses that couple a batch are never split."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sentence_transformers")
from datasets import Dataset
from sentence_transformers import (
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)

from memfit.errors import NothingFitsError
from memfit.integrations import GuardedSentenceTransformerTrainer
from memfit.integrations.sentence_transformers import (
    cached_variant,
    losses_module,
)
from tiny_models import save_bert

losses = losses_module()
WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT (dropout off) with its own word-level vocabulary, as a plain HF folder
    (SentenceTransformer wraps it with mean pooling)."""
    folder = tmp_path_factory.mktemp("tiny-st")
    save_bert(folder, WORDS)
    return str(folder)


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def pairs(n: int = 8, *, scores: bool = False) -> Dataset:
    columns: dict[str, list[Any]] = {"anchor": sentences(n, 1), "positive": sentences(n, 2)}
    if scores:
        columns["score"] = [random.Random(i).random() for i in range(n)]
    return Dataset.from_dict(columns)


def make(
    cls: type,
    folder: str,
    tmp_path: Path,
    loss: Callable[[Any], torch.nn.Module],
    data: Dataset,
    *,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> Any:
    model = SentenceTransformer(folder, device="cpu").to(dtype)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=len(data),
        gradient_accumulation_steps=2,
        optim="sgd",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = cls(model=model, args=args, train_dataset=data, loss=loss(model), **kwargs)
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def one_batch(trainer: Any) -> dict[str, Any]:
    return next(iter(trainer.get_train_dataloader()))


def test_losses_are_sorted_by_what_a_split_may_do() -> None:
    model = torch.nn.Module()
    model.model = None  # type: ignore[assignment]
    kind = GuardedSentenceTransformerTrainer.loss_reduction
    fake = object.__new__(GuardedSentenceTransformerTrainer)

    def of(cls_name: str, **attrs: Any) -> str:
        loss = type(cls_name, (torch.nn.Module,), {})()
        for key, value in attrs.items():
            setattr(loss, key, value)
        return kind(fake, loss)

    assert of("CosineSimilarityLoss", loss_fct=torch.nn.MSELoss()) == "mean"
    assert of("CosineSimilarityLoss", loss_fct=torch.nn.MSELoss(reduction="sum")) == "sum"
    assert of("SoftmaxLoss", loss_fct=torch.nn.CrossEntropyLoss()) == "mean"
    assert of("ContrastiveLoss", size_average=False) == "sum"
    assert of("TripletLoss") == "mean"
    assert of("MultipleNegativesRankingLoss") == "cached"
    assert of("CachedGISTEmbedLoss", uses_gradient_cache=True, mini_batch_size=8) == "cached"
    assert of("CoSENTLoss") == "coupled"
    assert of("MyRankingLoss") == "coupled"  # unknown: never split


@pytest.mark.filterwarnings("ignore:The .*SymmetricRankingLoss is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    "name", ["MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss"]
)
def test_the_cached_variant_keeps_the_loss_and_its_gradient(
    st_folder: str, name: str, gradients: Callable, assert_same_gradients: Callable
) -> None:
    # float64: GradCache embeds each mini-batch trimmed to its own padding, which changes float32
    # rounding (about 1e-5 of the gradient here); in float64 any real difference would show
    model = SentenceTransformer(st_folder, device="cpu").double()
    prepare = getattr(model, "preprocess", None) or model.tokenize
    features = [prepare(sentences(8, 1)), prepare(sentences(8, 2))]
    plain = getattr(losses, name)(model, scale=15.0)

    def run(loss: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        value = loss([dict(f) for f in features], None)
        value.backward()
        return float(value.detach()), gradients(model)

    expected_loss, expected = run(plain)
    cached = cached_variant(plain, 3)
    assert type(cached).__name__ == f"Cached{name}" and cached.mini_batch_size == 3
    assert cached.scale == 15.0
    value, got = run(cached)
    assert value == pytest.approx(expected_loss, rel=1e-12)
    assert_same_gradients(expected, got, rtol=1e-10)


def test_in_batch_negatives_run_as_gradcache_after_a_back_off(
    st_folder: str, tmp_path: Path, gradients: Callable, assert_same_gradients: Callable
) -> None:
    mnrl = losses.MultipleNegativesRankingLoss
    # float64, as above: GradCache's own float32 rounding would hide nothing but blur the check
    wide = torch.float64
    stock = make(SentenceTransformerTrainer, st_folder, tmp_path, mnrl, pairs(), dtype=wide)
    batch = one_batch(stock)
    expected = float(stock.training_step(stock.model, dict(batch), None))
    guarded = make(
        GuardedSentenceTransformerTrainer, st_folder, tmp_path, mnrl, pairs(), dtype=wide
    )
    given = guarded.loss
    seen: list[int] = []

    def refuse_big(module: Any, args: Any) -> None:
        rows = int(args[0]["input_ids"].shape[0])
        seen.append(rows)
        if rows > 4 and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    guarded.model[0].register_forward_pre_hook(refuse_big)
    loss = guarded.training_step(guarded.model, dict(batch), None)
    assert [e["type"] for e in guarded.guard_events] == ["oom", "backoff"]
    assert guarded.guard_events[1]["loss"] == "cached MultipleNegativesRankingLoss"
    assert guarded.guard_mini_batch_size == 4
    # the failed whole batch, then GradCache: embed 4 + 4 without a graph (each column), then
    # re-embed them with one
    assert seen[0] == 8 and set(seen[1:]) == {4}
    assert guarded.loss is given  # the user's loss object is back in place
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert_same_gradients(gradients(stock.model), gradients(guarded.model), rtol=1e-10)


def test_a_per_sample_loss_is_split_into_weighted_chunks(
    st_folder: str, tmp_path: Path, gradients: Callable, assert_same_gradients: Callable
) -> None:
    cosine = losses.CosineSimilarityLoss
    data = pairs(scores=True)
    stock = make(SentenceTransformerTrainer, st_folder, tmp_path, cosine, data)
    batch = one_batch(stock)
    expected = float(stock.training_step(stock.model, dict(batch), None))
    guarded = make(GuardedSentenceTransformerTrainer, st_folder, tmp_path, cosine, data)
    guarded.guard_micro_batch_size = 3
    loss = guarded.training_step(guarded.model, dict(batch), None)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))


def test_a_loss_that_couples_the_batch_is_never_split(st_folder: str, tmp_path: Path) -> None:
    data = pairs(scores=True)
    guarded = make(GuardedSentenceTransformerTrainer, st_folder, tmp_path, losses.CoSENTLoss, data)

    def refuse(module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    guarded.model[0].register_forward_pre_hook(refuse)
    with pytest.raises(NothingFitsError, match=r"step 1: CoSENTLoss compares the samples"):
        guarded.training_step(guarded.model, dict(one_batch(guarded)), None)
    assert [e["type"] for e in guarded.guard_events] == ["oom", "stop"]


def test_a_plan_for_in_batch_negatives_starts_with_the_cached_loss(
    st_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.plan
    from memfit.plan.planner import Candidate, Levers, Plan

    asked: list[dict[str, Any]] = []

    def plan(model: str, **kwargs: Any) -> Plan:
        asked.append({"model": model, **kwargs})
        chosen = Candidate(
            Levers("fp32", False, "adamw", 64, 0), 16, 1, 1, "cached-mnrl", 4, 1, 1.0
        )
        return Plan(True, 1 << 30, 1, 1, chosen, [], [], [])

    monkeypatch.setattr(memfit.plan, "plan", plan)
    model = SentenceTransformer(st_folder, device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to="none",
    )
    trainer = GuardedSentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=pairs(16),
        loss=losses.MultipleNegativesRankingLoss(model),
        memfit_plan={"seq_len": 64, "gpu_memory": "1GiB"},
    )
    [call] = asked
    assert call["task"] == "sentence-embedding" and call["loss"] == "mnrl"
    assert (Path(call["model"]) / "config.json").is_file()  # the model's own folder
    # the whole batch at once, the GradCache loss at the planned mini-batch from the first step
    assert trainer.args.per_device_train_batch_size == 16
    assert trainer.args.gradient_accumulation_steps == 1
    assert trainer.guard_mini_batch_size == 4
