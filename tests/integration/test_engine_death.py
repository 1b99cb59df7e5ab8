"""The runtime engine dies (issue 14, section 3): its ``/health`` turns 503, the
liveness probe restarts the container, and the operator reports it.

No kubelet runs pods in this tier, so the test writes what the kubelet and the
Deployment controller would: a runtime pod of the resource (created from its
Deployment's template), then its status and the Deployment's through the life of a
dying engine:

1. serving: container ready, Deployment 1/1 ready -> ``Ready=True``, not Degraded;
2. the liveness probe failed and the kubelet stopped the container, which drained and
   exited 0, and started it again (restartCount 1, not ready yet), Deployment 0/1 ->
   ``Ready=False`` and ``Degraded=True`` ``ContainerRestarting``, naming the pod, the
   restart and the last exit (before this change: ``Degraded=False``, since only a
   non-zero exit was reported);
3. it keeps dying, now killed (exit 137) with its last log lines as the termination
   message, in ``CrashLoopBackOff`` (restartCount 3) -> ``ContainerFailed`` with the
   restarts, the back-off and the runtime's own message;
4. it recovers: ready again -> ``Ready=True``, ``Degraded=False``.

The liveness probe itself (``/health``, 15 s period, 4 failures) is the builders' and
the chart's; that ``/health`` answers 503 once the engine thread died is the runtime's
(tests/runtime).
"""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from .sm_objects import Children, create_sm, delete_sm_and_wait, sm_body, wait_condition
from .test_operator_status_scale import write_deployment_status

pytestmark = pytest.mark.integration

NAME = "engine-dies"


def _container_status(ready: bool, restarts: int, state: dict, last: dict | None = None) -> dict:
    status = {
        "name": "runtime", "ready": ready, "restartCount": restarts, "state": state,
        "image": "ghcr.io/specula-dev/specula-runtime:test", "imageID": "", "started": ready,
    }
    if last is not None:
        status["lastState"] = {"terminated": last}
    return status


def _write_pod_status(core_v1, namespace: str, pod: str, container: dict) -> None:
    """What the kubelet reports for the runtime pod."""
    ready = "True" if container["ready"] else "False"
    core_v1.patch_namespaced_pod_status(pod, namespace, {"status": {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": ready},
            {"type": "ContainersReady", "status": ready},
        ],
        "containerStatuses": [container],
    }})


def _ensure_default_service_account(core_v1, namespace: str) -> None:
    # No service-account controller runs here; pod admission wants the default one.
    try:
        core_v1.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def test_a_dying_engine_is_reported_until_it_recovers(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    sm = create_sm(custom_objects, namespace, sm_body(NAME, {"resources": {"gpu": {"count": 0}}}))
    try:
        _, dep, _ = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"]).wait_all()
        _ensure_default_service_account(core_v1, namespace)
        template = dep.spec.template
        pod = core_v1.create_namespaced_pod(namespace, {
            "metadata": {"name": f"{NAME}-pod-0", "labels": template.metadata.labels},
            "spec": {"containers": [{"name": "runtime", "image": "ghcr.io/specula-dev/x:test"}],
                     "automountServiceAccountToken": False},
        }).metadata.name

        # 1. Serving.
        _write_pod_status(core_v1, namespace, pod, _container_status(
            True, 0, {"running": {"startedAt": "2026-11-26T10:00:00Z"}}))
        write_deployment_status(apps_v1, namespace, dep.metadata.name, ready=1)
        wait_condition(custom_objects, namespace, NAME, "Ready", "True")
        sm = wait_condition(custom_objects, namespace, NAME, "Degraded", "False")

        # 2. The engine died; liveness restarted the container (graceful exit 0).
        _write_pod_status(core_v1, namespace, pod, _container_status(
            False, 1, {"running": {"startedAt": "2026-11-26T10:01:05Z"}},
            last={"exitCode": 0, "reason": "Completed",
                  "startedAt": "2026-11-26T10:00:00Z", "finishedAt": "2026-11-26T10:01:04Z"}))
        write_deployment_status(apps_v1, namespace, dep.metadata.name, ready=0)
        sm = wait_condition(custom_objects, namespace, NAME, "Degraded", "True",
                            reason="ContainerRestarting")
        degraded = next(c for c in sm["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["message"] == (
            f"pod {pod}: container runtime is not ready (restarted 1 time); "
            "last run exited 0: Completed"
        )
        ready = next(c for c in sm["status"]["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"], ready["message"]) == (
            "False", "ReplicasNotReady", "0/1 replicas ready"
        )

        # 3. Crash loop: killed by the kubelet, the runtime's last log lines kept.
        _write_pod_status(core_v1, namespace, pod, _container_status(
            False, 3, {"waiting": {"reason": "CrashLoopBackOff",
                                   "message": "back-off 40s restarting failed container"}},
            last={"exitCode": 137, "reason": "Error",
                  "message": "engine loop died: RuntimeError: CUDA error: an illegal memory "
                             "access was encountered",
                  "startedAt": "2026-11-26T10:02:00Z", "finishedAt": "2026-11-26T10:03:00Z"}))
        sm = wait_condition(custom_objects, namespace, NAME, "Degraded", "True",
                            reason="ContainerFailed")
        degraded = next(c for c in sm["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["message"] == (
            f"pod {pod}: container runtime exited 137 (restarted 3 times, CrashLoopBackOff): "
            "engine loop died: RuntimeError: CUDA error: an illegal memory access was encountered"
        )

        # 4. Recovered.
        _write_pod_status(core_v1, namespace, pod, _container_status(
            True, 4, {"running": {"startedAt": "2026-11-26T10:04:00Z"}},
            last={"exitCode": 137, "reason": "Error"}))
        write_deployment_status(apps_v1, namespace, dep.metadata.name, ready=1)
        wait_condition(custom_objects, namespace, NAME, "Ready", "True")
        sm = wait_condition(custom_objects, namespace, NAME, "Degraded", "False",
                            reason="AsExpected")
        assert sm["status"]["readyReplicas"] == 1
    finally:
        try:
            core_v1.delete_namespaced_pod(f"{NAME}-pod-0", namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
        delete_sm_and_wait(custom_objects, namespace, NAME)
