"""Checkpoints: whole or absent, and a read-back that restores every random generator."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from memfit.train import checkpoint as ck


def _objects() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path) -> None:
    model, optimizer, scheduler = _objects()
    path = ck.write_checkpoint(
        tmp_path,
        7,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=None,
        state={"epoch": 1, "position": 12, "samples_seen": 40},
    )
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    other, other_opt, other_sched = _objects()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state = ck.read_checkpoint(
        path,
        model=other,
        optimizer=other_opt,
        scheduler=other_sched,
        scaler=None,
        device=torch.device("cpu"),
    )
    assert (state["step"], state["epoch"], state["position"]) == (7, 1, 12)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    assert other_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert other_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    # the generators continue exactly where they were when the checkpoint was written
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_half_written_checkpoints_are_invisible_and_cleaned(tmp_path) -> None:
    model, optimizer, scheduler = _objects()
    for step in (1, 2, 3):
        ck.write_checkpoint(
            tmp_path,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            state={},
            keep=2,
        )
    assert ck.completed_steps(tmp_path) == [2, 3]
    # what a kill leaves: a temporary folder, and a step folder without its state file
    (tmp_path / ".tmp-step-4-123").mkdir()
    (tmp_path / ".tmp-step-4-123" / "model.safetensors").write_bytes(b"partial")
    assert ck.completed_steps(tmp_path) == [2, 3]
    ck.clean_temporaries(tmp_path)
    assert not (tmp_path / ".tmp-step-4-123").exists()


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, scheduler = _objects()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        ck.write_checkpoint(
            tmp_path,
            5,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            state={},
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("free", "errno_name", "said"),
    [(0, "ENOSPC", "No space left on device"), (1 << 30, "EIO", "the disk may be full")],
)
def test_a_short_write_of_torch_save_is_a_disk_error_and_leaves_nothing(
    free: int, errno_name: str, said: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save on a full disk raises a RuntimeError from caffe2's writer with no errno: it
    comes out as the OSError it is (ENOSPC when the disk has no room left), nothing left."""
    import errno

    from memfit.train import runfolder

    model, optimizer, scheduler = _objects()

    def short_write(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at inline_container.cc:626] . unexpected pos 1216 vs 1114"
        )

    monkeypatch.setattr(ck.torch, "save", short_write)
    monkeypatch.setattr(runfolder, "free_bytes", lambda path: free)
    with pytest.raises(OSError) as failed:
        ck.write_checkpoint(
            tmp_path, 5, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
            state={},
        )  # fmt: skip
    assert failed.value.errno == getattr(errno, errno_name)
    assert said in str(failed.value)
    assert str(failed.value.filename).startswith(str(tmp_path / ".tmp-step-5-"))
    assert list(tmp_path.iterdir()) == []


def test_a_state_memfit_never_writes_is_named() -> None:
    good = {"step": 6, "epoch": 1, "position": 8, "samples_seen": 24, "best": 0.5}
    # 16 rows, 4 per step: 4 steps an epoch; step 6 is epoch 1 at position 8
    assert ck.state_problem(good, 6, 16, 4) is None
    assert (
        ck.state_problem({**good, "step": 8, "position": 16, "samples_seen": 32}, 8, 16, 4) is None
    )
    # a short last step (10 rows, 4 per step: 3 steps, the last of 2 rows)
    end = {"step": 3, "epoch": 0, "position": 10, "samples_seen": 10, "best": None}
    assert ck.state_problem(end, 3, 10, 4) is None
    bad = {
        "step -5": ({**good, "step": -5}, "step is -5, not a count"),
        "position": ({**good, "position": 10**9}, "position 1000000000 is past the 16"),
        "samples": ({**good, "samples_seen": 10**9}, "samples_seen 1000000000 is not"),
        "text": ({**good, "epoch": "1"}, "epoch is '1', not a count"),
        "bool": ({**good, "position": True}, "position is True"),
        "name": ({**good, "step": 5}, "step 5 in the checkpoint of step 6"),
        "where": ({**good, "epoch": 0, "samples_seen": 8}, "step 6 is not where epoch 0"),
        "best": ({**good, "best": "0.5"}, "best is '0.5', not a metric"),
        "list": ([1, 2], "not a JSON object"),
    }
    for case, (state, said) in bad.items():
        problem = ck.state_problem(state, 6, 16, 4)
        assert problem is not None and said in problem, (case, problem)


def test_a_best_that_is_not_finite_is_no_best_not_damage() -> None:
    """An older memfit kept a first eval's NaN as the best (every later checkpoint wrote
    "best": NaN): such a checkpoint is whole, its best is none."""
    good = {"step": 6, "epoch": 1, "position": 8, "samples_seen": 24}
    for best in (float("nan"), float("inf"), -float("inf")):
        assert ck.state_problem({**good, "best": best}, 6, 16, 4) is None, best
        assert ck.saved_best({**good, "best": best}) is None
    assert ck.saved_best({**good, "best": 0.25}) == 0.25
    assert ck.saved_best({**good, "best": None}) is None
    assert ck.saved_best(good) is None


def test_an_eval_that_is_not_finite_is_never_the_best() -> None:
    from memfit.train.loop import better

    assert not better(float("nan"), None, greater=True)
    assert not better(float("inf"), None, greater=True)
    assert not better(-float("inf"), 0.5, greater=False)
    assert not better(None, None, greater=True)
    # after a NaN eval (no best kept), the next finite one is the best
    assert better(0.5, None, greater=True)
    assert better(0.6, 0.5, greater=True) and not better(0.4, 0.5, greater=True)
    assert better(0.4, 0.5, greater=False)


def test_finite_reads_the_extremes_only() -> None:
    assert ck.finite(torch.ones(3))
    assert not ck.finite(torch.tensor([1.0, float("nan")]))
    assert not ck.finite(torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16))
    assert ck.finite(torch.arange(3))  # integers always are
    assert ck.finite(torch.empty(0))


def test_weights_that_are_not_finite_are_named(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])},
        str(tmp_path / "model.safetensors"),
    )
    assert ck.weights_problem(tmp_path) == "its weights are not finite (NaN or inf in b)"
    save_file({"a": torch.ones(3), "n": torch.arange(3)}, str(tmp_path / "model.safetensors"))
    assert ck.weights_problem(tmp_path) is None


def test_the_model_signature_tells_architectures_apart() -> None:
    a = ck.model_signature(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), "a")
    same = ck.model_signature(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), "elsewhere/a")
    wider = ck.model_signature(nn.Sequential(nn.Linear(4, 9), nn.Linear(9, 2)), "b")
    frozen = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    frozen[0].requires_grad_(False)
    assert a["digest"] == same["digest"] and a["parameters"] == 4
    assert wider["digest"] != a["digest"]
    # what is trained decides the optimizer state's shape
    assert ck.model_signature(frozen, "a")["digest"] != a["digest"]


def test_weights_finite_reads_a_zero3_partition_not_its_placeholder() -> None:
    """Under DeepSpeed ZeRO-3 a parameter outside a forward is an empty placeholder, its values
    in ``ds_tensor`` (this rank's partition): that is what is checked (the placeholder alone
    would always read as finite, and weights an update made NaN would be checkpointed)."""
    from memfit.train.loop import TrainingRun

    run = object.__new__(TrainingRun)
    run.ranks = None
    healthy, broken = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0))
    healthy.ds_tensor = torch.ones(4)  # type: ignore[attr-defined]
    broken.ds_tensor = torch.tensor([1.0, float("nan")])  # type: ignore[attr-defined]
    run.params = [healthy]
    assert run.weights_finite()
    run.params = [healthy, broken]
    assert not run.weights_finite()
    run.params = [nn.Parameter(torch.tensor([float("inf")]))]  # a plain parameter
    assert not run.weights_finite()
