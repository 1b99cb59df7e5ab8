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

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specula.devcluster.control_plane import ControlPlane, free_port, wait_for

from .operator_faults import (
    ALPHAS,
    TUNED,
    DeploymentController,
    KillHarness,
    _Tail,
    covering,
    kill_points,
    restart_apiserver,
    write_report,
)
from .operator_process import OperatorProcess
from .sm_objects import (
    Children,
    create_sm,
    delete_sm_and_wait,
    get_sm,
    patch_sm,
    sm_body,
    wait_observed,
)

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


def test_a_conflict_on_the_running_operators_status_write_is_retried(
    harness: KillHarness, custom_objects
):
    """A real 409 in the running operator: the stand-in pod holds the tuner's
    ``GET /metrics`` (the tuner has read the object and is mid-window), another client
    changes the object, the pod answers; the tuner's write, conditional on the version
    it read, gets 409, and it reads the object again and writes."""
    pod, ns = harness.pod, harness.namespace
    log = _Tail(harness.operator.log_path)
    requests = _Tail(pod.requests_log)
    before = get_sm(custom_objects, ns, TUNED)["status"]["tuner"]["lastScrapeTime"]
    pod.pause_file.touch()
    try:
        wait_for(lambda: any(r.startswith("GET /metrics") for r in requests.lines()),
                 timeout=30, interval=0.01, message="the tuner's scrape")
        patch_sm(custom_objects, ns, TUNED,
                 {"metadata": {"annotations": {"test.specula.dev/concurrent": "1"}}})
    finally:
        pod.pause_file.unlink()
    conflict = re.compile(
        rf"status write of {ns}/{TUNED} by tuner: 409 Conflict \(attempt 1/5\); reading it again"
    )
    seen: list[str] = []
    wait_for(lambda: seen.extend(line for line in log.lines() if conflict.search(line)) or seen,
             timeout=30, message="the tuner's 409 and retry in the operator's log")
    sm = wait_for(
        lambda: (lambda o: o if o["status"]["tuner"]["lastScrapeTime"] > before else None)(
            get_sm(custom_objects, ns, TUNED)),
        timeout=30, message="the window written after the conflict",
    )
    assert sm["metadata"]["annotations"]["test.specula.dev/concurrent"] == "1"
    harness.wait_converged(30)


def test_operator_keeps_working_across_an_api_server_restart(
    harness: KillHarness, control_plane: ControlPlane, operator, custom_objects, core_v1,
    apps_v1, namespace,
):
    """kube-apiserver stops (etcd stays) while both operators run, and comes back on
    the same port: neither exits, and a spec change made after the restart is
    reconciled (ConfigMap re-rendered, observedGeneration, conditions), the tuner
    measures again, and the package's shared operator creates a new resource's
    children."""
    own = harness.operator
    log = _Tail(own.log_path)
    # Down until a tuning tick of the operator has failed for want of an API server;
    # with SPECULA_APISERVER_OUTAGE=long (bench/faults_operator.py) until kopf has also
    # given up retrying its watch requests (its retry budget, 1+1+2+3+5+8+13+21 s).
    long = os.environ.get("SPECULA_APISERVER_OUTAGE") == "long"
    failed_tick = re.compile(r"\[specula-faults/tuned\] tuning tick failed, next tick in")
    escalated = re.compile(r"Request attempt #\d+/\d+ failed; escalating: GET .*watch=true")
    seen = {"tick": False, "escalated": False}

    def noticed() -> bool:
        for line in log.lines():
            seen["tick"] = seen["tick"] or bool(failed_tick.search(line))
            seen["escalated"] = seen["escalated"] or bool(escalated.search(line))
        return seen["tick"] and (seen["escalated"] or not long)

    down_s = restart_apiserver(control_plane, own, noticed)

    # A spec change after the restart.
    patch_sm(custom_objects, harness.namespace, TUNED, {"spec": {"model": {"maxModelLen": 1536}}})
    t0 = time.monotonic()
    harness.wait_converged(60)
    sm = get_sm(custom_objects, harness.namespace, TUNED)
    assert sm["status"]["observedGeneration"] == sm["metadata"]["generation"]
    # The tuner goes on at its interval (2 s), not after kopf's 60 s error backoff.
    wait_for(
        lambda: get_sm(custom_objects, harness.namespace, TUNED)["status"]["tuner"]
        ["lastScrapeTime"] > sm["status"]["tuner"]["lastScrapeTime"],
        timeout=15, message="a tuning window after the restart",
    )
    after_s = time.monotonic() - t0
    print(f"kube-apiserver down {down_s:.1f} s; after the restart, spec change reconciled "
          f"and a tuning window taken in {after_s:.1f} s")
    report = os.environ.get("SPECULA_APISERVER_REPORT")
    if report:
        Path(report).write_text(json.dumps({
            "down_s": round(down_s, 1), "reconciled_and_tuned_after_s": round(after_s, 1),
            "kopf_watch_retries_escalated": seen["escalated"],
        }))

    # The shared operator (other namespace) works too.
    created = create_sm(custom_objects, namespace, sm_body("after-apiserver-restart"))
    try:
        Children(core_v1, apps_v1, namespace, created["metadata"]["uid"]).wait_all(timeout=60)
        wait_observed(custom_objects, namespace, "after-apiserver-restart", timeout=60)
        operator.check_alive()
    finally:
        delete_sm_and_wait(custom_objects, namespace, "after-apiserver-restart")
