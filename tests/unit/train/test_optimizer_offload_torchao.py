"""--optimizer-offload cpu on CUDA runs torchao's CPUOffloadOptimizer (memfit.train.optim._resynced).
torchao needs CUDA, so a stand-in, :class:`FakeCPUOffloadOptimizer`, copies its structure from
torchao/optim/cpu_offload.py (pytorch/ao, torchao 0.18/0.19, lines 18-180): an Optimizer subclass
that never calls ``Optimizer.__init__`` (no ``state``), ``param_d2h_map`` of host copies, one
inner optimizer per offloaded parameter in ``optim_dict``, the small ones on the device optimizer
``d_opt``, a post-accumulate-grad hook that copies gradients out and queues them, a step that
steps the host copies and copies them back, and its state_dict layout. Only the device is the
CPU (with a stream whose events are no-ops) and nothing is pinned.

With it, the probe's undo (memfit.train.loop.TrainingRun.probe) and a resume
(memfit.train.checkpoint) must leave the weights of a run without them."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.errors import UsageError
from memfit.train import checkpoint as ck
from memfit.train.optim import make_optimizer, state_format


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream(torch.cpu.Stream):
    def record_event(self, event: Any = None) -> _Event:  # type: ignore[override]
        return _Event()

    def synchronize(self) -> None:
        pass


class FakeCPUOffloadOptimizer(torch.optim.Optimizer):
    """torchao/optim/cpu_offload.py's CPUOffloadOptimizer, line for line where it matters."""

    def __init__(
        self,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        offload_gradients: bool = False,
        minimal_size: int = 4096,
        **kwargs: Any,
    ) -> None:
        # no Optimizer.__init__ (torchao's line 16-17: "we don't call Optimizer.__init__()")
        if optimizer_class is torch.optim.AdamW and "fused" not in kwargs:
            kwargs.update(fused=True)
        param_groups = list(params)
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        self.minimal_size = minimal_size
        self.d_opt: Any = None
        self.d_param_groups: list[dict[str, Any]] = []
        self.param_d2h_map: dict[Any, Any] = {}
        self.optim_dict: dict[Any, Any] = {}
        self.device = "cpu"  # torchao: get_available_devices()[-1], "cuda" or "xpu"
        self.stream = _Stream()
        self.queue: dict[Any, Any] = {}

        def backward_hook(p_device: torch.Tensor) -> None:
            if p_device.grad is not None:
                p_host = self.param_d2h_map[p_device]
                self.stream.wait_stream(torch.cpu.current_stream())
                with torch.cpu.stream(self.stream):
                    p_host.grad.copy_(p_device.grad, non_blocking=True)
                if p_device in self.queue:
                    del self.queue[p_device]
                self.queue[p_device] = self.stream.record_event()

        for param_group in param_groups:
            group_params = param_group.pop("params")
            retained = []
            for p_device in group_params:
                if not p_device.requires_grad:
                    continue
                if p_device.numel() < self.minimal_size:
                    retained.append(p_device)
                    continue
                p_host = torch.empty_like(p_device, device="cpu")  # torchao: pin_memory=True
                p_host.grad = torch.empty_like(p_host)
                p_host.copy_(p_device.detach(), non_blocking=True)
                self.param_d2h_map[p_device] = p_host
                p_device.register_post_accumulate_grad_hook(backward_hook)
                self.optim_dict[p_device] = optimizer_class(
                    [{"params": p_host, **param_group}], **kwargs
                )
            if retained:
                self.d_param_groups.append({"params": retained, **param_group})
        if self.d_param_groups:
            self.d_opt = optimizer_class(self.d_param_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.d_opt is not None:
            self.d_opt.step()
        for p_device, event in self.queue.items():
            event.synchronize()
            self.optim_dict[p_device].step()
            p_host = self.param_d2h_map[p_device]
            with torch.cpu.stream(self.stream):
                p_device.copy_(p_host, non_blocking=True)
        self.stream.synchronize()
        self.queue.clear()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        assert set_to_none
        for p_device in self.param_d2h_map:
            p_device.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return sum((o.param_groups for o in self.optim_dict.values()), start=self.d_param_groups)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state_dict: dict[str, Any] = {
            "offloaded": [o.state_dict() for o in self.optim_dict.values()]
        }
        if self.d_opt:
            state_dict["on-device"] = self.d_opt.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for optim, optim_state in zip(
            self.optim_dict.values(), state_dict["offloaded"], strict=False
        ):
            optim.load_state_dict(optim_state)
        if self.d_opt:
            self.d_opt.load_state_dict(state_dict["on-device"])


@pytest.fixture
def fake_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    optim = types.ModuleType("torchao.optim")
    optim.CPUOffloadOptimizer = FakeCPUOffloadOptimizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.optim", optim)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 64x80 = 5120 elements: offloaded (>= minimal_size 4096); its bias and the head stay on d_opt
    return torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def _offloaded(model: torch.nn.Module) -> Any:
    optimizer = make_optimizer(
        "adamw", model, 0.01, 0.01, offload="cpu", device=torch.device("cuda")
    )
    assert optimizer.param_d2h_map and optimizer.d_opt is not None
    return optimizer


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 80, generator=torch.Generator().manual_seed(100 + i))


def _step(model: torch.nn.Module, optimizer: Any, i: int) -> None:
    model(_batch(i)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _probe(model: torch.nn.Module, optimizer: Any) -> None:
    """memfit.train.loop.TrainingRun.probe itself on a fresh optimizer, its step (the guarded
    forward and backward, the update) a step on other rows: afterwards gradients, state and
    weights must be put back."""
    from memfit.train.loop import TrainingRun

    def guarded_step(rows: list[int], number: int) -> None:
        model(_batch(99) * 3).pow(2).mean().backward()

    def update(number: int, *, probe: bool = False) -> None:
        optimizer.step()
        assert optimizer.state  # the probe's moments, host and device

    guard = types.SimpleNamespace(
        micro_batch_size=1,
        max_tokens=None,
        on_event=None,
        target_micro_batch_size=1,
        target_max_tokens=None,
        clean_steps=0,
    )
    run = types.SimpleNamespace(
        guard=guard,
        optimizer=optimizer,
        lengths=[5, 3],
        rows_n=2,
        per_step=2,
        train_rows=[0, 1],
        device=torch.device("cpu"),
        zero_stage=None,
        sharded=None,
        params=list(model.parameters()),
        on_event=lambda event: None,
        guarded_step=guarded_step,
        update=update,
    )
    snapshot = [p.detach().to("cpu", copy=True) for p in run.params]
    TrainingRun.probe(run, snapshot)  # type: ignore[arg-type]


def test_the_state_view_merges_the_inner_optimizers(fake_torchao: None) -> None:
    model = _model()
    optimizer = _offloaded(model)
    assert not optimizer.state and len(optimizer.state) == 0
    _step(model, optimizer, 0)
    assert set(optimizer.state) == set(model.parameters())  # offloaded and on-device
    big = model[0].weight
    assert optimizer.state[big]["exp_avg"].shape == big.shape
    optimizer.state.clear()
    assert not optimizer.state
    assert all(not inner.state for inner in optimizer.optim_dict.values())


def test_probe_then_steps_equal_steps_without_the_probe(fake_torchao: None) -> None:
    plain_model = _model()
    plain = _offloaded(plain_model)
    probed_model = _model()
    probed = _offloaded(probed_model)
    _probe(probed_model, probed)
    for i in range(3):
        _step(plain_model, plain, i)
        _step(probed_model, probed, i)
    for a, b in zip(_weights(plain_model), _weights(probed_model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_equals_the_uninterrupted_run(fake_torchao: None, tmp_path: Path) -> None:
    model = _model()
    optimizer = _offloaded(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for i in range(2):
        _step(model, optimizer, i)
    path = ck.write_checkpoint(
        tmp_path,
        2,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=None,
        state={"step": 2},
        keep=None,
    )
    for i in range(2, 4):
        _step(model, optimizer, i)
    uninterrupted = _weights(model)

    resumed_model = _model()  # the initial weights, in the host copies too
    resumed = _offloaded(resumed_model)
    ck.read_checkpoint(
        path,
        model=resumed_model,
        optimizer=resumed,
        scheduler=torch.optim.lr_scheduler.LambdaLR(resumed, lambda _: 1.0),
        scaler=None,
        device=torch.device("cpu"),
    )
    for i in range(2, 4):
        _step(resumed_model, resumed, i)
    for a, b in zip(uninterrupted, _weights(resumed_model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_plain_optimizer_state_is_refused(fake_torchao: None) -> None:
    model = _model()
    plain = torch.optim.AdamW(model.parameters())
    optimizer = _offloaded(model)
    assert state_format(optimizer) == "torchao-cpu-offload"
    assert state_format(plain) == "torch"
    with pytest.raises(ValueError, match="--optimizer-offload cpu"):
        optimizer.load_state_dict(plain.state_dict())


def test_without_torchao_the_offload_on_cuda_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(UsageError, match="torchao is not installed"):
        make_optimizer("adamw", _model(), 0.01, 0.0, offload="cpu", device=torch.device("cuda"))


@pytest.mark.parametrize("written_offloaded", [True, False])
def test_a_resume_with_the_other_optimizer_offload_is_refused(
    fake_torchao: None, tmp_path: Path, written_offloaded: bool
) -> None:
    """TrainingRun.load: a checkpoint's optimizer.pt of the other layout does not load (torchao's
    is one state dict per offloaded parameter): refused before loading, naming the flag."""
    from memfit.train.loop import TrainingRun

    def optimizer(model: torch.nn.Module, offloaded: bool) -> Any:
        return _offloaded(model) if offloaded else torch.optim.AdamW(model.parameters())

    model = _model()
    written = optimizer(model, written_offloaded)
    path = ck.write_checkpoint(
        tmp_path,
        1,
        model=model,
        optimizer=written,
        scheduler=torch.optim.lr_scheduler.LambdaLR(written, lambda _: 1.0),
        scaler=None,
        state={"step": 1, "optimizer": "adamw", "optimizer_format": state_format(written)},
    )
    other = _model()
    run = types.SimpleNamespace(
        settings=None,
        model_signature={"digest": None},
        cfg=types.SimpleNamespace(optimizer="adamw"),
        out=tmp_path,
        zero_stage=None,
        model=other,
        optimizer=optimizer(other, not written_offloaded),
    )
    flag = "cpu" if written_offloaded else "none"
    with pytest.raises(UsageError, match=f"resume with --optimizer-offload {flag}"):
        TrainingRun.load(run, path)  # type: ignore[arg-type]
