"""Instruction data for causal LM training: prompt/completion rows and chat messages, tokenized
with the mask of the tokens the loss covers, as TRL's ``SFTTrainer`` does
(``completion_only_loss``, ``assistant_only_loss``).

**Prompt/completion rows** (``--prompt-column P --completion-column C``): a row is the text
``prompt + completion`` (joined as they are, no separator: put the space or newline where the
text wants it) tokenized as the tokenizer tokenizes any text (its BOS, if it adds one), then the
tokenizer's EOS appended unless the encoding already ends with it, so the model learns to stop.
The prompt's tokens are the longest common start of that encoding and of the prompt tokenized
alone (TRL takes the prompt's own length and warns when the two disagree; a token that merges
across the join holds completion text, so it is counted a completion token here). The loss
covers the completion tokens and the EOS.

**Chat rows** (``--messages-column M``): a list of ``{"role", "content"}`` messages rendered with
the tokenizer's chat template (``apply_chat_template``); the loss covers the assistant turns'
tokens. Where the template marks them with ``{% generation %}`` … ``{% endgeneration %}`` the
mask is transformers' ``return_assistant_tokens_mask``. Otherwise the assistant spans are found by
rendering prefixes of the conversation: assistant turn *i* spans the characters from the end of
``render(messages[:i], add_generation_prompt=True)`` (or without the generation prompt, where
the template has none) to the end of ``render(messages[:i + 1])``, both checked to be prefixes
of the whole rendering; the tokens whose characters overlap a span (the tokenizer's offsets)
are the assistant's. A template that renders a conversation's start differently from the whole
conversation (one that drops earlier turns' reasoning, say) cannot be read this way: its rows are
bad rows, and the message says to add the markers.

**Truncation** to ``max_seq_len`` cuts from the right: a completion (or the last turns of a chat)
that runs past it is cut, its EOS with it. A row left with no token to learn from (the prompt,
or everything before the first assistant reply, fills ``max_seq_len``) is a bad row.

Position 0 is never a target (nothing predicts it): a row's target count is ``sum(targets[1:])``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# the label of a token the loss ignores (PyTorch's cross_entropy default)
IGNORE_INDEX = -100
# bumped when the tokenization of instruction rows changes (part of the cache key)
VERSION = "instructions-v1"

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class InstructionColumns:
    """Which columns hold instruction rows: ``prompt`` and ``completion``, or ``messages``
    (None for all: plain text rows)."""

    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None

    @property
    def kind(self) -> str:
        """``"messages"``, ``"prompt-completion"`` or ``"text"``."""
        if self.messages:
            return "messages"
        if self.prompt or self.completion:
            return "prompt-completion"
        return "text"

    @property
    def names(self) -> list[str]:
        """The columns a row must hold (none for text rows)."""
        if self.messages:
            return [self.messages]
        return [c for c in (self.prompt, self.completion) if c]


@dataclass(frozen=True)
class Tokenized:
    """One row's tokens, ``targets`` (1: a token the loss covers, 0: context) of the same length,
    or why the row cannot be trained on (``problem``; then both are empty)."""

    ids: list[int]
    targets: list[int]
    problem: str | None = None

    @property
    def target_count(self) -> int:
        """Tokens with a loss after the shift (position 0 is never predicted)."""
        return sum(self.targets[1:])


def flag_problems(
    *,
    task: str,
    prompt_column: str | None,
    completion_column: str | None,
    messages_column: str | None,
    packing: bool,
    text_column: str | None = "text",
) -> list[str]:
    """The problems with the instruction flags, one line each (``text_column`` other than the
    default ``text`` counts as given: it cannot be told apart from a default otherwise)."""
    problems: list[str] = []
    given = [
        flag
        for flag, value in (
            ("--prompt-column", prompt_column),
            ("--completion-column", completion_column),
            ("--messages-column", messages_column),
        )
        if value is not None
    ]
    if not given:
        return problems
    names = "/".join(given)
    if task != "causal-lm":
        return [f"{names}: only for --task causal-lm (got --task {task})"]
    for flag, value in (
        ("--prompt-column", prompt_column),
        ("--completion-column", completion_column),
        ("--messages-column", messages_column),
    ):
        if value is not None and not str(value).strip():
            problems.append(f"{flag}: give a column name")
    if (prompt_column is None) != (completion_column is None):
        problems.append(
            "--prompt-column and --completion-column go together: give both (the loss covers "
            "the completion only)"
        )
    elif prompt_column is not None and prompt_column == completion_column:
        problems.append(
            f"--prompt-column and --completion-column both name column {prompt_column!r}; "
            "give two columns"
        )
    if messages_column is not None and (prompt_column or completion_column):
        problems.append(
            "--messages-column: not with --prompt-column/--completion-column; give one kind of rows"
        )
    if packing:
        problems.append(
            f"--packing: not with {names} (the loss masks of instruction rows are not packed); "
            "leave --packing out"
        )
    if text_column not in (None, "text"):
        problems.append(
            f"--text-column: not with {names} (instruction rows are read from those columns); "
            "leave --text-column out"
        )
    return problems


# --- messages -------------------------------------------------------------------------------------
def parse_messages(value: Any, column: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the messages, None) when ``value`` is a list of ``{"role", "content"}`` messages with at
    least one assistant turn (a JSON text of one, as a CSV cell holds it, too), else
    (None, why it is not). Other keys of a message (``name``, ``tool_calls``) are kept."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None, f"column {column!r} is not a list of messages (text that is not JSON)"
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _kind(value)
        return None, (
            f'column {column!r} is not a list of messages ({{"role", "content"}} objects; '
            f"got {what})"
        )
    for number, message in enumerate(value, start=1):
        why = _message_problem(message)
        if why is not None:
            return None, f"column {column!r} message {number}: {why}"
    if not any(m["role"] == "assistant" for m in value):
        roles = ", ".join(sorted({str(m["role"]) for m in value}))
        return None, (
            f"column {column!r} has no assistant turn (roles: {roles}): nothing to learn from"
        )
    return value, None


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f'not a {{"role", "content"}} object (got {_kind(message)})'
    for key in ("role", "content"):
        if key not in message:
            keys = ", ".join(str(k) for k in message) or "none"
            return f"no {key!r} key (keys: {keys})"
    if not isinstance(message["role"], str) or not message["role"].strip():
        return f"'role' is not a name (got {_kind(message['role'])})"
    if not isinstance(message["content"], str):
        return f"'content' is not text (got {_kind(message['content'])})"
    return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return "text"
    return type(value).__name__


def messages_of(value: Any) -> list[dict[str, Any]]:
    """The messages a table cell holds (the JSON text :func:`parse_messages` stored, or the
    list itself in a row made by hand)."""
    return json.loads(value) if isinstance(value, str) else list(value)


def chat_template_problem(tokenizer: Any, model: str) -> str | None:
    """Why ``tokenizer`` cannot render chat rows, naming ``--messages-column`` and ``model``
    (None when it can): it has no chat template, or it gives no character offsets."""
    if not getattr(tokenizer, "chat_template", None):
        return (
            f"--messages-column: the tokenizer of {model} has no chat template, so messages "
            "cannot be rendered; give a model whose tokenizer has one (chat_template in "
            "tokenizer_config.json, or chat_template.jinja), or write the rows as "
            "--prompt-column/--completion-column text"
        )
    if not getattr(tokenizer, "is_fast", False):
        return (
            f"--messages-column: the tokenizer of {model} is a slow (Python) tokenizer, which "
            "gives no character offsets to find the assistant turns by; use its fast tokenizer "
            "(tokenizer.json)"
        )
    return None


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks the assistant's tokens (``{% generation %}``)."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # no template at all: transformers raises ValueError
        return False
    return bool(_GENERATION.search(str(template)))


def template_key(tokenizer: Any) -> str:
    """What names the chat rendering in a cache key: the template's text."""
    return str(getattr(tokenizer, "chat_template", "") or "")


# --- tokenizing -----------------------------------------------------------------------------------
def tokenize_prompt_completion(
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    max_seq_len: int | None = None,
) -> list[Tokenized]:
    """Each prompt + completion tokenized, the EOS appended, the targets on the completion (see
    the module docstring), cut to ``max_seq_len`` from the right (None: not cut)."""
    options = {"return_attention_mask": False, "return_token_type_ids": False}
    wholes = tokenizer([p + c for p, c in zip(prompts, completions, strict=True)], **options)
    heads = tokenizer(list(prompts), **options)
    eos = tokenizer.eos_token_id
    out = []
    for whole, head in zip(wholes["input_ids"], heads["input_ids"], strict=True):
        ids = list(whole)
        start = _common_start(ids, list(head))
        if eos is not None and ids[-1:] != [eos]:
            ids.append(int(eos))  # the completion ends: the model learns to stop
        targets = [0] * start + [1] * (len(ids) - start)
        out.append(_cut(ids, targets, max_seq_len, "the prompt", "completion"))
    return out


def tokenize_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_seq_len: int | None = None,
    *,
    markers: bool | None = None,
) -> Tokenized:
    """The conversation rendered with the tokenizer's chat template and tokenized, the targets
    on the assistant turns (the template's generation markers where it has them, else the
    rendered prefixes: see the module docstring), cut to ``max_seq_len`` from the right."""
    if markers is None:
        markers = has_generation_markers(tokenizer)
    try:
        if markers:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, targets = (
                [int(x) for x in out["input_ids"]],
                [int(x) for x in out["assistant_masks"]],
            )
        else:
            ids, targets = _chat_by_prefixes(tokenizer, messages)
    except _PrefixMismatch as exc:
        return Tokenized([], [], str(exc))
    except Exception as exc:  # the template's own raise_exception, a jinja error
        return Tokenized(
            [], [], f"the chat template fails on this conversation: {_first_line(exc)}"
        )
    if not any(targets):
        return Tokenized(
            [],
            [],
            "the chat template renders no assistant token for this conversation "
            "(an empty assistant reply?)",
        )
    return _cut(
        ids, targets, max_seq_len, "the conversation before the first assistant reply", "assistant"
    )


class _PrefixMismatch(Exception):
    """The template renders a conversation's start differently from the whole conversation."""


def _chat_by_prefixes(
    tokenizer: Any, messages: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """Tokens and assistant mask of a template without generation markers (rendered prefixes)."""

    def render(part: list[dict[str, Any]], prompt: bool) -> str:
        if not part:
            return ""
        text = tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        return str(text)

    whole = render(messages, False)
    spans: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:index], True)
        if not whole.startswith(before):
            before = render(messages[:index], False)  # a template without a generation prompt
        through = render(messages[: index + 1], False)
        if not (
            whole.startswith(before) and whole.startswith(through) and len(before) <= len(through)
        ):
            raise _PrefixMismatch(
                f"the chat template renders the conversation up to message {index + 1} "
                "differently from the whole conversation, so its assistant turns cannot be "
                "found; add {% generation %} … {% endgeneration %} around the assistant's "
                "output in the template"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(x) for x in encoded["input_ids"]]
    targets = [
        int(any(start < end_span and end > begin for begin, end_span in spans))
        for start, end in encoded["offset_mapping"]
    ]
    return ids, targets


def _common_start(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cut(
    ids: list[int], targets: list[int], max_seq_len: int | None, context: str, what: str
) -> Tokenized:
    """``ids``/``targets`` cut to ``max_seq_len`` from the right; a bad row when no target is left
    after the shift (position 0 is never one)."""
    first = next((i for i, t in enumerate(targets) if t and i > 0), None)
    if first is None:
        return Tokenized([], [], f"no {what} token to learn from")
    if max_seq_len is not None and first >= max_seq_len:
        return Tokenized(
            [],
            [],
            f"{context} fills --max-seq-len ({first} tokens, the limit is {max_seq_len}): no "
            f"{what} token is left to learn from",
        )
    if max_seq_len is not None:
        ids, targets = ids[:max_seq_len], targets[:max_seq_len]
    return Tokenized(ids, targets)


def labels_of(ids: Sequence[int], targets: Sequence[int] | None) -> list[int]:
    """The labels of a row: its tokens where the loss covers them, ``IGNORE_INDEX`` elsewhere
    (all its tokens without ``targets``: plain text rows)."""
    if targets is None:
        return [int(x) for x in ids]
    return [int(x) if t else IGNORE_INDEX for x, t in zip(ids, targets, strict=True)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "IGNORE_INDEX",
    "InstructionColumns",
    "Tokenized",
    "chat_template_problem",
    "flag_problems",
    "has_generation_markers",
    "labels_of",
    "messages_of",
    "parse_messages",
    "tokenize_chat",
    "tokenize_prompt_completion",
]
