"""The rendering side of :mod:`memfit.data.instructions`: a model folder's chat template run in a
process of its own, under a memory limit, so that a template that loops or grows without end
costs that row, not the run (the parent stops it after its time limit).

Run as ``python -m memfit.data._render_child``; never imported by memfit itself. It renders with
transformers' own ``render_jinja_template`` (its sandboxed Jinja environment, the ``{% generation
%}`` tracker), so the text is what ``tokenizer.apply_chat_template`` renders.

Protocol: frames of a 4-byte big-endian length and that many bytes of UTF-8 JSON, on the original
stdout and stdin (everything else the process prints, library chatter included, goes to stderr)::

    child:  {"ready": true}
    parent: {"template": T, "specials": {...}, "messages": [...], "renders": [[n, prompt,
             indices], ...], "memory": BYTES, "chars": N}
    child:  {"texts": [[text, indices or null], ...]}   each render of messages[:n]
        or  {"problem": "memory"}                       the renders needed more than BYTES
        or  {"problem": "chars", "chars": N}            a render is longer than N characters
        or  {"error": "first line"}                     the template failed (raise_exception…)
    ...
    parent: EOF: the child exits 0

After ``"problem": "memory"`` the child exits (the next row gets a fresh process).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")


def _read_frame(stream: BinaryIO) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    return json.loads(stream.read(size).decode("utf-8"))


def _send(stream: BinaryIO, value: Any) -> None:
    data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _address_space() -> int:
    """This process's mapped bytes now (VmSize), 0 where /proc says nothing."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _limit_memory(extra: int) -> Any:
    """Cap this process's address space at what it maps now plus ``extra`` bytes; returns the
    limits to restore (None where the system has no such limit: only the time limit holds)."""
    try:
        import resource

        before = resource.getrlimit(resource.RLIMIT_AS)
        now = _address_space()
        if now <= 0:
            return None
        soft = now + extra
        if before[1] != resource.RLIM_INFINITY:
            soft = min(soft, before[1])
        resource.setrlimit(resource.RLIMIT_AS, (soft, before[1]))
        return before
    except (ImportError, ValueError, OSError):
        return None


def _restore(limits: Any) -> None:
    if limits is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, limits)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main() -> int:
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints must not corrupt the protocol channel
    requests = os.fdopen(os.dup(0), "rb")
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
    except (ImportError, ValueError, OSError):
        pass
    from transformers.utils.chat_template_utils import render_jinja_template

    _send(protocol, {"ready": True})
    while True:
        request = _read_frame(requests)
        if request is None:
            return 0
        reply = _render(render_jinja_template, request)
        _send(protocol, reply)
        if reply.get("problem") == "memory":
            return 0


def _render(render: Any, request: dict[str, Any]) -> dict[str, Any]:
    # apply_chat_template drops the keys whose value is None before it renders
    messages = [{k: v for k, v in m.items() if v is not None} for m in request["messages"]]
    limit = int(request["chars"])
    texts: list[Any] = []
    limits = _limit_memory(int(request["memory"]))
    try:
        for count, prompt, indices in request["renders"]:
            if count == 0:
                texts.append(["", [] if indices else None])
                continue
            rendered, generation = render(
                conversations=[messages[:count]],
                chat_template=request["template"],
                return_assistant_tokens_mask=bool(indices),
                add_generation_prompt=bool(prompt),
                **request["specials"],
            )
            text = rendered[0]
            if len(text) > limit:
                return {"problem": "chars", "chars": limit}
            texts.append([text, [list(x) for x in generation[0]] if indices else None])
    except MemoryError:
        texts.clear()  # what rendered before: the reply needs the memory
        return {"problem": "memory"}
    except RecursionError:
        return {"error": "the template recurses too deeply"}
    except Exception as exc:  # the template's own raise_exception, a jinja error
        return {"error": _first_line(exc)}
    finally:
        _restore(limits)
    return {"texts": texts}


if __name__ == "__main__":
    sys.exit(main())
