"""``memfit ui``: its flags reach the server, a missing gradio or a bad or taken port is one line
(exit 2), Ctrl-C stops it, and the background tracer works while it serves (unless the user
turned it off). The server is a stand-in here: the page itself is tests/unit/ui/test_ui_app.py's."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cli_run import run_cli
from memfit import cli
from memfit.commands import ui as ui_command

BACKGROUND = "MEMFIT_NO_BACKGROUND"


class _Server:
    """A stand-in for the page: records how it was launched and what the environment said."""

    def __init__(self, share_url: str | None = None) -> None:
        self.launched: dict[str, Any] = {}
        self.background: str | None = "unset"
        self.closed = False
        self.share_url = share_url

    def launch(self, **kwargs: Any) -> tuple[None, str, str | None]:
        self.launched = kwargs
        self.background = os.environ.get(BACKGROUND)
        return None, "local", self.share_url

    def close(self) -> None:
        self.closed = True


class _CtrlC:
    """``time`` whose sleep is the user's Ctrl-C."""

    @staticmethod
    def sleep(seconds: float) -> None:
        raise KeyboardInterrupt


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Server]:
    pytest.importorskip("gradio")
    from memfit.ui import app

    made = _Server()

    def build(**options: bool) -> _Server:
        made.options = options  # type: ignore[attr-defined]
        return made

    monkeypatch.setattr(app, "build_app", build)
    monkeypatch.setattr(ui_command, "time", _CtrlC)
    opened: list[str] = []
    monkeypatch.setattr(ui_command.webbrowser, "open", opened.append)
    made.opened = opened  # type: ignore[attr-defined]
    yield made


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_it_serves_until_ctrl_c_with_its_flags(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _free_port()
    code, out, err = run_cli(capsys, "ui", "--port", str(port))
    assert code == 0, err
    assert out.splitlines() == [
        f"memfit ui: http://127.0.0.1:{port} (Ctrl-C stops it)",
        "memfit ui: stopped",
    ]
    launched = server.launched
    assert (launched["server_name"], launched["server_port"]) == ("127.0.0.1", port)
    assert launched["share"] is False and launched["prevent_thread_lock"] is True
    assert server.closed and server.opened == []  # type: ignore[attr-defined]
    # on a loopback address the page is this machine's own: its model box reads local paths
    assert server.options == {"local_paths": True, "server": True}  # type: ignore[attr-defined]


def test_a_page_others_reach_reads_no_local_path(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "ui", "--host", "0.0.0.0", "--port", str(_free_port()))
    assert code == 0, err
    assert server.options == {"local_paths": False, "server": True}  # type: ignore[attr-defined]


def test_open_opens_the_page_and_share_says_when_there_is_no_link(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _free_port()
    code, out, err = run_cli(capsys, "ui", "--port", str(port), "--open", "--share")
    assert code == 0, err
    assert server.launched["share"] is True
    assert server.opened == [f"http://127.0.0.1:{port}"]  # type: ignore[attr-defined]
    assert "--share: no public link (Gradio's share servers need internet)" in out
    server.share_url = "https://abc.gradio.live"
    code, out, err = run_cli(capsys, "ui", "--port", str(port), "--share")
    assert "memfit ui: public link https://abc.gradio.live" in out


def test_the_background_tracer_works_while_it_serves(
    server: _Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = str(_free_port())
    monkeypatch.delenv(BACKGROUND, raising=False)
    code, _, err = run_cli(capsys, "ui", "--port", port)
    assert code == 0, err
    assert server.background is None  # the CLI's own setting taken off again
    assert BACKGROUND not in os.environ and not cli.background_set_by_cli()
    # any other verb keeps it off while it runs
    seen: list[str | None] = []
    monkeypatch.setattr(
        "memfit.commands.gpus.catalog", lambda: seen.append(os.environ.get(BACKGROUND)) or {}
    )
    run_cli(capsys, "gpus")
    assert seen == ["1"]
    # the user's own setting stands
    monkeypatch.setenv(BACKGROUND, "1")
    code, _, err = run_cli(capsys, "ui", "--port", port)
    assert code == 0, err
    assert server.background == "1" and os.environ[BACKGROUND] == "1"


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


def test_a_missing_gradio_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ui_command, "is_installed", lambda module: module != "gradio")
    assert _error(capsys, "ui") == (
        "memfit: error: memfit ui needs gradio, which is not installed: pip install 'memfit[ui]'"
    )


def test_a_bad_or_taken_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gradio")
    assert _error(capsys, "ui", "--port", "0") == (
        "memfit: error: --port: must be in 1..65535, got 0"
    )
    assert "'--port'" in _error(capsys, "ui", "--port", "x")  # the CLI's own line for a flag
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _error(capsys, "ui", "--port", str(port)) == (
            f"memfit: error: --port {port}: in use; pick another with --port"
        )
    assert _error(capsys, "ui", "--host", "no-such-host.invalid").startswith(
        "memfit: error: --host no-such-host.invalid: "
    )


class _NoRights(socket.socket):
    """A socket on a machine where a port below 1024 needs administrator rights (as not root)."""

    def bind(self, address: Any) -> None:
        if address[1] < 1024:
            raise PermissionError(13, "Permission denied")
        super().bind(address)


def test_a_port_below_1024_without_the_rights_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gradio")
    monkeypatch.setattr(ui_command.socket, "socket", _NoRights)
    assert _error(capsys, "ui", "--port", "80") == (
        "memfit: error: --port 80: ports below 1024 need administrator rights; "
        "pick another with --port"
    )


def test_its_help_says_what_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert "ui  " in out and "Serve the estimate and the plan on a local web page" in out
    code, out, _ = run_cli(capsys, "ui", "--help")
    assert code == 0
    for flag in ("--host", "--port", "--open / --no-open", "--share", "needs internet"):
        assert flag in out, flag
    assert "[default: 127.0.0.1]" in out and "[default: 7860]" in out
    assert "memfit estimate and" in " ".join(out.split()) and "``" not in out  # plain words
