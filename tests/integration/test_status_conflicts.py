"""Write conflicts on status (issue 14, section 3): a 409 is retried, shown with real
conflicts from the real API server.

How the operator writes status: a JSON merge patch of the ``status`` subresource
(:meth:`specula.operator.kube.Kube.patch_status`).  Its three writers (reconcile,
status refresh after a Deployment or pod event, tuner) send ``metadata.resourceVersion``
of the read they computed from, which makes the patch conditional: the API server
answers 409 when the object changed since.  kopf's own writes (finalizer, progress and
last-handled annotations) are merge patches without a ``resourceVersion`` and cannot
conflict; nor could the operator's reconcile write before this change (it was
unconditional: a concurrent write was silently overwritten, not refused).

Here the operator's reconcile, refresh and tuning functions run in the test process
against the control plane, in a namespace no operator watches, through a ``Kube``
whose status writes are preceded, when asked, by another client's write to the same
object: exactly a concurrent writer between the operator's read and its write.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from specula.devcluster.control_plane import wait_for
from specula.operator.kube import Kube
from specula.operator.reconcile import RetryLater, reconcile, refresh_status
from specula.operator.runtime_client import RuntimeClient
from specula.operator.settings import OperatorSettings
from specula.operator.tuning import tune

from .sm_objects import GROUP, PLURAL, VERSION, condition, create_sm, endpoint_slice_body, get_sm
from .sm_objects import sm_body as _sm_body

pytestmark = pytest.mark.integration

CONFLICTS_NAMESPACE = "specula-conflicts"
SETTINGS = OperatorSettings(status_conflict_retries=5, retry_delay_s=1.0)


class ConcurrentWriter(Kube):
    """``Kube`` whose next ``inject`` status writes each come right after another
    client changed the object (an annotation), and which records each write's answer."""

    def __init__(self, api_client, other) -> None:
        super().__init__(field_manager="specula-operator", api_client=api_client)
        self.other = other
        self.inject = 0
        self.answers: list[int] = []
        self.bumps = 0

    def patch_status(self, namespace, name, status, resource_version=None) -> dict[str, Any]:
        if self.inject > 0:
            self.inject -= 1
            self.bumps += 1
            self.other.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name,
                {"metadata": {"annotations": {"test.specula.dev/concurrent": str(self.bumps)}}},
            )
        try:
            out = super().patch_status(namespace, name, status, resource_version)
        except ApiException as exc:
            self.answers.append(exc.status)
            raise
        self.answers.append(200)
        return out


@pytest.fixture(scope="module")
def conflicts_namespace(core_v1) -> str:
    core_v1.create_namespace({"metadata": {"name": CONFLICTS_NAMESPACE}})
    return CONFLICTS_NAMESPACE


@pytest.fixture
def kube(api_client, custom_objects) -> ConcurrentWriter:
    return ConcurrentWriter(api_client, custom_objects)


def _sm(custom_objects, namespace: str, name: str, **spec) -> dict[str, Any]:
    return create_sm(custom_objects, namespace, _sm_body(name, {
        "resources": {"gpu": {"count": 0}}, **spec,
    }))


def test_reconcile_status_write_conflict_is_retried(kube, custom_objects, conflicts_namespace):
    ns = conflicts_namespace
    body = _sm(custom_objects, ns, "conflict-reconcile")
    kube.inject = 2
    status = reconcile(body, kube, SETTINGS)
    assert kube.answers == [409, 409, 200]
    sm = get_sm(custom_objects, ns, "conflict-reconcile")
    # The operator's status and the concurrent writer's change are both kept.
    assert sm["metadata"]["annotations"]["test.specula.dev/concurrent"] == "2"
    assert sm["status"]["observedGeneration"] == sm["metadata"]["generation"]
    assert condition(sm, "Ready")["reason"] == "ReplicasNotReady"
    assert [c.type for c in status.conditions] == ["Ready", "Progressing", "Degraded"]


def test_reconcile_gives_up_after_the_last_attempt_and_kopf_retries(
    kube, custom_objects, conflicts_namespace
):
    """Conflicting on every attempt: RetryLater (kopf runs the reconcile again after
    retry_delay_s, as TemporaryError); nothing stale was written; the rerun writes."""
    ns = conflicts_namespace
    body = _sm(custom_objects, ns, "conflict-always")
    kube.inject = SETTINGS.status_conflict_retries
    with pytest.raises(RetryLater, match="kept changing"):
        reconcile(body, kube, SETTINGS)
    assert kube.answers == [409] * SETTINGS.status_conflict_retries
    assert "status" not in get_sm(custom_objects, ns, "conflict-always")
    reconcile(get_sm(custom_objects, ns, "conflict-always"), kube, SETTINGS)
    assert kube.answers[-1] == 200
    sm = get_sm(custom_objects, ns, "conflict-always")
    assert sm["status"]["observedGeneration"] == sm["metadata"]["generation"]


def test_status_refresh_conflict_is_retried(kube, custom_objects, apps_v1, conflicts_namespace):
    ns = conflicts_namespace
    body = _sm(custom_objects, ns, "conflict-refresh")
    reconcile(body, kube, SETTINGS)
    deployment = apps_v1.patch_namespaced_deployment_status(
        "conflict-refresh", ns, {"status": {
            "observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
            "availableReplicas": 1,
        }},
    )
    kube.answers.clear()
    kube.inject = 1
    status = refresh_status(
        kube.get_deployment(ns, deployment.metadata.name), kube, SETTINGS
    )
    assert kube.answers == [409, 200]
    assert status is not None
    sm = get_sm(custom_objects, ns, "conflict-refresh")
    assert condition(sm, "Ready")["status"] == "True"
    assert sm["status"]["readyReplicas"] == 1


def test_tuner_status_conflict_is_retried(
    kube, custom_objects, discovery_v1, conflicts_namespace
):
    """A tuning window (Recommend mode; its pod an unroutable TEST-NET address, so the window records a
    ScrapeFailed) is written after a concurrent change: 409, then the update is
    rebuilt on the object read again and written, the reconcile's conditions kept."""
    ns = conflicts_namespace
    body = _sm(custom_objects, ns, "conflict-tuner", tuning={"mode": "Recommend"})
    reconcile(body, kube, SETTINGS)
    discovery_v1.create_namespaced_endpoint_slice(ns, endpoint_slice_body(
        "conflict-tuner", "192.0.2.1", {"http": 1, "metrics": 1, "admin": 1}
    ))
    kube.answers.clear()
    kube.inject = 1
    client = RuntimeClient(timeout_s=0.5)
    try:
        update = tune(get_sm(custom_objects, ns, "conflict-tuner"), kube, client, SETTINGS)
    finally:
        client.close()
    assert update is not None
    assert kube.answers == [409, 200]
    sm = get_sm(custom_objects, ns, "conflict-tuner")
    assert condition(sm, "Tuned")["reason"] == "ScrapeFailed"
    assert sm["status"]["tuner"]["lastScrapeTime"] is not None
    assert condition(sm, "Ready") is not None and condition(sm, "Degraded") is not None


def test_an_unconditional_status_patch_cannot_conflict(kube, custom_objects, conflicts_namespace):
    """What kopf's own patches are: without resourceVersion, a concurrent change is
    not refused (last writer wins), so there is no 409 to retry."""
    ns = conflicts_namespace
    _sm(custom_objects, ns, "no-conflict")
    kube.inject = 1
    kube.patch_status(ns, "no-conflict", {"replicas": 0})
    assert kube.answers == [200]
    wait_for(lambda: get_sm(custom_objects, ns, "no-conflict").get("status"), timeout=5,
             message="status written")
