"""The CPU memory cap: bytes of live storages, counted once, freed on time, real OOM past the cap."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from memfit.errors import UsageError
from memfit.guard import CpuMemoryCap, memory_cap

FLOAT = 4  # bytes of a float32


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what the cap must count)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_new_tensors_are_counted_and_freed() -> None:
    with CpuMemoryCap(10**9) as cap:
        a = torch.empty(1000)
        assert cap.live_bytes == 1000 * FLOAT
        b = torch.ones(10, 10, dtype=torch.float64)
        assert cap.live_bytes == 1000 * FLOAT + 100 * 8
        del a
        assert cap.live_bytes == 100 * 8
        del b
        assert cap.live_bytes == 0


def test_views_and_in_place_ops_are_not_counted_twice() -> None:
    with CpuMemoryCap(10**9) as cap:
        a = torch.zeros(20, 50)
        views = [a.view(1000), a[::2], a.t(), a[3], a.unsqueeze(0).expand(4, 20, 50)]
        a.add_(1).mul_(2)
        assert cap.live_bytes == 1000 * FLOAT
        del a
        assert cap.live_bytes == 1000 * FLOAT  # the views still hold the storage
        views.clear()
        assert cap.live_bytes == 0


def test_the_cap_keeps_no_storage_alive() -> None:
    with CpuMemoryCap(10**9) as cap:
        t = torch.randn(256)
        ref = weakref.ref(t.untyped_storage())
        del t
        gc.collect()
        assert ref() is None
        assert cap.live_bytes == 0


def test_tracked_module_grads_and_optimizer_state_are_counted() -> None:
    model = nn.Linear(10, 20)
    params = list(model.parameters())
    cap = CpuMemoryCap(10**9)
    cap.track(model)
    assert cap.live_bytes == (10 * 20 + 20) * FLOAT

    model(torch.randn(3, 10)).sum().backward()
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values()]
    cap.track(model, optimizer, *params)  # counting again is a no-op
    expected = storage_bytes(*params, *(p.grad for p in params if p.grad is not None), *state)
    # parameters, gradients, exp_avg, exp_avg_sq, and two float32 step counters
    assert cap.live_bytes == expected == 4 * (10 * 20 + 20) * FLOAT + 2 * FLOAT

    with pytest.raises(TypeError, match="track"):
        cap.track("not a tensor")  # type: ignore[arg-type]


def test_a_training_step_is_counted_and_gradients_outlive_the_graph() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters())
    param_bytes = storage_bytes(*model.parameters())
    x = torch.randn(16, 8)  # made before the cap: not counted
    with CpuMemoryCap(10**9) as cap:
        cap.track(model, optimizer)
        assert cap.live_bytes == param_bytes
        loss = model(x).square().mean()
        assert cap.live_bytes > param_bytes  # activations
        loss.backward()
        del loss
        assert cap.live_bytes == 2 * param_bytes  # parameters + gradients, the graph is gone
        optimizer.step()  # Adam's state is created under the cap
        assert cap.live_bytes >= 4 * param_bytes
        optimizer.zero_grad(set_to_none=True)
        assert cap.live_bytes >= 3 * param_bytes
        with torch.no_grad():
            y = model(x)
        assert cap.live_bytes >= 3 * param_bytes + y.numel() * FLOAT


def test_exceeding_the_cap_raises_a_real_oom_and_frees_the_output() -> None:
    with CpuMemoryCap(4096 * FLOAT) as cap:
        a = torch.zeros(3000)
        with pytest.raises(
            torch.OutOfMemoryError,
            match=r"memfit memory cap: tried to hold 23\.44 KiB, the cap is 16\.00 KiB "
            r"\(simulated CPU out of memory",
        ):
            torch.ones(3000)
        gc.collect()
        assert cap.live_bytes == 3000 * FLOAT  # the failed op's output died with the error
        a.add_(1)  # an op that allocates nothing never fails
        b = torch.ones(1000)  # fits again
        assert cap.live_bytes == 4000 * FLOAT
        del a, b


def test_oom_during_backward_reaches_the_caller_as_out_of_memory_error() -> None:
    model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1))
    x = torch.randn(64, 16)
    with CpuMemoryCap(10**9) as probe:
        probe.track(model)
        loss = model(x).sum()
        after_forward = probe.live_bytes
        loss.backward()
        needed = probe.peak_bytes
    del loss
    for p in model.parameters():
        p.grad = None
    assert needed > after_forward  # backward needs more than the forward left behind

    with CpuMemoryCap((after_forward + needed) // 2) as cap:
        cap.track(model)
        loss = model(x).sum()  # the forward fits
        with pytest.raises(torch.OutOfMemoryError, match="memfit memory cap"):
            loss.backward()


def test_peak_and_reset_peak() -> None:
    with CpuMemoryCap(10**9) as cap:
        a = torch.empty(1000)
        b = torch.empty(500)
        del b
        assert cap.peak_bytes == 1500 * FLOAT
        cap.reset_peak()
        assert cap.peak_bytes == 1000 * FLOAT
        c = torch.empty(100)
        assert cap.peak_bytes == 1100 * FLOAT
        del a, c


def test_memory_cap_picks_the_cap_for_the_device() -> None:
    with memory_cap(None, torch.device("cpu")) as none:
        assert none is None
    with memory_cap(10**6, torch.device("cpu")) as cap:
        assert isinstance(cap, CpuMemoryCap)
        t = torch.empty(100)
        assert cap.live_bytes == 100 * FLOAT
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(10**6)
        del t
    with pytest.raises(UsageError, match="--memory-cap"), memory_cap(10**6, torch.device("meta")):
        pass
    with pytest.raises(ValueError, match="cap_bytes"):
        CpuMemoryCap(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_cap_on_cuda_limits_the_allocator() -> None:
    device = torch.device("cuda")
    with memory_cap(64 * 2**20, device) as cap:
        assert cap is None
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    ok = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # the whole GPU again
    del ok
    torch.cuda.empty_cache()


def test_memory_cap_on_cuda_releases_the_cache_first_and_restores_the_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the allocator checks the fraction only for new segments: cached blocks must be released
    # before the cap is set, and the caller's own fraction comes back after the run
    calls: list[tuple[str, float | None]] = []

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.5)
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, index: calls.append(("set", fraction)),
    )
    with memory_cap(20 * 2**30, torch.device("cuda")) as cap:
        assert cap is None
        assert calls == [("empty_cache", None), ("set", 0.25)]
    assert calls[-1] == ("set", 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_cap_on_cuda_bites_after_earlier_work_was_cached() -> None:
    device = torch.device("cuda")
    earlier = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    del earlier  # 512 MiB cached, not freed to CUDA
    with memory_cap(64 * 2**20, device), pytest.raises(torch.OutOfMemoryError):
        torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("getter", ["missing", "raises"])
def test_memory_cap_on_cuda_restores_the_whole_gpu_where_torch_cannot_say_the_fraction(
    monkeypatch: pytest.MonkeyPatch, getter: str
) -> None:
    set_to: list[float] = []

    class Props:
        total_memory = 80 * 2**30

    def no_fraction(index: int) -> float:
        raise RuntimeError("this allocator backend keeps no fraction")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    if getter == "missing":
        monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    else:
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", no_fraction)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, index: set_to.append(f)
    )
    # the fraction comes back even when the capped run raises
    with pytest.raises(torch.OutOfMemoryError), memory_cap(40 * 2**30, torch.device("cuda")):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert set_to == [0.5, 1.0]
