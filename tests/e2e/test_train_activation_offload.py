"""`memfit train --activation-offloading` on the CPU (issue 33), with checks that can fail.

What the CPU cannot show: on the CPU device the implementation is ``save_on_cpu``, whose copy of
a CPU tensor is the tensor itself, so the weights of an offloaded run equal those of a plain run
by construction (not checked here). The CUDA path (TRL's pinned copies on a side stream, the
values brought back) waits for a GPU. What is checked here instead:

- TRL's own context (trl 1.16's ``OffloadActivations``, run on the CPU with its streams stubbed)
  offloads exactly the tensors, by shape and dtype, in order, that the estimator's emulation of
  TRL's rules (:class:`memfit.step.offload.OffloadEmulation`) copies to the host for the same
  model and batch: the rules the estimate prices are TRL's (its small-save, parameter, output
  head and storage rules, and the fused-linear loss's head-weight gradient it does offload).
- The run enters the context once per micro-batch (its forward and backward) and run.json
  records the implementation that ran; a CUDA run without TRL is refused (exit 2's UsageError).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from memfit.train import TrainConfig, train

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("llama-offload")
    save_tiny_llama(folder, [" ".join(WORDS[i : i + 10]) for i in range(0, 40, 5)])
    return str(folder)


def _run(model: str, tmp_path: Path, name: str, **knobs: Any) -> dict[str, Any]:
    rng = random.Random(0)
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))})
            + "\n"
            for _ in range(12)
        )
    )
    out = tmp_path / name
    settings: dict[str, Any] = dict(
        task="causal-lm",
        model=model,
        train_file=str(data),
        output_dir=str(out),
        cache_dir=str(tmp_path / "cache"),
        effective_batch_size=4,
        micro_batch_size=2,
        max_steps=3,
        lr=1e-2,
        seed=3,
        device="cpu",
        quiet=True,
        probe=False,
    )
    train(TrainConfig(**(settings | knobs)))
    return {
        "weights": load_file(str(out / "model" / "model.safetensors")),
        "resolved": json.loads((out / "run.json").read_text())["resolved"],
    }


def _trl_on_the_cpu(monkeypatch: pytest.MonkeyPatch, model: Any) -> Any:
    """TRL's get_act_offloading_ctx_manager on the CPU (streams on, not pinned): TRL asks torch
    for the accelerator (the CPU here) and syncs its streams on exit (a no-op on the CPU)."""
    pytest.importorskip("trl")
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")
    )
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    # a view of a tensor brought back outlives its node (checkpointing's recompute): TRL keeps it
    # for the compute stream, a no-op on the CPU
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # bitsandbytes loaded (another test): TRL empties the device's cache on entry
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    return get_act_offloading_ctx_manager(
        model, use_pin_memory=False, use_streams=True, warn_if_no_head=False
    )


def _offloaded_by_trl(context: Any, step: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The host copies TRL's pack makes during ``step()`` (its tracker's offloaded entries)."""
    copies: list[tuple[tuple[int, ...], torch.dtype]] = []
    pack = context.pack_hook

    def recording(tensor: torch.Tensor) -> Any:
        tensor_id = pack(tensor)
        host, offloaded, *_ = context.tracker[tensor_id]
        if offloaded:
            copies.append((tuple(host.shape), host.dtype))
        return tensor_id

    context.pack_hook = recording
    with context:
        step()
    return copies


def _offloaded_by_the_emulation(model: Any, step: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    from memfit.step import offload

    copies: list[tuple[tuple[int, ...], torch.dtype]] = []

    def host_copy(tensor: torch.Tensor, whole_storage: bool) -> torch.Tensor:
        if whole_storage:
            size = tensor.untyped_storage().nbytes() // tensor.element_size()
            copy = torch.empty(size, dtype=tensor.dtype)
        else:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype)
        copies.append((tuple(copy.shape), copy.dtype))
        return copy

    emulation = offload.OffloadEmulation(model, "trl", host_copy)
    with emulation:
        step()
    return copies


@pytest.mark.parametrize(("checkpointing", "fused"), [(False, False), (True, False), (False, True)])
def test_trl_offloads_exactly_what_the_estimate_emulates(
    llama: str, monkeypatch: pytest.MonkeyPatch, checkpointing: bool, fused: bool
) -> None:
    from transformers import AutoModelForCausalLM

    from memfit.step.linear_ce import linear_cross_entropy

    def fresh() -> Any:
        model = AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager")
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        return model.train()

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 24))

    def step_of(model: Any) -> Any:
        def step() -> None:
            if fused:
                # the fused-linear loss takes the head's weight, not the head module: TRL's
                # output-head rule does not cover it (as Liger's lce_forward), so the V x H
                # weight gradient it saves for the backward is offloaded
                hidden = model.model(input_ids=ids).last_hidden_state
                flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
                loss = linear_cross_entropy(
                    flat, model.lm_head.weight, None, ids[:, 1:].reshape(-1)
                )
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

        return step

    model = fresh()
    by_trl = _offloaded_by_trl(_trl_on_the_cpu(monkeypatch, model), step_of(model))
    model = fresh()
    emulated = _offloaded_by_the_emulation(model, step_of(model))
    assert by_trl, "TRL offloaded nothing: the comparison would be empty"
    assert emulated == by_trl
    head = tuple(model.lm_head.weight.shape)
    # the head-weight gradient: offloaded with the fused loss, none without (the head's input
    # is kept by TRL's NoOpManager)
    assert (head, torch.float32) in by_trl if fused else (head, torch.float32) not in by_trl


def test_the_run_enters_the_context_per_micro_batch_and_records_it(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks pack the step's saved tensors in one entry per micro-batch (2 micro-batches a
    step, 3 steps), and run.json says which implementation ran."""
    from memfit.step import offload

    entries: list[int] = []
    packed: list[int] = []
    real = offload.offload_context

    class Counted(torch.autograd.graph.save_on_cpu):
        def __enter__(self) -> None:
            entries.append(0)
            super().__enter__()

    def counting(model: Any, device_type: str) -> Any:
        assert isinstance(real(model, device_type), torch.autograd.graph.save_on_cpu)
        context = Counted(pin_memory=False)
        pack = context.pack_hook

        def pack_counting(tensor: torch.Tensor) -> Any:
            entries[-1] += 1
            packed.append(tensor.numel())
            return pack(tensor)

        context.pack_hook = pack_counting
        return context

    monkeypatch.setattr(offload, "offload_context", counting)
    run = _run(llama, tmp_path, "counted", activation_offloading=True)
    assert run["resolved"]["activation_offloading"] == "save_on_cpu"
    assert len(entries) == 3 * 2 and all(count > 10 for count in entries)
    plain = _run(llama, tmp_path, "plain")
    assert plain["resolved"]["activation_offloading"] is None


def test_a_cuda_run_without_trl_is_refused_before_loading(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.errors import UsageError
    from memfit.step import offload

    monkeypatch.setattr(offload, "trl_available", lambda: False)
    with pytest.raises(UsageError) as refused:
        _run(llama, tmp_path, "refused", device="cuda", activation_offloading=True)
    # one line of the flag problems (this machine has no GPU: that is another line)
    assert offload.TRL_MISSING in str(refused.value).splitlines()
    assert not (tmp_path / "refused").exists()
