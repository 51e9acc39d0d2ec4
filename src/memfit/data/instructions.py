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

**Bounds.** A chat template is a program from the model folder, and Jinja's sandbox stops it from
reaching out, not from looping or growing: two nested ``range(100000)`` loops run 10^10 times,
``'x' * 10**10`` asks for 10 GB. So the template runs in a process of its own
(:mod:`memfit.data._render_child`, transformers' own renderer there), one conversation (all its
renderings) at a time, within :data:`RENDER_SECONDS`, :data:`RENDER_CHARS` characters per
rendering and, on Linux only, :data:`RENDER_MEMORY` of memory (macOS does not enforce the limit,
Windows has none); a conversation past a bound is a bad row that says which. The process never
outlives this one (see :mod:`memfit.data._render_child`). A template that passes a bound on
:data:`RENDER_GIVE_UP` rows and has rendered none is not run again: each later row is a bad row at
once, saying so. Real templates (Llama 3, Qwen, Mistral, Gemma, Phi) render a conversation in
milliseconds and a few kilobytes.

**Truncation** to ``max_seq_len`` cuts from the right: a completion (or the last turns of a chat)
that runs past it is cut, its EOS with it. A row left with no token to learn from (the prompt,
or everything before the first assistant reply, fills ``max_seq_len``) is a bad row.

Position 0 is never a target (nothing predicts it): a row's target count is ``sum(targets[1:])``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from memfit.data import _render_child
from memfit.errors import MemfitError
from memfit.units import format_bytes

# the label of a token the loss ignores (PyTorch's cross_entropy default)
IGNORE_INDEX = -100
# bumped when the tokenization of instruction rows changes (part of the cache key)
VERSION = "instructions-v1"

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

# the bounds of one conversation's rendering (see the module docstring): the seconds all its
# renderings may take, the memory they may take beyond what the renderer holds before, and the
# characters of one rendering beyond 4 per character of the conversation's JSON
RENDER_SECONDS = 10.0
RENDER_MEMORY = 1 << 30
RENDER_CHARS = 1 << 24
# rows past a bound, none rendered, after which a template is not run again
RENDER_GIVE_UP = 3
# the renderer's start (it imports transformers' renderer): not a row's time
_START_SECONDS = 300.0


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
    packing: str | bool | None,
    text_column: str | None = "text",
) -> list[str]:
    """The problems with the instruction flags, one line each (``text_column`` other than the
    default ``text`` counts as given: it cannot be told apart from a default otherwise).
    ``packing``: the packing strategy (None or False: no packing); instruction rows pack with
    ``bfd`` (each row keeps its loss mask), not in ``wrapped`` blocks."""
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
    if packing == "wrapped":
        problems.append(
            f"--packing-strategy wrapped: not with {names} (its blocks cut rows and their loss "
            "masks across blocks); use --packing-strategy bfd, which packs whole rows"
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
    """The conversation rendered with the tokenizer's chat template (within the bounds of the
    module docstring) and tokenized, the targets on the assistant turns (the template's
    generation markers where it has them, else the rendered prefixes: see the module
    docstring), cut to ``max_seq_len`` from the right."""
    if markers is None:
        markers = has_generation_markers(tokenizer)
    clock = _Clock()
    try:
        if markers:
            ((text, spans),) = _render(tokenizer, messages, [(len(messages), False)], clock, True)
            ids, targets = _marked_tokens(tokenizer, text, spans or [])
        else:
            ids, targets = _chat_by_prefixes(tokenizer, messages, clock)
    except (_PrefixMismatch, _PastBound) as exc:
        return Tokenized([], [], str(exc))
    except MemfitError:  # the renderer could not start: no row can be rendered
        raise
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
    tokenizer: Any, messages: list[dict[str, Any]], clock: _Clock
) -> tuple[list[int], list[int]]:
    """Tokens and assistant mask of a template without generation markers (rendered prefixes)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # every rendering the row needs, at once: (the number of messages, the generation prompt)
    wanted = list(
        dict.fromkeys(
            [(len(messages), False)] + [(i, True) for i in turns] + [(i + 1, False) for i in turns]
        )
    )
    texts = dict(zip(wanted, _texts(tokenizer, messages, wanted, clock), strict=True))
    whole = texts[(len(messages), False)]
    # a template without a generation prompt: the start before a reply rendered without one
    plain = [(i, False) for i in turns if not whole.startswith(texts[(i, True)])]
    plain = [key for key in dict.fromkeys(plain) if key not in texts]
    if plain:
        texts.update(zip(plain, _texts(tokenizer, messages, plain, clock), strict=True))
    spans: list[tuple[int, int]] = []
    for index in turns:
        before = texts[(index, True)]
        if not whole.startswith(before):
            before = texts[(index, False)]
        through = texts[(index + 1, False)]
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


def _marked_tokens(
    tokenizer: Any, text: str, spans: Sequence[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """Tokens and assistant mask of a rendering whose ``{% generation %}`` blocks span the
    characters ``spans``: what ``apply_chat_template(return_assistant_tokens_mask=True)`` gives
    (its tokenization, its mapping of characters to tokens)."""
    encoded = tokenizer([text], add_special_tokens=False)
    ids = [int(x) for x in encoded["input_ids"][0]]
    mask = [0] * len(ids)
    for begin, end in spans:
        first = encoded.char_to_token(0, begin)
        last = encoded.char_to_token(0, end - 1)
        if first is None:
            break
        for position in range(first, last + 1 if last else len(ids)):
            mask[position] = 1
    return ids, mask


def _texts(
    tokenizer: Any, messages: list[dict[str, Any]], wanted: list[tuple[int, bool]], clock: _Clock
) -> list[str]:
    return [text for text, _ in _render(tokenizer, messages, wanted, clock, False)]


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    wanted: list[tuple[int, bool]],
    clock: _Clock,
    spans: bool,
) -> list[tuple[str, list[list[int]] | None]]:
    """``messages[:n]`` rendered with the tokenizer's chat template for each ``(n, generation
    prompt)`` of ``wanted`` (with the ``{% generation %}`` spans where ``spans``), as
    ``apply_chat_template`` renders them, by the bounded renderer; a :class:`_PastBound` when
    the row passes a bound."""
    if not _jinja_tokenizer(tokenizer):
        # a tokenizer that renders without Jinja (mistral-common): nothing of the folder runs
        return [
            (
                str(
                    tokenizer.apply_chat_template(
                        messages[:n], tokenize=False, add_generation_prompt=p
                    )
                )
                if n
                else "",
                None,
            )
            for n, p in wanted
        ]
    specials = json.loads(
        json.dumps(getattr(tokenizer, "special_tokens_map", {}) or {}, default=str)
    )
    request = {
        "template": str(tokenizer.get_chat_template()),
        "specials": specials,
        "messages": messages,
        "renders": [[n, p, spans] for n, p in wanted],
    }
    return _renderer().render(request, clock)


def _jinja_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders chats with transformers' Jinja renderer (its
    ``apply_chat_template`` is the one of ``PreTrainedTokenizerBase``)."""
    try:
        # start-up: transformers takes a second or more to import; reading data needs none
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    method = getattr(type(tokenizer), "apply_chat_template", None)
    return isinstance(tokenizer, PreTrainedTokenizerBase) and (
        method is PreTrainedTokenizerBase.apply_chat_template
    )


# --- the bounded renderer ---------------------------------------------------------------------------
class _Clock:
    """A row's time for all its renderings: :data:`RENDER_SECONDS` from now, not counting the
    renderer's start (its imports: seconds on a busy machine, no time of the template's)."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + RENDER_SECONDS


class _PastBound(Exception):
    """A row's rendering passed a bound (its time, memory or size), or was not tried."""


class _Renderer:
    """The rendering process (:mod:`memfit.data._render_child`) of this process: started at the
    first chat row, restarted after a row that passed a bound, ended at exit."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        # the process's replies, read by a thread of their own (a timed wait on a pipe that works
        # everywhere: select() takes no pipes on Windows); None: its output ended
        self.replies: queue.Queue[Any] = queue.Queue()
        self.stderr: IO[bytes] | None = None
        # per template: the rows past a bound, and whether any row rendered
        self.past: dict[str, int] = {}
        self.rendered: set[str] = set()

    def render(
        self, request: dict[str, Any], clock: _Clock
    ) -> list[tuple[str, list[list[int]] | None]]:
        template = request["template"]
        size = len(json.dumps(request["messages"], ensure_ascii=False, default=str))
        memory = RENDER_MEMORY + 64 * size
        request = {
            **request,
            "memory": memory,
            "chars": RENDER_CHARS + 4 * size,
            "seconds": RENDER_SECONDS,
        }
        with self.lock:
            past = self.past.get(template, 0)
            if past >= RENDER_GIVE_UP and template not in self.rendered:
                raise _PastBound(
                    f"not rendered: the chat template passed memfit's bounds on the {past} rows "
                    "before this one and rendered none of them"
                )
            try:
                reply = self._ask(request, clock)
            except _PastBound:
                self.past[template] = past + 1
                raise
            if "texts" in reply:
                self.rendered.add(template)
                return [(str(text), spans) for text, spans in reply["texts"]]
            if "error" in reply:
                raise _TemplateError(str(reply["error"]))
            self.past[template] = past + 1
            if reply.get("problem") == "memory":
                self._stop()  # it ends after a memory error: the next row gets a fresh one
            if reply.get("problem") == "chars":
                raise _PastBound(
                    f"the chat template renders more than {int(reply['chars']):,} characters for "
                    "this conversation (memfit's bound for this row)"
                )
            raise _PastBound(
                f"the chat template needs more than {format_bytes(memory)} of memory "
                "to render this conversation (memfit's bound per row)"
            )

    def _ask(self, request: dict[str, Any], clock: _Clock) -> dict[str, Any]:
        started = time.monotonic()
        proc = self._running()
        clock.deadline += time.monotonic() - started  # the start is not the row's time
        assert proc.stdin is not None
        try:
            _render_child.send_frame(proc.stdin, request)
            return self._receive(clock.deadline)
        except TimeoutError:
            self._stop()
            raise _PastBound(
                f"the chat template did not finish rendering this conversation within "
                f"{RENDER_SECONDS:g} s (memfit's bound per row: does the template loop without "
                "end?)"
            ) from None
        except (BrokenPipeError, EOFError):
            code = self._stop()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            raise _PastBound(
                f"the chat template's renderer ended ({how}) while rendering this conversation"
            ) from None

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self._stop()
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - the process's, closed in _stop
        try:
            self.proc = subprocess.Popen(
                _child_command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
            )
            replies: queue.Queue[Any] = queue.Queue()
            self.replies = replies
            out = self.proc.stdout
            threading.Thread(target=_pump, args=(out, replies), daemon=True).start()
            ready = self._receive(time.monotonic() + _START_SECONDS)
        except (OSError, TimeoutError, EOFError, ValueError) as exc:
            ready = {"failed": str(exc) or type(exc).__name__}
        if not ready.get("ready"):
            tail = self._stderr_tail() or ready.get("failed")
            self._stop()
            raise MemfitError(
                f"memfit could not start its chat-template renderer ({_render_child.__file__}); "
                f"its stderr ends with: {tail or '(nothing)'}"
            )
        assert self.proc is not None
        return self.proc

    def _receive(self, deadline: float) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if reply is None:
            raise EOFError
        return dict(reply)

    def _stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else ""

    def _stop(self) -> int:
        """End the process (it is this process's own child); its exit code (0: none ran)."""
        proc, self.proc = self.proc, None
        code = 0
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        return code

    def close(self) -> None:
        """At exit: end the process (EOF on its input ends it; a kill if it does not)."""
        with self.lock:
            proc = self.proc
            if proc is not None and proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._stop()


def _child_command() -> list[str]:
    """The renderer's command: the script by its path, so that neither the current folder
    (``python -m`` puts it first on ``sys.path``) nor memfit's own folders shadow the standard
    library or Jinja there; ``-P`` says so from Python 3.11 (before, the script drops its folder)."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, str(Path(_render_child.__file__)), str(os.getpid())]


def _pump(stream: IO[bytes], replies: queue.Queue[Any]) -> None:
    """Reads the renderer's replies into ``replies``; None when its output ends (or breaks)."""
    try:
        while (reply := _render_child.read_frame(stream)) is not None:
            replies.put(reply)
    except (OSError, ValueError):
        pass
    finally:
        replies.put(None)


class _TemplateError(Exception):
    """The template failed on the conversation (its ``raise_exception``, a Jinja error)."""


_RENDERER: _Renderer | None = None
_RENDERER_LOCK = threading.Lock()


def _renderer() -> _Renderer:
    """This process's renderer (a forked child starts its own: the pipes are its parent's)."""
    global _RENDERER
    with _RENDERER_LOCK:
        if _RENDERER is None or _RENDERER.owner != os.getpid():
            _RENDERER = _Renderer()
            atexit.register(_RENDERER.close)
        return _RENDERER


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
