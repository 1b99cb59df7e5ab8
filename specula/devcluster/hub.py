"""A local stand-in for the Hugging Face Hub's file API, serving model repositories from
local directories, so that ``hf://`` downloads run through ``huggingface_hub`` (the
real client, pointed here with ``HF_ENDPOINT``) on a machine without internet.

The endpoints ``snapshot_download`` and ``hf_hub_download`` use:

* ``GET /api/models/{repo}/revision/{revision}``: repository info with the commit
  ``sha`` and the file list (``siblings``);
* ``GET /api/models/{repo}/tree/{revision}[/{path}]``: the file tree (``recursive``);
* ``HEAD``/``GET /{repo}/resolve/{revision}/{file}``: a file, with ``X-Repo-Commit``
  and ``ETag`` (the git blob id of its contents).

A revision is a branch or tag name (``main`` is the default) or its commit id.  Errors
look like the Hub's: ``404`` with ``X-Error-Code: RepoNotFound`` or
``RevisionNotFound``; a private repository answers ``401`` (``RepoNotFound``) without
a token and ``401`` ("Invalid credentials") to a wrong one.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    """A model repository: ``revisions`` maps branch or tag names to directories
    (each one commit); ``token`` makes it private (requests must carry it)."""

    revisions: dict[str, Path]
    token: str | None = None
    commits: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, root in self.revisions.items():
            digest = hashlib.sha1(name.encode())
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
            self.commits[name] = digest.hexdigest()

    def resolve(self, revision: str) -> tuple[str, Path] | None:
        """``(commit, directory)`` of a revision name or commit id."""
        for name, commit in self.commits.items():
            if revision in (name, commit):
                return commit, self.revisions[name]
        return None


class HubServer:
    """The server on ``host``:``port`` (0 picks a port) in a daemon thread."""

    _ROUTES = (
        ("info", re.compile(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$")),
        ("tree", re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")),
        ("file", re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")),
    )

    def __init__(self, repos: dict[str, HubRepo], host: str = "127.0.0.1", port: int = 0):
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                hub._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- requests ------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append(f"{req.command} {path}")
        found = next(((k, m) for k, p in self._ROUTES if (m := p.match(path))), None)
        if found is None:
            return self._error(req, 404, "EntryNotFound", "no such endpoint", head)
        kind, match = found
        repo_id, revision = match.group(1), match.group(2)
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(req, 404, "RepoNotFound", "Repository not found", head)
        if repo.token is not None:
            auth = req.headers.get("Authorization", "")
            if not auth:
                return self._error(req, 401, "RepoNotFound", "Repository not found", head)
            if auth != f"Bearer {repo.token}":
                return self._error(req, 401, None, "Invalid credentials in Authorization header",
                                   head)
        resolved = repo.resolve(revision)
        if resolved is None:
            return self._error(req, 404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
        commit, root = resolved
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        if kind == "info":
            body = {"id": repo_id, "modelId": repo_id, "sha": commit,
                    "private": repo.token is not None,
                    "siblings": [{"rfilename": f} for f in files]}
            return self._json(req, body, head)
        if kind == "tree":
            prefix = (match.group(3) or "").strip("/")
            entries = []
            for name in files:
                if prefix and not name.startswith(prefix + "/"):
                    continue
                data = (root / name).read_bytes()
                entries.append({"type": "file", "oid": _git_blob_id(data), "size": len(data),
                                "path": name})
            return self._json(req, entries, head)
        name = match.group(3)
        target = (root / name).resolve()
        if name not in files or not target.is_relative_to(root.resolve()):
            return self._error(req, 404, "EntryNotFound", f"{name} not found", head)
        data = target.read_bytes()
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(data)))
        req.send_header("ETag", f'"{_git_blob_id(data)}"')
        req.send_header("X-Repo-Commit", commit)
        req.end_headers()
        if not head:
            req.wfile.write(data)

    @staticmethod
    def _json(req: BaseHTTPRequestHandler, body: object, head: bool) -> None:
        data = json.dumps(body).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if not head:
            req.wfile.write(data)

    @staticmethod
    def _error(req: BaseHTTPRequestHandler, status: int, code: str | None, message: str,
               head: bool) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        req.end_headers()
        if not head:
            req.wfile.write(data)
