"""Fixtures for the integration tier: a real control plane, the CRD, the operator.

The control plane is started once for this package's tests on loopback ports in
a temporary directory, and stopped after its last test.  Binaries come from
``SPECULA_CONTROL_PLANE_BIN`` or from ``hack/control-plane.sh`` (build once, then
cached); if they cannot be had the tier fails, it never skips.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from specula.devcluster.control_plane import (
    REPO_ROOT,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    free_port,
    wait_for,
)

from .helm_cli import Helm, HelmError, find_helm
from .operator_process import OperatorProcess
from .sm_objects import GROUP, PLURAL
from .stand_in_pod import StandInPod

CRD_FILE = REPO_ROOT / "crds" / "speculativemodel.yaml"
TEST_NAMESPACE = "specula-it"

_timings: dict[str, float] = {}
_diagnostics: list[Callable[[], str]] = []
_binaries: dict[str, Path | str] = {}
"""``{"bin_dir": Path}`` or ``{"error": str}``, filled once per run."""


def _locate_binaries() -> None:
    if _binaries:
        return
    t0 = time.monotonic()
    try:
        _binaries["bin_dir"] = find_binaries()
    except ControlPlaneError as exc:
        _binaries["error"] = str(exc)
    _timings["find_binaries_s"] = time.monotonic() - t0


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build or find the binaries before the first test, so that a cold build (tens
    of minutes on two cores) is not counted against any test's timeout."""
    if session.config.option.collectonly:
        return
    here = Path(__file__).parent
    if not any(Path(item.path).is_relative_to(here) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("integration: locating the control plane (hack/control-plane.sh)")
    _locate_binaries()


@pytest.fixture(scope="package")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A running etcd + kube-apiserver + kube-controller-manager with the CRD installed."""
    _locate_binaries()
    if "error" in _binaries:
        pytest.fail(f"control plane binaries unavailable: {_binaries['error']}", pytrace=False)
    bin_dir = Path(_binaries["bin_dir"])

    cp = ControlPlane(bin_dir=bin_dir, workdir=tmp_path_factory.mktemp("control-plane"))
    _diagnostics.append(lambda: cp.logs_tail(40))

    def install_crd() -> None:
        t_crd = time.monotonic()
        _install_crd(cp)
        _timings["crd_install_s"] = time.monotonic() - t_crd

    try:
        try:
            cp.start(before_controllers=install_crd)
        except (ControlPlaneError, TimeoutError, OSError) as exc:
            # The component logs follow in the report's "component logs" section.
            pytest.fail(f"control plane did not start: {exc}", pytrace=False)
        _timings.update(cp.timings)
        yield cp
    finally:
        cp.stop()


def wait_crd_established(cp: ControlPlane, name: str, timeout: float = 60.0) -> None:
    """Wait until CRD ``name`` reports ``Established``. (``kubectl wait`` fails at once,
    instead of waiting, while a just-created CRD has no ``status.conditions`` yet.)"""
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
    wait_for(
        lambda: cp.run_kubectl("get", f"crd/{name}", "-o", f"jsonpath={jsonpath}",
                               check=False).stdout.strip() == "True",
        timeout=timeout,
        message=f"CRD {name} Established",
    )


def _install_crd(cp: ControlPlane) -> None:
    if not CRD_FILE.exists():
        pytest.fail(
            f"{CRD_FILE.relative_to(REPO_ROOT)} is missing (generate it with `specula crd`)",
            pytrace=False,
        )
    # Server-side apply: a client-side apply would store the whole schema in an
    # annotation, which large CRDs overflow.
    proc = cp.run_kubectl("apply", "--server-side", "-f", str(CRD_FILE), check=False)
    if proc.returncode != 0:
        pytest.fail(f"CRD rejected by the API server:\n{proc.stderr}{proc.stdout}", pytrace=False)
    wait_crd_established(cp, yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"])
    # Discovery must list the kind before kubectl and kopf can resolve "sm".
    wait_for(
        lambda: (
            PLURAL
            in cp.run_kubectl(
                "api-resources", f"--api-group={GROUP}", "-o", "name", check=False
            ).stdout
        ),
        timeout=30,
        message=f"{PLURAL} in discovery",
    )


@pytest.fixture(scope="package")
def api_client(control_plane: ControlPlane):
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    yield client
    client.close()


@pytest.fixture(scope="package")
def core_v1(api_client):
    from kubernetes import client

    return client.CoreV1Api(api_client)


@pytest.fixture(scope="package")
def apps_v1(api_client):
    from kubernetes import client

    return client.AppsV1Api(api_client)


@pytest.fixture(scope="package")
def custom_objects(api_client):
    from kubernetes import client

    return client.CustomObjectsApi(api_client)


@pytest.fixture(scope="package")
def discovery_v1(api_client):
    from kubernetes import client

    return client.DiscoveryV1Api(api_client)


@pytest.fixture(scope="package")
def namespace(core_v1) -> str:
    """The namespace the operator watches and the tests work in."""
    core_v1.create_namespace({"metadata": {"name": TEST_NAMESPACE}})
    return TEST_NAMESPACE


@pytest.fixture(scope="package")
def operator(control_plane: ControlPlane, namespace: str) -> Iterator[OperatorProcess]:
    """``specula operator --namespace specula-it`` running as the admin user."""
    op = OperatorProcess(
        kubeconfig=control_plane.kubeconfig,
        namespace=namespace,
        log_path=control_plane.workdir / "operator.log",
        # A short tuning tick so tests can use tuning intervals of a second or two;
        # the HTTP server (utilization, metrics) on a free loopback port.
        env={
            "SPECULA_TUNING_TICK_S": "1",
            "SPECULA_HTTP_HOST": "127.0.0.1",
            "SPECULA_HTTP_PORT": str(free_port()),
        },
    )
    _diagnostics.append(lambda: op.tail(60))
    t0 = time.monotonic()
    try:
        try:
            op.start()
        except (ControlPlaneError, TimeoutError, OSError) as exc:
            pytest.fail(f"operator did not start: {exc}", pytrace=False)
        _timings["operator_live_s"] = time.monotonic() - t0
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="module")
def stand_in_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., StandInPod]]:
    """``stand_in_pods(prefix, **counters)`` starts a :class:`StandInPod` (``counters``:
    its ``k``, ``alphas``, ...); every pod started is stopped after the module."""
    pods: list[StandInPod] = []

    def start(prefix: str, **counters) -> StandInPod:
        pod = StandInPod(workdir=tmp_path_factory.mktemp(f"{prefix}-stand-in"), prefix=prefix,
                         **counters)
        pods.append(pod)
        pod.start()
        return pod

    try:
        yield start
    finally:
        for pod in reversed(pods):
            pod.stop()


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = find_helm()
    except HelmError as exc:
        pytest.fail(f"helm unavailable: {exc}", pytrace=False)
    return Helm(binary=binary, home=tmp_path_factory.mktemp("helm-home"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and _diagnostics and "integration" in item.keywords:
        report.sections.append(("component logs", "\n".join(render() for render in _diagnostics)))
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    if _timings:
        parts = ", ".join(f"{k}={v:.1f}" for k, v in _timings.items())
        terminalreporter.write_line(f"control plane timings (s): {parts}")
