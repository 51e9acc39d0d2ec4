"""The child processes of the speed benches (`bench/_speed_common.py` starts and times them).

    python bench/_speed_child.py accelerate FOLDER   # accelerate's estimate-memory on FOLDER/config.json
    python bench/_speed_child.py deepspeed FOLDER    # DeepSpeed's ZeRO-2/3 model-state estimators
    python bench/_speed_child.py shapes JSON         # in one process: a first estimate, then new shapes
    python bench/_speed_child.py budgets JSON        # in one process: a first plan, then new budgets

`shapes` and `budgets` import memfit from PYTHONPATH (the checkout being timed) and print one
JSON object with their in-process timings on the last line of stdout. Only the standard library
is imported at the top, so the peers' figures hold nothing of memfit's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def accelerate_estimate(folder: str) -> None:
    """`accelerate estimate-memory FOLDER --library_name transformers`, offline.

    accelerate's command only takes Hub ids: `create_empty_model` first asks the Hub for the
    repo's metadata (`verify_on_hub` → `huggingface_hub.model_info`: the library name and the
    config's `auto_map`), which fails for a local folder and offline. That one call is answered
    from FOLDER/config.json; the rest is accelerate's own code, unchanged: its argument parser,
    `create_empty_model` (`AutoConfig.from_pretrained` + `init_empty_weights` +
    `AutoModel.from_config(config, torch_dtype=torch.float32)`), `calculate_maximum_sizes`,
    `estimate_training_usage` for its four default dtypes, and the printed table.
    """
    from accelerate.commands import estimate

    config = json.loads((Path(folder) / "config.json").read_text())

    def verify_on_hub(repo: str, token: str | None = None) -> Any:
        # what model_info would say of a transformers repo holding this config.json
        return SimpleNamespace(config=config, library_name="transformers")

    estimate.verify_on_hub = verify_on_hub
    args = estimate.estimate_command_parser().parse_args([folder, "--library_name", "transformers"])
    estimate.estimate_command(args)


def deepspeed_estimate(folder: str) -> None:
    """DeepSpeed's model-state estimators on an empty (meta) model of FOLDER/config.json, 1 GPU."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs_all_live,
    )
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(folder)
    # the model on the meta device, as accelerate's init_empty_weights builds it: no memory
    with torch.device("meta"):
        model = AutoModel.from_config(config, torch_dtype=torch.float32)
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)


def new_shapes(request: dict[str, Any]) -> dict[str, Any]:
    """A first estimate (timed apart), then every shape of `request["shapes"]`, each timed.

    `request["after_background"]`: between the two, wait until the background work the first
    estimate started has finished (`wait_for_background`); when this checkout gives no way to
    wait, no shape is timed and the answer says why (`"waited": None`, `"why"`).
    """
    import memfit

    model, knobs = request["model"], request["knobs"]
    started = time.perf_counter()
    memfit.estimate(model, **knobs)
    first = time.perf_counter() - started
    answer: dict[str, Any] = {"memfit": memfit.__file__, "first_seconds": first}
    if request.get("after_background"):
        started = time.perf_counter()
        waited, why = wait_for_background()
        answer.update(waited=waited, why=why, wait_seconds=time.perf_counter() - started)
        if waited is None:
            return dict(answer, shapes=[])
    timed = []
    for batch_size, seq_len in request["shapes"]:
        shape = dict(knobs, batch_size=batch_size, seq_len=seq_len)
        started = time.perf_counter()
        memfit.estimate(model, **shape)
        timed.append([batch_size, seq_len, time.perf_counter() - started])
    return dict(answer, shapes=timed)


def wait_for_background(timeout_s: float = 900.0) -> tuple[str | None, str]:
    """Wait until the traces a first estimate started in the background (the other kinds of
    shape: a batch of one, lengths that are no multiple of 8) have arrived.

    Returns (what was waited on, a sentence), or (None, why nothing was waited for): the checkout
    has no background tracing (`memfit.estimate.background`, issue 34), no way to wait for it, it
    did not finish within `timeout_s`, or no job of it ran (the background off here). What was
    waited on says how many jobs ran and whether the background is on. Nothing is guessed: a
    shape timed while its trace still runs would be no "after" figure.
    """
    try:
        from memfit.estimate import background  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None, "this checkout has no memfit.estimate.background (no background tracing)"
    wait_all = getattr(background, "wait_all", None)
    if wait_all is None:
        return None, "memfit.estimate.background has no wait_all (wire it in wait_for_background)"
    if not wait_all(timeout_s):
        return None, f"the background work had not finished after {timeout_s:g} s"
    # wait_all returns at once where nothing was started (the background off: a loaded machine,
    # MEMFIT_NO_BACKGROUND): the shapes would be timed as without it, no "after" figure
    jobs = list(getattr(background, "_JOBS", {}).values())
    done = sum(getattr(job, "state", None) == "done" for job in jobs)
    enabled = background.enabled()
    if not done:
        return None, (
            f"no background job ran ({len(jobs)} submitted, none done; "
            f"background.enabled() is {enabled} now)"
        )
    return (
        f"memfit.estimate.background.wait_all(): {done} of {len(jobs)} jobs done, "
        f"background.enabled() is {enabled} now"
    ), "every job queued or running has ended"


def new_budgets(request: dict[str, Any]) -> dict[str, Any]:
    """A first plan (timed apart), then a plan for every budget of `request["budgets"]`, timed."""
    import memfit

    model, job = request["model"], request["job"]
    started = time.perf_counter()
    memfit.plan(model, gpu_memory=request["first_budget"], **job)
    first = time.perf_counter() - started
    timed = []
    for budget in request["budgets"]:
        started = time.perf_counter()
        result = memfit.plan(model, gpu_memory=budget, **job)
        seconds = time.perf_counter() - started
        keys = ("micro_batch_size", "gradient_accumulation_steps", "precision")
        chosen = result.plan  # None: nothing fits this budget
        outcome = (
            None
            if chosen is None
            else {k: chosen.get(k) for k in (*keys, "gradient_checkpointing")}
        )
        timed.append([budget, seconds, outcome])
    return {"memfit": memfit.__file__, "first_seconds": first, "budgets": timed}


def main() -> None:
    verb, argument = sys.argv[1], sys.argv[2]
    if verb == "accelerate":
        accelerate_estimate(argument)
    elif verb == "deepspeed":
        deepspeed_estimate(argument)
    elif verb == "shapes":
        print(json.dumps(new_shapes(json.loads(argument))))
    elif verb == "budgets":
        print(json.dumps(new_budgets(json.loads(argument))))
    else:
        sys.exit(f"unknown verb {verb!r}: accelerate | deepspeed | shapes | budgets")


if __name__ == "__main__":
    main()
