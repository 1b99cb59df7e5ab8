"""A throwaway Kubernetes control plane: etcd, kube-apiserver and
kube-controller-manager, each a child process with its own log file.

Two shapes:

* API-server-only (the integration tier): everything on loopback, no kubelet, no
  scheduler, so pods never start; the controller manager runs only the garbage
  collector (owner references) and the namespace controller, and nothing else writes
  a Deployment's status but the tests themselves.  The API server makes its own
  self-signed serving certificate (``--cert-dir``).
* For a real node (``pki`` given, see :mod:`specula.devcluster.cluster`): the API
  server listens on the node's private bridge address with certificates from
  :class:`~specula.devcluster.pki.ClusterPKI`, authorizes with ``Node,RBAC`` and the
  ``NodeRestriction`` admission plugin, presents a client certificate to the kubelet
  API and checks the kubelet's serving certificate; the controller manager runs its
  default controllers and publishes the CA in each namespace's ``kube-root-ca.crt``.

Authentication is by static bearer tokens: ``admin`` in ``system:masters`` plus any
``users`` (the node, the scheduler, kube-proxy).  The service-account signing key is an
RSA key made with the ``cryptography`` package.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specula.devcluster.pki import ClusterPKI

REPO_ROOT = Path(__file__).resolve().parents[2]
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"
"""ClusterIP of the ``kubernetes`` Service: the first address of the range."""


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, found or started."""


def find_binaries() -> Path:
    """Directory holding etcd, kube-apiserver, kube-controller-manager and kubectl.

    ``SPECULA_CONTROL_PLANE_BIN`` wins when set; otherwise ``hack/control-plane.sh``
    builds them from the Go module proxy or reuses its cache, and prints the
    directory on its last stdout line.

    Raises:
        ControlPlaneError: the variable points at a directory missing a binary,
            or the build script fails.
    """
    env_dir = os.environ.get("SPECULA_CONTROL_PLANE_BIN")
    if env_dir:
        bin_dir = Path(env_dir)
        source = "SPECULA_CONTROL_PLANE_BIN"
    else:
        script = REPO_ROOT / "hack" / "control-plane.sh"
        proc = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
        if proc.returncode != 0:
            raise ControlPlaneError(
                f"{script} exited {proc.returncode}:\n{_tail_text(proc.stderr, 40)}"
            )
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise ControlPlaneError(f"{script} printed no binary directory")
        bin_dir = Path(lines[-1])
        source = str(script)
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise ControlPlaneError(f"{source}: {bin_dir} lacks executable {', '.join(missing)}")
    return bin_dir


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 30.0,
    interval: float = 0.2,
    message: str | Callable[[], str] = "condition",
) -> object:
    """Poll ``predicate`` until it returns something truthy; return that value.

    Exceptions raised by the predicate count as "not yet" (the last one is
    chained on timeout), so a 404 while an object is being created is fine;
    except :class:`ControlPlaneError`, which means a process died and is raised at once.

    Raises:
        TimeoutError: ``timeout`` seconds passed without a truthy result.
        ControlPlaneError: raised by the predicate.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    last_value: object = None
    while True:
        try:
            last_value = predicate()
            if last_value:
                return last_value
            last_exc = None
        except ControlPlaneError:
            raise
        except Exception as exc:  # noqa: BLE001 - polling tolerates transient errors
            last_exc = exc
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            detail = f"; last value {last_value!r}" if last_exc is None else ""
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {text}{detail}"
            ) from last_exc
        time.sleep(interval)


def die_with_parent() -> None:
    """``preexec_fn`` for children: on Linux, SIGTERM them when the test process dies,
    so a killed test run leaves no API server behind; elsewhere a no-op."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def spawn(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start ``argv`` in its own session, output appended to ``log_path``; it dies
    with the test process."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def stop_process(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def tail_file(path: Path, lines: int = 40) -> str:
    try:
        return _tail_text(path.read_text(errors="replace"), lines)
    except FileNotFoundError:
        return "(no log)"


@dataclass
class Component:
    """One control-plane process; stdout and stderr go to ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = spawn(self.argv, self.log_path, env=self.env)

    def check_alive(self) -> None:
        """Raises ControlPlaneError if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ControlPlaneError(f"{self.name} exited with {self.proc.returncode}")

    def stop(self, grace: float = 10.0) -> None:
        stop_process(self.proc, grace)

    def tail(self, lines: int = 40) -> str:
        return f"--- {self.name} ({self.log_path}) ---\n{tail_file(self.log_path, lines)}"


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager rooted in ``workdir``.

    ``start()`` returns once ``/readyz`` answers ok; ``stop()`` terminates the
    processes in reverse order.  ``timings`` holds seconds from ``start()`` to each
    milestone, for the test report.

    ``address`` is where the API server listens and what it advertises; ``pki``
    switches to the real-node shape (module docstring); ``users`` maps further user
    names to ``(token, groups)``; ``controllers`` is kube-controller-manager's
    ``--controllers`` (default: those of the shape).
    """

    bin_dir: Path
    workdir: Path
    address: str = "127.0.0.1"
    pki: ClusterPKI | None = None
    users: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    controllers: str | None = None
    components: list[Component] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    etcd_port: int = 0
    apiserver_port: int = 0
    controller_manager_port: int = 0

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.apiserver_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def ca_file(self) -> Path:
        if self.pki is not None:
            return self.pki.ca.cert
        # The API server writes its self-signed serving certificate followed by the
        # CA that signed it; trusting the file trusts that CA.
        return self.workdir / "pki" / "apiserver.crt"

    # -- lifecycle ---------------------------------------------------------------

    def start(self, before_controllers: Callable[[], None] | None = None) -> None:
        """Start etcd, then kube-apiserver, run ``before_controllers`` (install CRDs
        there, so the garbage collector's first discovery already knows their
        kinds), then kube-controller-manager.

        Raises:
            ControlPlaneError: a component exited.
            TimeoutError: a component did not become healthy in time (the message
                carries the tails of all component logs).
        """
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "pki").mkdir(exist_ok=True)
        self._write_service_account_key()
        self._write_token_file()

        self._start_etcd()
        wait_for(self._etcd_healthy, timeout=30, message=self._failure_message("etcd /health"))
        self.timings["etcd_ready_s"] = time.monotonic() - t0

        self._start_apiserver()
        wait_for(
            lambda: self.check_alive() or self.ca_file.exists(),
            timeout=60,
            message=self._failure_message("kube-apiserver serving certificate"),
        )
        self._write_kubeconfig()
        wait_for(
            self._apiserver_ready,
            timeout=120,
            interval=0.5,
            message=self._failure_message("kube-apiserver /readyz"),
        )
        self.timings["apiserver_ready_s"] = time.monotonic() - t0

        if before_controllers is not None:
            before_controllers()
        self._start_controller_manager()
        wait_for(
            self._controller_manager_healthy,
            timeout=60,
            interval=0.5,
            message=self._failure_message("kube-controller-manager /healthz"),
        )
        self.timings["controller_manager_ready_s"] = time.monotonic() - t0

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()

    def check_alive(self) -> None:
        for component in self.components:
            component.check_alive()

    def logs_tail(self, lines: int = 40) -> str:
        return "\n".join(c.tail(lines) for c in self.components)

    def _failure_message(self, what: str) -> Callable[[], str]:
        def render() -> str:
            states = ", ".join(
                f"{c.name}={'running' if c.proc and c.proc.poll() is None else 'exited'}"
                for c in self.components
            )
            return f"{what} ({states})"

        return render

    # -- files -------------------------------------------------------------------

    def _write_service_account_key(self) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "pki" / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.workdir / "pki" / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def _write_token_file(self) -> None:
        path = self.workdir / "tokens.csv"
        lines = [f'{self.token},admin,admin-uid,"system:masters"']
        for user, (token, groups) in self.users.items():
            lines.append(f'{token},{user},{user}-uid,"{",".join(groups)}"')
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)

    def kubeconfig_for(self, user: str, path: Path) -> Path:
        """Write a kubeconfig at ``path`` that authenticates as ``user`` (one of
        ``users``) with its token; returns ``path``.

        Raises:
            KeyError: ``user`` is not in ``users``.
        """
        token = self.users[user][0]
        path.write_text(yaml.safe_dump(self._kubeconfig_dict(user, token)))
        path.chmod(0o600)
        return path

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig_dict("admin", self.token)))
        self.kubeconfig.chmod(0o600)

    def _kubeconfig_dict(self, user: str, token: str) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "specula-it",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {"name": f"{user}@specula-it", "context": {"cluster": "specula-it", "user": user}}
            ],
            "current-context": f"{user}@specula-it",
        }

    # -- processes ---------------------------------------------------------------

    def _add(self, name: str, argv: list[str]) -> Component:
        component = Component(name, argv, self.workdir / f"{name}.log")
        self.components.append(component)
        component.start()
        return component

    def _start_etcd(self) -> None:
        self.etcd_port = free_port()
        peer_port = free_port()
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self._add(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                # Test data is disposable; skipping fsync keeps writes fast on slow disks.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        self.apiserver_port = free_port()
        pki = self.workdir / "pki"
        argv = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={self.apiserver_port}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--profiling=false",
            "--v=1",
        ]
        if self.pki is None:
            argv += [
                f"--cert-dir={pki}",
                "--authorization-mode=RBAC",
                # The "kubernetes" Service cannot point at a loopback address.
                "--endpoint-reconciler-type=none",
            ]
        else:
            serving = self.pki.issue(
                "apiserver",
                "kube-apiserver",
                dns_names=(
                    "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local", "localhost",
                ),
                ip_addresses=(self.address, "127.0.0.1", SERVICE_IP),
                server=True,
            )
            kubelet_client = self.pki.issue(
                "apiserver-kubelet-client",
                "kube-apiserver-kubelet-client",
                organizations=("system:masters",),
                client=True,
            )
            argv += [
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.pki.ca.cert}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={self.pki.ca.cert}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        self._add("kube-apiserver", argv)

    def _start_controller_manager(self) -> None:
        self.controller_manager_port = free_port()
        self._add(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--controllers={self._controllers()}",
                *self._controller_manager_node_flags(),
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.controller_manager_port}",
                f"--cert-dir={self.workdir / 'kcm-pki'}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                # No front-proxy or client-CA config exists to look up; only the token is used.
                "--authentication-skip-lookup=true",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _controllers(self) -> str:
        if self.controllers is not None:
            return self.controllers
        if self.pki is None:
            # Owner-reference garbage collection and namespace deletion are all the
            # tests rely on; the Deployment controller stays off so that only the
            # tests write Deployment status (no kubelet would ever run the pods).
            return "garbagecollector,namespace"
        return "*"

    def _controller_manager_node_flags(self) -> list[str]:
        if self.pki is None:
            return ["--use-service-account-credentials=false"]
        pki = self.workdir / "pki"
        return [
            # Each controller acts under its own service account (bootstrap RBAC roles).
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            # Published as the kube-root-ca.crt ConfigMap of every namespace, which the
            # projected service-account token volume of every pod needs.
            f"--root-ca-file={self.pki.ca.cert}",
        ]

    # -- probes ------------------------------------------------------------------

    def _etcd_healthy(self) -> bool:
        self.check_alive()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as r:
            return json.load(r).get("health") == "true"

    def _https_ok(self, url: str, verify: bool) -> bool:
        ctx = (
            ssl.create_default_context(cafile=str(self.ca_file))
            if verify
            else (ssl._create_unverified_context())
        )  # noqa: S323 - the component's own self-signed cert
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=3, context=ctx) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False

    def _apiserver_ready(self) -> bool:
        self.check_alive()
        return self._https_ok(f"{self.server}/readyz", verify=True)

    def _controller_manager_healthy(self) -> bool:
        self.check_alive()
        return self._https_ok(
            f"https://127.0.0.1:{self.controller_manager_port}/healthz", verify=False
        )

    # -- kubectl -----------------------------------------------------------------

    def run_kubectl(
        self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run the built kubectl as admin against this control plane (``input`` on its
        stdin); output is text.

        Raises:
            ControlPlaneError: it exited non-zero and ``check`` is set.
        """
        proc = subprocess.run(
            [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
            )
        return proc
