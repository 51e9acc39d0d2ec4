"""Resuming a packed run: the packing strategy decides which rows each step holds, so a
checkpoint records it and a resume with another is refused; a run folder of a memfit before
--packing-strategy (run.json with ``packing`` and no strategy) packed wrapped blocks, the only
packing there was, and resumes as wrapped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from memfit.train.config import TrainConfig
from memfit.train.recipes.causal_lm import CausalLMRecipe
from memfit.train.resume import changed_settings, step_settings


def config(tmp_path: Path, **knobs: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        task="causal-lm",
        model="m",
        train_file=str(tmp_path / "t.jsonl"),
        output_dir=str(tmp_path / "out"),
        packing=True,
    )
    return TrainConfig(**(settings | knobs))


def write_run_json(tmp_path: Path, saved: dict[str, Any]) -> None:
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "run.json").write_text(json.dumps({"config": saved}), encoding="utf-8")


def test_a_run_from_before_packing_strategy_resumes_as_wrapped(tmp_path: Path) -> None:
    # what an older memfit wrote: --packing, no strategy (its blocks were wrapped)
    legacy = {"packing": True, "seed": 42, "max_seq_len": None}
    write_run_json(tmp_path, legacy)
    resumed = config(tmp_path, resume=True)
    # said in the config, so that run.json and the checkpoints record it
    assert resumed.packing_strategy == "wrapped"
    assert CausalLMRecipe.config_options(resumed)["packing_strategy"] == "wrapped"
    now = step_settings(resumed)
    assert now["packing_strategy"] == "wrapped"
    # its checkpoints' settings (no strategy either) are the resumed run's
    assert changed_settings({**legacy, "effective_batch_size": 32}, now) == []
    # a new run in another folder, or one not resumed, packs bfd
    assert config(tmp_path).packing_strategy == "bfd"
    # asked for bfd, the resume would hold other rows in each step: refused
    explicit = step_settings(config(tmp_path, resume=True, packing_strategy="bfd"))
    assert changed_settings(legacy, explicit) == ["--packing-strategy wrapped then, bfd now"]


def test_a_run_of_this_memfit_resumes_with_its_strategy(tmp_path: Path) -> None:
    # run.json's config is the run's TrainConfig, its strategy said
    write_run_json(tmp_path, {"packing": True, "packing_strategy": "bfd"})
    resumed = config(tmp_path, resume=True)
    assert resumed.packing_strategy == "bfd"
    saved = {"packing": True, "packing_strategy": "bfd"}
    assert changed_settings(saved, step_settings(resumed)) == []
    wrapped = step_settings(config(tmp_path, resume=True, packing_strategy="wrapped"))
    assert changed_settings(saved, wrapped) == ["--packing-strategy bfd then, wrapped now"]
    # no packing: no strategy, whatever run.json says
    plain = step_settings(config(tmp_path, packing=False))
    assert plain["packing_strategy"] is None
    assert changed_settings({"packing": False}, plain) == []


def test_a_run_resumed_twice_keeps_its_wrapped_blocks(tmp_path: Path) -> None:
    """The first resume of an older run writes run.json again with the strategy it resolved;
    the second resume reads it there."""
    write_run_json(tmp_path, {"packing": True})
    first = config(tmp_path, resume=True)
    write_run_json(tmp_path, dataclasses.asdict(first))
    second = config(tmp_path, resume=True)
    assert second.packing_strategy == "wrapped"
    assert changed_settings(step_settings(first), step_settings(second)) == []
