"""`memfit train --activation-offloading` on the CPU (issue 33): a tiny Llama trained with the
saved activations copied out and back (``torch.autograd.graph.save_on_cpu``, the CPU's
implementation: :mod:`memfit.step.offload`) ends with the weights of the run without it, with and
without gradient checkpointing, and run.json says which implementation ran.
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


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_run_ends_with_the_weights_of_the_run_without_it(
    llama: str, tmp_path: Path, checkpointing: bool
) -> None:
    plain = _run(llama, tmp_path, "plain", gradient_checkpointing=checkpointing)
    offloaded = _run(
        llama,
        tmp_path,
        "offloaded",
        gradient_checkpointing=checkpointing,
        activation_offloading=True,
    )
    assert plain["resolved"]["activation_offloading"] is None
    assert offloaded["resolved"]["activation_offloading"] == "save_on_cpu"
    assert offloaded["resolved"]["gradient_checkpointing"] is checkpointing
    assert plain["weights"].keys() == offloaded["weights"].keys()
    initial = load_file(str(Path(llama) / "model.safetensors"))
    moved = 0.0
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(offloaded["weights"][name], weight, rtol=0, atol=1e-6)
        moved = max(moved, float((weight - initial[name]).abs().max()))
    assert moved > 1e-3  # the runs trained: equal weights are not the initial ones


def test_the_offloading_context_runs_during_the_step(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks pack the step's saved tensors (the run does offload, not merely say so)."""
    from memfit.step import offload

    packed: list[int] = []
    real = offload.offload_context

    def counting(model: Any, device_type: str) -> Any:
        context = real(model, device_type)
        pack = context.pack_hook

        def pack_counting(tensor: torch.Tensor) -> Any:
            packed.append(tensor.numel())
            return pack(tensor)

        context.pack_hook = pack_counting
        return context

    monkeypatch.setattr(offload, "offload_context", counting)
    _run(llama, tmp_path, "counted", activation_offloading=True, max_steps=1)
    assert len(packed) > 10
