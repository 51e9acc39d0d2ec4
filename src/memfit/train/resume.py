"""``memfit train --resume``: which checkpoint to go on from, and whether it may.

A resume must find each step holding the samples it held before: the settings that decide them
(:data:`STEP_FLAGS`, the rows and their lengths) are recorded in each checkpoint and in run.json,
and a resume with other ones is refused. So is one whose weights do not fit --model (each
checkpoint records its model's signature; an older one's loading says it): another model is a
setting of the resume, never a damaged checkpoint. A --model spelled otherwise (another path to
the folder, a Hub id for its local copy) is the same model when its signature is. The newest checkpoint that verifies, holds
counts memfit writes and finite weights, and loads is taken; a damaged one is set aside. A
finished run has nothing to resume (unless it is asked to train longer, or its model/ is gone).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.guard import is_oom
from memfit.levers.packing import DEFAULT_PACKING_STRATEGY, packing_strategy
from memfit.train import checkpoint as ck
from memfit.train import runfolder
from memfit.train.config import TrainConfig
from memfit.train.console import say

# what decides which samples each step holds, and the flag that sets it
STEP_FLAGS = {
    "effective_batch_size": "--effective-batch-size",
    "seed": "--seed",
    "group_by_length": "--group-by-length",
    "packing": "--packing",
    "packing_strategy": "--packing-strategy",
    "max_seq_len": "--max-seq-len",
}


def _saved_strategy(saved: dict[str, Any]) -> str | None:
    """The packing strategy of recorded settings (a checkpoint's, run.json's config): a record
    without one that packs is of a memfit before --packing-strategy (``wrapped`` blocks)."""
    if not saved.get("packing"):
        return None
    if "packing_strategy" not in saved:
        return "wrapped"
    return saved["packing_strategy"] or DEFAULT_PACKING_STRATEGY


def finished_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """With --resume, the result of a run that finished in the folder with these settings and
    length (nothing to redo), else None. Other settings that decide the steps are refused. A
    --model spelled otherwise than the run's (another path to its folder, a Hub id for its local
    copy) is told by the model's signature once it is loaded (:func:`finished_model`,
    :func:`refuse_another_finished`); without a recorded signature it is refused, saying that.
    A finished run whose model/ is gone is None too: it goes on from its newest checkpoint and
    writes it."""
    out = Path(cfg.output_dir)
    done = runfolder.finished(out) if cfg.resume else None
    if done is None:
        return None
    changed = changed_settings(runfolder.run_config(out), step_settings(cfg))
    if changed:
        raise UsageError(
            f"--resume: the run in {cfg.output_dir} finished with other settings that decide "
            f"which samples each step holds: {'; '.join(changed)}. Start a new run in "
            "another folder (--model on its model/ to train it further)"
        )
    saved_model = (runfolder.run_config(out) or {}).get("model")
    if _model_to_check(cfg, out) and recorded_model(out) is None:
        # a run of a memfit that recorded no signature, and no checkpoint that does: the two
        # spellings may name one model or two, and a finished run is not loaded to find out
        raise UsageError(
            f"--resume: the run in {cfg.output_dir} finished training --model {saved_model}; "
            f"whether --model {cfg.model} is the same model memfit cannot tell (the run "
            "recorded no signature of its model). Resume with --model "
            f"{saved_model}, as the run was started, or start a new run in another folder"
        )
    if _longer(runfolder.run_config(out), cfg):
        return None  # more epochs or steps: train on from the newest checkpoint
    if not runfolder.model_present(out):
        # its model/ was removed: the run goes on from its newest checkpoint and writes it again
        _say_republish(cfg, out, int(done.get("steps", 0)))
        return None
    return done


def _model_to_check(cfg: TrainConfig, out: Path) -> bool:
    """Whether the finished run in ``out`` was started with a --model that this one may not be:
    spelled otherwise, and not the same folder. A longer run that goes on from checkpoints is
    not: each checkpoint's recorded model is checked against --model's when it is loaded."""
    config = runfolder.run_config(out) or {}
    saved = config.get("model")
    if not isinstance(saved, str) or same_model(saved, cfg.model, _recorded_path(out)):
        return False
    return not (_longer(config, cfg) and ck.completed_steps(out / "checkpoints"))


def finished_model(cfg: TrainConfig) -> dict[str, Any] | None:
    """With --resume of a finished run started with a --model spelled otherwise (another path
    to its folder, a Hub id for its local copy): the model signature it recorded, which
    --model's must equal once loaded (:func:`refuse_another_finished`). None: nothing to check
    (no finished run, or the same --model)."""
    out = Path(cfg.output_dir)
    if not cfg.resume or not _model_to_check(cfg, out):
        return None
    return recorded_model(out) if runfolder.finished(out) is not None else None


def recorded_model(out: Path) -> dict[str, Any] | None:
    """The signature of the model the run in ``out`` trained (:func:`memfit.train.checkpoint.
    model_signature`): run.json's, else its newest checkpoint's that records one, else None (a
    run of a memfit that recorded none)."""
    try:
        run = json.loads((out / "run.json").read_text(encoding="utf-8"))
        saved = run["resolved"]["model_signature"]
        if isinstance(saved, dict) and isinstance(saved.get("digest"), str):
            return saved
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for number in reversed(ck.completed_steps(out / "checkpoints")):
        try:
            saved = ck.read_state(out / "checkpoints" / f"step-{number}").get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(saved, dict) and isinstance(saved.get("digest"), str):
            return saved
    return None


def refuse_another_finished(cfg: TrainConfig, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A UsageError if --model (its signature ``now``, loaded) is not the model the finished run
    in the folder trained (``saved``): a finished run is not loaded (to go on from its
    checkpoints is the longer run's way), so its model/ is the other model's."""
    detail = other_model(saved, now)
    if detail is None:
        return
    out = Path(cfg.output_dir)
    started = (runfolder.run_config(out) or {}).get("model") or saved.get("name")
    fix = (
        "To train its model further, start a new run in another folder with --model "
        f"{out / 'model'}"
        if runfolder.model_present(out)
        else f"Its model/ is missing: resume with --model {started} to write it again"
    )
    raise UsageError(
        f"--resume: the run in {cfg.output_dir} finished training --model {started}, not "
        f"--model {cfg.model} ({detail}): there is nothing of it to resume with another model. "
        f"{fix}"
    )


def _recorded_path(out: Path) -> str | None:
    """The absolute path of the --model folder the run in ``out`` was started with (run.json),
    or None (a Hub id, or a run of a memfit that recorded none)."""
    try:
        run = json.loads((out / "run.json").read_text(encoding="utf-8"))
        path = run["resolved"]["model_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if isinstance(path, str) else None


def same_model(saved: str, now: str, recorded_path: str | None = None) -> bool:
    """Whether --model ``now`` surely names the model the run was started with, ``saved``: the
    folder whose absolute path the run recorded at its start (the same text from another
    folder may be another model), else the same text, or the same folder by another path."""
    if recorded_path is not None and os.path.exists(now):
        try:
            return os.path.samefile(recorded_path, now)
        except OSError:  # the recorded folder is gone: the signature tells
            return False
    if saved == now:
        return True
    try:
        return os.path.exists(saved) and os.path.samefile(saved, now)
    except OSError:
        return False


def _say_republish(cfg: TrainConfig, out: Path, steps: int) -> None:
    """The line for a finished run whose model/ is gone: what --resume does to write it again."""
    if cfg.quiet:
        return
    saved = ck.completed_steps(out / "checkpoints")
    if saved and saved[-1] == steps:
        how = f"it is written again from {out / 'checkpoints' / f'step-{steps}'}"
    elif saved:
        how = (
            f"its newest checkpoint is {out / 'checkpoints' / f'step-{saved[-1]}'}: the steps "
            "after it are trained again to write it"
        )
    else:
        how = "no checkpoint holds its weights: it is trained again from the start"
    say(f"memfit: the run in {out} finished ({steps} steps) but {out / 'model'} is missing; {how}")


def step_settings(
    cfg: TrainConfig, rows: int | None = None, lengths: Sequence[int] | None = None
) -> dict[str, Any]:
    """The settings a checkpoint records so that a resume can check them: the flags that decide
    which samples each step holds, the number of training rows and a digest of their lengths in
    tokens (a changed file almost always changes one)."""
    digest = (
        hashlib.sha256(array.array("q", lengths).tobytes()).hexdigest()[:16]
        if lengths is not None
        else None
    )
    return {
        **{key: getattr(cfg, key) for key in STEP_FLAGS},
        "packing": bool(cfg.packing),
        "packing_strategy": packing_strategy(cfg),
        "train_rows": rows,
        "train_lengths": digest,
    }


def _longer(saved: Any, cfg: TrainConfig) -> bool:
    """Whether this run asks for another length than the finished run in the folder had (its
    epochs or steps): then it trains on from the newest checkpoint."""
    if not isinstance(saved, dict):
        return False
    return (saved.get("epochs"), saved.get("max_steps")) != (cfg.epochs, cfg.max_steps)


def changed_settings(saved: Any, now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's settings and this run's, one phrase each (none for a
    checkpoint of a memfit version that recorded no settings)."""
    if not isinstance(saved, dict):
        return []
    if "packing" in saved:
        saved = {**saved, "packing_strategy": _saved_strategy(saved)}
    changed = [
        f"{flag} {saved[key]} then, {now[key]} now"
        for key, flag in STEP_FLAGS.items()
        if key in saved and saved[key] != now[key]
    ]
    if now["train_rows"] is None:
        pass  # a run's config (before its data is read): the flags only
    elif saved.get("train_rows") is not None and saved["train_rows"] != now["train_rows"]:
        changed.append(f"--train-file {saved['train_rows']} rows then, {now['train_rows']} now")
    elif saved.get("train_lengths") is not None and saved["train_lengths"] != now["train_lengths"]:
        changed.append("--train-file: its rows are not the ones trained on (their lengths differ)")
    return changed


def refuse_changed(path: Path, saved: Any, now: dict[str, Any]) -> None:
    """A UsageError if the checkpoint at ``path`` was written with other step settings."""
    changed = changed_settings(saved, now)
    if changed:
        raise UsageError(
            f"--resume: {path} was written by a run with other settings that decide which "
            f"samples each step holds: {'; '.join(changed)}. Resume with the run's settings, "
            "or start a new run in another folder"
        )


def pick_checkpoint(
    folder: Path,
    load: Callable[[Path], dict[str, Any]] | None,
    skip: Callable[[Path, str], None],
    check: Callable[[Path, dict[str, Any]], str | None] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, passes ``check`` (its state and weights: what is
    wrong with them, or None) and loads (with ``load``): its path and state.

    Each one passed over is handed to ``skip`` with the reason. A refused resume (UsageError:
    changed settings, another model) and an out-of-memory error are not a damaged checkpoint:
    they propagate.
    """
    for number in reversed(ck.completed_steps(folder)):
        path = folder / f"step-{number}"
        problem = ck.verify(path)
        if problem is None:
            try:
                state = ck.read_state(path)
                problem = check(path, state) if check is not None else None
                if problem is None:
                    return path, (load(path) if load is not None else state)
            except UsageError:
                raise
            except Exception as exc:
                if is_oom(exc):
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                problem = f"unreadable ({type(exc).__name__}{': ' + first[:200] if first else ''})"
        skip(path, problem)
    return None


def other_model(saved: Any, now: dict[str, Any]) -> str | None:
    """How the model a checkpoint's weights were written for (its recorded signature,
    :func:`memfit.train.checkpoint.model_signature`) differs from this run's, or None (the same,
    or a checkpoint of a memfit version that recorded none)."""
    if not isinstance(saved, dict) or saved.get("digest") in (None, now["digest"]):
        return None

    then = (saved.get("class"), saved.get("parameters"))
    written = f"it was written for a {then[0]} of {then[1]} parameter tensors"
    if then == (now["class"], now["parameters"]):
        return f"{written} of other names or shapes"
    return f"{written}, --model {now['name']} is a {now['class']} of {now['parameters']}"


# how torch, safetensors and memfit's QLoRA loader say that weights or an optimizer state were
# written for other parameters (not a damaged file: a file that verifies and does not fit)
_MISFIT = re.compile(
    r"Error\(s\) in loading state_dict|size mismatch for|Missing key\(s\)|Unexpected key\(s\)"
    r"|doesn't match the size of optimizer's group|different number of parameter groups"
    r"|trained parameters are not this run's"
)


def misfit(exc: BaseException) -> str | None:
    """The line of a load error that says the checkpoint was written for another model, or None
    (then the error is the file's: a damaged checkpoint)."""
    if not isinstance(exc, RuntimeError | ValueError) or not _MISFIT.search(str(exc)):
        return None
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    detail = next((x for x in lines[1:] if _MISFIT.search(x)), lines[0])
    return detail if len(detail) <= 200 else detail[:199] + "…"


def refuse_other_model(path: Path, cfg: TrainConfig, saved: Any, detail: str) -> UsageError:
    """The refusal of a checkpoint whose weights do not fit this run's model: a setting of the
    resume (--model), never a damaged checkpoint (set aside, the run would start over)."""
    name = saved.get("name") if isinstance(saved, dict) else None
    started = f" (the run was started with --model {name})" if name and name != cfg.model else ""
    return UsageError(
        f"--resume: {path} holds the weights of another model than --model {cfg.model}"
        f"{started}: {detail}. Resume with the run's --model (and its --lora-rank, "
        "--quantization), or start a new run in another folder"
    )


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume: drop the lines the killed run logged after its checkpoint (they are redone)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a kill cut in half
        if int(record.get("step", 0)) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)
