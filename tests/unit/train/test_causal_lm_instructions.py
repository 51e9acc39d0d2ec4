"""The causal-lm recipe on instruction rows (prompt/completion, chat messages) with a tiny Llama:
the loss covers the completion (assistant) tokens only, the guard's weight is those tokens, a
split step has the whole step's gradient, bad rows are refused at their lines or skipped and
counted, and a tokenizer without a chat template refuses the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.data.rows import DataError, DataOptions
from memfit.errors import UsageError
from memfit.plan.data_profile import DataProfile
from memfit.train.config import TrainConfig, config_problems
from memfit.train.recipes import CausalLMRecipe
from memfit.train.recipes.causal_lm import TARGETS, TOKENS
from tiny_models import SENTENCES, save_tiny_llama, write_jsonl

# completions of different lengths, each starting at a word (a space): the join splits no token
PAIRS = [
    {"prompt": "what is two plus two", "completion": " it is four"},
    {"prompt": "name a colour", "completion": " blue"},
    {"prompt": "the cat", "completion": " sat on the mat"},
    {"prompt": "hello there how are you", "completion": " i am fine thank you"},
    {"prompt": "what is", "completion": " two"},
    {"prompt": "blue is a", "completion": " colour"},
]
CHATS = [
    [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "it is four"},
    ],
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "hello there how are you"},
        {"role": "assistant", "content": "i am fine thank you"},
    ],
    [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}],
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue"}],
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, SENTENCES)
    return str(folder)


@pytest.fixture(scope="module")
def plain_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same Llama, its tokenizer without a chat template."""
    folder = tmp_path_factory.mktemp("plain-llama")
    save_tiny_llama(folder, SENTENCES, chat_template=None)
    return str(folder)


def recipe_for(model: str, tmp_path: Path, *, skip: bool = False, **options: Any) -> CausalLMRecipe:
    recipe = CausalLMRecipe(model, **options)
    recipe.data_options = DataOptions(skip_bad_rows=skip, cache_dir=str(tmp_path / "cache"))
    return recipe


def manual_mean(model: Any, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, int]:
    """The mean cross-entropy of the targeted tokens, row by row (no padding, no batching)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, targets in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(1, len(ids)):
            if targets[t]:
                total = total - logp[t - 1, ids[t]]
                count += 1
    return total / count, count


def manual_loss(model: Any, rows: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    with torch.no_grad():
        mean, count = manual_mean(model, rows)
    return float(mean), count


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def split_matches_whole(recipe: CausalLMRecipe, rows: Any) -> None:
    """Halves of the step, each over the step's target tokens, give the whole step's gradient."""
    recipe.model.eval()
    rows = list(rows)
    half = len(rows) // 2
    total = recipe.units(rows)
    # the halves hold different numbers of targets: a per-row or per-token-of-the-half weight fails
    assert recipe.units(rows[:half]) != recipe.units(rows[half:])
    recipe.model.zero_grad()
    recipe.loss(rows, total).backward()
    whole = gradients(recipe.model)
    recipe.model.zero_grad()
    recipe.loss(rows[:half], total).backward()
    recipe.loss(rows[half:], total).backward()
    split = gradients(recipe.model)
    assert whole.keys() == split.keys() and whole
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-6, msg=name)


# --- prompt/completion ---------------------------------------------------------------------------
def test_prompt_completion_loss_covers_the_completion_only(llama_dir: str, tmp_path: Path) -> None:
    recipe = recipe_for(llama_dir, tmp_path, prompt_column="prompt", completion_column="completion")
    rows = recipe.read(write_jsonl(tmp_path / "train.jsonl", PAIRS))
    recipe.build(rows)
    tokenizer = recipe.tokenizer
    # each completion's own tokens and the EOS are the targets; the prompt and BOS are not
    completion_tokens = [
        len(tokenizer(p["completion"], add_special_tokens=False)["input_ids"]) + 1 for p in PAIRS
    ]
    assert recipe.units(rows) == sum(completion_tokens)
    expected = []
    for pair in PAIRS:
        prompt_ids = tokenizer(pair["prompt"])["input_ids"]
        completion_ids = tokenizer(pair["completion"], add_special_tokens=False)["input_ids"]
        ids = [*prompt_ids, *completion_ids, tokenizer.eos_token_id]
        expected.append((ids, [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)))
    mean, count = manual_loss(recipe.model, expected)
    assert count == recipe.units(rows)
    with torch.no_grad():
        got = float(recipe.loss(rows, recipe.units(rows)))
        summed, tokens = recipe.eval_partial(rows)
    assert got == pytest.approx(mean, rel=1e-5)
    assert tokens == count and summed / tokens == pytest.approx(mean, rel=1e-5)
    split_matches_whole(recipe, rows)


def test_guard_split_step_has_the_gradient_of_the_completion_token_mean(
    llama_dir: str, tmp_path: Path
) -> None:
    from memfit.guard import Guard

    recipe = recipe_for(llama_dir, tmp_path, prompt_column="prompt", completion_column="completion")
    rows = list(recipe.read(write_jsonl(tmp_path / "train.jsonl", PAIRS)))
    recipe.build(rows)
    recipe.model.eval()
    params = [p for p in recipe.model.parameters() if p.requires_grad]
    # by hand: every completion token of the step weighs the same, whatever row holds it
    mean, _ = manual_mean(recipe.model, [(list(r[TOKENS]), list(r[TARGETS])) for r in rows])
    mean.backward()
    expected = gradients(recipe.model)
    recipe.model.zero_grad(set_to_none=True)
    guard = Guard(micro_batch_size=len(rows) // 2)
    guard.step(rows, recipe, params=params)
    split = gradients(recipe.model)
    for name in expected:
        torch.testing.assert_close(
            split[name], expected[name].float(), atol=1e-6, rtol=1e-5, msg=name
        )


def test_prompt_completion_rows_made_by_hand(llama_dir: str, tmp_path: Path) -> None:
    read = recipe_for(llama_dir, tmp_path, prompt_column="prompt", completion_column="completion")
    rows = read.read(write_jsonl(tmp_path / "train.jsonl", PAIRS))
    recipe = recipe_for(llama_dir, tmp_path, prompt_column="prompt", completion_column="completion")
    recipe.build([])
    assert recipe.units([dict(p) for p in PAIRS]) == read.units(rows)
    assert recipe.lengths([dict(p) for p in PAIRS]) == read.lengths(rows)
    with pytest.raises(UsageError, match="column 'completion' is empty"):
        recipe.units([{"prompt": "what is", "completion": " "}])


def test_prompt_completion_bad_rows_refused_at_their_lines(llama_dir: str, tmp_path: Path) -> None:
    long_prompt = "hello there how are you and the cat sat on the mat"
    rows = [
        PAIRS[0],
        {"prompt": "what is", "completion": ""},
        {"prompt": "what is"},
        {"prompt": long_prompt, "completion": " fine"},
        PAIRS[1],
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    limit = 10  # the long prompt's tokens (BOS in) fill it; the others fit
    options = dict(prompt_column="prompt", completion_column="completion", max_seq_len=limit)
    with pytest.raises(DataError) as caught:
        recipe_for(llama_dir, tmp_path, **options).read(path)
    shown = str(caught.value).splitlines()
    assert shown == [
        f"--train-file: {path} line 2: column 'completion' is empty",
        f"--train-file: {path} line 3: no column 'completion' (columns: prompt)",
    ]
    # the row that fits no completion is found once the others are fixed (while tokenizing)
    path = write_jsonl(tmp_path / "train.jsonl", [PAIRS[0], rows[3], PAIRS[1]])
    with pytest.raises(
        DataError,
        match=rf"^--train-file: {path} line 2: the prompt fills "
        rf"--max-seq-len \(\d+ tokens, the limit is {limit}\)",
    ):
        recipe_for(llama_dir, tmp_path, **options).read(path)

    skipping = recipe_for(llama_dir, tmp_path, skip=True, **options)
    prompt_tokens = len(skipping._load_tokenizer()(long_prompt)["input_ids"])
    assert prompt_tokens >= limit
    kept = skipping.read(write_jsonl(tmp_path / "all.jsonl", rows))
    assert len(kept) == 2
    assert [(p.line, p.reason.split(":")[0]) for p in skipping.data_options.skipped] == [
        (2, "column 'completion' is empty"),
        (3, "no column 'completion' (columns"),
        (4, f"the prompt fills --max-seq-len ({prompt_tokens} tokens, the limit is {limit})"),
    ]


def test_a_completion_past_max_seq_len_is_truncated(llama_dir: str, tmp_path: Path) -> None:
    recipe = recipe_for(
        llama_dir, tmp_path, prompt_column="prompt", completion_column="completion", max_seq_len=8
    )
    row = {"prompt": "the cat", "completion": " sat on the mat and the cat sat on the mat"}
    (kept,) = recipe.read(write_jsonl(tmp_path / "t.jsonl", [row]))
    prompt_tokens = len(recipe.tokenizer("the cat")["input_ids"])
    assert recipe.lengths([kept]) == [8] and recipe.units([kept]) == 8 - prompt_tokens


# --- chats ---------------------------------------------------------------------------------------
def test_chat_loss_covers_the_assistant_turns_only(llama_dir: str, tmp_path: Path) -> None:
    recipe = recipe_for(llama_dir, tmp_path, messages_column="messages")
    rows = recipe.read(write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]))
    recipe.build(rows)
    tokenizer = recipe.tokenizer
    expected = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        # the assistant's tokens: each reply and its end of turn, found in the ids by hand
        targets = [0] * len(ids)
        end, newline = tokenizer.convert_tokens_to_ids(["<|end|>", "Ċ"])
        header = tokenizer.convert_tokens_to_ids("<|assistant|>")
        for i, token in enumerate(ids):
            if token == header:
                j = i + 2  # past the header and its newline
                while ids[j - 1] != end:
                    targets[j] = 1
                    j += 1
                targets[j] = int(ids[j] == newline)
        expected.append((ids, targets))
    mean, count = manual_loss(recipe.model, expected)
    assert recipe.units(rows) == count
    with torch.no_grad():
        assert float(recipe.loss(rows, count)) == pytest.approx(mean, rel=1e-5)
    split_matches_whole(recipe, rows)


def chat_rows_with_every_problem() -> list[Any]:
    long_user = " ".join(["hello there how are you"] * 6)
    return [
        {"messages": CHATS[0]},
        {"messages": "what is two plus two"},
        {"messages": [{"role": "user", "content": "hi"}, {"content": "it is four"}]},
        {"messages": [{"role": "user", "content": "what is two plus two"}]},
        {"messages": CHATS[3]},
        {"messages": [{"role": "user", "content": long_user}, CHATS[0][1]]},
    ]


def test_chat_bad_rows_refused_at_their_lines(llama_dir: str, tmp_path: Path) -> None:
    rows = chat_rows_with_every_problem()
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    options = dict(messages_column="messages", max_seq_len=24)
    with pytest.raises(DataError) as caught:
        recipe_for(llama_dir, tmp_path, **options).read(path)
    shown = str(caught.value).splitlines()
    assert [line.split(": column")[0] for line in shown] == [
        f"--train-file: {path} line {n}" for n in (2, 3, 4)
    ]
    assert "not a list of messages" in shown[0]
    assert "message 2: no 'role' key" in shown[1]
    assert "has no assistant turn (roles: user)" in shown[2]
    path = write_jsonl(tmp_path / "long.jsonl", [rows[0], rows[5]])
    with pytest.raises(
        DataError,
        match=rf"^--train-file: {path} line 2: the conversation before the first assistant reply "
        r"fills --max-seq-len \(\d+ tokens, the limit is 24\): no assistant token is left",
    ):
        recipe_for(llama_dir, tmp_path, **options).read(path)


def test_chat_bad_rows_skipped_and_counted(llama_dir: str, tmp_path: Path) -> None:
    recipe = recipe_for(llama_dir, tmp_path, skip=True, messages_column="messages", max_seq_len=24)
    kept = recipe.read(write_jsonl(tmp_path / "chat.jsonl", chat_rows_with_every_problem()))
    assert len(kept) == 2
    assert [p.line for p in recipe.data_options.skipped] == [2, 3, 4, 6]
    assert all(
        p.flag == "--train-file" and p.file.endswith("chat.jsonl")
        for p in recipe.data_options.skipped
    )


def test_a_tokenizer_without_a_chat_template_refuses_the_run(
    plain_llama_dir: str, tmp_path: Path
) -> None:
    recipe = recipe_for(plain_llama_dir, tmp_path, skip=True, messages_column="messages")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    with pytest.raises(UsageError) as caught:
        recipe.read(path)
    message = str(caught.value)
    assert not isinstance(caught.value, DataError) and "\n" not in message
    assert message.startswith("--messages-column: ") and plain_llama_dir in message
    assert "no chat template" in message
    # prompt/completion rows need none
    pairs = recipe_for(
        plain_llama_dir, tmp_path, prompt_column="prompt", completion_column="completion"
    )
    assert len(pairs.read(write_jsonl(tmp_path / "p.jsonl", PAIRS))) == len(PAIRS)


# --- flags ---------------------------------------------------------------------------------------
def test_recipe_and_config_refuse_flags_that_do_not_go_together(tmp_path: Path) -> None:
    with pytest.raises(
        UsageError, match=r"^--packing-strategy wrapped: not with --prompt-column/--completion"
    ):
        CausalLMRecipe(
            "m", prompt_column="p", completion_column="c", packing=True, packing_strategy="wrapped"
        )
    with pytest.raises(UsageError, match="go together"):
        CausalLMRecipe("m", completion_column="c")
    train = write_jsonl(tmp_path / "t.jsonl", PAIRS)
    cfg = TrainConfig(
        task="classification",
        model="m",
        train_file=str(train),
        output_dir=str(tmp_path / "out"),
        messages_column="messages",
    )
    assert "--messages-column: only for --task causal-lm (got --task classification)" in (
        config_problems(cfg)
    )
    cfg = TrainConfig(
        task="causal-lm",
        model="m",
        train_file=str(train),
        output_dir=str(tmp_path / "out"),
        prompt_column="prompt",
        text_column="body",
        packing=True,
        packing_strategy="wrapped",
    )
    found = [p.split(":")[0] for p in config_problems(cfg)]
    assert {
        "--prompt-column and --completion-column go together",
        "--packing-strategy wrapped",
        "--text-column",
    } <= {p.split(" (")[0] for p in found}


# --- data profile ---------------------------------------------------------------------------------
def test_data_profile_measures_rendered_rows(llama_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    profile = DataProfile.from_file(
        pairs, [], llama_dir, prompt_column="prompt", completion_column="completion"
    )
    assert profile.lengths.tolist() == [
        len(tokenizer(p["prompt"] + p["completion"])["input_ids"]) + 1 for p in PAIRS
    ]
    assert profile.to_dict()["rendering"] == "prompt + completion + eos"
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    profile = DataProfile.from_file(chats, [], llama_dir, messages_column="messages")
    assert profile.lengths.tolist() == [
        len(tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"])
        for c in CHATS
    ]
    assert profile.text_columns == ("messages",) and "chat template" in profile.summary_lines()[1]
    # and the lengths memfit train sees, before truncation, are the same
    recipe = recipe_for(llama_dir, tmp_path, messages_column="messages", max_seq_len=128)
    assert recipe.lengths(recipe.read(chats)) == profile.lengths.tolist()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[0]}, {"messages": []}])
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: column 'messages' is not a list"):
        DataProfile.from_file(bad, [], llama_dir, messages_column="messages")
    # --skip-bad-rows: the rows memfit train would keep, and how many were left out
    kept = DataProfile.from_file(bad, [], llama_dir, messages_column="messages", skip_bad_rows=True)
    assert kept.lengths.tolist() == profile.lengths.tolist()[:1]
    assert kept.skipped_rows == 1 and kept.to_dict()["skipped_rows"] == 1


def test_data_profile_cli(
    llama_dir: str, plain_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    flags = ["--prompt-column", "prompt", "--completion-column", "completion"]
    code, out, _ = run("data", "profile", str(pairs), "--model", llama_dir, *flags, "--json")
    profile = DataProfile.from_file(
        pairs, [], llama_dir, prompt_column="prompt", completion_column="completion"
    )
    assert code == 0 and json.loads(out)["tokens"]["max"] == profile.max_length
    assert json.loads(out)["text_columns"] == ["prompt", "completion"]
    code, _, err = run("data", "profile", str(pairs), "--model", llama_dir, "--prompt-column", "p")
    assert code == 2 and "--prompt-column and --completion-column go together" in err
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    code, _, err = run(
        "data", "profile", str(chats), "--model", plain_llama_dir, "--messages-column", "messages"
    )
    assert code == 2 and "--messages-column: the tokenizer of" in err and "no chat template" in err
