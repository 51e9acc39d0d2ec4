"""Activation offloading's context and its emulation (:mod:`memfit.step.offload`), on real CPU
tensors: which implementation runs where, the same gradients under the CPU's context, and the
emulation's rules (TRL's: what stays on the device, the forward stash of copies in flight)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from memfit.step import offload
from memfit.step.offload import FORWARD_STASH


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
        self.lm_head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(x))


def test_which_implementation_runs_where(monkeypatch: pytest.MonkeyPatch) -> None:
    # on CUDA TRL's context whatever is installed here (a run without TRL is refused): the
    # estimate of a CUDA step emulates TRL's rules on a machine without TRL too
    monkeypatch.setattr(offload, "trl_available", lambda: False)
    assert offload.implementation("cuda") == "trl"
    assert offload.implementation("cpu") == "save_on_cpu"
    context = offload.offload_context(_Net(), "cpu")
    assert isinstance(context, torch.autograd.graph.save_on_cpu)


def test_cuda_without_trl_is_refused_naming_the_flag_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(offload, "trl_available", lambda: False)
    said = offload.missing("cuda")
    assert said is not None
    assert "--activation-offloading" in said and "pip install 'memfit[trl]'" in said
    assert "\n" not in said
    # the context itself never runs what the estimate does not price
    with pytest.raises(offload.OffloadUnavailable):
        offload.offload_context(_Net(), "cuda")
    assert offload.missing("cpu") is None  # the CPU device needs no TRL
    offload.require("cpu")


def _trl_on_the_cpu(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> Any:
    """TRL's own OffloadActivations (trl/models/activation_offloading.py, trl 1.16) on the CPU:
    no streams, no pinning, every save offloaded; its enters and exits logged, and at each
    attempt's first pack how many entries its tracker already held."""
    trl = pytest.importorskip("trl.models.activation_offloading")
    # TRL asks torch which accelerator it runs on (it has no CPU case): the CPU here
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")
    )
    # bitsandbytes loaded (another test): TRL empties the device's cache on entry
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)

    class Logged(trl.OffloadActivations):  # type: ignore[misc,name-defined]
        def __enter__(self) -> Any:
            log.append("enter")
            entered = super().__enter__()
            log.append(f"tracker {len(self.tracker)}")
            return entered

        def __exit__(self, *exc: Any) -> Any:
            log.append("exit" if exc[0] is None else "exit after " + exc[0].__name__)
            return super().__exit__(*exc)

    return Logged(use_pin_memory=False, use_streams=False, min_offload_size=0)


def test_each_guard_attempt_enters_and_exits_its_own_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An OOM in a micro-batch's backward (the cap's, at micro-batch 4) leaves saves in TRL's
    tracker; the re-run at micro-batch 2 enters the context anew (its tracker cleared) for each
    micro-batch, and nothing is left tracked after the step (#1 of the review: one entry around
    the whole guard.step kept the failed attempt's tensors through the re-run)."""
    from memfit.guard import Guard

    log: list[str] = []
    context = _trl_on_the_cpu(monkeypatch, log)
    per = offload.PerMicroBatch(context)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3))
    rows = [torch.randn(6) for _ in range(4)]

    class Recipe:
        splittable = True

        def units(self, chunk: list[torch.Tensor]) -> int:
            return len(chunk)

        def loss(self, chunk: list[torch.Tensor], total: int, **_: Any) -> torch.Tensor:
            out = model(torch.stack(chunk)).square().sum() / total
            if len(chunk) > 2:
                # out of memory in this micro-batch's backward, after the saves were packed

                def fail(grad: torch.Tensor) -> torch.Tensor:
                    raise torch.OutOfMemoryError("CUDA out of memory in backward")

                out.register_hook(fail)
            return out

    guard = Guard(4, backward=per.backward(None))
    try:
        recipe: Any = Recipe()
        guard.step(
            rows, recipe, params=list(model.parameters()), autocast=per.autocast(_no_autocast)
        )
    finally:
        per.close()
    assert guard.micro_batch_size == 2
    assert log == [
        "enter", "tracker 0", "exit after OutOfMemoryError",  # the failed attempt
        "enter", "tracker 0", "exit",  # the re-run's micro-batch 1
        "enter", "tracker 0", "exit",  # micro-batch 2
    ]  # fmt: skip
    assert context.tracker == {}


def test_a_failed_forward_exits_the_context_too(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    per = offload.PerMicroBatch(_trl_on_the_cpu(monkeypatch, log))
    net = _Net()
    with pytest.raises(torch.OutOfMemoryError), per.autocast(_no_autocast)():
        net(torch.randn(4, 32, requires_grad=True))
        raise torch.OutOfMemoryError("CUDA out of memory in forward")
    per.close()  # exited already: nothing more
    assert log == ["enter", "tracker 0", "exit after OutOfMemoryError"]


def _no_autocast() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_the_cpu_context_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 32)
    net(x).square().sum().backward()
    plain = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad()
    packed: list[int] = []
    context = offload.offload_context(net, "cpu")
    pack = context.pack_hook
    context.pack_hook = lambda t: packed.append(t.numel()) or pack(t)
    with context:
        net(x).square().sum().backward()
    assert packed  # the context did copy the saves out
    for before, p in zip(plain, net.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, before)


def _emulated(target: str, net: nn.Module) -> tuple[offload.OffloadEmulation, list[int]]:
    host: list[int] = []

    def host_copy(tensor: torch.Tensor, whole_storage: bool) -> torch.Tensor:
        if whole_storage:
            copy = torch.empty(tensor.untyped_storage().nbytes(), dtype=torch.uint8)
        else:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype)
        host.append(copy.numel() * copy.element_size())
        return copy

    return offload.OffloadEmulation(net, target, host_copy), host


def test_trl_rules_keep_small_saves_parameters_and_the_heads_input() -> None:
    net = _Net()
    emulation, host = _emulated("trl", net)
    x = torch.randn(4, 32, requires_grad=True)  # 512 bytes per layer input: under 1 KiB
    with emulation:
        net(x).sum().backward()
    assert host == []  # every save was small, a parameter, or inside the head
    wide = torch.randn(16, 32, requires_grad=True)  # 2 KiB per layer input
    with emulation:
        net(wide).sum().backward()
    # each body layer's input (ReLU-free Linear layers save their input); the head's is kept
    assert host == [16 * 32 * 4] * 8
    assert wide.grad is not None and wide.grad.shape == wide.shape


def test_the_forward_stash_lets_a_device_tensor_go_five_saves_later() -> None:
    emulation, host = _emulated("trl", nn.Linear(1, 1))
    tensors = [torch.randn(512) for _ in range(8)]  # 2 KiB each
    alive = [weakref.ref(t) for t in tensors]
    with emulation:
        ids = [emulation.pack_hook(t) for t in tensors]
        del tensors
        # the copies of the saves up to five before the last are taken to be done
        assert [ref() is not None for ref in alive] == [False] * 3 + [True] * 5
        assert len(host) == 8
        # a storage saved again while its copy is in flight stays on the device
        again = alive[-1]()
        assert again is not None
        kept = emulation.pack_hook(again)
        assert len(host) == 8
        assert emulation.unpack_hook(kept) is again
        del again
        # unpacking outside a backward node brings an empty tensor of the same shape back
        back = emulation.unpack_hook(ids[0])
        assert back.shape == (512,) and back.dtype == torch.float32


def test_a_broadcast_save_copies_its_storage_and_comes_back_as_the_same_view() -> None:
    emulation, host = _emulated("trl", nn.Linear(1, 1))
    storage = torch.randn(1, 512)
    broadcast = storage.expand(64, 512)  # a zero stride: 128 KiB as a tensor, 2 KiB stored
    with emulation:
        saved = emulation.pack_hook(broadcast)
        assert host == [512 * 4]
        for _ in range(FORWARD_STASH):  # the copy is done: the device tensor is let go
            emulation.pack_hook(torch.randn(512))
        back = emulation.unpack_hook(saved)
    assert back.shape == broadcast.shape and back.stride() == broadcast.stride()
    assert back.untyped_storage().nbytes() == 512 * 4


def test_save_on_cpu_rules_copy_every_save_and_on_the_cpu_give_the_copy_back() -> None:
    net = _Net()
    emulation, host = _emulated("save_on_cpu", net)
    x = torch.randn(4, 32, requires_grad=True)
    with emulation:
        out = net(x).sum()
        # parameters and small saves too: torch's save_on_cpu copies everything
        assert len(host) >= 2 * 9
        out.backward()


@pytest.mark.parametrize("target", ["trl", "save_on_cpu"])
def test_the_output_head_is_found_as_trl_finds_it(target: str) -> None:
    net = _Net()
    assert offload.output_head(net) is net.lm_head
    wrapped = nn.Module()
    wrapped.module = net  # a DDP-style wrapper
    assert offload.output_head(wrapped) is net.lm_head
