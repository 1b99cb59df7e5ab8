"""``python -m specula.devcluster``: the local single-node cluster from a shell.

* ``prepare``: build (or find) everything a node needs: the control-plane and node
  binaries, Helm, and the images (pause, operator, CPU runtime).  Idempotent and
  serialized by a lock, so ``make test`` can start it in the background and the
  end-to-end tier waits for it.
* ``up``: bring a node up with the images, print how to reach it, and keep it until
  Ctrl-C; then tear it down.
* ``sweep``: remove what a killed run left behind (processes, mounts, cgroups, the
  bridge, iptables chains).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specula.devcluster.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE, ImageBuilder, cache_root


def prepare(log=print) -> dict[str, float]:
    """Binaries, Helm and images, each built once and cached; returns seconds per step.

    Raises:
        ControlPlaneError, HelmError, ImageError: a build failed.
    """
    from specula.devcluster.cluster import find_node_binaries
    from specula.devcluster.control_plane import find_binaries
    from specula.devcluster.helm import find_helm

    timings: dict[str, float] = {}
    lock_path = cache_root() / "prepare.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        # Images first: they wait on the network and the disk, so they overlap well
        # with a control-plane build (CPU) that `make test` runs meanwhile.
        builder = ImageBuilder(log=log)
        if shutil.which("buildah") is None or shutil.which("debootstrap") is None:
            log("prepare: Debian packages of a node (hack/node.sh)")
            find_node_binaries()
        builder.ensure_pause()
        builder.build_operator()
        builder.build_runtime_cpu()
        timings.update(builder.timings)
        t1 = time.monotonic()
        log("prepare: control plane and node binaries (hack/control-plane.sh, hack/node.sh)")
        find_binaries()
        find_node_binaries()
        find_helm()
        timings["binaries_s"] = time.monotonic() - t1
        timings["prepare_s"] = time.monotonic() - t0
    return timings


def _prepare_in_background() -> int:
    from specula.devcluster.cluster import host_support

    reason = host_support()
    if reason:
        print(f"devcluster: no local node here ({reason})")
        return 0
    log = cache_root() / "prepare.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        subprocess.Popen(
            [sys.executable, "-m", "specula.devcluster", "prepare"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    print(f"devcluster: building the images in the background (log: {log})")
    return 0


def _up(args: argparse.Namespace) -> int:
    from specula.devcluster.cluster import LocalCluster

    prepare()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="specula-cluster-"))
    cluster = LocalCluster(workdir=workdir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.up(images=(OPERATOR_IMAGE, RUNTIME_CPU_IMAGE))
        print(f"cluster: export KUBECONFIG={cluster.kubeconfig}")
        print("cluster: Ctrl-C tears it down")
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        leftovers = cluster.down()
        print("cluster: down" + (f"; left behind: {leftovers}" if leftovers else ""))
    return 1 if leftovers else 0


def _sweep(_: argparse.Namespace) -> int:
    from specula.devcluster.cluster import LocalCluster

    cluster = LocalCluster(workdir=Path(tempfile.mkdtemp(prefix="specula-sweep-")))
    leftovers = cluster.down()
    print("sweep: " + (f"could not remove {leftovers}" if leftovers else "nothing left"))
    return 1 if leftovers else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specula.devcluster",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build or find the binaries and images")
    prep.add_argument("--background", action="store_true",
                      help="start it detached (output in the cache directory) and return; "
                      "does nothing where a node cannot run")
    up = sub.add_parser("up", help="run a node until Ctrl-C")
    up.add_argument("--workdir", default=None)
    sub.add_parser("sweep", help="remove a killed run's leftovers")
    args = parser.parse_args(argv)
    if args.command == "prepare" and args.background:
        return _prepare_in_background()
    if args.command == "prepare":
        timings = prepare()
        print("prepare: " + ", ".join(f"{k}={v:.0f}s" for k, v in timings.items()))
        return 0
    if os.geteuid() != 0:
        print("a local node needs root", file=sys.stderr)
        return 1
    return _up(args) if args.command == "up" else _sweep(args)


if __name__ == "__main__":
    sys.exit(main())
