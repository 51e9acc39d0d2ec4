"""memfit.step.weights.checkpoint_dtype reads a config's dtype without transformers 5's
deprecated ``torch_dtype`` alias (a property that logs "`torch_dtype` is deprecated"), and still
reads an older config that holds ``torch_dtype`` as a field; the doctor reads it the same way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from memfit.report import doctor_cures
from memfit.step import weights


def _refuse(_config: Any) -> Any:
    raise AssertionError("the deprecated torch_dtype alias was read")


@pytest.mark.parametrize(
    ("dtype", "expected"), [(None, torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_the_deprecated_alias_is_never_read(
    monkeypatch: pytest.MonkeyPatch, dtype: str | None, expected: torch.dtype
) -> None:
    # transformers 5: a property on the config class, aliasing dtype
    monkeypatch.setattr(transformers.PretrainedConfig, "torch_dtype", property(_refuse))
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    config.dtype = dtype
    assert weights.checkpoint_dtype(config) == expected


def test_an_older_config_holding_torch_dtype_as_a_field_is_read() -> None:
    assert weights.checkpoint_dtype(SimpleNamespace(torch_dtype="bfloat16")) == torch.bfloat16
    assert weights.checkpoint_dtype(SimpleNamespace(dtype=None, torch_dtype="float16")) == (
        torch.float16
    )
    assert weights.checkpoint_dtype(SimpleNamespace()) == torch.float32


def test_the_doctor_reads_the_step_s_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # the doctor has no reader of its own: the step's decides what it says
    monkeypatch.setattr(weights, "checkpoint_dtype", lambda config: torch.float16)
    assert doctor_cures.checkpoint_dtype("gpt2") == "fp16"
    assert doctor_cures.checkpoint_dtype("no/such-model-anywhere") is None
