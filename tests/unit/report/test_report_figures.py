"""The report compares like with like: the estimate at the shapes the run fed, each figure named
for what it counts on its device, the OOM mark at the failed allocation's size, nothing hidden."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from memfit.report import plots
from memfit.report.html import measure_of, run_estimate, run_shapes, write_report
from memfit.report.plots import memory_plot, oom_bytes, training_plot

MiB = 2**20
GiB = 2**30

CAP_ERROR = (
    "memfit memory cap: tried to hold 434.86 MiB, the cap is 434.31 MiB (simulated CPU out of "
    "memory. Raised by aten.embedding_dense_backward.default)"
)
CUDA_ERROR = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB of "
    "which 1.06 GiB is free. Including non-PyTorch memory, this process has 14.69 GiB memory in "
    "use. Of the allocated memory 10.25 GiB is allocated by PyTorch, and 4.02 GiB is reserved by "
    "PyTorch but unallocated."
)


def _steps(micro: list[int], peak: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "loss": 1.0,
            "samples_seen": step * size,
            "micro_batch_size": size,
            "gradient_accumulation_steps": 1,
            "padded_tokens": size * 16,
            "peak_bytes": peak + step * MiB,
            "seconds": 1.0,
            "samples_per_second": float(size),
            **extra,
        }
        for step, size in enumerate(micro, start=1)
    ]


def _run_json(device: str = "cpu", memory_cap: int | None = None, **resolved: Any) -> dict:
    return {
        "config": {
            "model": "some-model",
            "task": "classification",
            "max_seq_len": 64,
            "effective_batch_size": 8,
            "memory_cap": memory_cap,
            "device": device,
        },
        "resolved": {"device": device, "micro_batch_size": 8, "precision": "fp32", **resolved},
    }


class _FakeEstimate:
    def __init__(self, kwargs: dict[str, Any]) -> None:
        # a made-up model whose memory grows with rows × tokens, so the shapes show in the total
        rows_tokens = kwargs["batch_size"] * kwargs["seq_len"]
        self.breakdown = {"parameters": 100 * MiB, "activations": rows_tokens * 64 * 1024}
        self.total_bytes = sum(self.breakdown.values())
        self.details = {"allocated_peak_bytes": self.total_bytes - MiB}


@pytest.fixture
def estimates(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments each ``memfit.estimate`` call of the report got (a fake estimator)."""
    import memfit.estimate

    calls: list[dict[str, Any]] = []

    def fake(model: str, **kwargs: Any) -> _FakeEstimate:
        calls.append(kwargs)
        return _FakeEstimate(kwargs)

    monkeypatch.setattr(memfit.estimate, "estimate", fake)
    return calls


def test_the_estimate_is_taken_at_the_width_the_run_fed(
    estimates: list[dict[str, Any]],
) -> None:
    # --max-seq-len 64, but the data's longest row is 14 tokens, padded to 16
    run = _run_json(longest_tokens=14, seq_len=16, train_rows=100)
    metrics = _steps([8, 8, 4, 4], 300 * MiB)
    predicted, note = run_estimate(run, metrics, [])
    assert estimates[-1]["seq_len"] == 16 and estimates[-1]["batch_size"] == 8
    assert predicted is not None
    assert predicted["total_bytes"] == _FakeEstimate({"batch_size": 8, "seq_len": 16}).total_bytes
    assert "micro-batch 8 × 16 tokens" in note and "resolved.seq_len" in note
    assert "longest row: 14 tokens" in note


def test_older_run_folders_fall_back_and_say_which(estimates: list[dict[str, Any]]) -> None:
    metrics = _steps([8, 8], 300 * MiB)
    probe = {"type": "probe", "step": 0, "longest_tokens": 21, "micro_batch_size": 8}
    # no resolved.seq_len: the probe's longest row, padded as the run padded
    shapes = run_shapes(_run_json(pad_to_multiple_of=8), metrics, [probe])
    assert shapes.seq_len == 24 and "probe" in shapes.seq_source
    # neither: --max-seq-len, named an upper bound
    shapes = run_shapes(_run_json(), metrics, [])
    assert shapes.seq_len == 64 and "--max-seq-len" in shapes.seq_source
    assert "upper bound" in shapes.seq_source
    _, note = run_estimate(_run_json(), metrics, [])
    assert "--max-seq-len" in note and estimates[-1]["seq_len"] == 64


def test_the_micro_batch_is_the_largest_the_steps_ran_within_the_data() -> None:
    # the guard grew the micro-batch from 8 to 16 at step 3
    shapes = run_shapes(_run_json(seq_len=16, train_rows=100), _steps([8, 8, 16], MiB), [])
    assert shapes.micro_batch_size == 16
    # a micro-batch of 8 over 5 rows holds 5
    shapes = run_shapes(_run_json(seq_len=16, train_rows=5), _steps([8], MiB), [])
    assert shapes.micro_batch_size == 5 and "5 rows" in shapes.batch_source


@pytest.mark.slow  # traces the tiny model twice (seconds each)
def test_the_report_page_uses_the_width_the_run_fed(
    tiny_bert: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real estimator: the page's estimated peak is the estimate at resolved.seq_len."""
    from memfit.estimate import estimate

    folder = tmp_path / "run"
    folder.mkdir()
    run = _run_json(longest_tokens=12, seq_len=12, train_rows=40)
    run["config"]["model"] = tiny_bert
    (folder / "run.json").write_text(json.dumps(run))
    lines = _steps([8, 8], 600 * MiB)
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    text = write_report(folder).read_text()
    knobs = dict(task="classification", batch_size=8, precision="fp32", device="cpu")
    fed = estimate(tiny_bert, seq_len=12, **knobs).total_bytes
    widest = estimate(tiny_bert, seq_len=64, **knobs).total_bytes
    assert fed != widest
    from memfit.units import format_bytes

    card = re.search(r"estimated peak \(tensors\)<b>([^<]+)</b>", text)
    assert card is not None and card.group(1) == format_bytes(fed)


def _page_and_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: dict, metrics: list, events: list
) -> tuple[str, dict[str, Any]]:
    """write_report's page, and the figures it drew (by the file they went to)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps(run))
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    (folder / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    drawn: list[Any] = []
    real = plots.figure_png

    def keep(fig: Any, **kwargs: Any) -> bytes:
        drawn.append(fig)
        return real(fig, **kwargs)

    monkeypatch.setattr(plots, "figure_png", keep)
    text = write_report(folder, estimate=False).read_text()
    return text, dict(zip(("memory.png", "breakdown.png", "training.png"), drawn, strict=True))


def _legend_texts(fig: Any) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]


@pytest.mark.parametrize(
    ("device", "cap", "name", "comparable"),
    [
        ("cuda:0", None, "CUDA allocated", True),
        ("cpu", 500 * MiB, "live tensors, memory cap", True),
        ("cpu", None, "process RSS", False),
    ],
)
def test_each_figure_says_what_it_measures(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    cap: int | None,
    name: str,
    comparable: bool,
) -> None:
    run = _run_json(device, cap, seq_len=16)
    # run.json's recorded estimate (no estimator needed), with CUDA's allocated figure
    breakdown = {"parameters": 100 * MiB, "activations": 300 * MiB, "runtime_overhead": 50 * MiB}
    run["estimate"] = {
        "total_bytes": 450 * MiB,
        "breakdown": breakdown,
        "allocated_peak_bytes": 380 * MiB,
    }
    metrics = _steps([8, 8, 8], 360 * MiB)
    text, figures = _page_and_figures(tmp_path, monkeypatch, run, metrics, [])
    assert measure_of(run).name == name
    assert f"measured peak ({name})<b>" in text  # the card
    assert f"<th>measured peak ({name})</th>" in text  # the table's row
    legend = _legend_texts(figures["memory.png"])
    assert f"peak: {name}" in legend and "peak (allocated)" not in legend
    bars = [t.get_text() for t in figures["breakdown.png"].axes[0].get_xticklabels()]
    assert f"measured peak\n({name})" in bars
    measured = 363 * MiB  # the largest step's peak
    if comparable:
        like = 380 * MiB if device.startswith("cuda") else 450 * MiB
        assert f"{measured / like:.0%} of the estimate" in text
    else:
        # no ratio, and why: RSS holds more than the tensors the estimate counts
        assert "of the estimate" not in text
        assert "Not comparable" in text and "Python interpreter" in text
        assert "--memory-cap" in text
    if device.startswith("cuda"):
        assert "estimated peak (reserved + CUDA context)" in text
        assert "allocated peak is 380.00 MiB" in text


def test_the_like_for_like_measurement_leaves_out_the_steps_that_ran_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run_json("cpu", 440 * MiB, seq_len=16)
    run["estimate"] = {"total_bytes": 400 * MiB, "breakdown": {"activations": 400 * MiB}}
    metrics = _steps([8, 8, 4], 300 * MiB)
    metrics[1]["peak_bytes"] = 435 * MiB  # step 2 held the failed attempt's bytes too
    events = [{"type": "oom", "step": 2, "micro_batch_size": 8, "error": CAP_ERROR}]
    text, _ = _page_and_figures(tmp_path, monkeypatch, run, metrics, events)
    # step 1 is the only one at micro-batch 8 without an OOM
    assert (
        f"Measured 301.00 MiB (the step at micro-batch 8 without an out-of-memory error): {301 / 400:.0%}"
        in text
    )
    assert "No step can measure more than the cap (440.00 MiB)" in text


def test_the_oom_mark_sits_at_the_failed_allocation() -> None:
    events = [
        {"type": "oom", "step": 2, "micro_batch_size": 32, "error": CAP_ERROR},
        {"type": "backoff", "step": 2, "from": 32, "to": 16},
    ]
    fig = memory_plot(_steps([32, 32, 16], 400 * MiB), events, 434 * MiB)
    oom = {line.get_gid(): line for line in fig.axes[0].get_lines()}["oom"]
    assert list(oom.get_xdata()) == [2]
    assert oom.get_transform() == fig.axes[0].transData  # data units, not a fraction of the axes
    assert oom.get_ydata()[0] == pytest.approx(434.86)  # the MiB axis
    assert any("434.86 MiB" in t.get_text() for t in fig.axes[0].texts)
    # the guard lowered GradCache's mini-batch (MNRL): the marks say so
    lowered = [{**e, "what": "mini_batch"} for e in events]
    texts = [t.get_text() for t in memory_plot(_steps([32], MiB), lowered).axes[0].texts]
    assert "OOM at mini-batch 32: would have held 434.86 MiB" in texts
    assert "back-off mini-batch 32→16" in texts
    # CUDA: what was allocated plus what it tried to allocate
    assert oom_bytes({"error": CUDA_ERROR}) == round(10.25 * GiB) + 2 * GiB
    cuda = memory_plot(_steps([8], 9 * GiB), [{"type": "oom", "step": 1, "error": CUDA_ERROR}])
    line = {line.get_gid(): line for line in cuda.axes[0].get_lines()}["oom"]
    assert line.get_ydata()[0] == pytest.approx(12.25)  # the GiB axis
    # the CPU allocator names the request alone: no total, no mark at a made-up height
    assert (
        oom_bytes(
            {"error": "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"}
        )
        is None
    )


def _display(line: Any) -> list[tuple[float, float]]:
    xy = list(zip(line.get_xdata(), line.get_ydata(), strict=True))
    return [tuple(p) for p in line.get_transform().transform(xy)]


def test_no_event_marker_hides_behind_a_legend() -> None:
    events = [
        {"type": "probe", "step": 0, "micro_batch_size": 8},
        {"type": "oom", "step": 5, "micro_batch_size": 8, "error": CAP_ERROR},
        {"type": "backoff", "step": 5, "from": 8, "to": 4},
        {"type": "resume", "step": 3},
        {"type": "stop", "step": 6, "reason": "done"},
    ]
    # the phases' curves too: the legend is as tall as a capped run's (the demo's)
    phases = {f"{name}_peak_bytes": 250 * MiB for name in ("forward", "backward", "optimizer")}
    metrics = _steps([8, 8, 8, 8, 8, 4], 400 * MiB, **phases)
    fig = memory_plot(metrics, events, 440 * MiB, peak_label="peak: live tensors, memory cap")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # drawn as figure_png draws it: the legends get their place
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
    memory_ax = fig.axes[0]
    markers = {line.get_gid(): line for line in memory_ax.get_lines()}
    for kind in ("probe", "oom", "backoff", "resume", "stop"):
        for x, y in _display(markers[kind]):
            assert memory_ax.bbox.contains(x, y), kind
            assert not any(box.contains(x, y) for box in boxes), f"{kind} is under a legend"
        assert markers[kind].get_zorder() > markers["memory:peak_bytes"].get_zorder()


def test_eval_loss_has_its_own_axis_and_equal_scores_stay_visible() -> None:
    metrics: list[dict[str, Any]] = _steps([8, 8, 8, 8], MiB)
    for step in (2, 4):
        # a balanced eval set: accuracy equals macro-F1
        metrics.append(
            {
                "step": step,
                "eval_loss": 2.5 / step,
                "eval_accuracy": 0.5 + step / 10,
                "eval_macro_f1": 0.5 + step / 10,
                "eval_perplexity": 40.0 / step,
            }
        )
    fig = training_plot(metrics)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    loss, accuracy, f1 = lines["eval_loss"], lines["eval_accuracy"], lines["eval_macro_f1"]
    assert loss.axes is lines["loss"].axes  # with the training loss
    assert loss.axes is not accuracy.axes
    assert accuracy.axes is f1.axes and accuracy.axes.get_ylim() == pytest.approx((-0.03, 1.03))
    # perplexity is not a 0…1 score either: an axis of its own
    assert lines["eval_perplexity"].axes not in (accuracy.axes, loss.axes)
    # the same values, drawn differently: the one on top is hollow and smaller
    assert accuracy.get_marker() != f1.get_marker()
    assert accuracy.get_linestyle() != f1.get_linestyle()
    top, under = sorted((accuracy, f1), key=lambda line: line.get_zorder(), reverse=True)
    assert top.get_fillstyle() == "none" and top.get_markersize() < under.get_markersize()
