"""One rank of tests/e2e/test_zero_reset.py (run by torchrun): the guard over DeepSpeed ZeRO with
out-of-memory errors injected at chosen points, against plain full-batch SGD in one process.

argv: OUT_FOLDER STAGE [STAGE ...]: each stage in turn in this launch (one process group, a new
engine each), its results in ``OUT_FOLDER/stageN.json`` (rank 0) and ``stageN.json.rankR``. Injected: step 2, rank 1, micro-batch 2's forward; step 3, rank 0,
micro-batch 1's backward (after a reduce bucket may have gone out); step 4, rank 1, the last
micro-batch's backward. Each is a real ``torch.OutOfMemoryError`` raised inside the engine's
forward or backward; the other rank learns of it at its next sync point.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn

from memfit.guard import Guard
from memfit.train.distributed import init_ranks
from memfit.train.zero import build_config, start_engine

STEPS, ROWS, FEATURES = 5, 8, 16
INJECTIONS = frozenset({(2, 1, 1, "forward"), (3, 0, 0, "backward"), (4, 1, 1, "backward")})
INJECT: set[tuple[int, int, int, str]] = set()  # what is still to fire in the stage running


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 3)
        self.boom: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if self.boom == "forward":
            self.boom = None
            raise torch.OutOfMemoryError("injected in forward")
        if self.boom == "backward":
            self.boom = None

            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("injected in backward")

            h.register_hook(fail)
        return self.c(h)


class Recipe:
    """Rows are indices into (X, Y); the loss of a chunk is its summed loss over the step's rows."""

    splittable = True

    def __init__(self, model: Net, x: torch.Tensor, y: torch.Tensor, rank: int) -> None:
        self.model, self.x, self.y, self.rank = model, x, y, rank
        self.step = 0
        self.chunk = 0

    def units(self, rows: list[int]) -> int:
        return len(rows)

    def lengths(self, rows: list[int]) -> None:
        return None

    def loss(self, rows: list[int], total_units: int, **_: object) -> torch.Tensor:
        if (self.step, self.rank, self.chunk, "forward") in INJECT:
            INJECT.discard((self.step, self.rank, self.chunk, "forward"))
            self.model.boom = "forward"
        if (self.step, self.rank, self.chunk, "backward") in INJECT:
            INJECT.discard((self.step, self.rank, self.chunk, "backward"))
            self.model.boom = "backward"
        self.chunk += 1
        logits = self.model(self.x[rows])
        return nn.functional.cross_entropy(logits, self.y[rows], reduction="sum") / total_units


def reference(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(STEPS):
        rows = list(range(step * ROWS, (step + 1) * ROWS))
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    folder, stages = sys.argv[1], [int(a) for a in sys.argv[2:]]
    ranks = init_ranks("cpu")
    for stage in stages:
        run_stage(stage, f"{folder}/stage{stage}.json", ranks)
    ranks.close()


def run_stage(stage: int, out: str, ranks: Any) -> None:
    INJECT.clear()
    INJECT.update(INJECTIONS)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * ROWS, FEATURES, generator=generator)
    y = torch.randint(0, 3, (STEPS * ROWS,), generator=generator)
    expected = reference(x, y)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    cfg = type("Cfg", (), {"deepspeed": None, "max_grad_norm": 0.0})()
    config, _ = build_config(cfg, stage=stage, hidden_size=16, precision="fp32", micro=2)
    # small buckets and no persistent parameters: several reductions and gathers per backward
    config["zero_optimization"].update(reduce_bucket_size=600)
    if stage == 3:
        config["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=500
        )
    zero = start_engine(model, optimizer, ranks, config)
    params = [p for p in model.parameters() if p.requires_grad]
    ranks.prepare(params)
    ranks.reduces_in_backward = True
    recipe = Recipe(model, x, y, ranks.rank)
    events: list[dict] = []
    guard = Guard(
        2,
        on_event=events.append,
        ranks=ranks,
        on_recover=zero.reset,
        backward=zero.backward,
        pad_pass=zero.pad_pass(recipe, [0]),
    )
    for step in range(STEPS):
        recipe.step, recipe.chunk = step, 0
        mine = list(range(step * ROWS + ranks.rank, (step + 1) * ROWS, ranks.world_size))
        guard.step(mine, recipe, params=params, step=step, total_units=ROWS)
        zero.step()
        guard.micro_batch_size = 2  # every step starts at 2 rows (the injections count chunks)
    got = zero.full_state_dict()
    difference = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    if ranks.rank == 0:
        ooms = [e for e in events if e["type"] == "oom"]
        with open(out, "w") as f:
            json.dump({"difference": difference, "ooms": len(ooms)}, f)
    with open(f"{out}.rank{ranks.rank}", "w") as f:
        left = [key for key in INJECT if key[1] == ranks.rank]
        json.dump({"events": [e["type"] for e in events], "left": len(left)}, f)
    ranks.barrier()
    zero.close()


if __name__ == "__main__":
    main()
    # the rank ends without the interpreter's teardown, as memfit train's ranks do: in it, gloo's
    # threads can end a finished rank with SIGABRT (a CI run saw it)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
