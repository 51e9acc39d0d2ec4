"""Instruction rows (:mod:`memfit.data.instructions`): the targets of prompt/completion rows and of
chats (with the template's generation markers, and found from rendered prefixes without them),
truncation from the right, the rows that cannot be trained on, the messages a row may hold, and
the flags' problems."""

from __future__ import annotations

import json
import os
import sys
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
from tiny_models import CHAT_TEMPLATE, SENTENCES, save_tiny_llama

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
    # padding-free packing keeps each row's loss mask; wrapped blocks would cut it
    assert problems(messages_column="m", packing="bfd") == []
    (one,) = problems(messages_column="m", packing="wrapped")
    assert one.startswith("--packing-strategy wrapped: not with --messages-column")
    (one,) = problems(prompt_column="p", completion_column="c", text_column="body")
    assert one.startswith("--text-column: not with --prompt-column/--completion-column")
    assert len(problems(prompt_column="p", packing="wrapped", text_column="t")) == 3


# --- the bounds of a template's rendering (issue 30) -------------------------------------------
# a template is a program from the model folder: one that loops or grows without end costs its
# row, never the run. Each renders the conversation first, so only the bound can stop it.
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROWS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 10 ** 10 }}"
# real templates, as their tokenizer_config.json holds them (Llama 3, Qwen 2.5, Gemma, Mistral,
# Phi-3): rendered as transformers renders them, never past a bound
REAL_TEMPLATES = {
    "llama-3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
        "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
        "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "qwen-2.5": (
        "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
        "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You "
        "are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}"
        '\n    {{- "\\n\\n# Tools\\n\\n<tools>" }}\n    {%- for tool in tools %}\n        '
        '{{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>'
        "<|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        "
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else "
        "%}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in "
        'messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not '
        'loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n        '
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
        "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role "
        "}}\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n"
        "        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            "
        "{%- if tool_call.function is defined %}\n                {%- set tool_call = "
        "tool_call.function %}\n            {%- endif %}\n            {{- '\\n<tool_call>\\n"
        '{"name": "\' }}\n            {{- tool_call.name }}\n            {{- \'", "arguments": '
        "' }}\n            {{- tool_call.arguments | tojson }}\n            {{- '}\\n</tool_call>"
        "' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role "
        '== "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != '
        "\"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- "
        "'\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n"
        "</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "
        "\"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}"
        "\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}"
        "\n{%- endif %}\n"
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
        "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
        "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
        "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
        "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
        "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{'<start_of_turn>model\n'}}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index % 2 == 1) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
        "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
        "user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    ),
    "phi-3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
        "{% endif %}"
    ),
}


@pytest.fixture
def template(tokenizer: Any) -> Any:
    """Sets the tokenizer's chat template for one test (the fixture's own back after it)."""

    def use(text: str) -> None:
        tokenizer.chat_template = text

    yield use
    tokenizer.chat_template = CHAT_TEMPLATE


def end_renderer() -> None:
    """Ends memfit's rendering process and waits for it: its peak then counts among the
    children's."""
    from memfit.data import instructions

    renderer = getattr(instructions, "_RENDERER", None)
    if renderer is not None:
        renderer.close()


def children_peak_bytes() -> int:
    """The largest resident size of the children of this process that have ended (ru_maxrss:
    KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def test_a_template_that_loops_without_end_is_a_bad_row_in_its_time(
    tokenizer: Any, template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from memfit.data import instructions

    monkeypatch.setattr(instructions, "RENDER_SECONDS", 1.0, raising=False)
    template(LOOPS + CHAT_TEMPLATE)
    start = time.monotonic()
    row = tokenize_chat(tokenizer, CHATS[0], markers=True)
    assert time.monotonic() - start < 30  # the loops alone run for hours
    assert row.ids == [] and row.targets == []
    assert row.problem == (
        "the chat template did not finish rendering this conversation within 1 s (memfit's "
        "bound per row: does the template loop without end?)"
    )
    # the next row renders in a fresh renderer, with a template that ends
    template(CHAT_TEMPLATE)
    assert tokenize_chat(tokenizer, CHATS[0], markers=True).problem is None


@pytest.mark.parametrize("text", [GROWS, HUGE])
def test_a_template_that_grows_without_end_is_a_bad_row_within_its_memory(
    tokenizer: Any, template: Any, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    from memfit.data import instructions

    monkeypatch.setattr(instructions, "RENDER_MEMORY", 32 << 20, raising=False)
    end_renderer()  # the rows before: their renderer's peak is counted here
    before = children_peak_bytes()
    template(text + CHAT_TEMPLATE)
    row = tokenize_chat(tokenizer, CHATS[1], markers=False)
    assert row.ids == [] and row.targets == []
    assert row.problem is not None
    assert row.problem.startswith("the chat template needs more than 32.")
    assert row.problem.endswith("of memory to render this conversation (memfit's bound per row)")
    end_renderer()  # ended and waited for: its peak is counted now
    # the template alone asks for 10 GB and more; its renderer stayed small
    assert children_peak_bytes() <= max(before, 1 << 30)


def test_a_template_that_renders_too_much_text_is_a_bad_row(
    tokenizer: Any, template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.data import instructions

    monkeypatch.setattr(instructions, "RENDER_CHARS", 1000, raising=False)
    template("{{ 'x' * 100000 }}" + CHAT_TEMPLATE)
    row = tokenize_chat(tokenizer, CHATS[0], markers=True)
    assert row.problem is not None
    assert row.problem.startswith("the chat template renders more than 1,")
    assert row.problem.endswith("characters for this conversation (memfit's bound for this row)")


def test_a_template_past_its_bounds_on_every_row_is_not_run_again(
    tokenizer: Any, template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from memfit.data import instructions

    monkeypatch.setattr(instructions, "RENDER_SECONDS", 1.0, raising=False)
    monkeypatch.setattr(instructions, "RENDER_GIVE_UP", 2, raising=False)
    template(LOOPS + "{# another template #}" + CHAT_TEMPLATE)
    problems = [tokenize_chat(tokenizer, CHATS[0], markers=True).problem for _ in range(2)]
    assert all(p is not None and "within 1 s" in p for p in problems)
    start = time.monotonic()
    row = tokenize_chat(tokenizer, CHATS[1], markers=True)
    assert time.monotonic() - start < 0.5  # not run: no second of waiting
    assert row.problem == (
        "not rendered: the chat template passed memfit's bounds on the 2 rows before this one "
        "and rendered none of them"
    )


# --- the renderer's process: never past its parent, never shadowed, one framing ----------------
PARENT = """
import os, sys, threading, time
from memfit.data import instructions

instructions.RENDER_SECONDS = 600.0  # only the parent's end may stop the loop here
renderer = instructions._renderer()
chat = [{"role": "user", "content": "hi"}]
def request(template):
    return {"template": template, "specials": {}, "messages": chat, "renders": [[1, False, False]]}
renderer.render(request("{{ messages[0].content }}"), instructions._Clock())  # started
pids = [renderer.proc.pid]
if sys.argv[2] == "forked":
    # a forked copy of this process (a DataLoader worker, say) holds the renderer's stdin open:
    # no EOF reaches it when this process ends
    holder = os.fork()
    if holder == 0:
        time.sleep(120)
        os._exit(0)
    pids.append(holder)
loop = threading.Thread(target=renderer.render, args=(request(sys.argv[3]), instructions._Clock()))
loop.start()
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(" ".join(map(str, pids)))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
loop.join()
"""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is there in CI
        stat = Path(f"/proc/{pid}/stat")
        if not stat.parent.parent.is_dir():
            pytest.skip("neither psutil nor /proc to see the process")
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        return bool(psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD))
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pid: int, seconds: float) -> bool:
    import time

    end = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: SIGKILL and fork")
@pytest.mark.parametrize("how", ["alone", "forked"])
def test_the_renderer_ends_when_its_parent_is_killed_mid_render(tmp_path: Path, how: str) -> None:
    # SIGKILL to a process whose template loops: its renderer ends too, at once (EOF on its
    # stdin; with a forked copy holding that open, its parent's death), not hours later at 100 %
    import signal
    import subprocess
    import time

    pids_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pids_file), how, LOOPS])
    child = holder = 0
    try:
        end = time.monotonic() + 120
        while not pids_file.exists():
            assert parent.poll() is None and time.monotonic() < end, "the parent did not start"
            time.sleep(0.1)
        child, *rest = map(int, pids_file.read_text().split())
        holder = rest[0] if rest else 0
        time.sleep(1.0)  # the loop is running
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_gone(child, 5.0), "the renderer outlived its parent"
    finally:
        for pid in (parent.pid, child, holder):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_the_renderer_outlives_the_thread_that_started_it() -> None:
    # Linux sends the parent-death signal when the starting *thread* ends: the renderer ends only
    # when its parent process did, so a row from another thread still finds it
    import threading
    import time

    from memfit.data import instructions

    end_renderer()
    renderer = instructions._renderer()
    request = {
        "template": "{{ messages[0].content }}!",
        "specials": {},
        "messages": [{"role": "user", "content": "hi"}],
        "renders": [[1, False, False]],
    }
    starter = threading.Thread(target=renderer.render, args=(request, instructions._Clock()))
    starter.start()
    starter.join()
    assert renderer.proc is not None
    pid = renderer.proc.pid
    time.sleep(0.5)  # a signal on the thread's end has arrived
    assert renderer.render(request, instructions._Clock()) == [("hi!", None)]
    assert renderer.proc is not None and renderer.proc.pid == pid


@pytest.mark.skipif(os.name != "posix", reason="POSIX: the parent id changes")
def test_the_watchdog_ends_the_renderer_where_its_parent_id_changes(tmp_path: Path) -> None:
    # where there is no PR_SET_PDEATHSIG (macOS, BSD): a thread watches the parent's id
    import signal
    import subprocess
    import time

    watcher = (
        "import sys; from memfit.data import _render_child as c; c._watch_parent(int(sys.argv[1]))"
    )
    middle = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {watcher!r}, str(os.getpid())])\n"
        "open(sys.argv[1], 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", middle, str(pid_file)])
    child = 0
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_gone(child, 5.0), "the watchdog did not end the process"
    finally:
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(os.name != "posix", reason="RLIMIT_CPU: POSIX")
def test_a_runaway_render_ends_on_its_own_past_its_cpu_time() -> None:
    # nobody stops it (a parent stopped, say): the system ends it after the row's seconds of CPU
    # and a little more, not hours later
    import signal
    import subprocess

    from memfit.data import _render_child, instructions

    proc = subprocess.Popen(
        instructions._child_command(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert _render_child.read_frame(proc.stdout) == {"ready": True}
        request = {
            "template": LOOPS,
            "specials": {},
            "messages": [{"role": "user", "content": "hi"}],
            "renders": [[1, False, False]],
            "memory": 1 << 30,
            "chars": 1 << 20,
            "seconds": 0.5,
        }
        _render_child.send_frame(proc.stdin, request)
        assert proc.wait(timeout=60) == -signal.SIGXCPU  # ~3 CPU seconds; the loops take hours
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_module_in_the_current_folder_does_not_replace_the_renderers(
    tokenizer: Any, template: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `python -m` would import this jinja2.py (the current folder first on sys.path): every chat
    # row would fail
    from memfit.data import instructions

    (tmp_path / "jinja2.py").write_text("raise ImportError('the folder jinja2.py was imported')\n")
    (tmp_path / "json.py").write_text("raise ImportError('the folder json.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    end_renderer()  # the next row starts a renderer here
    try:
        template(REAL_TEMPLATES["llama-3"])
        chat = CHATS[0]
        assert instructions._texts(tokenizer, chat, [(2, False)], instructions._Clock()) == [
            tokenizer.apply_chat_template(chat, tokenize=False)
        ]
    finally:
        end_renderer()


def test_without_safe_path_the_renderer_drops_its_own_folder(tmp_path: Path) -> None:
    # Python 3.10 has no -P: the script's folder (sys.path[0]) is dropped before any import
    import shutil
    import subprocess

    from memfit.data import _render_child

    script = tmp_path / "_render_child.py"
    shutil.copy(_render_child.__file__, script)
    (tmp_path / "jinja2.py").write_text("raise ImportError('the folder jinja2.py was imported')\n")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    ready = _render_child.read_frame(proc.stdout)
    request = {
        "template": "{{ messages[0].content }}!",
        "specials": {},
        "messages": [{"role": "user", "content": "hi"}],
        "renders": [[1, False, False]],
        "memory": 1 << 30,
        "chars": 1 << 20,
        "seconds": 10.0,
    }
    if ready is not None:
        _render_child.send_frame(proc.stdin, request)
        reply = _render_child.read_frame(proc.stdout)
    _, err = proc.communicate(timeout=60)  # EOF on its stdin: it ends
    assert ready == {"ready": True}, err.decode()
    assert reply == {"texts": [["hi!", None]]}
    assert proc.returncode == 0


def test_the_wait_for_the_renderer_needs_no_select(
    tokenizer: Any, template: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Windows' select() takes sockets, not pipes: a wait on it would fail every chat row there
    import select

    from memfit.data import instructions

    def windows_select(*_: Any) -> Any:
        raise OSError(10038, "An operation was attempted on something that is not a socket")

    monkeypatch.setattr(select, "select", windows_select)
    end_renderer()
    template(REAL_TEMPLATES["gemma"])
    chat = CHATS[0]
    assert instructions._texts(tokenizer, chat, [(2, False)], instructions._Clock()) == [
        tokenizer.apply_chat_template(chat, tokenize=False)
    ]


def test_one_framing_for_both_sides() -> None:
    # the parent reads and writes its renderer's frames with the renderer's own functions
    import io
    import queue

    from memfit.data import _render_child, instructions

    stream = io.BytesIO()
    value = {"texts": [["héllo ✓", [[0, 3]]]], "n": 1}
    _render_child.send_frame(stream, value)
    data = stream.getvalue()
    assert _render_child.read_frame(io.BytesIO(data)) == value
    assert _render_child.read_frame(io.BytesIO(data[:-1])) is None  # cut short: the end
    assert _render_child.read_frame(io.BytesIO(b"")) is None
    replies: queue.Queue[Any] = queue.Queue()
    instructions._pump(io.BytesIO(data + data[:3]), replies)
    assert [replies.get_nowait() for _ in range(2)] == [value, None]


@pytest.mark.parametrize("name", list(REAL_TEMPLATES))
def test_real_templates_render_as_transformers_renders_them_over_long_chats(
    tokenizer: Any, template: Any, name: str
) -> None:
    template(REAL_TEMPLATES[name])
    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{SENTENCES[i % 7]} #{i}."}
        for i in range(200)
    ]
    from memfit.data import instructions

    # the bounded renderer's text is transformers' own
    wanted = [(len(chat), False), (len(chat) - 1, True)]
    assert instructions._texts(tokenizer, chat, wanted, instructions._Clock()) == [
        tokenizer.apply_chat_template(chat, tokenize=False),
        tokenizer.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True),
    ]
    row = tokenize_chat(tokenizer, chat, markers=False)
    if name == "phi-3":
        # its EOS after the last turn: a start renders differently from the whole (the
        # prefixes cannot find the turns; the message says to add the markers), no bound
        assert row.problem is not None
        assert row.problem.startswith("the chat template renders the conversation up to ")
        return
    assert row.problem is None
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert row.ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    targets = decoded_targets(tokenizer, row.ids, row.targets)
    for message in chat:
        assert (message["content"] in targets) == (message["role"] == "assistant")


def test_generation_markers_give_transformers_own_mask(tokenizer: Any) -> None:
    for chat in CHATS:
        row = tokenize_chat(tokenizer, chat, markers=True)
        out = tokenizer.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert row.ids == list(out["input_ids"])
        assert row.targets == list(out["assistant_masks"])
