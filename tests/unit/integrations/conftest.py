"""Tiny models built from configs in memory (seeded, dropout off) and a Trainer factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import bert_config, gpt2_config

VOCAB = 64


def _bert_classifier() -> Any:
    from transformers import BertForSequenceClassification

    config = bert_config(VOCAB, num_labels=3)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _gpt2_lm() -> Any:
    from transformers import GPT2LMHeadModel

    config = gpt2_config(VOCAB)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _padded_batch(rows: int, *, seed: int = 1, causal: bool = False) -> dict[str, torch.Tensor]:
    """Rows of different lengths, right-padded; causal-LM labels are the ids with -100 on pads."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(5, VOCAB, (rows, width), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    if causal:
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, 3, (rows,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture
def make_trainer(tmp_path: Path) -> Any:
    """``make_trainer(cls, model, **training_args)``: a Trainer on the CPU, ready for direct
    ``training_step`` calls (what the training loop sets before them is set here)."""
    from transformers import TrainingArguments

    def make(cls: type, model: Any, *, trainer_kwargs: dict | None = None, **overrides: Any) -> Any:
        options: dict[str, Any] = dict(
            output_dir=str(tmp_path / cls.__name__),
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            optim="sgd",
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
        )
        args = TrainingArguments(**(options | overrides))
        trainer = cls(model=model, args=args, **(trainer_kwargs or {}))
        # set by the training loop before it calls training_step (÷ accumulation steps)
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        return trainer

    return make


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: param.grad.detach().clone()
        for name, param in model.named_parameters()
        if param.grad is not None
    }


def _assert_same_gradients(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, rtol: float = 1e-5
) -> None:
    """Equal up to float summation order: within ``rtol`` of the largest gradient entry."""
    assert a.keys() == b.keys()
    assert a, "no gradients to compare"
    scale = max(float(t.abs().max()) for t in a.values())
    assert scale > 0
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= rtol * scale, f"gradients differ by {worst:.3g} (largest entry {scale:.3g})"


# the helpers as fixtures (test files share nothing else: they are not a package)
@pytest.fixture
def bert_classifier() -> Any:
    """A fresh tiny BERT sequence classifier (3 labels), the same weights every call."""
    return _bert_classifier


@pytest.fixture
def gpt2_lm() -> Any:
    """A fresh tiny GPT-2 causal LM, the same weights every call."""
    return _gpt2_lm


@pytest.fixture
def padded_batch() -> Any:
    return _padded_batch


@pytest.fixture
def gradients() -> Any:
    return _gradients


@pytest.fixture
def assert_same_gradients() -> Any:
    return _assert_same_gradients
