"""The operator under test: ``specula operator`` as a child process.

It runs as the admin user of the test control plane (through ``KUBECONFIG``),
watches one namespace, and logs to a file the tests can read and search.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specula.devcluster.control_plane import (
    REPO_ROOT,
    ControlPlaneError,
    free_port,
    spawn,
    stop_process,
    tail_file,
    wait_for,
)


@dataclass
class OperatorProcess:
    """``python -m specula.cli operator --namespace NS`` with a liveness endpoint.

    ``start()`` returns once kopf answers on its liveness endpoint, which it opens
    only after the operator's startup handlers have run.
    """

    kubeconfig: Path
    namespace: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the operator (``SPECULA_*`` settings)."""
    proc: subprocess.Popen | None = None
    liveness_port: int = 0
    starts: int = 0

    def start(self, timeout: float = 60) -> None:
        self.liveness_port = free_port()
        env = {**os.environ, **self.env}
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PYTHONUNBUFFERED"] = "1"
        argv = [
            sys.executable,
            "-m",
            "specula.cli",
            "operator",
            "--namespace",
            self.namespace,
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--verbose",
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start #{self.starts + 1}: {' '.join(argv)}\n".encode())
        self.proc = spawn(argv, self.log_path, env=env, cwd=REPO_ROOT)
        self.starts += 1
        wait_for(
            self._live,
            timeout=timeout,
            interval=0.3,
            message="operator liveness endpoint",
        )

    def _live(self) -> bool:
        self.check_alive()
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200

    def check_alive(self) -> None:
        """Raises ControlPlaneError if the operator has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ControlPlaneError(f"operator exited with {self.proc.returncode}")

    def stop(self, grace: float = 20.0) -> None:
        # SIGTERM lets kopf finish in-flight handlers and release its watches.
        stop_process(self.proc, grace)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_for_log_count(
        self, pattern: str, count: int, since: int = 0, timeout: float = 30
    ) -> None:
        """Wait until at least ``count`` log lines from byte offset ``since`` match
        the regex ``pattern`` (kopf logs one "Resuming is processed" per object)."""
        regex = re.compile(pattern)

        def enough() -> bool:
            self.check_alive()
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
            return sum(1 for line in text.splitlines() if regex.search(line)) >= count

        wait_for(
            enough,
            timeout=timeout,
            interval=0.3,
            message=f"{count} operator log lines /{pattern}/",
        )

    def tail(self, lines: int = 60) -> str:
        return f"--- operator ({self.log_path}) ---\n{tail_file(self.log_path, lines)}"

    def settle(self, seconds: float = 2.0) -> None:
        """Give the operator time to react to an event that should produce no writes."""
        time.sleep(seconds)
        self.check_alive()
