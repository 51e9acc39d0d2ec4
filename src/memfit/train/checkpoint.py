"""Checkpoints of a run: written whole or not at all, read back to the exact sample.

``DIR/checkpoints/step-N/`` holds the weights (safetensors), the optimizer and scheduler state, the
RNG states, the sampler position and the guard's micro-batch. It is written into a hidden temporary
folder beside it and renamed into place, so a kill at any moment leaves either the old set of
checkpoints or the new one, never a half-written folder. The last file written before the rename
is ``manifest.json``: every other file's size and SHA-256. A resume verifies it and falls back past
a checkpoint that does not match (a disk that lost or cut a file after the rename, a hand edit).
Only files this run wrote are read back (``torch.load(weights_only=True)``: no unpickling of
arbitrary objects).

A QLoRA run's weights file holds only what it trains (the adapters, a classifier's head; marked
in the file's metadata): the quantized base is never written, a resume loads it from ``--model``
again (:mod:`memfit.train.quantization`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from memfit.train.quantization import holds_quantized_weights, load_trained_state, trained_state
from memfit.train.runfolder import removed_on_failure

STATE_FILE = "trainer_state.json"
# the weights file's metadata key saying what it holds, and its value for "the trained
# parameters only" (a QLoRA run's checkpoint)
WEIGHTS_KIND = "memfit_weights"
TRAINED_ONLY = "trained"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict[str, Any]:
    """Every random generator a step draws from, as JSON-able data."""
    numpy_state: Any = np.random.get_state()
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": _to_json(random.getstate()),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    return value


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value


def write_checkpoint(
    folder: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    state: dict[str, Any],
    keep: int | None = None,
    ranks: Any = None,
    sharded: Any = None,
) -> Path:
    """Write ``folder/step-N`` atomically; keep the newest ``keep`` checkpoints (None: all).

    With several ranks every rank calls it: rank 0 writes the files, the others hand it their
    random generators' state; under FSDP every rank first helps gather the whole model's
    weights and optimizer state (a collective). The files are the same either way, so a
    checkpoint resumes on any number of ranks.
    """
    # the whole model's weights and optimizer state, gathered from the shards (all ranks)
    weights = sharded.full_state_dict() if sharded is not None else None
    optimizer_state = sharded.full_optimizer_state(optimizer) if sharded is not None else None
    rngs = ranks.gather_object(rng_state()) if ranks is not None else None
    final = folder / f"step-{step}"
    if ranks is None or ranks.is_main:
        _write(
            folder,
            step,
            model=model,
            optimizer_state=optimizer_state
            if optimizer_state is not None
            else optimizer.state_dict(),
            weights=weights,
            scheduler=scheduler,
            scaler=scaler,
            state={**state, "world_size": ranks.world_size if ranks is not None else 1}
            | ({"rng_ranks": rngs} if rngs is not None else {}),
            keep=keep,
        )
    if ranks is not None:
        # nobody goes on (or exits) before the checkpoint is whole
        ranks.barrier()
    return final


def _write(
    folder: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer_state: dict[str, Any],
    weights: dict[str, torch.Tensor] | None,
    scheduler: Any,
    scaler: Any,
    state: dict[str, Any],
    keep: int | None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step}"
    tmp = folder / f".tmp-step-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with removed_on_failure(tmp):
        if weights is not None:
            save_file(_unshared(weights), str(tmp / "model.safetensors"))
        elif holds_quantized_weights(model):
            # QLoRA: the trained parameters only; the frozen base is reloaded from --model
            save_file(
                _unshared(trained_state(model)),
                str(tmp / "model.safetensors"),
                metadata={WEIGHTS_KIND: TRAINED_ONLY},
            )
        else:
            save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        text = json.dumps({**state, "step": step, "rng": rng_state()})
        (tmp / STATE_FILE).write_text(text, encoding="utf-8")
        _fsync_tree(tmp)
        # last: what the files must be, so a resume can tell a whole checkpoint from a damaged one
        manifest = {"files": {p.name: _describe_file(p) for p in sorted(tmp.iterdir())}}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():  # a re-run of the same step (after a resume): replace it whole
            old = folder / f".old-step-{step}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    if keep is not None:
        for old_step in completed_steps(folder)[:-keep]:
            shutil.rmtree(folder / f"step-{old_step}", ignore_errors=True)


def _load_weights(model: nn.Module, file: Path, device: torch.device) -> None:
    """A checkpoint's weights into ``model``: the whole model, or a QLoRA run's trained
    parameters (then the rest of the model is the base as loaded)."""
    with safe_open(str(file), framework="pt") as handle:
        kind = (handle.metadata() or {}).get(WEIGHTS_KIND)
    if kind == TRAINED_ONLY:
        load_trained_state(model, load_file(str(file), device=str(device)))
    else:
        load_model(model, str(file), device=str(device))


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights (GPT-2's lm_head and wte) share one storage, which safetensors refuses:
    the later names get a copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if key in seen else tensor.contiguous()
        seen.add(key)
    return out


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _describe_file(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def verify(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be trusted, or None when it is whole.

    Checks the manifest's files, sizes and checksums. A checkpoint of a memfit version that wrote
    no manifest is checked for its files only (its loading is the rest of the check).
    """
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        missing = [
            name for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", STATE_FILE)
            if not (path / name).is_file()
        ]  # fmt: skip
        return f"{', '.join(missing)} missing" if missing else None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_FILE} unreadable"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} missing"
        try:
            size = file.stat().st_size
            if size != want.get("bytes"):
                return f"{name} has {size} bytes, {want.get('bytes')} were written"
            if _describe_file(file)["sha256"] != want.get("sha256"):
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name} unreadable ({exc.strerror or exc})"
    return None


def model_signature(model: nn.Module, name: str) -> dict[str, Any]:
    """What a checkpoint's weights must fit, recorded in it (``model`` in its trainer state): the
    model's class and a digest of its parameters' names, shapes and whether each is trained (the
    optimizer state follows them). Taken before any sharding (the same on any number of ranks);
    dtypes are left out (a resume may change --precision). ``name``: the --model it was loaded
    from, to name it in a refusal."""
    digest = hashlib.sha256()
    count = 0
    for key, param in model.named_parameters():
        digest.update(f"{key}:{tuple(param.shape)}:{int(param.requires_grad)};".encode())
        count += 1
    return {
        "name": name,
        "class": type(model).__name__,
        "parameters": count,
        "digest": digest.hexdigest()[:32],
    }


def state_problem(
    state: Any, number: int, rows: int | None = None, per_step: int | None = None
) -> str | None:
    """Why the trainer state of checkpoint ``step-{number}`` is not one memfit wrote, or None.

    Its counts must be counts and agree with each other: the step with the folder's name, and
    (given the run's ``rows`` and rows per step, which a resume has checked are the checkpoint's)
    the position within the epoch, the samples seen and the step with the epoch and position. A
    state that verifies against its manifest and still fails was edited after it was written.
    """
    if not isinstance(state, dict):
        return f"{STATE_FILE} is not a JSON object"
    counts = {}
    for key in ("step", "epoch", "position", "samples_seen"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{STATE_FILE}: {key} is {value!r}, not a count"
        counts[key] = value
    step, epoch, position = counts["step"], counts["epoch"], counts["position"]
    if step != number:
        return f"{STATE_FILE}: step {step} in the checkpoint of step {number}"
    best = state.get("best")
    if best is not None and (isinstance(best, bool) or not isinstance(best, int | float)):
        # NaN or inf is a metric memfit wrote (before it passed over an eval that was not
        # finite): no best yet (:func:`saved_best`), not damage
        return f"{STATE_FILE}: best is {best!r}, not a metric"
    if rows is None or per_step is None or rows <= 0 or per_step <= 0:
        return None
    # each step takes the next per_step rows of its epoch's order (the last one what is left);
    # an epoch ends at position == rows
    if position > rows:
        return f"{STATE_FILE}: position {position} is past the {rows} training rows"
    if counts["samples_seen"] != epoch * rows + position:
        return (
            f"{STATE_FILE}: samples_seen {counts['samples_seen']} is not {epoch} epochs of "
            f"{rows} rows and {position}"
        )
    if step != epoch * math.ceil(rows / per_step) + math.ceil(position / per_step):
        return f"{STATE_FILE}: step {step} is not where epoch {epoch}, position {position} is"
    return None


def saved_best(state: dict[str, Any]) -> float | None:
    """The best eval metric a checkpoint recorded, or None: none yet, or one that is not finite
    (an older memfit kept a first eval's NaN as the best, which no later eval could beat)."""
    best = state.get("best")
    if isinstance(best, bool) or not isinstance(best, int | float) or not math.isfinite(best):
        return None
    return float(best)


def weights_problem(path: Path) -> str | None:
    """Why the weights of checkpoint ``path`` cannot be trained on, or None: a tensor that holds
    NaN or inf (the next step's loss would be NaN, whatever --lr). Read one tensor at a time,
    each told by :func:`finite` (no copy of it)."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            if not finite(handle.get_tensor(name)):
                return f"its weights are not finite (NaN or inf in {name})"
    return None


def finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite, told by its smallest and largest (NaN is
    both): two scalars, never a copy of the tensor (a checkpoint under a tight --memory-cap, the
    stop when even micro-batch 1 does not fit, a resume's check of a large model allocate
    nothing here). Integers always are; an empty tensor holds nothing that is not."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except RuntimeError:  # a dtype aminmax does not take here
        try:
            return bool(torch.isfinite(tensor).all())
        except (RuntimeError, TypeError):  # nor isfinite (float8): it cannot be told
            return True
    return math.isfinite(float(low)) and math.isfinite(float(high))


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer state (step, position, the settings of the run that wrote it)."""
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    return state


def completed_steps(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in ``folder``, oldest first (temporaries ignored)."""
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def set_aside(path: Path, why: str = "damaged") -> Path:
    """Move a damaged checkpoint (or one no resume may take) out of the ones a resume (or
    ``keep``) counts: it would be taken as the newest and push good ones out. Kept as
    ``.damaged-step-N`` (``why``: ``.not-finite-step-N``) to look at."""
    aside = path.with_name(f".{why}-{path.name}")
    if aside.exists():
        aside = path.with_name(f".{why}-{path.name}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        return path  # a read-only folder: the resume still passes over it
    return aside


def clean_temporaries(folder: Path) -> None:
    """Remove what a killed run left half-written (hidden ``.tmp-``/``.old-`` folders).

    A kill between the two renames that replace a step's checkpoint leaves the old one only as
    ``.old-step-N-PID``: it is put back, not removed.
    """
    if folder.is_dir():
        for child in sorted(folder.iterdir()):
            old = re.match(r"^\.old-step-(\d+)-\d+$", child.name)
            final = folder / f"step-{old.group(1)}" if old else None
            if final is not None and not final.exists():
                os.rename(child, final)
            elif child.name.startswith((".tmp-step-", ".old-step-")):
                shutil.rmtree(child, ignore_errors=True)


def read_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    sharded: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint into the run's objects; returns its trainer state (RNG already set).

    Every rank reads the same files. A rank's own random generators come back when the run had
    as many ranks; otherwise the ranks keep the seeds they started with.
    """
    if sharded is not None:
        # whole-model files, loaded into this rank's shards
        sharded.load(
            load_file(str(path / "model.safetensors")),
            optimizer,
            torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True),
        )
    else:
        _load_weights(model, path / "model.safetensors", device)
        optimizer.load_state_dict(
            torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
        )
        # torchao's CPUOffloadOptimizer (--optimizer-offload cpu on CUDA) steps host copies of
        # the weights, taken when it was built: they get the loaded weights, or its first step
        # writes the old ones back (memfit.train.optim._resynced)
        sync = getattr(optimizer, "sync_host_weights", None)
        if sync is not None:
            sync()
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if scaler is not None and (path / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    rngs = state.get("rng_ranks")
    if rngs is not None and len(rngs) == world_size:
        set_rng_state(rngs[rank])
    elif world_size == 1 or rank == 0:
        set_rng_state(state["rng"])
    return state
