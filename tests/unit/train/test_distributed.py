"""memfit.train.distributed: the shard of a step, the sync points and the guard agreed by 2 ranks.

The multi-rank tests spawn two real processes joined by gloo (no torchrun), each running the
guard on its share of a step; a fake OOM (raised above a micro-batch size, on one rank only) or
the real memory cap forces the back-off. Each spawned test has a timeout: a rank left waiting in
a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from memfit.guard import CpuMemoryCap, Guard, StepTooLarge
from memfit.report.events import agreed_events
from memfit.train.distributed import Ranks, shard_rows

Row = dict[str, Any]
SPAWN_TIMEOUT = 120


# --- pure functions --------------------------------------------------------------------------
def test_shard_rows_deals_longest_first_in_snake_order() -> None:
    rows = list("abcdefg")
    lengths = [5, 70, 3, 40, 9, 60, 1]  # by length: b f d e a c g
    shares = [shard_rows(rows, lengths, r, 3) for r in range(3)]
    # positions 0,1,2 → ranks 0,1,2; 3,4,5 → ranks 2,1,0; 6 → rank 0
    assert shares == [["b", "c", "g"], ["f", "a"], ["d", "e"]]
    assert sorted(x for share in shares for x in share) == rows  # every row once


def test_shard_rows_without_lengths_is_round_robin_and_total() -> None:
    rows = list(range(10))
    shares = [shard_rows(rows, None, r, 4) for r in range(4)]
    assert sorted(x for s in shares for x in s) == rows
    assert [len(s) for s in shares] == [3, 3, 2, 2]
    assert shard_rows(rows, None, 0, 1) == rows


def test_shard_rows_with_fewer_rows_than_ranks_leaves_some_empty() -> None:
    shares = [shard_rows(["x"], [3], r, 2) for r in range(2)]
    assert shares == [["x"], []]


def test_agreed_events_keeps_each_decision_once_and_every_oom() -> None:
    events = [
        {"type": "oom", "rank": 1, "step": 3},
        {"type": "backoff", "rank": 1, "step": 3, "from": 4, "to": 2, "cause": "another rank"},
        {"type": "backoff", "rank": 0, "step": 3, "from": 4, "to": 2},
        {"type": "oom", "rank": 0, "step": 4},
        {"type": "checkpoint", "rank": 0, "step": 4},
        {"type": "backoff", "step": 9, "from": 2, "to": 1},  # a single-process run
    ]
    kept = agreed_events(events)
    assert [e["type"] for e in kept] == ["oom", "backoff", "oom", "checkpoint", "backoff"]
    assert [e.get("rank") for e in kept] == [1, 0, 0, 0, None]


# --- two real ranks --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _rows(n: int) -> list[Row]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return [{"id": i, "x": x[i], "y": y[i]} for i in range(n)]


class _Recipe:
    """One unit per row; on ``oom_rank``, a chunk of more than ``oom_above`` rows runs out of
    memory (a hand-raised OOM: the schedule is under test here; the cap test below is real)."""

    splittable = True

    def __init__(self, model: nn.Module, rank: int, oom_rank: int | None, oom_above: int) -> None:
        self.model, self.rank = model, rank
        self.oom_rank, self.oom_above = oom_rank, oom_above

    def units(self, rows: list[Row]) -> int:
        return len(rows)

    def loss(
        self, rows: list[Row], total_units: int, *, mini_batch_size: int | None = None
    ) -> torch.Tensor:
        if self.rank == self.oom_rank and len(rows) > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(rows)} MiB")
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        return F.cross_entropy(self.model(x), y, reduction="sum") / total_units

    def eval_partial(self, rows: list[Row]) -> Any:
        if self.rank == self.oom_rank and len(rows) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 MiB")
        x = torch.stack([row["x"] for row in rows])
        y = torch.stack([row["y"] for row in rows])
        return float(F.cross_entropy(self.model(x), y, reduction="sum")), len(rows)

    def eval_reduce(self, partials: list[Any]) -> dict[str, float]:
        return {"loss": sum(p[0] for p in partials) / sum(p[1] for p in partials)}


def _worker(rank: int, port: int, scenario: str, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        ranks = Ranks(
            rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo"
        )
        model = _make_model()
        params = list(model.parameters())
        ranks.prepare(params)
        events: list[dict[str, Any]] = []
        rows = _rows(14)
        mine = shard_rows(rows, None, rank, 2)
        oom_rank = 1 if scenario in ("one-rank", "eval") else None
        recipe = _Recipe(model, rank, oom_rank, oom_above=2)
        guard = Guard(8, on_event=events.append, ranks=ranks)
        result: dict[str, Any] = {"events": events}
        if scenario == "eval":
            result["eval"] = guard.evaluate(mine, recipe)
        elif scenario == "cap":
            with CpuMemoryCap(1 << 40) as cap:
                cap.track(model, *ranks.buffers())
                before = cap.live_bytes
                for _ in range(5):
                    ranks.anyone(False)
                    ranks.least(3, 4)
                    ranks.gather_floats([1.0, None])
                result["sync_bytes"] = cap.live_bytes - before
        elif scenario == "too-large":
            recipe.oom_rank, recipe.oom_above = 1, 0
            try:
                guard.step(mine, recipe, params=params, total_units=len(rows), step=1)
            except StepTooLarge as exc:
                result["too_large"] = str(exc)
        else:
            result["loss"] = guard.step(mine, recipe, params=params, total_units=len(rows), step=1)
            result["grads"] = [p.grad.clone() for p in params]
            result["micro"] = guard.micro_batch_size
            result["syncs"] = ranks.syncs
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        # both ranks done with every collective before either tears the group down (a peer
        # destroyed mid-send aborts gloo)
        dist.barrier()
    except BaseException:
        (Path(folder) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    context = mp.start_processes(
        _worker,
        args=(_free_port(), scenario, str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    import time

    deadline = time.monotonic() + SPAWN_TIMEOUT
    while True:
        try:
            if context.join(timeout=1):
                break
        except mp.ProcessExitedException as exc:
            # gloo's teardown now and then aborts a rank as it exits ("terminate called without
            # an active exception"), after both ranks wrote their results and passed the last
            # barrier: that exit is not what is tested. Anything earlier is a failure.
            done = all((tmp_path / f"rank{r}.pt").is_file() for r in range(2))
            if exc.signal_name != "SIGABRT" or not done or list(tmp_path.glob("*.error")):
                raise
            for process in context.processes:
                process.join(timeout=30)
            if list(tmp_path.glob("*.error")):
                raise
            break
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            errors = [p.read_text() for p in tmp_path.glob("*.error")]
            pytest.fail(f"the ranks did not finish in {SPAWN_TIMEOUT} s (a hang): {errors}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _whole_batch_grads() -> list[torch.Tensor]:
    model = _make_model()
    rows = _rows(14)
    x = torch.stack([row["x"] for row in rows])
    y = torch.stack([row["y"] for row in rows])
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_two_ranks_sum_to_the_whole_batch_gradient(tmp_path: Path) -> None:
    results = _spawn("plain", tmp_path)
    expected = _whole_batch_grads()
    for result in results:
        for got, want in zip(result["grads"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # a micro-batch (7 rows each: one chunk), its sync point, the reduction's sync point
    assert results[0]["syncs"] == results[1]["syncs"] == 2
    rows = _rows(14)
    with torch.no_grad():
        whole = F.cross_entropy(
            _make_model()(torch.stack([r["x"] for r in rows])), torch.stack([r["y"] for r in rows])
        )
    # each rank's loss is its share of the whole step's mean: they add up to it
    assert sum(r["loss"] for r in results) == pytest.approx(float(whole))


@pytest.mark.slow
def test_an_oom_on_one_rank_is_adopted_by_both_same_gradient(tmp_path: Path) -> None:
    results = _spawn("one-rank", tmp_path)
    expected = _whole_batch_grads()
    for result in results:
        for got, want in zip(result["grads"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # rank 1 ran out at 7 rows, then at 3; both ranks adopted 3, then 1… the same sizes
    assert results[0]["micro"] == results[1]["micro"] <= 2
    ooms = [[e for e in r["events"] if e["type"] == "oom"] for r in results]
    assert ooms[0] == [] and len(ooms[1]) >= 1
    backoffs = [
        [(e["from"], e["to"]) for e in r["events"] if e["type"] == "backoff"] for r in results
    ]
    assert backoffs[0] == backoffs[1] and backoffs[0]
    assert all(
        e.get("cause") == "another rank" for e in results[0]["events"] if e["type"] == "backoff"
    )


@pytest.mark.slow
def test_eval_backs_off_together_and_reduces_every_rank(tmp_path: Path) -> None:
    results = _spawn("eval", tmp_path)
    model = _make_model()
    rows = _rows(14)
    with torch.no_grad():
        loss = F.cross_entropy(
            model(torch.stack([r["x"] for r in rows])), torch.stack([r["y"] for r in rows])
        )
    for result in results:
        assert result["eval"]["loss"] == pytest.approx(float(loss), abs=1e-6)
    assert any(e["type"] == "oom" for e in results[1]["events"])
    assert any(e["type"] == "backoff" for e in results[0]["events"])


@pytest.mark.slow
def test_one_row_too_large_on_one_rank_stops_both(tmp_path: Path) -> None:
    results = _spawn("too-large", tmp_path)
    assert "too_large" in results[0] and "too_large" in results[1]
    assert "another rank" in results[0]["too_large"]


@pytest.mark.slow
def test_sync_points_allocate_nothing_under_the_cap(tmp_path: Path) -> None:
    results = _spawn("cap", tmp_path)
    assert results[0]["sync_bytes"] == 0 and results[1]["sync_bytes"] == 0


def test_memfit_ends_only_a_process_group_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that joined the ranks itself (and trains several times, or goes on after
    memfit.train) keeps its process group; one memfit started, memfit ends."""
    from memfit.train.distributed import init_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1"
    ).items():
        monkeypatch.setenv(name, value)
    ranks = init_ranks("cpu")  # memfit starts the group
    assert ranks.owns_group and dist.is_initialized()
    ranks.close()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(2):  # the caller's group, used by two runs in turn
            ranks = init_ranks("cpu")
            assert not ranks.owns_group
            ranks.barrier()
            ranks.close()
            assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
