"""Fixtures of the end-to-end tier: a real node (``specula.devcluster``), the project's
images built from its Dockerfile, the demo checkpoints on a local PersistentVolume,
and the chart installed with Helm.

The tier needs Linux and root (containerd, the kubelet and a bridge); on a machine
without them every test is skipped with that reason.  Anything else missing (a binary
that does not build, an image that does not build) fails the tier.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specula.devcluster.__main__ import prepare
from specula.devcluster.cluster import LocalCluster, host_support
from specula.devcluster.control_plane import ControlPlaneError
from specula.devcluster.helm import Helm, HelmError, find_helm
from specula.devcluster.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE

_timings: dict[str, float] = {}
_prepared: dict[str, object] = {}
_preparing: threading.Thread | None = None


def _here(item_path) -> bool:
    return Path(item_path).is_relative_to(Path(__file__).parent)


def _prepare(log) -> None:
    """Build or find everything the tier needs (``python -m specula.devcluster
    prepare``); errors are kept for the fixtures to report."""
    reason = host_support()
    if reason:
        _prepared["skip"] = reason
        return
    t0 = time.monotonic()
    try:
        _timings.update(prepare(log=log))
        _prepared["helm"] = find_helm()
    except (ControlPlaneError, HelmError, RuntimeError, OSError) as exc:
        _prepared["error"] = str(exc)
    _timings["prepare_wait_s"] = time.monotonic() - t0


def pytest_collection_modifyitems(session: pytest.Session, config, items) -> None:
    """Run this tier last, so that its builds overlap the other tiers."""
    items.sort(key=lambda item: _here(item.path))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the builds (cold: tens of minutes) in the background before the first
    test, so they count against no test's timeout and overlap the other tiers."""
    global _preparing
    if session.config.option.collectonly or not any(_here(i.path) for i in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)

    if reporter is not None:
        reporter.write_line("e2e: preparing binaries and images in the background")
    _preparing = threading.Thread(target=_prepare, args=(log,), daemon=True)
    _preparing.start()
    _prepared["log"] = lines


def _wait_prepared() -> None:
    if _preparing is not None:
        _preparing.join()
    elif not _prepared:
        _prepare(print)


def pytest_terminal_summary(terminalreporter) -> None:
    if _timings:
        terminalreporter.write_line(
            "e2e timings (s): " + ", ".join(f"{k}={v:.1f}" for k, v in _timings.items())
        )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running node with the operator and CPU runtime images imported."""
    _wait_prepared()
    if "skip" in _prepared:
        pytest.skip(f"end-to-end tier needs a local node: {_prepared['skip']}")
    if "error" in _prepared:
        pytest.fail(f"end-to-end prerequisites failed: {_prepared['error']}", pytrace=False)
    workdir = tmp_path_factory.mktemp("cluster")
    local = LocalCluster(workdir=workdir, log=lambda line: None)
    t0 = time.monotonic()
    try:
        try:
            local.up(images=(OPERATOR_IMAGE, RUNTIME_CPU_IMAGE))
        except (ControlPlaneError, TimeoutError, OSError) as exc:
            pytest.fail(f"node did not come up: {exc}\n{local.logs_tail(30)}", pytrace=False)
        _timings["cluster_up_s"] = time.monotonic() - t0
        yield local
    finally:
        leftovers = local.down()
        _timings["cluster_down_s"] = local.timings.get("down_s", 0.0)
        if leftovers:
            pytest.fail(f"teardown left {leftovers}", pytrace=False)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(Path(_prepared["helm"]), tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def demo_checkpoints(cluster: LocalCluster) -> Path:
    """The demo target and draft (trained on first use), copied world-readable into a
    directory that a local PersistentVolume exposes (the runtime runs as uid 1000)."""
    from specula.demo.train import ensure_models

    t0 = time.monotonic()
    source, _, _ = ensure_models(progress=False)
    _timings["demo_models_s"] = time.monotonic() - t0
    root = cluster.workdir / "volumes" / "models"
    for name in ("target", "draft"):
        shutil.copytree(source / name, root / name, dirs_exist_ok=True)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root
