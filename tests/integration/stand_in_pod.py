"""A stand-in serving pod (``metrics_server.py``) in a network namespace of the test's
own, for tests that need a pod's ``/metrics`` but no model: the autoscaling tests and
the ``engine: vllm`` tuning test (no kubelet runs the pods of this tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specula.devcluster.control_plane import spawn, stop_process, tail_file, wait_for

from .runtime_server import ServerNamespace

_SCRIPT = Path(__file__).with_name("metrics_server.py")


@dataclass
class StandInPod:
    """``metrics_server.py`` on port 8000 of a fresh network namespace."""

    workdir: Path
    prefix: str
    """``specula`` or ``vllm``: the metric names (and API) it imitates."""
    k: int = 3
    alphas: tuple[float, ...] = (0.8, 0.5, 0.25)
    drafts_per_second: float = 400.0
    running: int = 4
    waiting: int = 2
    port: int = 8000
    writable: bool = False
    """Serve a writable admin API that checks the token :meth:`use_token` set
    (``--admin-token-file``)."""
    test_host: ServerNamespace = field(default_factory=ServerNamespace)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return self.test_host.address

    @property
    def requests_log(self) -> Path:
        return self.workdir / f"{self.prefix}-requests.log"

    @property
    def pause_file(self) -> Path:
        """While it exists, a writable pod holds its ``GET /metrics`` answers."""
        return self.workdir / f"{self.prefix}-pause"

    @property
    def token_file(self) -> Path:
        return self.workdir / f"{self.prefix}-admin-token"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.prefix}-stand-in.log"

    def start(self) -> None:
        self.test_host.create()
        argv = [
            sys.executable, str(_SCRIPT), "--host", self.address, "--port", str(self.port),
            "--prefix", self.prefix, "--k", str(self.k),
            "--alphas", ",".join(str(a) for a in self.alphas),
            "--drafts-per-second", str(self.drafts_per_second),
            "--running", str(self.running), "--waiting", str(self.waiting),
            "--requests-log", str(self.requests_log),
        ]
        if self.writable:
            argv += ["--admin-token-file", str(self.token_file),
                     "--pause-file", str(self.pause_file)]
        self.proc = spawn(self.test_host.command(argv), self.log_path, env=dict(os.environ))
        wait_for(self._healthy, timeout=30, interval=0.2, message="stand-in pod /health")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"stand-in pod exited: {tail_file(self.log_path, 20)}")
        try:
            return httpx.get(f"http://{self.address}:{self.port}/health", timeout=2).is_success
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        stop_process(self.proc, grace=5)
        self.test_host.delete()

    def use_token(self, token: str) -> None:
        """The admin token the pod accepts from now on (what the kubelet mounts)."""
        self.token_file.write_text(token)

    def current_k(self) -> int:
        """k in effect, from ``GET /v1/speculative_config`` with the token."""
        response = httpx.get(
            f"http://{self.address}:{self.port}/v1/speculative_config",
            headers={"Authorization": f"Bearer {self.token_file.read_text().strip()}"},
            timeout=5,
        )
        response.raise_for_status()
        return int(response.json()["num_speculative_tokens"])

    def requests(self) -> list[str]:
        """``METHOD PATH`` of every request received so far."""
        if not self.requests_log.exists():
            return []
        return self.requests_log.read_text().splitlines()
