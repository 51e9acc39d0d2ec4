"""``memfit ui``: the estimate and the plan on a local web page (Gradio: :mod:`memfit.ui.app`),
served until Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import socket
import time
import webbrowser
from typing import Annotated

import typer

from memfit import cli, progress
from memfit.errors import UsageError
from memfit.extras import is_installed, missing_line

# the background tracer's switch (memfit.estimate.background.OFF_VARIABLE: not imported here,
# that module's import is the estimator's)
_NO_BACKGROUND = "MEMFIT_NO_BACKGROUND"


def port_problem(host: str, port: int) -> str | None:
    """The one line when ``port`` is not a port, or cannot be listened on at ``host`` (in use,
    below 1024 without administrator rights, or a host that is not this machine's); None when it
    is free."""
    if not 1 <= port <= 65535:
        return f"--port: must be in 1..65535, got {port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host {host}: not an address of this machine ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        if os.name != "nt":
            # as the server binds (uvicorn): a port a closed server left in TIME_WAIT is free,
            # one that a server listens on is not (on Windows the option would share it)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
                return f"--port {port}: in use; pick another with --port"
            if exc.errno in (13, 10013) and port < 1024:  # EACCES; Windows: WSAEACCES
                return (
                    f"--port {port}: ports below 1024 need administrator rights; "
                    "pick another with --port"
                )
            return f"--host {host}: cannot listen there ({exc.strerror or exc})"
    return None


def _loopback(host: str) -> bool:
    """Whether ``host`` is reached from this machine only (localhost, 127.x, ::1)."""
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError, UnicodeError):
        return False


def ui_command(
    *,
    host: Annotated[
        str, typer.Option(help="The address to listen on (0.0.0.0: every interface).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The port to listen on.")] = 7860,
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="Open the page in the web browser.")
    ] = False,
    share: Annotated[
        bool,
        typer.Option(
            help="Also a public link to the page through Gradio's share servers (needs internet)."
        ),
    ] = False,
) -> None:
    """Serve the estimate and the plan on a local web page: the model, the card and every knob
    as inputs, the breakdown and the memory curves as figures, a link that carries the job.

    The page answers from the same estimator and planner as memfit estimate and memfit plan:
    a slider move from the shape fit of the traces already made, a knob that needs a
    trace with a progress bar. It is served until Ctrl-C.
    """
    if not is_installed("gradio"):
        raise UsageError(missing_line("gradio", "memfit ui"))
    problem = port_problem(host, port)
    if problem is not None:
        raise UsageError(problem)
    # a long-lived process: the background tracer traces the kinds of shape asked next on the
    # other core (memfit.estimate.background), unless the user turned it off themselves
    if cli.background_set_by_cli():
        os.environ.pop(_NO_BACKGROUND, None)
    with progress.status("loading gradio", subject="memfit ui"):
        # optional: gradio is the 'ui' extra; start-up: it takes seconds to import
        from memfit.ui.app import LAUNCH, build_app

        progress.report("building the page")
        # the model box reads paths on this machine only where the page is this machine's own
        demo = build_app(local_paths=_loopback(host) and not share, server=True)
        progress.report(f"starting the server on {host}:{port}")
        try:
            _, _, share_url = demo.launch(
                server_name=host,
                server_port=port,
                share=share,
                prevent_thread_lock=True,
                quiet=True,
                **LAUNCH,
            )
        except OSError as exc:
            # (taken between the check above and the server's own bind, say)
            raise UsageError(f"--port {port}: cannot listen there ({exc})") from exc
    url = f"http://{host}:{port}"
    typer.echo(f"memfit ui: {url} (Ctrl-C stops it)")
    if share:
        if share_url:
            typer.echo(f"memfit ui: public link {share_url} (anyone with it reaches this page)")
        else:
            typer.echo("memfit ui: --share: no public link (Gradio's share servers need internet)")
    if open_browser:
        webbrowser.open(url)
    try:
        # torch and the estimator load now, while the page opens, not at its first answer (the
        # server answers meanwhile, in its own threads)
        import memfit.estimate  # noqa: F401  (start-up)

        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        typer.echo("memfit ui: stopped")
    finally:
        # (quietly: Gradio says "Closing server running on port" on stdout)
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
            demo.close()  # the server is going down anyway: nothing to say if it fails
