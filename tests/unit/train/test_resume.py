"""What a resume tells apart: a checkpoint written for another model (a refusal naming --model)
from a damaged one (passed over)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.train import checkpoint as ck
from memfit.train.resume import misfit, other_model


def _load_error(action: object) -> BaseException:
    with pytest.raises((RuntimeError, ValueError)) as failed:
        action()  # type: ignore[operator]
    return failed.value


def test_torch_loading_errors_of_another_model_are_misfits() -> None:
    small, wide = nn.Linear(4, 2), nn.Linear(4, 3)
    size = _load_error(lambda: wide.load_state_dict(small.state_dict()))
    assert "size mismatch for weight" in (misfit(size) or "")
    deeper = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 2))
    missing = _load_error(
        lambda: deeper.load_state_dict(nn.Sequential(nn.Linear(4, 2)).state_dict())
    )
    assert "Missing key(s)" in (misfit(missing) or "")
    one = torch.optim.SGD(small.parameters(), lr=0.1)
    two = torch.optim.SGD(deeper.parameters(), lr=0.1)
    groups = _load_error(lambda: one.load_state_dict(two.state_dict()))
    assert misfit(groups) is not None
    # a damaged file is not a misfit
    assert misfit(RuntimeError("PytorchStreamReader failed reading zip archive")) is None
    assert misfit(ValueError("Expecting value: line 1 column 1")) is None


def test_another_recorded_model_is_described() -> None:
    a = ck.model_signature(nn.Sequential(nn.Linear(4, 8)), "a")
    b = ck.model_signature(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), "b")
    assert other_model(a, a) is None
    assert other_model(None, a) is None  # a checkpoint of a memfit that recorded none
    assert other_model(b, a) == (
        "it was written for a Sequential of 4 parameter tensors, --model a is a Sequential of 2"
    )
    c = ck.model_signature(nn.Sequential(nn.Linear(4, 9)), "c")
    assert other_model(c, a) == (
        "it was written for a Sequential of 2 parameter tensors of other names or shapes"
    )


# --- a finished run's --model spelled otherwise -----------------------------------------------------
def _finished(folder, model: str, *, path=None, signature=None) -> None:
    """A finished run's folder as memfit leaves it (run.json's config, result; model/)."""
    import json

    folder.mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "model" / "model.safetensors").write_bytes(b"weights")
    resolved = {"model_path": path, "model_signature": signature} if path or signature else {}
    (folder / "run.json").write_text(
        json.dumps(
            {
                "config": {"model": model, "epochs": 1, "max_steps": None, "seed": 0},
                "resolved": resolved,
                "result": {"stopped": "done", "steps": 8, "samples_seen": 32},
            }
        )
    )


def _cfg(out, model: str):
    from memfit.train.config import TrainConfig

    return TrainConfig(
        task="classification", model=model, train_file="t.csv", output_dir=str(out),
        resume=True, epochs=1, seed=0, quiet=True,
    )  # fmt: skip


def test_a_finished_run_resumed_from_another_folder_by_another_path_is_finished(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started as ``--model ./base`` in proj/, resumed from its parent as ``proj/base``: the
    same folder (the absolute path recorded at the start), not "another model"."""
    from memfit.train.resume import finished_model, finished_run, same_model

    (tmp_path / "proj" / "base").mkdir(parents=True)
    out = tmp_path / "proj" / "run"
    _finished(out, "./base", path=str(tmp_path / "proj" / "base"))
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(out, "proj/base")
    assert finished_run(cfg) == {"stopped": "done", "steps": 8, "samples_seen": 32}
    assert finished_model(cfg) is None  # nothing to load to tell
    # the same text from another folder where ./base is another folder: not surely the same
    (tmp_path / "base").mkdir()
    assert not same_model("./base", "./base", str(tmp_path / "proj" / "base"))
    assert same_model("./base", "proj/base", str(tmp_path / "proj" / "base"))


def test_a_finished_run_resumed_with_its_local_copy_is_told_by_the_signature(tmp_path) -> None:
    """Started with a Hub id, resumed with its local snapshot: the spelling cannot tell, the
    signature recorded in run.json does once --model is loaded; another model is refused."""
    from memfit.errors import UsageError
    from memfit.train.resume import finished_model, finished_run, refuse_another_finished

    model = nn.Sequential(nn.Linear(4, 8))
    saved = ck.model_signature(model, "org/tiny")
    out = tmp_path / "run"
    _finished(out, "org/tiny", signature=saved)
    cfg = _cfg(out, str(tmp_path / "snapshots" / "abc"))
    assert finished_run(cfg) is not None
    assert finished_model(cfg) == saved
    refuse_another_finished(cfg, saved, ck.model_signature(model, cfg.model))  # the same: quiet
    other = ck.model_signature(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), cfg.model)
    with pytest.raises(UsageError) as refused:
        refuse_another_finished(cfg, saved, other)
    assert str(refused.value).startswith(
        f"--resume: the run in {out} finished training --model org/tiny, not --model {cfg.model}"
        " (it was written for a Sequential of 2 parameter tensors, --model"
    )


def test_a_finished_run_that_recorded_no_signature_says_it_cannot_tell(tmp_path) -> None:
    from memfit.errors import UsageError
    from memfit.train.resume import finished_run

    out = tmp_path / "run"
    _finished(out, "org/tiny")
    with pytest.raises(UsageError) as refused:
        finished_run(_cfg(out, "/models/tiny"))
    said = str(refused.value)
    assert "whether --model /models/tiny is the same model memfit cannot tell" in said
    assert "Resume with --model org/tiny" in said and "another model" not in said
    assert finished_run(_cfg(out, "org/tiny")) is not None  # as it was started


# --- out of memory outside a step --------------------------------------------------------------------
def test_an_oom_outside_a_step_says_where_and_only_cures_not_in_use(tmp_path) -> None:
    import dataclasses

    from memfit.train.run import _oom_message

    cfg = _cfg(tmp_path / "run", "m")
    ram = _oom_message(cfg, MemoryError(), {"now": "reading the data"})
    assert ram == (
        "out of memory outside a training step (MemoryError), while reading the data: the "
        "machine's memory (RAM) ran out; give it more memory"
    )
    device = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    between = _oom_message(cfg, device, {"now": "ordering the data"})
    assert between.endswith(
        "while ordering the data: the device's memory ran out; give it more memory or hold less "
        "(--lora-rank 8, --optimizer adafactor)"
    )
    # the cures in use already are not offered again
    lean = dataclasses.replace(cfg, lora_rank=8, optimizer="adafactor")
    assert _oom_message(lean, device, {"now": "ordering the data"}).endswith(
        "the device's memory ran out; give it more memory"
    )
    capped = dataclasses.replace(cfg, lora_rank=8, memory_cap=1 << 20)
    assert _oom_message(capped, device, {"now": "writing the model", "capped": "yes"}).endswith(
        "while writing the model: it does not fit under --memory-cap; give it a larger "
        "--memory-cap or hold less (--optimizer adafactor)"
    )
    assert "--lora-rank" not in _oom_message(cfg, device, {"now": "loading the model"})
    # before --memory-cap counts, the device's own memory ran out
    assert "the device's memory ran out" in _oom_message(
        capped, device, {"now": "building the optimizer"}
    )
