"""Instruction rows (:mod:`memfit.data.instructions`): the targets of prompt/completion rows and of
chats (with the template's generation markers, and found from rendered prefixes without them),
truncation from the right, the rows that cannot be trained on, the messages a row may hold, and
the flags' problems."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.data.instructions import (
    IGNORE_INDEX,
    chat_template_problem,
    flag_problems,
    has_generation_markers,
    labels_of,
    parse_messages,
    tokenize_chat,
    tokenize_prompt_completion,
)
from memfit.data.rows import Column, DataError, DataOptions, read_rows
from tiny_models import CHAT_TEMPLATE, save_tiny_llama

SENTENCES = [
    "what is two plus two",
    "it is four",
    "the cat sat on the mat",
    "name a colour",
    "blue is a colour",
    "hello there how are you",
    "i am fine thank you",
]
# the same rendering without the markers: the assistant turns are found from rendered prefixes
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHATS = [
    [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "it is four"},
    ],
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "blue is a colour"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "i am fine thank you"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), SENTENCES)


def assistant_text(chat: list[dict[str, str]]) -> str:
    """What the template renders of the assistant turns: each reply, its end-of-turn, newline."""
    return "".join(m["content"] + "<|end|>\n" for m in chat if m["role"] == "assistant")


def decoded_targets(tokenizer: Any, ids: list[int], targets: list[int]) -> str:
    return str(tokenizer.decode([i for i, t in zip(ids, targets, strict=True) if t]))


# --- prompt/completion ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "completion"),
    [
        ("what is two plus two", " it is four"),
        ("name a colour:", "\nblue is a colour"),
        ("the ca", "t sat on the mat"),  # the join falls inside a word: a token spans it
    ],
)
def test_prompt_completion_targets_are_the_completion_and_eos(
    tokenizer: Any, prompt: str, completion: str
) -> None:
    (row,) = tokenize_prompt_completion(tokenizer, [prompt], [completion])
    whole = tokenizer(prompt + completion)["input_ids"]
    assert row.problem is None
    assert row.ids == [*whole, tokenizer.eos_token_id]  # BOS as the tokenizer adds it, then EOS
    start = row.targets.index(1)
    assert row.targets == [0] * start + [1] * (len(row.ids) - start)
    # the context is the prompt's own first tokens; the targets hold all of the completion
    assert row.ids[:start] == tokenizer(prompt)["input_ids"][:start]
    learned = tokenizer.decode(row.ids[start:-1])
    assert learned.endswith(completion) and (prompt + completion).endswith(learned)
    assert row.ids[-1] == tokenizer.eos_token_id and row.targets[-1] == 1
    assert row.target_count == len(row.ids) - start
    labels = labels_of(row.ids, row.targets)
    assert labels[:start] == [IGNORE_INDEX] * start and labels[start:] == row.ids[start:]


def test_a_completion_past_max_seq_len_is_cut_from_the_right(tokenizer: Any) -> None:
    prompt, completion = "what is two", " plus two it is four"
    (whole,) = tokenize_prompt_completion(tokenizer, [prompt], [completion])
    start = whole.targets.index(1)
    limit = start + 2
    (cut,) = tokenize_prompt_completion(tokenizer, [prompt], [completion], limit)
    assert cut.ids == whole.ids[:limit] and cut.targets == whole.targets[:limit]
    assert cut.target_count == 2 and cut.ids[-1] != tokenizer.eos_token_id


def test_a_prompt_that_fills_max_seq_len_leaves_nothing_to_learn(tokenizer: Any) -> None:
    prompt = "the cat sat on the mat"
    start = len(tokenizer(prompt)["input_ids"])
    rows = tokenize_prompt_completion(tokenizer, [prompt, prompt], [" ok", " ok"], start)
    for row in rows:
        assert row.ids == [] and row.problem is not None
        assert (
            "the prompt fills --max-seq-len" in row.problem and f"limit is {start}" in row.problem
        )
    (fits,) = tokenize_prompt_completion(tokenizer, [prompt], [" ok"], start + 1)
    assert fits.problem is None and fits.target_count == 1


# --- chats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", CHATS)
def test_chat_targets_with_generation_markers(tokenizer: Any, chat: list[dict[str, str]]) -> None:
    assert has_generation_markers(tokenizer)
    row = tokenize_chat(tokenizer, chat)
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert row.problem is None
    assert row.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert decoded_targets(tokenizer, row.ids, row.targets) == assistant_text(chat)
    assert row.targets[0] == 0  # the BOS, the system and user turns are context


@pytest.mark.parametrize("chat", CHATS)
def test_chat_targets_from_rendered_prefixes_match_the_markers(
    tokenizer: Any, chat: list[dict[str, str]]
) -> None:
    marked = tokenize_chat(tokenizer, chat, markers=True)
    tokenizer.chat_template = PLAIN_TEMPLATE
    try:
        assert not has_generation_markers(tokenizer)
        plain = tokenize_chat(tokenizer, chat)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert plain.problem is None
    assert (plain.ids, plain.targets) == (marked.ids, marked.targets)


def test_a_template_whose_prefix_renders_differently_is_a_bad_row(tokenizer: Any) -> None:
    # the last message rendered in capitals: a conversation's start is no prefix of the whole
    shouting = PLAIN_TEMPLATE.replace(
        "{{ message['content'] }}",
        "{% if loop.last %}{{ message['content'] | upper }}{% else %}"
        "{{ message['content'] }}{% endif %}",
    )
    tokenizer.chat_template = shouting
    try:
        row = tokenize_chat(tokenizer, CHATS[1])
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert row.ids == [] and row.problem is not None
    assert "{% generation %}" in row.problem and "message" in row.problem


def test_a_template_that_raises_is_a_bad_row(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        row = tokenize_chat(tokenizer, CHATS[0], markers=False)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert row.problem is not None and "roles must alternate" in row.problem


def test_chat_truncation_and_a_first_reply_past_max_seq_len(tokenizer: Any) -> None:
    chat = CHATS[1]
    whole = tokenize_chat(tokenizer, chat)
    first = whole.targets.index(1)
    cut = tokenize_chat(tokenizer, chat, first + 3)
    assert cut.ids == whole.ids[: first + 3] and cut.targets == whole.targets[: first + 3]
    assert cut.target_count == 3
    late = tokenize_chat(tokenizer, chat, first)
    assert late.problem is not None and "before the first assistant reply fills" in late.problem


def test_an_empty_reply_renders_no_assistant_token_without_markers(tokenizer: Any) -> None:
    # the plain template's span of an empty reply is its end-of-turn: still a target
    chat = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": ""}]
    row = tokenize_chat(tokenizer, chat, markers=False)
    assert decoded_targets(tokenizer, row.ids, row.targets) == "<|end|>\n"
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    try:
        empty = tokenize_chat(tokenizer, chat)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert empty.problem is not None and "no assistant token" in empty.problem


def test_chat_template_problem(tokenizer: Any) -> None:
    assert chat_template_problem(tokenizer, "m") is None
    tokenizer.chat_template = None
    try:
        problem = chat_template_problem(tokenizer, "models/tiny")
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert problem is not None and "\n" not in problem
    assert problem.startswith("--messages-column:") and "models/tiny" in problem
    assert "no chat template" in problem


# --- messages in a row ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("hello", "text that is not JSON"),
        ({"role": "user"}, "got an object"),
        ([], "got an empty list"),
        (None, "got null"),
        ([["user", "hi"]], 'message 1: not a {"role", "content"} object (got a list)'),
        ([{"role": "user", "text": "hi"}], "message 1: no 'content' key (keys: role, text)"),
        ([{"content": "hi"}], "message 1: no 'role' key"),
        ([{"role": 3, "content": "hi"}], "message 1: 'role' is not a name"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"a": 1}]}],
            "message 2: 'content' is not text (got a list)",
        ),
        ([{"role": "user", "content": "hi"}], "has no assistant turn (roles: user)"),
    ],
)
def test_parse_messages_refuses(value: Any, reason: str) -> None:
    messages, why = parse_messages(value, "messages")
    assert messages is None and why is not None
    assert why.startswith("column 'messages'") and reason in why


def test_parse_messages_reads_json_text_and_keeps_other_keys() -> None:
    chat = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
    ]
    assert parse_messages(json.dumps(chat), "m") == (chat, None)
    assert parse_messages(chat, "m") == (chat, None)


def test_read_rows_checks_messages_at_their_lines(tmp_path: Path) -> None:
    good = CHATS[0]
    lines = [
        {"messages": good},
        {"messages": "not json"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": good},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    with pytest.raises(DataError) as caught:
        read_rows(path, [Column("messages", "messages")], flag="--train-file")
    shown = str(caught.value).splitlines()
    assert len(shown) == 2
    assert shown[0].startswith(f"--train-file: {path} line 2: column 'messages'")
    assert shown[1].startswith(f"--train-file: {path} line 3: column 'messages' has no assistant")
    options = DataOptions(skip_bad_rows=True)
    table = read_rows(path, [Column("messages", "messages")], flag="--train-file", options=options)
    assert len(table) == 2 and [p.line for p in options.skipped] == [2, 3]
    assert [json.loads(r["messages"]) for r in table] == [good, good]


def test_read_rows_reads_messages_from_a_csv_cell(tmp_path: Path) -> None:
    import csv

    path = tmp_path / "chat.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["messages"])
        writer.writerow([json.dumps(CHATS[1])])
        writer.writerow(['[{"role": "user"}]'])
    with pytest.raises(
        DataError, match=r"chat\.csv line 3: column 'messages' message 1: no 'content'"
    ):
        read_rows(path, [Column("messages", "messages")], flag="--train-file")


# --- flags ---------------------------------------------------------------------------------------
def test_flag_problems() -> None:
    def problems(**flags: Any) -> list[str]:
        settings: dict[str, Any] = dict(
            task="causal-lm",
            prompt_column=None,
            completion_column=None,
            messages_column=None,
            packing=False,
            text_column="text",
        )
        return flag_problems(**(settings | flags))

    assert problems() == []
    assert problems(prompt_column="p", completion_column="c") == []
    assert problems(messages_column="m") == []
    assert problems(packing=True, text_column="body") == []  # text rows: not these checks
    (one,) = problems(task="classification", messages_column="m")
    assert one.startswith("--messages-column: only for --task causal-lm")
    (one,) = problems(prompt_column="p")
    assert "--prompt-column and --completion-column go together" in one
    (one,) = problems(prompt_column="x", completion_column="x")
    assert "both name column 'x'" in one
    (one,) = problems(prompt_column="p", completion_column="c", messages_column="m")
    assert one.startswith("--messages-column: not with --prompt-column")
    (one,) = problems(messages_column="m", packing=True)
    assert one.startswith("--packing: not with --messages-column")
    (one,) = problems(prompt_column="p", completion_column="c", text_column="body")
    assert one.startswith("--text-column: not with --prompt-column/--completion-column")
    assert len(problems(prompt_column="p", packing=True, text_column="t")) == 3
