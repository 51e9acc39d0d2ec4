"""Plots and the HTML report from hand-made run folders; `memfit estimate --plot`."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.errors import UsageError
from memfit.report.html import budget_of, write_report
from memfit.report.plots import breakdown_plot, memory_plot, training_plot

MiB = 2**20


def _metrics(steps: int = 6, **extra: int | str) -> list[dict]:
    lines: list[dict] = []
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "epoch": 0,
                "loss": 1.0 / step,
                "samples_seen": 8 * step,
                "micro_batch_size": 8 if step > 2 else 4,
                "gradient_accumulation_steps": 1 if step > 2 else 2,
                "max_tokens_per_micro_batch": None,
                "tokens": 500,
                "padded_tokens": 512,
                "peak_bytes": (100 + step) * MiB,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "seconds": 0.5,
                "samples_per_second": 16.0,
                **extra,
            }
        )
        if step % 3 == 0:
            lines.append({"step": step, "samples_seen": 8 * step, "eval_accuracy": 0.5 + step / 20})
    return lines


EVENTS = [
    {"time": 1.0, "type": "probe", "step": 0, "rows": 8, "micro_batch_size": 8, "changed": False},
    {"time": 2.0, "type": "oom", "step": 2, "micro_batch_size": 8, "error": "CUDA out of memory"},
    {"time": 2.1, "type": "backoff", "step": 2, "from": 8, "to": 4},
    {"time": 3.0, "type": "grow", "step": 3, "from": 4, "to": 8},
    {
        "time": 4.0,
        "type": "oom",
        "step": 5,
        "micro_batch_size": 8,
        "max_tokens": 4096,
        "error": "x",
    },
    {"time": 4.1, "type": "backoff", "step": 5, "max_tokens_from": 4096, "max_tokens_to": 2048},
    {"time": 5.0, "type": "checkpoint", "step": 6, "path": "checkpoints/step-6"},
]


def _lines(fig) -> dict:
    return {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}


def test_memory_plot_marks_events_and_budget() -> None:
    fig = memory_plot(_metrics(), EVENTS, 128 * MiB, budget_label="memory cap")
    lines = _lines(fig)
    assert list(lines["oom"].get_xdata()) == [2, 5]
    assert list(lines["backoff"].get_xdata()) == [2, 5]
    assert list(lines["grow"].get_xdata()) == [3]
    assert list(lines["probe"].get_xdata()) == [0]
    assert "checkpoint" not in lines  # routine: not marked
    assert lines["budget"].get_ydata()[0] == pytest.approx(128)  # MiB axis
    assert lines["budget"].get_label() == "memory cap 128.00 MiB"
    assert fig.axes[0].get_ylabel() == "memory (MiB)"
    assert list(lines["memory:peak_bytes"].get_ydata()) == [101, 102, 103, 104, 105, 106]
    # the micro-batch that ran out of memory, on the lower panel
    assert list(lines["oom:micro_batch_size"].get_ydata()) == [8, 8]
    assert fig.axes[0].get_xlim()[0] < 0  # step 0 (the probe) is in view
    texts = [t.get_text() for t in fig.axes[0].texts]
    # the test's CUDA messages give no sizes: the marks say so
    assert "OOM at mb 8 (size not in its message)" in texts and "back-off mb 8→4" in texts
    assert "budget 4096→2048 tok" in texts


def test_memory_plot_names_the_gradcache_mini_batch_where_the_guard_lowered_it() -> None:
    # in-batch negatives: the step stays whole, the guard lowers the GradCache mini-batch; the
    # lower panel must not call it a micro-batch
    events = [{**e, "what": "mini_batch"} if e["type"] in ("oom", "backoff") else e for e in EVENTS]
    fig = memory_plot(_metrics(what="mini_batch"), events, 128 * MiB)
    lower = fig.axes[-1]
    labels = [line.get_label() for line in lower.get_lines()]
    assert lower.get_ylabel() == "mini-batch"
    assert "GradCache mini-batch size" in labels and "micro-batch size" not in labels
    plain = memory_plot(_metrics(), EVENTS, 128 * MiB).axes[-1]
    assert plain.get_ylabel() == "micro-batch"


def test_memory_plot_draws_optional_keys_only_when_present() -> None:
    plain = _lines(memory_plot(_metrics(), [], None))
    assert "budget" not in plain and "oom" not in plain
    assert not any(gid.startswith("memory:reserved") for gid in plain)
    rich = _lines(
        memory_plot(
            _metrics(
                reserved_bytes=200 * MiB,
                forward_peak_bytes=90 * MiB,
                backward_peak_bytes=95 * MiB,
                optimizer_peak_bytes=80 * MiB,
            ),
            [],
            None,
        )
    )
    for key in (
        "reserved_bytes",
        "forward_peak_bytes",
        "backward_peak_bytes",
        "optimizer_peak_bytes",
    ):
        assert f"memory:{key}" in rich
    assert rich["memory:reserved_bytes"].get_ydata()[0] == pytest.approx(200)


def test_memory_plot_of_an_empty_run() -> None:
    fig = memory_plot([], [], None)
    assert any("no optimizer steps" in t.get_text() for t in fig.axes[0].texts)


def test_breakdown_plot_stacks_the_estimate_beside_the_measured_peak() -> None:
    breakdown = {"parameters": 400 * MiB, "gradients": 400 * MiB, "activations": 1200 * MiB}
    fig = breakdown_plot(breakdown, 1900 * MiB, budget=4 * 2**30)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "memory (GiB)"
    bars = {p.get_gid(): p for p in ax.patches}
    assert bars["estimate:gradients"].get_y() == pytest.approx(400 / 1024)  # on top of parameters
    assert bars["measured peak"].get_height() == pytest.approx(1900 / 1024)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["estimate", "measured peak"]
    assert _lines(fig)["budget"].get_ydata()[0] == pytest.approx(4)
    # no estimate: the measured bar alone, and why
    alone = breakdown_plot(None, 1900 * MiB, note="no estimate: --no-estimate")
    assert [t.get_text() for t in alone.axes[0].get_xticklabels()] == ["measured peak"]
    assert alone.axes[0].get_xlabel() == "no estimate: --no-estimate"


def test_training_plot_has_loss_eval_and_throughput() -> None:
    lines = _lines(training_plot(_metrics()))
    assert list(lines["loss"].get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(lines["eval_accuracy"].get_xdata()) == [3, 6]
    assert list(lines["tokens_per_second"].get_ydata()) == [1000.0] * 6
    empty = training_plot([])
    assert any("no eval" in t.get_text() for ax in empty.axes for t in ax.texts)


def _run_dir(tmp_path: Path, run: dict | None = None) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(
        "\n".join(json.dumps(m) for m in _metrics()) + '\n{"step": 7, "lo'  # a torn last line
    )
    (folder / "events.jsonl").write_text("\n".join(json.dumps(e) for e in EVENTS) + "\n")
    run = run or {
        "config": {
            "model": "https://example.invalid/not-a-model <b>",
            "task": "classification",
            "memory_cap": None,
            "gpu_memory": 128 * MiB,
            "effective_batch_size": 8,
        },
        "resolved": {"device": "cuda:0", "micro_batch_size": 8, "precision": "bf16"},
        "plan": {
            "source": "memfit plan",
            "plan": {"micro_batch_size": 8},
            "predicted_peak_bytes": 3,
        },
        "estimate": {
            "total_bytes": 110 * MiB,
            "breakdown": {"parameters": 10 * MiB, "activations": 100 * MiB},
        },
        "versions": {"torch": "2.x"},
    }
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_report_is_self_contained(tmp_path: Path) -> None:
    folder = _run_dir(tmp_path)
    page = write_report(folder, estimate=False)
    text = page.read_text()
    for name in ("memory.png", "breakdown.png", "training.png"):
        data = (folder / name).read_bytes()
        assert data.startswith(b"\x89PNG")
        assert base64.b64encode(data).decode() in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert "<script" not in text and "<link" not in text
    # user text is escaped, the tables are there, run.json's estimate is used
    assert "not-a-model &lt;b&gt;" in text and "not-a-model <b>" not in text
    assert "<th>plan.micro_batch_size</th><td>8</td>" in text
    assert "<th>gpu_memory</th>" in text and "128.00 MiB" in text
    assert "the estimate memfit train recorded in run.json" in text
    assert text.count('<tr class="oom">') == 2 and text.count('<tr class="backoff">') == 2
    assert "1 line(s) of metrics.jsonl" in text
    assert not list(folder.glob(".*"))  # no temporary file left behind


def test_budget_comes_from_cap_then_gpu_memory_then_plan() -> None:
    assert budget_of({"config": {"memory_cap": 5, "gpu_memory": 7}}) == (5, "memory cap")
    assert budget_of({"config": {"memory_cap": None, "gpu_memory": 7}}) == (7, "GPU memory")
    planned = {"config": {}, "plan": {"plan": {"budget_bytes": 9}}}
    assert budget_of(planned) == (9, "plan budget")
    assert budget_of({}) == (None, "")


def test_a_failed_estimate_is_explained(tmp_path: Path) -> None:
    run = {
        "config": {
            "model": str(tmp_path / "missing-model"),
            "task": "classification",
            "effective_batch_size": 8,
        },
        "resolved": {"device": "cpu", "micro_batch_size": 8},
    }
    text = write_report(_run_dir(tmp_path, run), estimate=True).read_text()
    assert "no estimate (micro-batch 8 × 64 tokens, fp32, on cpu)" in text


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_run_dir_exits_2(tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "nope"
    if make == "empty":
        folder.mkdir()
    with pytest.raises(UsageError, match=re.escape(str(folder))):
        write_report(folder)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(folder)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder) in err


def test_estimate_plot(tiny_bert: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "breakdown.png"
    args = ["estimate", tiny_bert, "--task", "classification", "--batch-size", "4"]
    main([*args, "--seq-len", "32", "--device", "cpu", "--plot", str(out), "--json"])
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout is still one JSON object
    assert f"wrote {out}" in captured.err
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--seq-len", "32", "--plot", str(tmp_path / "no" / "such" / "x.png")])
    assert exit_info.value.code == 2
    assert "--plot" in capsys.readouterr().err
