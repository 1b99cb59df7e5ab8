"""Faults the operator must survive (issue 14, section 3), against the real control
plane: SIGKILL at points of its reconcile and tuning work.

The operator under test here is a process of this module's own, watching a namespace
of its own with NetworkPolicies on (so every child kind is made), and is killed and
restarted; the package's shared operator is not touched.  A stand-in pod with a
writable admin API (``metrics_server.py --admin-token-file``) takes the tuner's k.

``SPECULA_OPERATOR_KILLS`` (a number, or ``all``) runs more of the seeded kill points
than the covering few, and ``SPECULA_OPERATOR_KILLS_REPORT`` names a JSON file for
the outcome of each: ``bench/faults_operator.py`` runs all 20 that way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specula.devcluster.control_plane import ControlPlane, free_port

from .operator_faults import (
    ALPHAS,
    TUNED,
    DeploymentController,
    KillHarness,
    covering,
    kill_points,
    write_report,
)
from .operator_process import OperatorProcess
from .sm_objects import get_sm

pytestmark = pytest.mark.integration

FAULTS_NAMESPACE = "specula-faults"
OPERATOR_LABELS = "app.kubernetes.io/name=specula-operator"


@pytest.fixture(scope="module")
def networking_v1(api_client):
    from kubernetes import client

    return client.NetworkingV1Api(api_client)


@pytest.fixture(scope="module")
def faults_namespace(core_v1) -> str:
    core_v1.create_namespace({"metadata": {"name": FAULTS_NAMESPACE}})
    return FAULTS_NAMESPACE


@pytest.fixture(scope="module")
def own_operator(control_plane: ControlPlane, faults_namespace: str) -> Iterator[OperatorProcess]:
    """An operator of this module's own (it is killed), NetworkPolicies on."""
    from .conftest import _diagnostics

    op = OperatorProcess(
        kubeconfig=control_plane.kubeconfig,
        namespace=faults_namespace,
        log_path=control_plane.workdir / "operator-faults.log",
        env={
            "SPECULA_TUNING_TICK_S": "1",
            "SPECULA_RETRY_DELAY_S": "1",
            "SPECULA_HTTP_HOST": "127.0.0.1",
            "SPECULA_HTTP_PORT": str(free_port()),
            "SPECULA_NETWORK_POLICY": "true",
            "SPECULA_OPERATOR_POD_LABELS": OPERATOR_LABELS,
        },
    )
    _diagnostics.append(lambda: op.tail(80))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="module")
def deployment_controller(apps_v1, faults_namespace) -> Iterator[DeploymentController]:
    controller = DeploymentController(apps_v1, faults_namespace)
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture(scope="module")
def harness(
    own_operator, deployment_controller, stand_in_pods, custom_objects, core_v1, apps_v1,
    networking_v1, discovery_v1, faults_namespace,
) -> Iterator[KillHarness]:
    pod = stand_in_pods("specula", k=2, alphas=ALPHAS, writable=True)
    h = KillHarness(
        operator=own_operator, pod=pod, custom_objects=custom_objects, core_v1=core_v1,
        apps_v1=apps_v1, networking_v1=networking_v1, discovery_v1=discovery_v1,
        namespace=faults_namespace,
    )
    h.set_up()
    yield h


def _selected():
    points = kill_points()
    wanted = os.environ.get("SPECULA_OPERATOR_KILLS", "")
    if wanted == "all":
        return points
    if wanted:
        return points[: int(wanted)]
    return covering(points)


def test_operator_killed_at_reconcile_and_tuning_points_converges(harness: KillHarness):
    points = _selected()
    outcomes = []
    t0 = time.monotonic()
    for point in points:
        outcomes.append(harness.run(point))
    report = os.environ.get("SPECULA_OPERATOR_KILLS_REPORT")
    if report:
        write_report(Path(report), outcomes, seconds=round(time.monotonic() - t0, 1))
    failed = [o.to_dict() for o in outcomes if not o.survived]
    assert not failed, failed
    # Every kill came at its event (none fell back to a kill after the trigger timeout).
    assert all(o.killed for o in outcomes), [o.to_dict() for o in outcomes if not o.killed]


def test_the_convergence_check_sees_a_duplicate_child(harness: KillHarness, core_v1):
    """The check the kill points pass is not vacuous: a second ConfigMap controlled by
    the resource is reported (and none remains once it is deleted)."""
    sm = get_sm(harness.custom_objects, harness.namespace, TUNED)
    stray = {
        "metadata": {
            "name": f"{TUNED}-stray",
            "ownerReferences": [{
                "apiVersion": sm["apiVersion"], "kind": sm["kind"], "name": TUNED,
                "uid": sm["metadata"]["uid"], "controller": True,
            }],
        },
        "data": {"x": "y"},
    }
    core_v1.create_namespaced_config_map(harness.namespace, stray)
    try:
        assert f"{TUNED}: 2 ConfigMaps owned (want 1)" in harness.problems()
    finally:
        core_v1.delete_namespaced_config_map(f"{TUNED}-stray", harness.namespace)
    harness.wait_converged(30)
