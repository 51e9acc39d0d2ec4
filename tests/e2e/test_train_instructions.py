"""``memfit train --task causal-lm`` end to end on instruction rows, with a tiny Llama on the CPU:
prompt/completion JSON Lines and chat messages JSON Lines. The logged losses are checked against
the completion-only (assistant-only) mean computed by hand from the model folders: step 1's loss
with the initial weights, the final eval loss with the saved model. A bad row is skipped and
said so; a tokenizer without a chat template is refused in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from memfit_runs import offline_environment, train_command

from tiny_models import CHAT_TEMPLATE, SENTENCES, save_tiny_llama, write_jsonl

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

PAIRS = [
    {"prompt": "what is two plus two", "completion": " it is four"},
    {"prompt": "name a colour", "completion": " blue"},
    {"prompt": "the cat", "completion": " sat on the mat"},
    {"prompt": "hello there how are you", "completion": " i am fine thank you"},
    {"prompt": "what is", "completion": " two"},
    {"prompt": "blue is a", "completion": " colour"},
    {"prompt": "the cat sat on the", "completion": " mat"},
    {"prompt": "hello", "completion": " there how are you"},
]
CHATS = [
    [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["completion"]}]
    for p in PAIRS[:4]
] + [
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "hello there how are you"},
        {"role": "assistant", "content": "i am fine thank you"},
    ],
    [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "it is four"},
    ],
]
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def run(folder: Path, flags: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        train_command(folder, flags),
        env=offline_environment(folder),
        capture_output=True,
        text=True,
        timeout=600,
    )


def trained(folder: Path, model: str, data: Path, flags: dict[str, str | None]) -> dict[str, Any]:
    done = run(
        folder,
        {
            "--task": "causal-lm",
            "--model": model,
            "--train-file": str(data),
            "--eval-file": str(data),
            "--effective-batch-size": "8",
            "--micro-batch-size": "3",  # uneven chunks: the guard's weight is under test
            "--max-steps": "2",
            "--eval-every": "2",
            "--lr": "0.1",
            "--max-seq-len": "64",
            **flags,
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    out = folder / "out"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"stderr": done.stderr, "metrics": metrics, "out": out}


def mean_loss(model_dir: Any, rows: list[tuple[list[int], list[int]]]) -> float:
    """The mean cross-entropy of the tokens marked 1, row by row, with the model in
    ``model_dir`` (no padding, no batching: none of the recipe's code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, marks in rows:
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            for t in range(1, len(ids)):
                if marks[t]:
                    total -= float(logp[t - 1, ids[t]])
                    count += 1
    return total / count


def check_losses(run: dict[str, Any], model: str, rows: list[tuple[list[int], list[int]]]) -> None:
    """Step 1's loss (initial weights, all rows in the step) and the final eval loss (the saved
    model) are the means over the marked tokens; over every token they would differ."""
    steps = [m for m in run["metrics"] if "loss" in m and m.get("loss") is not None]
    evals = [m for m in run["metrics"] if "eval_loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and steps[0]["samples_seen"] == len(rows)
    expected = mean_loss(model, rows)
    everything = mean_loss(model, [(ids, [1] * len(ids)) for ids, _ in rows])
    assert abs(everything - expected) > 1e-3 * expected  # the check can tell them apart
    assert steps[0]["loss"] == pytest.approx(expected, rel=1e-4)
    assert evals[-1]["step"] == 2
    assert evals[-1]["eval_loss"] == pytest.approx(mean_loss(run["out"] / "model", rows), rel=1e-4)
    assert steps[1]["loss"] != pytest.approx(steps[0]["loss"], rel=1e-6)  # it trained


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, SENTENCES)
    return str(folder)


def test_prompt_completion_rows_train_on_the_completion(llama: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    bad = {"prompt": "what is", "completion": ""}
    data = write_jsonl(tmp_path / "train.jsonl", [*PAIRS[:3], bad, *PAIRS[3:]])
    flags = {"--prompt-column": "prompt", "--completion-column": "completion"}
    run = trained(tmp_path, llama, data, {**flags, "--skip-bad-rows": None})
    # the skipped row is said and listed, never dropped silently
    assert "memfit: skipped 2 bad row(s)" in run["stderr"]  # from the train and the eval file
    skipped = [json.loads(x) for x in (run["out"] / "skipped_rows.jsonl").read_text().splitlines()]
    assert {(s["flag"], s["line"]) for s in skipped} == {("--train-file", 4), ("--eval-file", 4)}
    tokenizer = AutoTokenizer.from_pretrained(llama)
    rows = []
    for pair in PAIRS:
        prompt = tokenizer(pair["prompt"])["input_ids"]
        completion = tokenizer(pair["completion"], add_special_tokens=False)["input_ids"]
        rows.append(
            (
                [*prompt, *completion, tokenizer.eos_token_id],
                [0] * len(prompt) + [1] * (len(completion) + 1),
            )
        )
    check_losses(run, llama, rows)


def test_chat_rows_train_on_the_assistant_turns(llama: str, tmp_path: Path) -> None:
    """Trained with a template without generation markers (the assistant turns found from
    rendered prefixes); the reference masks are transformers' own, from the marked template."""
    import shutil

    from transformers import AutoTokenizer

    plain = tmp_path / "plain-llama"
    shutil.copytree(llama, plain)
    tokenizer = AutoTokenizer.from_pretrained(llama)
    tokenizer.chat_template = PLAIN_TEMPLATE
    tokenizer.save_pretrained(plain)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    run = trained(tmp_path, str(plain), data, {"--messages-column": "messages"})
    assert "skipped" not in run["stderr"]
    reference = AutoTokenizer.from_pretrained(llama)
    rows = []
    for chat in CHATS:
        out = reference.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        rows.append((list(out["input_ids"]), list(out["assistant_masks"])))
    check_losses(run, str(plain), rows)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "no-template"
    save_tiny_llama(model, SENTENCES, chat_template=None)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    done = run(
        tmp_path,
        {
            "--task": "causal-lm",
            "--model": str(model),
            "--train-file": str(data),
            "--messages-column": "messages",
            "--skip-bad-rows": None,
        },
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [x for x in done.stderr.splitlines() if x.startswith("memfit: error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert errors[0].startswith(f"memfit: error: --messages-column: the tokenizer of {model} ")
    assert "no chat template" in errors[0]


# a model folder's chat template that never ends (issue 30: it grew to 22.7 GB before the kernel
# killed it), and one that asks for 10 GB at once: each row is a bad row, memory stays small
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 10 ** 10 }}"


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (
            LOOPS,
            r"the chat template did not finish rendering this conversation within 1 s "
            r"\(memfit's bound per row: does the template loop without end\?\)",
        ),
        (
            HUGE,
            r"the chat template needs more than 1\.00 GiB of memory to render this "
            r"conversation \(memfit's bound per row\)",
        ),
    ],
    ids=["loops", "huge"],
)
def test_a_chat_template_past_its_bounds_makes_bad_rows(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    template: str,
    reason: str,
) -> None:
    import re
    import time

    from cli_run import run_cli
    from memfit.data import instructions

    monkeypatch.setattr(
        instructions, "RENDER_SECONDS", 1.0, raising=False
    )  # the default: 10 s a row
    for name, value in offline_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    model = tmp_path / "model"
    save_tiny_llama(model, SENTENCES, chat_template=None)
    (model / "chat_template.jinja").write_text(template + CHAT_TEMPLATE, encoding="utf-8")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS[:2]])
    argv = train_command(
        tmp_path,
        {
            "--task": "causal-lm",
            "--model": str(model),
            "--train-file": str(data),
            "--messages-column": "messages",
            "--no-probe": None,
        },
    )[3:]
    start = time.monotonic()
    code, _, err = run_cli(capsys, *argv)
    assert time.monotonic() - start < 60, err  # unbounded, either runs for hours
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("memfit: error: ")]
    where = re.escape(f"memfit: error: --train-file: {data}")
    assert len(errors) == 2, err
    for line, error in enumerate(errors, start=1):
        assert re.fullmatch(f"{where} line {line}: {reason}", error), error
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []
    # --skip-bad-rows: every row is bad, so none is left to train on
    code, _, err = run_cli(capsys, *argv, "--skip-bad-rows")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"memfit: error: --train-file: {data}: no rows" in err.splitlines(), err
