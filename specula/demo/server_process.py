"""Run ``specula serve`` as a child process for the demo, and always stop it."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from specula.demo.measure import DemoClient


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message holds its log's tail."""


class ServerProcess:
    """``specula serve ARGS --host 127.0.0.1 --port PORT`` with its output in ``log_path``.

    ``env`` adds to (or overrides) this process's environment for the child.

    Use as a context manager: entering starts the process and waits for ``/health``;
    leaving (also on an exception or Ctrl-C) sends SIGTERM, waits ``stop_timeout_s`` and
    then SIGKILLs, so no server outlives the demo.
    """

    def __init__(
        self,
        serve_args: list[str],
        log_path: Path,
        port: int = 0,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 15.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.base_url = f"http://{self.host}:{self.port}"
        # The admin API on a port of its own, behind a token made for this run.
        self.admin_port = free_port(self.host)
        self.admin_url = f"http://{self.host}:{self.admin_port}"
        self.admin_token = secrets.token_urlsafe(32)
        self.log_path = log_path
        self._args = serve_args
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._env = dict(env or {})
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "specula.cli", "serve", *self._args,
                "--host", self.host, "--port", str(self.port),
                "--admin-port", str(self.admin_port)]

    def client(self) -> DemoClient:
        """A :class:`DemoClient` of this server, admin API included."""
        return DemoClient(self.base_url, admin_url=self.admin_url, admin_token=self.admin_token)

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._env,
               "SPECULA_ADMIN_TOKEN": self.admin_token}
        self._proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env,
        )

    def log_tail(self, max_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-max_lines:])

    def wait_healthy(self) -> None:
        """Poll ``/health`` until 200.

        Raises:
            ServerError: the process exited, or ``start_timeout_s`` passed.
        """
        assert self._proc is not None
        client = DemoClient(self.base_url)
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ServerError(
                        f"specula serve exited with status {self._proc.returncode} during "
                        f"start-up; log {self.log_path}:\n{self.log_tail()}"
                    )
                if client.healthy():
                    return
                time.sleep(0.25)
        finally:
            client.close()
        raise ServerError(
            f"specula serve not healthy after {self._start_timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        """Terminate and reap the process; returns its exit status (None if never started)."""
        proc, self._proc = self._proc, None
        status = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self._stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                except KeyboardInterrupt:
                    # A second Ctrl-C while waiting must not leave the server running.
                    proc.kill()
                    proc.wait()
                    raise
            status = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return status
