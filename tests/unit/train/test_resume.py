"""What a resume tells apart: a checkpoint written for another model (a refusal naming --model)
from a damaged one (passed over)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.train import checkpoint as ck
from memfit.train.resume import misfit, other_model


def _load_error(action: object) -> BaseException:
    with pytest.raises((RuntimeError, ValueError)) as failed:
        action()  # type: ignore[operator]
    return failed.value


def test_torch_loading_errors_of_another_model_are_misfits() -> None:
    small, wide = nn.Linear(4, 2), nn.Linear(4, 3)
    size = _load_error(lambda: wide.load_state_dict(small.state_dict()))
    assert "size mismatch for weight" in (misfit(size) or "")
    deeper = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 2))
    missing = _load_error(
        lambda: deeper.load_state_dict(nn.Sequential(nn.Linear(4, 2)).state_dict())
    )
    assert "Missing key(s)" in (misfit(missing) or "")
    one = torch.optim.SGD(small.parameters(), lr=0.1)
    two = torch.optim.SGD(deeper.parameters(), lr=0.1)
    groups = _load_error(lambda: one.load_state_dict(two.state_dict()))
    assert misfit(groups) is not None
    # a damaged file is not a misfit
    assert misfit(RuntimeError("PytorchStreamReader failed reading zip archive")) is None
    assert misfit(ValueError("Expecting value: line 1 column 1")) is None


def test_another_recorded_model_is_described() -> None:
    a = ck.model_signature(nn.Sequential(nn.Linear(4, 8)), "a")
    b = ck.model_signature(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), "b")
    assert other_model(a, a) is None
    assert other_model(None, a) is None  # a checkpoint of a memfit that recorded none
    assert other_model(b, a) == (
        "it was written for a Sequential of 4 parameter tensors, --model a is a Sequential of 2"
    )
    c = ck.model_signature(nn.Sequential(nn.Linear(4, 9)), "c")
    assert other_model(c, a) == (
        "it was written for a Sequential of 2 parameter tensors of other names or shapes"
    )
