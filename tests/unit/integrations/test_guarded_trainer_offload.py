"""GuardedTrainer with TRL's ``activation_offloading`` (issue 33): arguments that say it (TRL's
SFTConfig, as apply_plan sets it when the plan chose it) run each training step inside the
offloading context SFTTrainer enters (:func:`memfit.step.offload.offload_context`; on the CPU
torch's save_on_cpu), with the stock gradients; arguments without it run no context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer

from memfit.integrations import GuardedTrainer
from memfit.step import offload

pytest.importorskip("trl")


def _arguments(tmp_path: Path, **overrides: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        optim="sgd",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    return SFTConfig(**(options | overrides))


def _step(cls: type, model: Any, args: Any, batch: dict[str, torch.Tensor]) -> Any:
    trainer = cls(model=model, args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by the loop before training_step
    trainer.training_step(trainer.model, dict(batch), None)
    return trainer


def test_offloading_arguments_run_the_step_in_the_context_with_the_stock_gradients(
    tmp_path: Path,
    gpt2_lm: Any,
    padded_batch: Any,
    gradients: Any,
    assert_same_gradients: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = padded_batch(4, causal=True)
    stock = _step(Trainer, gpt2_lm(), _arguments(tmp_path / "stock"), batch)
    packed: list[int] = []
    real = offload.offload_context

    def counting(model: Any, device_type: str) -> Any:
        context = real(model, device_type)
        pack = context.pack_hook
        context.pack_hook = lambda t: packed.append(t.numel()) or pack(t)
        return context

    monkeypatch.setattr(offload, "offload_context", counting)
    plain = _step(GuardedTrainer, gpt2_lm(), _arguments(tmp_path / "plain"), batch)
    assert packed == []  # the field off: no context
    moved = _step(
        GuardedTrainer,
        gpt2_lm(),
        _arguments(tmp_path / "moved", activation_offloading=True),
        batch,
    )
    assert packed  # the step's saves went through the offloading context
    assert_same_gradients(gradients(stock.model), gradients(moved.model))
    assert_same_gradients(gradients(stock.model), gradients(plain.model))


def test_each_attempt_and_chunk_enters_and_exits_its_own_context(
    tmp_path: Path,
    gpt2_lm: Any,
    padded_batch: Any,
    gradients: Any,
    assert_same_gradients: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An OOM in the forward of a 4-row call: the guard re-runs it as two 2-row chunks, each in
    an entry of its own (TRL's ``__enter__`` drops what the failed attempt left), never nested."""
    batch = padded_batch(4, causal=True)
    stock = _step(Trainer, gpt2_lm(), _arguments(tmp_path / "stock"), batch)
    log: list[str] = []

    class Logged(torch.autograd.graph.save_on_cpu):
        def __enter__(self) -> None:
            log.append("enter")
            super().__enter__()

        def __exit__(self, *exc: Any) -> None:
            log.append("exit" if exc[0] is None else "exit after " + exc[0].__name__)
            super().__exit__(*exc)

    monkeypatch.setattr(offload, "offload_context", lambda model, device: Logged())
    model = gpt2_lm()

    def out_of_memory(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled() and ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    moved = _step(
        GuardedTrainer, model, _arguments(tmp_path / "moved", activation_offloading=True), batch
    )
    assert moved.guard_micro_batch_size == 2
    assert log == ["enter", "exit after OutOfMemoryError", "enter", "exit", "enter", "exit"]
    assert_same_gradients(gradients(stock.model), gradients(moved.model))


def test_cuda_without_trl_is_refused(
    tmp_path: Path, gpt2_lm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.errors import UsageError

    monkeypatch.setattr(offload, "trl_available", lambda: False)
    args = _arguments(tmp_path, activation_offloading=True)
    monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(UsageError, match=r"pip install 'memfit\[trl\]'"):
        GuardedTrainer(model=gpt2_lm(), args=args)
