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
