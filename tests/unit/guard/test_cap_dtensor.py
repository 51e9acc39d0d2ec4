"""The CPU memory cap under FSDP2: DTensor shards at their local size, storage resizes followed.

A sharded parameter is a DTensor whose own storage reports the global size, and FSDP2 frees an
unsharded parameter with ``untyped_storage().resize_(0)`` and allocates it again by resizing back:
the cap must count what the rank holds (as ``bench/sharding_check.py``'s FSDP worker does).
One process, a gloo group of world size 1.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memfit.guard import CpuMemoryCap

FLOAT = 4  # bytes of a float32

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Any]:
    """A 1-rank CPU device mesh over a gloo group (a FileStore in ``tmp_path``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is initialized already")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors``, DTensors by their local shard."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t._local_tensor
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_a_dtensor_counts_as_its_local_shard(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    # rank 0's half of a sharded 1000 x 1000 parameter: the DTensor's own storage reports the
    # whole parameter (4,000,000 bytes), the rank holds its local shard (2,000,000)
    shard = torch.randn(500, 1000)
    whole = torch.Size([1000, 1000])
    param = DTensor.from_local(
        shard, mesh, [Shard(0)], run_check=False, shape=whole, stride=(1000, 1)
    )
    assert param.untyped_storage().nbytes() == 1000 * 1000 * FLOAT
    cap = CpuMemoryCap(10**9)
    cap.track(param)
    assert cap.live_bytes == 500 * 1000 * FLOAT
    cap.track(nn.Parameter(param))  # the same shard again (FSDP's parameters): counted once
    assert cap.live_bytes == 500 * 1000 * FLOAT

    with cap:
        doubled = param * 2  # a DTensor op under the mode: a new local shard
        assert isinstance(doubled, DTensor)
        assert cap.live_bytes == 2 * 500 * 1000 * FLOAT
        assert cap.peak_bytes == 2 * 500 * 1000 * FLOAT
        del doubled
        gc.collect()
        assert cap.live_bytes == 500 * 1000 * FLOAT


def test_a_dtensor_op_past_the_cap_raises_at_its_local_size(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    shard = torch.randn(250, 100)
    param = DTensor.from_local(
        shard, mesh, [Shard(0)], run_check=False, shape=torch.Size([1000, 100]), stride=(100, 1)
    )
    # room for the shard and one more of its size (the global size would not fit even once)
    with CpuMemoryCap(2 * 250 * 100 * FLOAT + 100) as cap:
        cap.track(param)
        copy = param + 1  # fits at its local size
        assert cap.live_bytes == 2 * 250 * 100 * FLOAT
        with pytest.raises(torch.OutOfMemoryError, match="memfit memory cap"):
            param * 3
        assert cap.peak_bytes == 2 * 250 * 100 * FLOAT  # the failed op adds nothing
        del copy


def test_storage_resizes_free_and_allocate() -> None:
    with CpuMemoryCap(3000 * FLOAT) as cap:
        t = torch.empty(1000)
        view = t[10:20]
        assert cap.live_bytes == cap.peak_bytes == 1000 * FLOAT
        t.untyped_storage().resize_(0)  # FSDP's free_storage
        assert cap.live_bytes == 0
        view.untyped_storage().resize_(2000 * FLOAT)  # FSDP's alloc_storage, through a view
        assert cap.live_bytes == cap.peak_bytes == 2000 * FLOAT
        cap.reset_peak()
        t.untyped_storage().resize_(0)
        assert cap.live_bytes == 0
        # growing it past the cap is an allocation that fails: nothing grows, the peak stays
        with pytest.raises(
            torch.OutOfMemoryError, match=r"memfit memory cap: .*Raised by UntypedStorage\.resize_"
        ):
            t.untyped_storage().resize_(4000 * FLOAT)
        assert t.untyped_storage().nbytes() == 0
        assert cap.live_bytes == 0
        assert cap.peak_bytes == 2000 * FLOAT
        t.untyped_storage().resize_(3000 * FLOAT)  # up to the cap fits
        assert cap.live_bytes == 3000 * FLOAT
        del t, view
        gc.collect()
        assert cap.live_bytes == 0


def test_resizes_of_storages_made_before_the_cap() -> None:
    made_before = torch.empty(500)  # not tracked: its resizes count from the first growth
    tracked = torch.empty(100)
    with CpuMemoryCap(10**6) as cap:
        cap.track(tracked)
        made_before.untyped_storage().resize_(0)  # never counted: nothing to take back
        assert cap.live_bytes == 100 * FLOAT
        made_before.untyped_storage().resize_(500 * FLOAT)
        assert cap.live_bytes == 600 * FLOAT
        tracked.untyped_storage().resize_(0)
        assert cap.live_bytes == 500 * FLOAT


def test_resizes_are_followed_only_while_the_cap_is_active() -> None:
    original = torch.UntypedStorage.resize_
    outer = CpuMemoryCap(10**6)
    with outer:
        t = torch.empty(100)
        with CpuMemoryCap(10**6) as inner:
            u = torch.empty(50)
            u.untyped_storage().resize_(0)  # both caps see it
            assert inner.live_bytes == 0
        assert outer.live_bytes == 100 * FLOAT
        assert torch.UntypedStorage.resize_ is not original  # the outer cap still follows
        # another thread's resizes are not this mode's (nor are its ops)
        other = threading.Thread(target=t.untyped_storage().resize_, args=(0,))
        other.start()
        other.join()
        assert outer.live_bytes == 100 * FLOAT
    assert torch.UntypedStorage.resize_ is original
    t.untyped_storage().resize_(400)
    u.untyped_storage().resize_(200)
    assert outer.live_bytes == 100 * FLOAT  # not followed once the cap has exited
    del t, u


def _fsdp_model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 4))
    # as memfit train wraps a model: each block (here each layer), then the root
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp_steps_count_the_shards_and_free_the_gathered_parameters(mesh: Any) -> None:
    model = _fsdp_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    params = local_bytes(model.parameters())
    assert params == (64 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4) * FLOAT
    x = torch.randn(32, 64)
    with CpuMemoryCap(10**9) as cap:
        cap.track(model, optimizer)
        assert cap.live_bytes == params
        for _ in range(3):
            cap.reset_peak()
            resident = cap.live_bytes  # the shards (and the optimizer state after a step)
            loss = model(x).square().mean()
            # each layer's gathered parameters are freed after its forward: what it adds is the
            # activations, less than one more copy of the parameters
            assert resident < cap.live_bytes < resident + params
            loss.backward()
            del loss
            grads = local_bytes(p.grad for p in model.parameters())
            assert grads == params
            assert cap.live_bytes == resident + grads  # the gathered parameters freed again
            optimizer.step()
            # flush the gradients: only the shards and the optimizer state stay
            optimizer.zero_grad(set_to_none=True)
            state = local_bytes(v for s in optimizer.state.values() for v in s.values())
            assert cap.live_bytes == params + state
            # the step held at least the shards, their gradients and a gathered layer
            assert cap.peak_bytes >= resident + grads + 256 * 256 * FLOAT


def test_an_fsdp_all_gather_past_the_cap_raises_and_the_step_runs_again(mesh: Any) -> None:
    model = _fsdp_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 64)
    with CpuMemoryCap(10**9) as cap:
        cap.track(model, optimizer)
        model(x).sum().backward()  # the first step makes FSDP's buffers and the optimizer state
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        held = cap.live_bytes
        # room for less than the largest layer's gathered parameters: its all-gather allocation
        # (a storage resized back up) is the op that fails
        cap.cap_bytes = held + 256 * 256 * FLOAT
        cap.reset_peak()
        with pytest.raises(torch.OutOfMemoryError, match=r"UntypedStorage\.resize_"):
            model(x).sum().backward()
        assert cap.peak_bytes <= cap.cap_bytes  # the failed allocation never counted
        # FSDP's recovery (memfit's ShardedModel.reset): resharded, the gathered memory freed
        model.reset_iter_state()  # type: ignore[operator]
        gc.collect()
        assert cap.live_bytes == held
        cap.cap_bytes = 10**9
        model(x).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
