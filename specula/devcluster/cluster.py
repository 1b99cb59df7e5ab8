"""A real single-node Kubernetes cluster on this machine, for the end-to-end tests and
``make demo``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
kube-proxy and containerd, each a child process of the caller.

Layout and choices (``../shared``-independent; see the README's "Local cluster"):

* Network: a bridge ``specula0`` on ``10.88.0.1/16``.  The bridge address is the
  node's InternalIP and where the API server and the kubelet listen, so nothing listens
  beyond the machine; pods get addresses from the same /16 through Debian's CNI
  ``bridge`` and ``host-local`` plugins; a filter chain drops anything forwarded from
  the bridge elsewhere.  kube-proxy (iptables mode) makes Services work.
* Identity: the API server authorizes with ``Node,RBAC`` and ``NodeRestriction``; the
  node authenticates as ``system:node:specula-node`` in ``system:nodes``; the kubelet
  API refuses anonymous requests and authorizes through the API server (webhook),
  which presents a client certificate from the cluster CA.
* Runtime: Debian's containerd and runc with the cgroupfs driver,
  ``restrict_oom_score_adj`` (root here may lack CAP_SYS_RESOURCE), and a local pause
  image.  Images persist in containerd's root under the cache directory; no registry.
* Teardown (:meth:`LocalCluster.down`, also run first by :meth:`LocalCluster.up` to
  sweep a killed run's leftovers) leaves no processes, mounts, cgroups, network
  devices, iptables chains or files outside the cache.

Binaries: ``hack/control-plane.sh`` and ``hack/node.sh`` (built from the Go module
proxy, cached by version; ``hack/node.sh`` apt-installs the Debian packages).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specula.devcluster import host
from specula.devcluster.control_plane import (
    REPO_ROOT,
    Component,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    free_port,
    wait_for,
)
from specula.devcluster.images import PAUSE_IMAGE, ImageBuilder, cache_root
from specula.devcluster.pki import ClusterPKI

NODE_NAME = "specula-node"
CNI_NETWORK = "specula"
CNI_BIN_DIR = Path("/usr/lib/cni")
STATE_DIR = Path("/run/specula-cluster")
"""containerd's state and socket, runc's root: on tmpfs, removed at teardown."""
REQUIRED_TOOLS = ("containerd", "runc", "ctr", "iptables", "iptables-save", "conntrack",
                  "ip", "buildah", "debootstrap", "go", "mount", "umount")


class ClusterUnsupported(RuntimeError):
    """This machine cannot run a node (the message says why)."""


def host_support() -> str | None:
    """Why this machine cannot run a local node, or None when it can (Linux, root,
    cgroups mounted, bridges allowed).  Missing Debian packages are not a reason:
    ``hack/node.sh`` installs them."""
    if sys.platform != "linux":
        return f"a local node needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "a local node needs root (containerd, the kubelet and the pod bridge)"
    if not (host.CGROUP_ROOT / "cgroup.controllers").exists() and not any(
        (host.CGROUP_ROOT / c).is_dir() for c in ("memory", "cpu")
    ):
        return "no cgroup hierarchy is mounted at /sys/fs/cgroup"
    if shutil.which("apt-get") is None and shutil.which("containerd") is None:
        return "containerd is not installed and apt-get is not available to install it"
    return None


def find_node_binaries() -> Path:
    """Directory of kubelet, kube-scheduler and kube-proxy (``SPECULA_NODE_BIN`` or
    ``hack/node.sh``, which also installs the Debian packages a node needs).

    Raises:
        ControlPlaneError: the script failed.
    """
    env_dir = os.environ.get("SPECULA_NODE_BIN")
    if env_dir:
        return Path(env_dir)
    script = REPO_ROOT / "hack" / "node.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise ControlPlaneError(f"{script} exited {proc.returncode}:\n{tail}")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass
class LocalCluster:
    """One node and its control plane, rooted in ``workdir`` (configs, logs, etcd
    data, certificates); containerd's images and buildah's layers live under
    ``cache_dir`` and survive :meth:`down`.

    ``log`` receives progress lines; ``timings`` holds seconds per phase.
    """

    workdir: Path
    cache_dir: Path = field(default_factory=lambda: cache_root() / "cluster")
    log: Callable[[str], None] = print
    control_plane: ControlPlane | None = None
    components: list[Component] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _lock_fd: int | None = None

    # -- paths ---------------------------------------------------------------------

    @property
    def containerd_root(self) -> Path:
        return self.cache_dir / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.cache_dir / "kubelet"

    @property
    def containerd_socket(self) -> Path:
        return STATE_DIR / "containerd.sock"

    @property
    def ctr(self) -> list[str]:
        """``ctr`` against the node's containerd, in the CRI's ``k8s.io`` namespace."""
        return ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io"]

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane is not None
        return self.control_plane.kubeconfig

    @property
    def images(self) -> ImageBuilder:
        return ImageBuilder(log=self.log)

    # -- lifecycle -----------------------------------------------------------------

    def up(self, images: tuple[str, ...] = ()) -> None:
        """Bring the node up: sweep leftovers, bridge, control plane, containerd (with
        the pause image and ``images`` imported, each built beforehand in
        :attr:`images`), kubelet (until the Node is Ready), kube-proxy, scheduler.

        Raises:
            ClusterUnsupported: :func:`host_support` gave a reason.
            ControlPlaneError: a binary is missing or a component exited.
            TimeoutError: a component did not become ready (the message names it;
                :meth:`logs_tail` has the logs).
        """
        reason = host_support()
        if reason:
            raise ClusterUnsupported(reason)
        t0 = time.monotonic()
        self._lock()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._sweep()
        host.save_host_state(self.cache_dir / "host-state.json")
        cp_bin = find_binaries()
        node_bin = find_node_binaries()
        self.timings["binaries_s"] = time.monotonic() - t0

        builder = self.images
        builder.ensure_pause()
        host.bring_up_bridge()

        pki = ClusterPKI(self.workdir / "pki")
        tokens = {
            f"system:node:{NODE_NAME}": (secrets.token_hex(16), ("system:nodes",)),
            "system:kube-proxy": (secrets.token_hex(16), ()),
            "system:kube-scheduler": (secrets.token_hex(16), ()),
        }
        self.control_plane = ControlPlane(
            bin_dir=cp_bin, workdir=self.workdir / "control-plane", address=host.NODE_IP,
            pki=pki, users=tokens,
        )
        self.log("cluster: starting etcd, kube-apiserver, kube-controller-manager")
        self.control_plane.start()
        self.timings["control_plane_s"] = time.monotonic() - t0

        self.log("cluster: starting containerd")
        self._start_containerd()
        self._forget_old_containers()
        for name in (PAUSE_IMAGE, *images):
            builder.import_into(name, self.ctr, self.cache_dir / "imported")
        self.timings["containerd_s"] = time.monotonic() - t0

        self.log(f"cluster: starting kubelet (node {NODE_NAME} on {host.NODE_IP})")
        self._start_kubelet(node_bin, pki)
        wait_for(self._node_ready, timeout=120, interval=0.5,
                 message=self._failure("Node Ready"))
        self.timings["node_ready_s"] = time.monotonic() - t0

        self.log("cluster: starting kube-proxy and kube-scheduler")
        self._start_kube_proxy(node_bin)
        self._start_scheduler(node_bin)
        wait_for(self._scheduler_and_proxy_healthy, timeout=60, interval=0.5,
                 message=self._failure("kube-scheduler and kube-proxy /healthz"))
        wait_for(self._default_service_account, timeout=60, interval=0.5,
                 message=self._failure("the default ServiceAccount"))
        self.timings["ready_s"] = time.monotonic() - t0
        self.log(f"cluster: ready in {self.timings['ready_s']:.0f}s")

    def down(self) -> list[str]:
        """Stop everything and remove what the node made; returns the leftovers that
        could not be removed (empty on success)."""
        t0 = time.monotonic()
        for component in reversed(self.components):
            component.stop(grace=10)
        self.components.clear()
        if self.control_plane is not None:
            self.control_plane.stop()
        self._cleanup_host()
        leftovers = self.leftovers()
        self._unlock()
        self.timings["down_s"] = time.monotonic() - t0
        return leftovers

    def leftovers(self) -> list[str]:
        """What of the node is still on the machine: processes, mounts, cgroups,
        network devices and namespaces, iptables chains."""
        found = []
        for pid in host.cgroup_pids() | set(host.processes_with(str(STATE_DIR))):
            found.append(f"process {pid}")
        netns = list(host.NETNS_DIR.glob("cni-*")) if host.NETNS_DIR.is_dir() else []
        for point in host.mounts_under([self.kubelet_root, STATE_DIR, self.containerd_root,
                                        *netns]):
            found.append(f"mount {point}")
        found += [f"cgroup {p}" for p in host._cgroup_dirs()]
        if host.link_exists(host.BRIDGE):
            found.append(f"link {host.BRIDGE}")
        found += [f"netns {p.name}" for p in netns]
        for tool in ("iptables", "ip6tables"):
            if shutil.which(tool + "-save") is None:
                continue
            for table in ("filter", "nat"):
                saved = host.run([tool + "-save", "-t", table], check=False)
                found += [
                    f"{tool} chain {table}/{line[1:].split()[0]}"
                    for line in saved.splitlines()
                    if line.startswith((":KUBE-", f":{host.FORWARD_CHAIN}"))
                ]
        return found

    def logs_tail(self, lines: int = 40) -> str:
        parts = [c.tail(lines) for c in self.components]
        if self.control_plane is not None:
            parts.insert(0, self.control_plane.logs_tail(lines))
        return "\n".join(parts)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
        """Run kubectl as admin against this cluster
        (:meth:`ControlPlane.run_kubectl`).

        Raises:
            ControlPlaneError: it exited non-zero and ``check`` is set.
        """
        assert self.control_plane is not None
        return self.control_plane.run_kubectl(*args, check=check, timeout=timeout, input=input)

    # -- internals -----------------------------------------------------------------

    def _lock(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cache_dir / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ControlPlaneError(
                f"another local cluster holds {self.cache_dir / '.lock'}"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _sweep(self) -> None:
        """Remove what a killed run left (nothing on a clean machine)."""
        stale = host.processes_with(str(STATE_DIR))
        if stale or host.link_exists(host.BRIDGE) or host._cgroup_dirs():
            self.log("cluster: removing what an earlier run left behind")
        host.kill_all(p for p in stale if "containerd-shim" not in _cmdline(p))
        self._cleanup_host()

    def _cleanup_host(self) -> None:
        host.kill_pods_and_shims(str(STATE_DIR))
        host.unmount_under([self.kubelet_root, STATE_DIR, self.containerd_root / "tmpmounts"])
        # Container root filesystems (overlay snapshots) of the task manager.
        host.unmount_under([self.containerd_root / "io.containerd.runtime.v2.task"])
        host.remove_cgroups()
        host.remove_network()
        host.restore_host_state(self.cache_dir / "host-state.json")
        shutil.rmtree(self.kubelet_root, ignore_errors=True)
        shutil.rmtree(STATE_DIR, ignore_errors=True)

    def _forget_old_containers(self) -> None:
        """Delete the containers an earlier run registered in containerd's metadata
        (kept with its images across runs): their tasks died with that run, and their
        snapshots would otherwise never be garbage-collected."""
        listed = subprocess.run([*self.ctr, "containers", "ls", "-q"],
                                capture_output=True, text=True, timeout=120)
        ids = listed.stdout.split()
        if ids:
            self.log(f"cluster: removing {len(ids)} containers of an earlier run from containerd")
            proc = subprocess.run([*self.ctr, "containers", "rm", *ids],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                self.log(f"cluster: ctr containers rm: {proc.stderr.strip()[:300]}")

    def _failure(self, what: str) -> Callable[[], str]:
        def render() -> str:
            names = [*(c.name for c in (self.control_plane.components
                                        if self.control_plane else [])),
                     *(c.name for c in self.components)]
            return f"{what} (components: {', '.join(names)})"
        return render

    def _add(self, name: str, argv: list[str]) -> Component:
        component = Component(name, argv, self.workdir / f"{name}.log")
        self.components.append(component)
        component.start()
        return component

    def _check_alive(self) -> None:
        for component in self.components:
            component.check_alive()
        if self.control_plane is not None:
            self.control_plane.check_alive()

    def _start_containerd(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / f"10-{CNI_NETWORK}.conflist").write_text(json.dumps(self._cni_config(),
                                                                       indent=2))
        config = self.workdir / "containerd.toml"
        config.write_text(_containerd_toml(
            root=self.containerd_root, state=STATE_DIR / "containerd",
            socket=self.containerd_socket, runc_root=STATE_DIR / "runc", cni_conf=cni_conf,
        ))
        self._add("containerd", ["containerd", "--config", str(config)])
        wait_for(
            lambda: self._check_alive() or subprocess.run(
                [*self.ctr, "version"], capture_output=True).returncode == 0,
            timeout=60, interval=0.3, message=self._failure("containerd's socket"),
        )

    def _cni_config(self) -> dict:
        return {
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": host.BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{
                            "subnet": host.POD_SUBNET,
                            "rangeStart": "10.88.1.0",
                            "gateway": host.NODE_IP,
                        }]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(STATE_DIR / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _start_kubelet(self, node_bin: Path, pki: ClusterPKI) -> None:
        assert self.control_plane is not None
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        serving = pki.issue(
            "kubelet", f"system:node:{NODE_NAME}", organizations=("system:nodes",),
            dns_names=(NODE_NAME,), ip_addresses=(host.NODE_IP,), server=True,
        )
        self.kubelet_healthz_port = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": host.NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.kubelet_healthz_port,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki.ca.cert)},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "failSwapOn": False,
            "podLogsDir": str(self.kubelet_root / "pod-logs"),
            # Imported images cannot be pulled again: never collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%",
                             "imagefs.available": "2%", "nodefs.inodesFree": "2%"},
            "serializeImagePulls": False,
            "maxPods": 64,
            # Config and Secret volume updates reach pods within seconds.
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
        }
        config_path = self.workdir / "kubelet.yaml"
        config_path.write_text(yaml.safe_dump(config))
        kubeconfig = self.control_plane.kubeconfig_for(
            f"system:node:{NODE_NAME}", self.workdir / "kubelet.kubeconfig"
        )
        self._add("kubelet", [
            str(node_bin / "kubelet"),
            f"--config={config_path}",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={host.NODE_IP}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.kubelet_root / 'pki'}",
            "--v=1",
        ])

    def _start_kube_proxy(self, node_bin: Path) -> None:
        assert self.control_plane is not None
        self.proxy_healthz_port = free_port()
        kubeconfig = self.control_plane.kubeconfig_for(
            "system:kube-proxy", self.workdir / "kube-proxy.kubeconfig"
        )
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": host.POD_SUBNET,
            "hostnameOverride": NODE_NAME,
            "bindAddress": host.NODE_IP,
            "healthzBindAddress": f"127.0.0.1:{self.proxy_healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "nodePortAddresses": [f"{host.NODE_IP}/32"],
            # Leave the host's conntrack sysctls as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        self._add("kube-proxy", [str(node_bin / "kube-proxy"), f"--config={path}", "--v=1"])

    def _start_scheduler(self, node_bin: Path) -> None:
        assert self.control_plane is not None
        self.scheduler_port = free_port()
        kubeconfig = self.control_plane.kubeconfig_for(
            "system:kube-scheduler", self.workdir / "kube-scheduler.kubeconfig"
        )
        self._add("kube-scheduler", [
            str(node_bin / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--authentication-skip-lookup=true",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.scheduler_port}",
            f"--cert-dir={self.workdir / 'scheduler-pki'}",
            "--profiling=false",
            "--v=1",
        ])

    # -- probes --------------------------------------------------------------------

    def _node_ready(self) -> bool:
        self._check_alive()
        proc = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if proc.returncode != 0:
            return False
        conditions = json.loads(proc.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _scheduler_and_proxy_healthy(self) -> bool:
        self._check_alive()
        import ssl

        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.proxy_healthz_port}/healthz", timeout=2
        ) as r:
            if r.status != 200:
                return False
        ctx = ssl._create_unverified_context()  # noqa: S323 - its own self-signed cert
        with urllib.request.urlopen(
            f"https://127.0.0.1:{self.scheduler_port}/healthz", timeout=2, context=ctx
        ) as r:
            return r.status == 200

    def _default_service_account(self) -> bool:
        self._check_alive()
        return self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _containerd_toml(root: Path, state: Path, socket: Path, runc_root: Path,
                     cni_conf: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # The kubelet asks for oom_score_adj -998, which root without CAP_SYS_RESOURCE
  # cannot set; containerd then keeps the value it may set.
  restrict_oom_score_adj = true
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{runc_root}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{cni_conf}"
  max_conf_num = 1
"""
