"""Sentence embeddings on several ranks: the in-batch-negatives loss over gathered embeddings.

Two real processes joined by gloo (no torchrun) run :func:`ranked_mnrl_loss` on their shares of
one batch of random embeddings; the sum of their losses and the gradients at every embedding must
equal sentence-transformers' ``MultipleNegativesRankingLoss`` over the whole batch in one process,
for unequal shares, a rank with no rows, and GradCache's chunked scoring. Fake OOMs (a rank
raising its flag instead of computing) check that the other rank meets it at a sync point before
each collective (forward, the gather's backward, the end of ``.backward()``), as
:class:`PeerOutOfMemory`, even from inside autograd. Then the recipe itself under the guard, with a
tiny sentence-transformers model: one rank runs out of memory (a fake OOM in its encoder above
one text per forward with a graph: the plain loss's forward, GradCache's replay inside
``.backward()``), both ranks back off together, and the gradients are still the one-process ones.
Every spawn has a timeout.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfit.guard import Guard
from memfit.guard.guard import PeerOutOfMemory
from memfit.train.distributed import Ranks, shard_rows
from memfit.train.recipes.sentence_embedding import (
    SentenceEmbeddingRecipe,
    _ends_with_sync_point,
    _losses_module,
    ranked_mnrl_loss,
)
from tiny_models import save_bert, save_sentence_transformer

pytestmark = pytest.mark.slow  # every test here spawns 2 processes: `-m "not slow"` skips them
SPAWN_TIMEOUT = 120
PAIRS, WIDTH = 7, 6
# the rows of the batch each rank holds (any order: the loss does not depend on it)
SPLITS = {"unequal": ([5, 1, 0, 6], [2, 3, 4]), "one empty": (list(range(PAIRS)), [])}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(PAIRS, WIDTH, generator=generator, dtype=torch.float64).float()
    # positives near their anchors, not too near: a loss well away from 0 and from log(PAIRS)
    positives = anchors + torch.randn(PAIRS, WIDTH, generator=generator).float()
    return anchors, positives


def _one_process() -> tuple[float, torch.Tensor, torch.Tensor]:
    """sentence-transformers' own loss and gradients over the whole batch."""
    anchors, positives = (t.clone().requires_grad_() for t in _batch())
    module = _losses_module().MultipleNegativesRankingLoss(model=None)
    loss = module.compute_loss_from_embeddings([anchors, positives], None)
    loss.backward()
    assert anchors.grad is not None and positives.grad is not None
    return float(loss.detach()), anchors.grad, positives.grad


def _share(rank: int, split: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    rows = SPLITS[split][rank]
    anchors, positives = _batch()
    return rows, anchors[rows].requires_grad_(), positives[rows].requires_grad_()


def _fake_oom(*args: Any) -> torch.Tensor:
    raise torch.OutOfMemoryError("fake: out of memory scoring the anchors")


def _worker(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        ranks = Ranks(
            rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo"
        )
        ranks.prepare([])
        from sentence_transformers.util import cos_sim

        result: dict[str, Any] = {}
        for split in SPLITS:
            for chunk in (None, 2):
                rows, anchors, positives = _share(rank, split)
                loss = ranked_mnrl_loss(
                    anchors, positives, ranks=ranks, step_pairs=PAIRS, scale=20.0,
                    similarity_fct=cos_sim, anchors_per_chunk=chunk, with_backward=True,
                )  # fmt: skip
                result[split, chunk] = (rows, float(loss), anchors.grad, positives.grad)
        # an OOM before the gather: the other rank learns of it at the first sync point
        _, anchors, positives = _share(rank, "unequal")
        outcome = []
        if rank == 1:
            ranks.anyone(True)
        else:
            try:
                ranked_mnrl_loss(
                    anchors, positives, ranks=ranks, step_pairs=PAIRS, scale=20.0,
                    similarity_fct=cos_sim, with_backward=True,
                )  # fmt: skip
            except PeerOutOfMemory:
                outcome.append("forward")
        # an OOM scoring after the gather: the other rank is at the gather's backward
        try:
            ranked_mnrl_loss(
                anchors, positives, ranks=ranks, step_pairs=PAIRS, scale=20.0,
                similarity_fct=_fake_oom if rank == 1 else cos_sim, with_backward=True,
            )  # fmt: skip
        except PeerOutOfMemory:
            outcome.append("gather backward")
        except torch.OutOfMemoryError:
            ranks.anyone(True)
            outcome.append("own")
        # an OOM in the model's backward: the other rank's backward ends at a sync point
        weight = torch.ones(3, requires_grad=True)
        loss = _ends_with_sync_point((weight * 2).sum(), ranks)
        if rank == 1:
            ranks.anyone(True)
        else:
            try:
                loss.backward()
            except PeerOutOfMemory:
                outcome.append("end of backward")
        result["outcome"] = outcome
        result["syncs"] = ranks.syncs
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(folder) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the recipe under the guard ----------------------------------------------------------------
WORDS = [f"w{i}" for i in range(30)]
STEP_PAIRS = 7  # odd: shares of 4 and 3


def _pairs() -> list[dict[str, str]]:
    rows = []
    for i in range(STEP_PAIRS):
        anchor = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 4)]
        rows.append({"anchor": " ".join(anchor), "positive": " ".join([*anchor[::2], WORDS[i]])})
    return rows


def _recipe(model: str, loss: str) -> tuple[SentenceEmbeddingRecipe, list[torch.Tensor]]:
    recipe = SentenceEmbeddingRecipe(model, loss=loss, max_seq_len=16)
    recipe.build(_pairs())
    return recipe, [p for p in recipe.model.parameters() if p.requires_grad]


def _fake_oom_above_one_text(module: Any, args: tuple[Any, ...]) -> None:
    """A forward pre-hook: out of memory when a forward with a graph holds more than one text."""
    features = args[0]
    if torch.is_grad_enabled() and features["input_ids"].shape[0] > 1:
        raise torch.OutOfMemoryError("fake: out of memory in the encoder")


def _recipe_worker(rank: int, port: int, folder: str, model: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        ranks = Ranks(
            rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo"
        )
        result: dict[str, Any] = {}
        for loss in ("mnrl", "cached-mnrl"):
            recipe, params = _recipe(model, loss)
            recipe.ranks = ranks
            ranks.prepare(params)
            if rank == 1:
                recipe.model[0].register_forward_pre_hook(_fake_oom_above_one_text)
            events: list[dict[str, Any]] = []
            guard = Guard(4, ranks=ranks, on_event=events.append)
            rows = _pairs()
            mine = shard_rows(rows, None, rank, 2)
            value = guard.step(mine, recipe, params=params, total_units=len(rows), step=1)
            grads = [p.grad.clone() if p.grad is not None else None for p in params]
            result[loss] = (value, grads, events, guard.micro_batch_size)
        result["syncs"] = ranks.syncs
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(folder) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(worker: Any, folder: Path, *args: Any) -> list[dict[str, Any]]:
    context = mp.start_processes(
        worker, args=(_free_port(), str(folder), *args), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT
    while True:
        try:
            if context.join(timeout=1):
                break
        except mp.ProcessExitedException as exc:
            # gloo's teardown may abort a rank after both wrote their results (not what is tested)
            done = all((folder / f"rank{r}.pt").is_file() for r in range(2))
            if exc.signal_name != "SIGABRT" or not done or list(folder.glob("*.error")):
                raise
            break
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            errors = [p.read_text() for p in folder.glob("*.error")]
            pytest.fail(f"the ranks did not finish in {SPAWN_TIMEOUT} s (a hang): {errors}")
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(_worker, tmp_path_factory.mktemp("gather"))


@pytest.fixture(scope="module")
def tiny_st(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tiny-st")
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, layers=1, seed=0)
    save_sentence_transformer(root / "st", encoder, max_seq_length=16)
    return str(root / "st")


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("split", list(SPLITS))
def test_two_ranks_add_up_to_the_one_process_loss_and_gradients(
    two_ranks: list[dict[str, Any]], split: str, chunk: int | None
) -> None:
    loss, anchor_grad, positive_grad = _one_process()
    assert 0.1 < loss < 1.5  # a loss with something to learn: the comparison means something
    got_anchor_grad = torch.zeros_like(anchor_grad)
    got_positive_grad = torch.zeros_like(positive_grad)
    total = 0.0
    for result in two_ranks:
        rows, rank_loss, anchors, positives = result[split, chunk]
        total += rank_loss
        if rows:
            got_anchor_grad[rows] = anchors
            got_positive_grad[rows] = positives
    assert total == pytest.approx(loss, abs=1e-6)
    assert float((got_anchor_grad - anchor_grad).abs().max()) <= 1e-6
    assert float((got_positive_grad - positive_grad).abs().max()) <= 1e-6
    assert float(positive_grad.abs().max()) > 1e-3  # the gradients are not all zero


def test_an_oom_on_one_rank_meets_the_other_at_a_sync_point(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert two_ranks[0]["outcome"] == ["forward", "gather backward", "end of backward"]
    assert two_ranks[1]["outcome"] == ["own"]
    # the ranks met as often (a sync point joined by one rank only would have hung)
    assert two_ranks[0]["syncs"] == two_ranks[1]["syncs"]


def test_the_recipe_on_two_ranks_backs_off_together_with_the_one_process_gradient(
    tiny_st: str, tmp_path: Path
) -> None:
    ranks = _spawn(_recipe_worker, tmp_path, tiny_st)
    for loss in ("mnrl", "cached-mnrl"):
        recipe, params = _recipe(tiny_st, loss)
        value = Guard(STEP_PAIRS).step(_pairs(), recipe, params=params)
        assert value > 0.1
        (loss_0, grads_0, events_0, size_0), (loss_1, grads_1, events_1, size_1) = (
            result[loss] for result in ranks
        )
        assert loss_0 + loss_1 == pytest.approx(value, abs=1e-6)
        for param, got_0, got_1 in zip(params, grads_0, grads_1, strict=True):
            if param.grad is None:  # unused in one process (BERT's pooler): unused on both
                assert got_0 is None and got_1 is None
                continue
            assert got_0 is not None and got_1 is not None
            # the ranks hold the same, reduced gradient: the one process's
            assert torch.equal(got_0, got_1)
            torch.testing.assert_close(got_0, param.grad, rtol=1e-5, atol=1e-5)
        # rank 1 (4 pairs) ran out of memory: mnrl in its forward (4 → 2), then in GradCache's
        # replay inside .backward() (2 → 1); cached-mnrl in the replay (4 → 2 → 1). Rank 0 learnt
        # of each at a sync point, and both adopted the same sizes
        ooms = [e for e in events_1 if e["type"] == "oom"]
        assert [e["micro_batch_size"] for e in ooms] == [4, 2], (loss, events_1)
        adopted_1 = [(e["from"], e["to"]) for e in events_1 if e["type"] == "backoff"]
        adopted_0 = [(e["from"], e["to"]) for e in events_0 if e["type"] == "backoff"]
        assert adopted_0 == adopted_1 == [(4, 2), (2, 1)]
        assert all(e.get("cause") == "another rank" for e in events_0), events_0
        assert not [e for e in events_0 if e["type"] == "oom"]
        assert size_0 == size_1 == 1
    assert ranks[0]["syncs"] == ranks[1]["syncs"]
