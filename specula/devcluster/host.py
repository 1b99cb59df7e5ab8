"""Host-level pieces of a local node: the pod bridge, packet forwarding, and the sweep
that removes every process, mount, cgroup, network device and file a node leaves
behind (also after a run that was killed before it could clean up).

Linux only, as root.  Every function here is idempotent: it does nothing when there
is nothing of its kind left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

BRIDGE = "specula0"
"""The pod bridge; its address is the node's (and the API server's) address."""
NODE_IP = "10.88.0.1"
POD_SUBNET = "10.88.0.0/16"
POD_PREFIX = 16
FORWARD_CHAIN = "SPECULA-LOCAL"
"""A filter-table chain that drops packets forwarded from the pod bridge to any other
interface, so that pods reach one another, the node and Services, and nothing else."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_NAMES = ("kubepods", "kubepods.slice", "k8s.io")
"""Top-level cgroups made by the kubelet (pods) and containerd (its namespace)."""
NETNS_DIR = Path("/run/netns")
KUBE_CHAIN_PREFIXES = ("KUBE-",)
# Written by the kubelet and containerd whatever their configuration says.
FIXED_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
)


class HostError(RuntimeError):
    """A host command failed."""


def run(argv: list[str], check: bool = True, timeout: float = 60) -> str:
    """Run ``argv``; return its stdout.

    Raises:
        HostError: it exited non-zero and ``check`` is set.
    """
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise HostError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


# -- host state saved at start, restored at teardown ------------------------------


def save_host_state(path: Path) -> dict:
    """Record what teardown must restore or must not remove: ``ip_forward`` and which
    of :data:`FIXED_PATHS` existed before the node.  Kept if already recorded (a
    killed run's record is the truthful one)."""
    if path.exists():
        return json.loads(path.read_text())
    state = {
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "preexisting": [str(p) for p in FIXED_PATHS if p.exists()],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))
    return state


def restore_host_state(path: Path) -> None:
    """Set ``ip_forward`` back and remove the fixed paths the node created."""
    if not path.exists():
        return
    state = json.loads(path.read_text())
    Path("/proc/sys/net/ipv4/ip_forward").write_text(state["ip_forward"] + "\n")
    preexisting = set(state["preexisting"])
    for fixed in FIXED_PATHS:
        if str(fixed) not in preexisting:
            unmount_under([fixed])
            shutil.rmtree(fixed, ignore_errors=True)
    path.unlink()


# -- network -----------------------------------------------------------------------


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def bring_up_bridge() -> None:
    """Create :data:`BRIDGE` with :data:`NODE_IP`, turn on forwarding, and install
    :data:`FORWARD_CHAIN`.  The CNI bridge plugin later attaches pods to it."""
    if not link_exists(BRIDGE):
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{NODE_IP}/{POD_PREFIX}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    exists = subprocess.run(["iptables", "-w", "-n", "-L", FORWARD_CHAIN], capture_output=True)
    if exists.returncode != 0:
        run(["iptables", "-w", "-N", FORWARD_CHAIN])
    run(["iptables", "-w", "-F", FORWARD_CHAIN])
    run(["iptables", "-w", "-A", FORWARD_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP"])
    jump = ["FORWARD", "-j", FORWARD_CHAIN]
    if subprocess.run(["iptables", "-w", "-C", *jump], capture_output=True).returncode != 0:
        run(["iptables", "-w", "-I", *jump])


def remove_network() -> None:
    """Delete the pods' veths, the bridge, the CNI network namespaces and the
    iptables chains of kube-proxy, the kubelet and :data:`FORWARD_CHAIN`."""
    if link_exists(BRIDGE):
        for line in run(["ip", "-o", "link", "show", "master", BRIDGE], check=False).splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            run(["ip", "link", "del", name], check=False)
        run(["ip", "link", "del", BRIDGE], check=False)
    if NETNS_DIR.is_dir():
        for ns in NETNS_DIR.glob("cni-*"):
            subprocess.run(["umount", "-l", str(ns)], capture_output=True)
            ns.unlink(missing_ok=True)
    for tool in ("iptables", "ip6tables"):
        remove_chains(tool, lambda c: c.startswith(KUBE_CHAIN_PREFIXES) or c == FORWARD_CHAIN)


def remove_chains(tool: str, owned) -> None:
    """Remove every rule that jumps to a chain ``owned(name)`` accepts, then the
    chains themselves, in each table of ``tool`` (``iptables`` or ``ip6tables``)."""
    if shutil.which(tool) is None:
        return
    for table in ("filter", "nat", "mangle", "raw"):
        saved = run([tool + "-save", "-t", table], check=False)
        chains = [
            line[1:].split()[0] for line in saved.splitlines() if line.startswith(":")
        ]
        mine = [c for c in chains if owned(c)]
        if not mine:
            continue
        for line in saved.splitlines():
            if not line.startswith("-A "):
                continue
            parts = line.split()
            chain = parts[1]
            if chain in mine:
                continue
            if any(p in mine for p in parts[2:]):
                subprocess.run(
                    [tool, "-w", "-t", table, "-D", chain, *_unquote(line)[2:]],
                    capture_output=True,
                )
        for chain in mine:
            subprocess.run([tool, "-w", "-t", table, "-F", chain], capture_output=True)
        for chain in mine:
            subprocess.run([tool, "-w", "-t", table, "-X", chain], capture_output=True)


def _unquote(line: str) -> list[str]:
    import shlex

    return shlex.split(line)


# -- processes, mounts, cgroups ------------------------------------------------------


def processes_with(substring: str) -> list[int]:
    """PIDs whose command line contains ``substring``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if substring in cmdline:
            pids.append(int(entry.name))
    return pids


def _cgroup_dirs() -> list[Path]:
    """Every cgroup made by the node, deepest first, in every hierarchy."""
    found: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return found
    tops = []
    for hierarchy in CGROUP_ROOT.iterdir():
        for name in CGROUP_NAMES:
            if (hierarchy / name).is_dir():
                tops.append(hierarchy / name)
            elif hierarchy.name == name and (hierarchy / "cgroup.procs").exists():
                tops.append(hierarchy)  # cgroup v2: /sys/fs/cgroup/kubepods
    for top in tops:
        for dirpath, _, _ in os.walk(top):
            found.append(Path(dirpath))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def cgroup_pids() -> set[int]:
    """PIDs in the node's cgroups (the pods' processes)."""
    pids: set[int] = set()
    for directory in _cgroup_dirs():
        for name in ("cgroup.procs", "tasks"):
            try:
                pids.update(int(x) for x in (directory / name).read_text().split())
            except (OSError, ValueError):
                continue
    return pids


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_pods_and_shims(shim_marker: str, timeout: float = 20) -> None:
    """SIGKILL every process in the node's cgroups and every containerd shim whose
    command line names ``shim_marker`` (the node's containerd socket), until none is
    left or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids() | set(processes_with(shim_marker))
        if not pids or time.monotonic() > deadline:
            return
        kill_all(pids)
        time.sleep(0.2)


def remove_cgroups(timeout: float = 20) -> list[Path]:
    """rmdir the node's cgroups, deepest first; returns those that remain."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for directory in _cgroup_dirs():
            try:
                directory.rmdir()
            except OSError:
                left.append(directory)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def mounts_under(prefixes: Iterable[Path]) -> list[str]:
    """Mount points at or below any of ``prefixes``, deepest first."""
    roots = [str(p.resolve()) if p.exists() else str(p) for p in prefixes]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == r or point.startswith(r.rstrip("/") + "/") for r in roots):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_under(prefixes: Iterable[Path]) -> None:
    """Lazily unmount everything mounted at or below ``prefixes``."""
    prefixes = list(prefixes)
    for _ in range(5):
        points = mounts_under(prefixes)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True)
