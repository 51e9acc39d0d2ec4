"""progress.listening: a page hears the messages a status line would show, in its own thread."""

from __future__ import annotations

import threading

from memfit import progress


def test_a_listener_hears_report_say_and_status_in_its_thread_only() -> None:
    heard: list[str] = []
    progress.report("before")
    with progress.listening(heard.append):
        progress.report("tracing 3 of 12 layers")
        progress.say("fitting batch 8")
        with progress.status("loading torch", subject="memfit ui"):
            progress.report("inside a status block")
        # another thread's messages are its own listeners' (a page's other request)
        other = threading.Thread(target=progress.report, args=("another thread",))
        other.start()
        other.join()
    progress.report("after")
    assert heard == [
        "tracing 3 of 12 layers",
        "fitting batch 8",
        "loading torch",
        "inside a status block",
    ]


def test_listeners_nest_and_each_hears_while_open() -> None:
    outer: list[str] = []
    inner: list[str] = []
    with progress.listening(outer.append):
        progress.report("one")
        with progress.listening(inner.append):
            progress.report("two")
        progress.report("three")
        # the same callback opened again (the page's, and the answer's own) hears each message once
        with progress.listening(outer.append):
            progress.report("four")
    assert outer == ["one", "two", "three", "four"]
    assert inner == ["two"]
    assert progress._listening == 0  # closed: report() looks no further


def test_a_listener_is_closed_by_an_exception_too() -> None:
    heard: list[str] = []
    try:
        with progress.listening(heard.append):
            raise KeyError("stop")
    except KeyError:
        pass
    progress.report("after")
    assert heard == [] and progress._listening == 0
