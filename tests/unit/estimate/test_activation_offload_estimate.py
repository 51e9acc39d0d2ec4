"""The estimate of a step with ``activation_offloading`` (issue 33).

- The host bytes are what TRL's context manager would copy out, counted independently on a real
  CPU step: every tensor the step saves for backward passes a ``saved_tensors_hooks`` that applies
  TRL's rules (1 KiB and more, no parameter, not inside the output head, a storage saved again
  while its copy is in flight kept) to real tensors.
- With gradient checkpointing (torch's non-reentrant checkpoint, as transformers runs it), the
  saves that reach the offloading hooks are each layer's input and what the step saves outside
  the layers (the final norm's, the loss's): the checkpoint's own hooks take everything else and
  the recomputation saves nothing through the outer hooks. Checked on real tensors.
- The GPU holds less: the saved activations leave the breakdown, and the forward's peak drops by
  no more than what went to the host.
- Host bytes survive the depth extrapolation: auto depth gives the full-depth trace's host bytes
  (with checkpointing the first layers are kept literal: :func:`memfit.estimate.traces`).
- The CPU device has no host part (one memory); the host budget is checked and said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from memfit import step
from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.step.offload import FORWARD_STASH, MIN_OFFLOAD_BYTES

pytest.importorskip("trl")  # the CUDA target's rules are TRL's where TRL is installed
# each test traces a model (seconds) or runs a real step: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

BATCH, SEQ = 2, 128  # every offloaded tensor a power of two bytes: no pinned rounding to undo


def _config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("llama4-offload")
    _config(4).save_pretrained(folder)
    return str(folder)


def _saved_on_real_tensors(
    config: Any, checkpointing: bool
) -> tuple[list[tuple[tuple[int, ...], int]], list[tuple[tuple[int, ...], int]]]:
    """The saves of one real CPU step that TRL would offload and those it would keep, each
    (shape, bytes), by TRL's rules applied independently of memfit's emulation."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    # eager attention: the same ops on the CPU as on a CUDA target (SDPA's kernels save
    # differently on each; with checkpointing it does not matter, the layers' saves stay inside)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    in_head = [0]
    model.lm_head.register_forward_pre_hook(lambda *a: in_head.__setitem__(0, in_head[0] + 1))
    model.lm_head.register_forward_hook(
        lambda *a: in_head.__setitem__(0, in_head[0] - 1), always_call=True
    )
    offloaded: list[tuple[tuple[int, ...], int]] = []
    kept: list[tuple[tuple[int, ...], int]] = []
    # (pack number, storage key) of the offloaded saves: TRL keeps a storage saved again while
    # its copy is in flight (the last FORWARD_STASH saves), and from then on
    recent: list[tuple[int, tuple[int, torch.dtype]]] = []
    tracked: set[tuple[int, torch.dtype]] = set()
    count = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        size = tensor.numel() * tensor.element_size()
        key = (tensor.untyped_storage().data_ptr() + tensor.storage_offset(), tensor.dtype)
        in_flight = key in tracked or any(
            k == key and count[0] - n < FORWARD_STASH for n, k in recent
        )
        if (
            in_head[0]
            or size < MIN_OFFLOAD_BYTES
            or isinstance(tensor, torch.nn.Parameter)
            or tensor.untyped_storage().data_ptr() in params
            or in_flight
        ):
            kept.append((tuple(tensor.shape), size))
            if in_flight:
                tracked.add(key)
        else:
            offloaded.append((tuple(tensor.shape), size))
            recent.append((count[0], key))
        return tensor

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with saved_tensors_hooks(pack, lambda t: t):
        loss = step.causal_lm_loss(model, ids, torch.ones_like(ids), ids, units=BATCH * SEQ)
        forward_saves = len(offloaded) + len(kept)
        loss.backward()
    assert len(offloaded) + len(kept) == forward_saves  # the backward saved nothing through them
    return offloaded, kept


def _estimate(model: str, **knobs: Any) -> Any:
    settings: dict[str, Any] = dict(
        task="causal-lm",
        batch_size=BATCH,
        seq_len=SEQ,
        device="cuda",
        precision="fp32",
        attn_implementation="eager",
        trace_depth="full",
    )
    return estimate(model, **(settings | knobs))


def test_checkpointing_offloads_each_layers_input_and_what_the_step_saves_outside_the_layers() -> (
    None
):
    config = _config(4)
    offloaded, kept = _saved_on_real_tensors(config, checkpointing=True)
    saves = [shape for shape, _ in offloaded + kept]
    hidden = (BATCH, SEQ, config.hidden_size)
    # the layers' own saves (attention, MLP, norms) never reach the hooks: the checkpoint's own
    # hooks take them, and the recomputation's saves go to the checkpoint too
    # each layer's input, and the final RMSNorm's three saves of that shape (outside the layers)
    assert saves.count(hidden) == config.num_hidden_layers + 3
    assert (BATCH, SEQ, config.intermediate_size) not in saves
    # without checkpointing every layer saves many more
    offloaded_all, kept_all = _saved_on_real_tensors(config, checkpointing=False)
    assert len(offloaded_all) + len(kept_all) > 5 * len(saves)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_host_bytes_are_what_trl_would_offload_counted_on_real_tensors(
    llama4: str, checkpointing: bool
) -> None:
    offloaded, _ = _saved_on_real_tensors(_config(4), checkpointing)
    est = _estimate(llama4, gradient_checkpointing=checkpointing, activation_offloading=True)
    host = est.details["host"]
    # every copy is alive on the host when the forward ends (none comes back before backward)
    assert host["parts"] == {"activations": sum(size for _, size in offloaded)}
    assert host["total_bytes"] == host["parts"]["activations"]
    assert host["activation_offloading"] == "trl"
    assert host["fits"] is True and host["budget_bytes"] > 0


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_gpu_holds_less_by_no_more_than_what_went_to_the_host(
    llama4: str, checkpointing: bool
) -> None:
    kept = _estimate(llama4, gradient_checkpointing=checkpointing)
    moved = _estimate(llama4, gradient_checkpointing=checkpointing, activation_offloading=True)
    assert "host" not in kept.details
    host = moved.details["host"]["total_bytes"]
    before = kept.details["phase_peak_bytes"]["forward"]
    after = moved.details["phase_peak_bytes"]["forward"]
    # the forward's peak drops by the offloaded bytes less those still on the GPU then (the
    # copies in flight: the last FORWARD_STASH saves; the head's input): never by more. With
    # checkpointing four layers save too little for the stash to let go of much
    assert 0 <= before - after <= host
    assert moved.total_bytes <= kept.total_bytes
    if not checkpointing:
        assert before - after > host / 3
        # at the peak most saved activations are off the GPU (what stays: small saves, the stash,
        # and in the backward the tensors brought back for the nodes running)
        assert moved.breakdown["activations"] < kept.breakdown["activations"] / 2


def test_a_host_budget_too_small_is_said_and_a_bad_one_refused(llama4: str) -> None:
    est = _estimate(
        llama4, gradient_checkpointing=True, activation_offloading=True, host_memory="64KiB"
    )
    assert est.details["host"]["budget_bytes"] == 64 * 1024
    assert est.details["host"]["fits"] is False
    # the estimate's fits includes the host's budget (no GPU budget was given: None otherwise)
    assert est.fits is False and est.budget_bytes is None
    roomy = _estimate(
        llama4, gradient_checkpointing=True, activation_offloading=True, host_memory="64GiB"
    )
    assert roomy.fits is None and roomy.details["host"]["fits"] is True
    with pytest.raises(UsageError, match="--host-memory"):
        _estimate(llama4, activation_offloading=True, host_memory="lots")


def test_a_cuda_estimate_follows_trls_rules_without_trl_installed(
    llama4: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memfit train runs TRL's context on CUDA (and refuses to run without it), so the estimate
    of a CUDA step is TRL's on a machine without TRL too: the same host bytes, said "trl"."""
    from memfit.step import offload

    with_trl = _estimate(llama4, gradient_checkpointing=True, activation_offloading=True)
    monkeypatch.setattr(offload, "trl_available", lambda: False)
    without = _estimate(llama4, gradient_checkpointing=True, activation_offloading=True)
    assert without.details["host"] == with_trl.details["host"]
    assert without.details["host"]["activation_offloading"] == "trl"


def test_an_evaluation_with_offloading_is_refused_naming_the_flag(llama4: str) -> None:
    with pytest.raises(UsageError, match=r"--activation-offloading: an evaluation \(--mode eval\)"):
        _estimate(llama4, activation_offloading=True, mode="eval")


def test_the_cpu_device_has_no_host_part(llama4: str) -> None:
    # host and device are one memory: the copies are the step's own
    est = _estimate(llama4, device="cpu", gradient_checkpointing=True, activation_offloading=True)
    assert "host" not in est.details


def test_depth_extrapolation_gives_the_full_depth_host_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "llama12"
    _config(12).save_pretrained(folder)
    for checkpointing in (True, False):
        knobs = dict(gradient_checkpointing=checkpointing, activation_offloading=True)
        full = _estimate(str(folder), **knobs)
        auto = _estimate(str(folder), trace_depth="auto", **knobs)
        assert auto.details["trace_depth"]["mode"] == "extrapolated"
        assert auto.details["host"] == full.details["host"]
        assert auto.total_bytes == full.total_bytes
        assert auto.details["phase_peak_bytes"] == full.details["phase_peak_bytes"]
