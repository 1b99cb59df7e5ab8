"""A real ``specula serve`` process with tiny checkpoints, for the tuning tests, in a
network namespace the test makes itself.

The checkpoints are built by the runtime tier's helpers (``tests/runtime/conftest.py``:
a 3-layer Llama target and a 1-layer draft derived from it that agrees with it about
half the time), loaded from that file by path since ``tests`` is not a package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specula.devcluster.control_plane import REPO_ROOT, spawn, stop_process, tail_file, wait_for

_RUNTIME_CONFTEST = REPO_ROOT / "tests" / "runtime" / "conftest.py"


def build_tiny_checkpoints(root: Path) -> tuple[Path, Path]:
    """Save the runtime tier's tiny Llama target and its draft under ``root``;
    returns ``(target_dir, draft_dir)``."""
    spec = importlib.util.spec_from_file_location("_specula_runtime_fixtures", _RUNTIME_CONFTEST)
    assert spec is not None and spec.loader is not None
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    tokenizer = fixtures._train_tokenizer()
    target = fixtures._llama(tokenizer, num_layers=3, seed=0)
    draft = fixtures.derive_draft(target, num_layers=1, noise=0.01, seed=2)
    return (
        fixtures.save_checkpoint(target, tokenizer, root / "target"),
        fixtures.save_checkpoint(draft, tokenizer, root / "draft"),
    )


@dataclass
class ServerNamespace:
    """A network namespace of the test's own, joined to this one by a veth pair, in
    which the runtime server listens: the API server refuses loopback addresses in
    EndpointSlices, so the server needs an address of its own that is not loopback,
    and a namespace made by the test gives it one without reaching any other machine.

    Needs root and iproute2's ``ip`` (both present where the test control plane runs).
    """

    name: str = field(default_factory=lambda: f"specula-it-{os.getpid()}")
    subnet_index: int = field(default_factory=lambda: os.getpid() % 250 + 1)
    created: bool = False

    @property
    def host_side(self) -> str:
        return f"10.213.{self.subnet_index}.1"

    @property
    def address(self) -> str:
        """The server's address inside the namespace."""
        return f"10.213.{self.subnet_index}.2"

    @property
    def _veth(self) -> tuple[str, str]:
        # Interface names are limited to 15 characters.
        return f"spit{self.subnet_index}h", f"spit{self.subnet_index}n"

    def _ip(self, *args: str) -> None:
        ip = shutil.which("ip")
        if ip is None:
            raise RuntimeError("iproute2's `ip` is required for the tuning tests' test host")
        proc = subprocess.run([ip, *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")

    def create(self) -> None:
        self.delete()
        host, peer = self._veth
        self._ip("netns", "add", self.name)
        self.created = True
        self._ip("link", "add", host, "type", "veth", "peer", "name", peer)
        self._ip("link", "set", peer, "netns", self.name)
        self._ip("addr", "add", f"{self.host_side}/30", "dev", host)
        self._ip("link", "set", host, "up")
        self._ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.address}/30", "dev", peer)
        self._ip("netns", "exec", self.name, "ip", "link", "set", peer, "up")
        self._ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")

    def delete(self) -> None:
        """Remove the namespace; its veth end goes with it, and so does the peer."""
        ip = shutil.which("ip")
        if ip is None:
            return
        subprocess.run([ip, "netns", "del", self.name], capture_output=True)
        subprocess.run([ip, "link", "del", self._veth[0]], capture_output=True)
        self.created = False

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.name, *argv]


@dataclass
class RuntimeServer:
    """``specula serve --config FILE`` with a draft model; ``num_speculative_tokens``
    is the pod's startup (and largest) k."""

    target: Path
    draft: Path
    workdir: Path
    num_speculative_tokens: int
    test_host: ServerNamespace
    served_model_name: str = "tiny"
    port: int = 0
    metrics_port: int = 0
    admin_port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path = field(init=False)
    token_file: Path = field(init=False)
    """The admin token, as the pod's mounted Secret holds it (:meth:`use_token`)."""

    def __post_init__(self) -> None:
        self.log_path = self.workdir / "runtime.log"
        self.token_file = self.workdir / "admin-token"
        self.token_file.write_text("token-before-any-resource")

    def use_token(self, token: str) -> None:
        """Replace the admin token, as the kubelet does when the Secret behind the pod's
        mount changes (the server reads it per request)."""
        self.token_file.write_text(token)

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}/v1/speculative_config"

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    @property
    def host(self) -> str:
        return self.test_host.address

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120) -> None:
        # A namespace of its own: the pod's ports are free there.
        self.port, self.metrics_port, self.admin_port = 8000, 9090, 8001
        config = self.workdir / "runtime.json"
        config.write_text(json.dumps({
            "model": f"file://{self.target}",
            "served_model_name": self.served_model_name,
            "dtype": "float32",
            "max_model_len": 128,
            "max_num_seqs": 8,
            "host": self.host,
            "port": self.port,
            "metrics_port": self.metrics_port,
            "admin_port": self.admin_port,
            "admin_token_file": str(self.token_file),
            "speculator": {
                "method": "draft_model",
                "model": f"file://{self.draft}",
                "num_speculative_tokens": self.num_speculative_tokens,
            },
        }))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = spawn(
            self.test_host.command(
                [sys.executable, "-m", "specula.cli", "serve", "--config", str(config)]
            ),
            self.log_path, env=env, cwd=REPO_ROOT,
        )
        wait_for(self._healthy, timeout=timeout, interval=0.5, message="specula serve /health")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"specula serve exited with {self.proc.returncode}")
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        stop_process(self.proc, grace=20)

    def speculative_config(self) -> dict:
        response = httpx.get(self.admin_url, headers=self._admin_headers(), timeout=5)
        response.raise_for_status()
        return response.json()

    def set_num_speculative_tokens(self, k: int) -> None:
        response = httpx.put(
            self.admin_url, json={"num_speculative_tokens": k},
            headers=self._admin_headers(), timeout=10,
        )
        response.raise_for_status()

    def tail(self, lines: int = 40) -> str:
        return f"--- specula serve ({self.log_path}) ---\n{tail_file(self.log_path, lines)}"


PROMPTS = [
    "def speculative_decoding(target, draft, k):",
    "The quick brown fox jumps over the lazy dog",
    "Kubernetes reconciles a SpeculativeModel into pods",
    "import torch\nfrom transformers import AutoTokenizer",
]


class Traffic:
    """Completions sent back to back by ``concurrency`` threads until stopped, so the
    server's counters keep moving while the operator measures."""

    def __init__(self, server: RuntimeServer, concurrency: int = 4, max_tokens: int = 48) -> None:
        self.server = server
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.completed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=60) as client:
            n = index
            while not self._stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                try:
                    response = client.post("/v1/completions", json={
                        "model": self.server.served_model_name,
                        "prompt": prompt,
                        "max_tokens": self.max_tokens,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    })
                    if response.status_code == 200:
                        self.completed += 1
                    else:
                        self.errors.append(f"{response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))
                    time.sleep(0.2)

    def __enter__(self) -> Traffic:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
