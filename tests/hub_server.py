"""A local HTTP server standing in for the Hugging Face Hub, for ``HF_ENDPOINT`` (no network).

It answers what ``huggingface_hub.hf_hub_download`` asks, the way the Hub does (read from
huggingface_hub's ``file_download.get_hf_file_metadata`` and ``utils/_http.hf_raise_for_status``):
``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` with ``X-Repo-Commit``, ``ETag`` and
``Content-Length``; a missing repository as ``401`` with ``X-Error-Code: RepoNotFound``, a gated one
as ``401`` (no token) or ``403`` (a token without access) with ``X-Error-Code: GatedRepo``, a
missing revision or file as ``404`` with ``RevisionNotFound`` or ``EntryNotFound``. ``HEAD /``
answers ``200`` (memfit's is-the-Hub-there probe). Every request is logged in :attr:`FakeHub.log`.

    with serve_hub({"acme/tiny": HubRepo({"config.json": b"{...}"})}) as hub:
        use_hub(monkeypatch, hub, tmp_path)  # HF_ENDPOINT, a fresh HF cache, online
        ...

Written by hand: huggingface_hub ships no such server (its own tests use the real staging Hub).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


@dataclass
class HubRepo:
    """One model repository: its files on ``main``, other revisions' files, whether it is gated.

    A gated repository serves its files only to a request carrying ``Authorization: Bearer
    {token}``."""

    files: dict[str, bytes]
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: bool = False
    token: str = "hf_fake_token_with_access"

    def files_at(self, revision: str) -> dict[str, bytes] | None:
        if revision == "main" or revision == commit_of(self, "main"):
            return self.files
        return self.revisions.get(revision)


def commit_of(repo: HubRepo, revision: str) -> str:
    """The 40-hex commit a revision of ``repo`` stands at (stable, made up)."""
    return hashlib.sha1(f"{id(repo)}@{revision}".encode()).hexdigest()


@dataclass
class FakeHub:
    """The running server: its address (for ``HF_ENDPOINT``), its repositories, its request log."""

    url: str
    repos: dict[str, HubRepo]
    # (method, path, the Authorization header or None) of every request, in order
    log: list[tuple[str, str, str | None]] = field(default_factory=list)

    def files_asked(self) -> list[str]:
        """The paths of the requests for files (``/resolve/``), the probe left out."""
        return [path for _, path, _ in self.log if "/resolve/" in path]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: pytest shows what a test prints

        def do_HEAD(self) -> None:
            self._answer(body_too=False)

        def do_GET(self) -> None:
            self._answer(body_too=True)

        def _answer(self, *, body_too: bool) -> None:
            path = urlsplit(self.path).path
            hub.log.append((self.command, path, self.headers.get("Authorization")))
            if path in ("", "/"):
                return self._send(200, b"a stand-in for the Hugging Face Hub", {}, body_too)
            repo_id, marker, rest = path.lstrip("/").partition("/resolve/")
            revision, _, filename = rest.partition("/")
            revision, filename = unquote(revision), unquote(filename)
            repo = hub.repos.get(repo_id)
            if not marker or repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", body_too)
            if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
                status = 403 if self.headers.get("Authorization") else 401
                message = f"Access to model {repo_id} is restricted and you are not in the authorized list."
                return self._error(status, "GatedRepo", message, body_too)
            files = repo.files_at(revision)
            if files is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id", body_too)
            commit = commit_of(repo, revision)
            if filename not in files:
                headers = {"X-Repo-Commit": commit}
                return self._error(404, "EntryNotFound", "Entry not found", body_too, headers)
            content = files[filename]
            headers = {
                "X-Repo-Commit": commit,
                "ETag": f'"{hashlib.sha1(content).hexdigest()}"',
                "Content-Type": "application/json",
            }
            self._send(200, content, headers, body_too)

        def _error(
            self,
            status: int,
            code: str,
            message: str,
            body_too: bool,
            headers: dict[str, str] | None = None,
        ) -> None:
            body = json.dumps({"error": message}).encode()
            extra = {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})}
            self._send(status, body, {"Content-Type": "application/json", **extra}, body_too)

        def _send(self, status: int, body: bytes, headers: dict[str, str], body_too: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body_too:
                self.wfile.write(body)

    return Handler


@contextmanager
def serve_hub(repos: dict[str, HubRepo]) -> Iterator[FakeHub]:
    """A stand-in Hub serving ``repos`` on 127.0.0.1 (a free port) while the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    hub = FakeHub(url=f"http://127.0.0.1:{server.server_address[1]}", repos=repos)
    server.RequestHandlerClass = _handler(hub)
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
    )
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """An http:// address on 127.0.0.1 where nothing listens (a connection is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def use_hub(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """Point this process at ``endpoint`` as the Hub, online, with an empty HF home in ``home``.

    huggingface_hub reads ``HF_HUB_OFFLINE``, ``HF_HOME`` and the token file's place once, at
    import, so its constants are set here too (tests/conftest.py sets ``HF_HUB_OFFLINE=1`` for
    every other test); no token of the user's reaches the stand-in. memfit's per-process memory of
    which endpoints answer is forgotten.
    """
    from huggingface_hub import constants

    for variable in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    try:
        from memfit.models import hub as memfit_hub
    except ImportError:  # a memfit from before it asked the Hub (a test run against old code)
        return
    monkeypatch.setattr(memfit_hub, "_ANSWERS", {})
    monkeypatch.setattr(memfit_hub, "_FETCHED", {})
