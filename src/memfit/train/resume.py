"""``memfit train --resume``: which checkpoint to go on from, and whether it may.

A resume must find each step holding the samples it held before: the settings that decide them
(:data:`STEP_FLAGS`, the rows and their lengths) are recorded in each checkpoint and in run.json,
and a resume with other ones is refused. The newest checkpoint that verifies and loads is taken;
a damaged one is set aside. A finished run has nothing to resume (unless it is asked to train
longer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.train.config import TrainConfig

# what decides which samples each step holds, and the flag that sets it
STEP_FLAGS = {
    "effective_batch_size": "--effective-batch-size",
    "seed": "--seed",
    "group_by_length": "--group-by-length",
    "packing": "--packing",
    "max_seq_len": "--max-seq-len",
}


def finished_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """With --resume, the result of a run that finished in the folder with these settings and
    length (nothing to redo), else None. Other settings that decide the steps are refused."""
    from memfit.train import runfolder

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
    if _longer(runfolder.run_config(out), cfg):
        return None  # more epochs or steps: train on from the newest checkpoint
    return done


def step_settings(
    cfg: TrainConfig, rows: int | None = None, lengths: Sequence[int] | None = None
) -> dict[str, Any]:
    """The settings a checkpoint records so that a resume can check them: the flags that decide
    which samples each step holds, the number of training rows and a digest of their lengths in
    tokens (a changed file almost always changes one)."""
    import array
    import hashlib

    digest = (
        hashlib.sha256(array.array("q", lengths).tobytes()).hexdigest()[:16]
        if lengths is not None
        else None
    )
    return {
        **{key: getattr(cfg, key) for key in STEP_FLAGS},
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
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (and loads, with ``load``): its path and state.

    Each one passed over is handed to ``skip`` with the reason. A refused resume (UsageError:
    changed settings) and an out-of-memory error are not a damaged checkpoint: they propagate.
    """
    from memfit.guard import is_oom
    from memfit.train import checkpoint as ck

    for number in reversed(ck.completed_steps(folder)):
        path = folder / f"step-{number}"
        problem = ck.verify(path)
        if problem is None:
            try:
                return path, (load(path) if load is not None else ck.read_state(path))
            except UsageError:
                raise
            except Exception as exc:
                if is_oom(exc):
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                problem = f"unreadable ({type(exc).__name__}{': ' + first[:200] if first else ''})"
        skip(path, problem)
    return None


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
