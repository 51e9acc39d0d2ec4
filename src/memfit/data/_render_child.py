"""The rendering side of :mod:`memfit.data.instructions`: a model folder's chat template run in a
process of its own, under a memory limit, so that a template that loops or grows without end
costs that row, not the run (the parent stops it after its time limit).

Run as a script by its path (``python -P .../_render_child.py PARENT_PID``): neither the user's
current folder nor memfit's own folders come before the standard library on ``sys.path`` (a
``jinja2.py`` where memfit is run must not replace Jinja here). It uses only the standard library
and transformers' own ``render_jinja_template`` (its sandboxed Jinja environment, the ``{%
generation %}`` tracker), so the text is what ``tokenizer.apply_chat_template`` renders; the
parent imports its framing (:func:`read_frame`, :func:`send_frame`).

Protocol: frames of a 4-byte big-endian length and that many bytes of UTF-8 JSON, on the original
stdout and stdin (everything else the process prints, library chatter included, goes to stderr)::

    child:  {"ready": true}
    parent: {"template": T, "specials": {...}, "messages": [...], "renders": [[n, prompt,
             indices], ...], "memory": BYTES, "chars": N, "seconds": S}
    child:  {"texts": [[text, indices or null], ...]}   each render of messages[:n]
        or  {"problem": "memory"}                       the renders needed more than BYTES
        or  {"problem": "chars", "chars": N}            a render is longer than N characters
        or  {"error": "first line"}                     the template failed (raise_exception…)
    ...
    parent: EOF: the child exits 0

After ``"problem": "memory"`` the child exits (the next row gets a fresh process).

It never outlives its parent, which stops it after ``S`` seconds: it ends at EOF on its stdin
(read by a thread of its own, so even mid-render), when its parent process ends (Linux:
``PR_SET_PDEATHSIG``; other POSIX systems: a thread that watches ``os.getppid()``), and a render
may use ``S`` seconds of CPU and a little more (``RLIMIT_CPU``, POSIX) before the system ends it.
The memory bound (``RLIMIT_AS`` above what the process maps when the render starts) holds on Linux
only: elsewhere the address space cannot be read or is not enforced, and the time and text bounds
hold alone.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.path and not getattr(sys.flags, "safe_path", False):
    # run without -P (Python 3.10): the script's own folder is sys.path[0], before the standard
    # library; nothing is imported from it (os is imported already, at the start)
    import os.path

    if os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
        del sys.path[0]

import json  # (after the path is made safe)
import math
import os
import queue
import struct
import threading
import time
from typing import IO, Any

_HEADER = struct.Struct(">I")
# the CPU seconds a render may use beyond the row's bound before the system ends the process:
# the parent stops it at the bound; this ends it where the parent cannot (gone, stopped)
CPU_SLACK = 2.0
# how often the watchdog thread looks for a new parent (where PR_SET_PDEATHSIG is missing)
_WATCH_SECONDS = 0.5


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's value; None at EOF (a frame cut short by EOF too)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data.decode("utf-8"))


def send_frame(stream: IO[bytes], value: Any) -> None:
    data = json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _address_space() -> int:
    """This process's mapped bytes now (VmSize), 0 where /proc says nothing."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _limit_memory(extra: int) -> Any:
    """Cap this process's address space at what it maps now plus ``extra`` bytes; returns the
    limits to restore (None where the system has no such limit: only the time limit holds)."""
    try:
        import resource  # optional: Unix only (elsewhere the time limit alone holds)

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


def _limit_cpu(seconds: float) -> Any:
    """Let this process use ``seconds`` (and :data:`CPU_SLACK`) more CPU time, then the system
    ends it (SIGXCPU); returns the limits to restore (None where there is no such limit)."""
    try:
        import resource  # optional: Unix only

        before = resource.getrlimit(resource.RLIMIT_CPU)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds + CPU_SLACK)
        if before[1] != resource.RLIM_INFINITY:
            soft = min(soft, before[1])
        resource.setrlimit(resource.RLIMIT_CPU, (soft, before[1]))
        return before
    except (ImportError, ValueError, OSError):
        return None


def _restore(kind: str, limits: Any) -> None:
    if limits is not None:
        import resource  # optional: Unix only (limits is None elsewhere)

        resource.setrlimit(getattr(resource, kind), limits)


def _end_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the process that started it) ends."""
    if sys.platform.startswith("linux") and _death_signal(parent):
        return
    if hasattr(os, "getppid") and os.name == "posix":
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # elsewhere (Windows: its parent id stays after the parent ends) EOF on stdin ends it


def _death_signal(parent: int) -> bool:
    """Linux: SIGUSR1 when the thread that started this process ends; this ends only when its
    process did (the parent id changed), not when the parent's thread alone ended."""
    try:
        # optional: ctypes and prctl's parent-death signal (Linux only; elsewhere a watcher thread)
        import ctypes
        import signal

        def orphaned(*_: Any) -> None:
            if os.getppid() != parent:
                os._exit(0)

        signal.signal(signal.SIGUSR1, orphaned)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGUSR1), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (ImportError, OSError, AttributeError, ValueError):
        return False
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)
    return True


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    os._exit(0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    _end_with_parent(int(args[0]) if args else os.getppid())
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints must not corrupt the protocol channel
    requests = os.fdopen(os.dup(0), "rb")
    try:
        import resource  # optional: Unix only

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
    except (ImportError, ValueError, OSError):
        pass
    inbox: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        # EOF: the parent is done or gone; mid-render too, so nothing renders for no one
        try:
            while (request := read_frame(requests)) is not None:
                inbox.put(request)
        finally:
            os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    # start-up: the parent imports this module's framing without transformers
    from transformers.utils.chat_template_utils import render_jinja_template

    send_frame(protocol, {"ready": True})
    while True:
        reply = _render(render_jinja_template, inbox.get())
        send_frame(protocol, reply)
        if reply.get("problem") == "memory":
            return 0


def _render(render: Any, request: dict[str, Any]) -> dict[str, Any]:
    # apply_chat_template drops the keys whose value is None before it renders
    messages = [{k: v for k, v in m.items() if v is not None} for m in request["messages"]]
    limit = int(request["chars"])
    texts: list[Any] = []
    cpu = _limit_cpu(float(request["seconds"]))
    memory = _limit_memory(int(request["memory"]))
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
        _restore("RLIMIT_AS", memory)
        _restore("RLIMIT_CPU", cpu)
    return {"texts": texts}


if __name__ == "__main__":
    sys.exit(main())
