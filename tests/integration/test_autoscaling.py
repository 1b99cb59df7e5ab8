"""Autoscaling against the real API server: the operator renders a KEDA ScaledObject
(validated by KEDA's own CRD, from its published Go module) or an ``autoscaling/v2``
HorizontalPodAutoscaler that targets the resource's ``scale`` subresource, swaps them
when the provider changes and removes them with ``spec.autoscaling``; it measures
utilization from a pod's counters into ``status.autoscaling`` and serves it over HTTP
and as a Prometheus gauge.

No kubelet runs pods here: the Service points at a stand-in pod (``metrics_server.py``
in a network namespace) through an EndpointSlice the test writes.  The stand-in's
counters grow at a known rate: 400 drafts/s of k=3 with conditional acceptance
0.8, 0.5, 0.25, i.e. 400 * (1 + 0.8 + 0.4 + 0.1) = 920 tokens/s, with 4 requests
running and 2 waiting, so demand = 920 * (4 + 2) / 4 = 1380 tokens/s.
"""

from __future__ import annotations

import math
import subprocess

import httpx
import pytest
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

from specula.devcluster.control_plane import REPO_ROOT, ControlPlane, wait_for

from .conftest import wait_crd_established
from .sm_objects import (
    GROUP,
    PLURAL,
    VERSION,
    create_sm,
    delete_sm_and_wait,
    endpoint_slice_body,
    get_sm,
    patch_sm,
    sm_body,
    wait_observed,
)
from .stand_in_pod import StandInPod

pytestmark = pytest.mark.integration

EXPECTED_DEMAND = 400 * (1 + 0.8 + 0.4 + 0.1) * (4 + 2) / 4


@pytest.fixture(scope="module")
def keda_crd(control_plane: ControlPlane) -> None:
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "keda-crd.sh")], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/keda-crd.sh failed:\n{proc.stderr}", pytrace=False)
    crd = proc.stdout.strip()
    control_plane.run_kubectl("apply", "--server-side", "-f", crd)
    wait_crd_established(control_plane, "scaledobjects.keda.sh")


@pytest.fixture(scope="module")
def stand_in(stand_in_pods) -> StandInPod:
    return stand_in_pods("specula")


@pytest.fixture(scope="module")
def autoscaling_v2(api_client):
    from kubernetes import client

    return client.AutoscalingV2Api(api_client)


def _scaled_object(custom_objects, namespace: str, name: str) -> dict | None:
    try:
        return custom_objects.get_namespaced_custom_object(
            "keda.sh", "v1alpha1", namespace, "scaledobjects", name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _hpa(autoscaling_v2, namespace: str, name: str):
    try:
        return autoscaling_v2.read_namespaced_horizontal_pod_autoscaler(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _autoscaled(name: str, autoscaling: dict, **spec) -> dict:
    return sm_body(name, {"resources": {"gpu": {"count": 0}}, "autoscaling": autoscaling, **spec})


def test_provider_objects_follow_the_spec(
    operator, keda_crd, custom_objects, autoscaling_v2, namespace
):
    name = "scaled"
    sm = create_sm(custom_objects, namespace, _autoscaled(
        name, {"minReplicas": 1, "maxReplicas": 4, "targetUtilization": 0.6}
    ))
    uid = sm["metadata"]["uid"]
    try:
        so = wait_for(lambda: _scaled_object(custom_objects, namespace, name), timeout=30,
                      message="ScaledObject")
        assert so["metadata"]["ownerReferences"][0]["uid"] == uid
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "SpeculativeModel", "name": name,
        }
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 4)
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "metrics-api" and trigger["metricType"] == "Value"
        assert trigger["metadata"]["targetValue"] == "0.6"
        assert trigger["metadata"]["url"].endswith(
            f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/utilization"
        )
        assert _hpa(autoscaling_v2, namespace, name) is None

        patch_sm(custom_objects, namespace, name, {"spec": {"autoscaling": {"provider": "hpa"}}})
        hpa = wait_for(lambda: _hpa(autoscaling_v2, namespace, name), timeout=30, message="HPA")
        assert hpa.metadata.owner_references[0].uid == uid
        assert hpa.spec.scale_target_ref.kind == "SpeculativeModel"
        assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 4)
        (metric,) = hpa.spec.metrics
        assert metric.type == "Object"
        assert metric.object.metric.name == "specula_operator_utilization"
        assert metric.object.target.type == "Value" and metric.object.target.value == "600m"
        wait_for(lambda: _scaled_object(custom_objects, namespace, name) is None, timeout=30,
                 message="ScaledObject removed after the switch to hpa")

        patch_sm(custom_objects, namespace, name, {"spec": {"autoscaling": None}})
        wait_for(lambda: _hpa(autoscaling_v2, namespace, name) is None, timeout=30,
                 message="HPA removed with spec.autoscaling")
        assert _scaled_object(custom_objects, namespace, name) is None
    finally:
        delete_sm_and_wait(custom_objects, namespace, name)


def test_api_server_rejects_bad_autoscaling(custom_objects, namespace):
    cases = {
        "must not exceed autoscaling.maxReplicas": {"minReplicas": 3, "maxReplicas": 2},
        "targetUtilization": {"maxReplicas": 2, "targetUtilization": 0},
    }
    for message, autoscaling in cases.items():
        with pytest.raises(ApiException) as err:
            create_sm(custom_objects, namespace, _autoscaled("bad-as", autoscaling))
        assert err.value.status == 422 and message in err.value.body, err.value.body
    with pytest.raises(ApiException) as err:
        create_sm(custom_objects, namespace, _autoscaled(
            "bad-as", {"maxReplicas": 2}, tuning={"mode": "Off"}
        ))
    assert "tuning.mode must be Recommend or Auto" in err.value.body


def test_utilization_is_measured_served_and_scaled_on(
    operator, keda_crd, custom_objects, apps_v1, discovery_v1, namespace, stand_in
):
    name = "utilized"
    target = 0.5
    create_sm(custom_objects, namespace, _autoscaled(
        name, {"minReplicas": 1, "maxReplicas": 4, "targetUtilization": target},
        replicas=2, tuning={"interval": "2s"},
    ))
    discovery_v1.create_namespaced_endpoint_slice(namespace, endpoint_slice_body(
        name, stand_in.address, {"http": stand_in.port, "metrics": stand_in.port, "admin": stand_in.port},
    ))
    try:
        def measured() -> dict | None:
            status = get_sm(custom_objects, namespace, name).get("status") or {}
            auto = status.get("autoscaling") or {}
            return auto if auto.get("utilization") is not None else None

        auto = wait_for(measured, timeout=60, interval=0.5, message="status.autoscaling")
        assert auto["demandTokensPerSecond"] == pytest.approx(EXPECTED_DEMAND, rel=0.1)
        assert auto["utilization"] == pytest.approx(
            auto["demandTokensPerSecond"] / auto["capacityTokensPerSecond"], rel=1e-3
        )
        assert auto["currentReplicas"] == 1 and auto["requestsWaiting"] == 2
        assert auto["desiredReplicas"] == min(4, max(1, math.ceil(auto["utilization"] / target)))
        assert auto["lastUpdateTime"].endswith("Z")

        base = f"http://127.0.0.1:{operator.env['SPECULA_HTTP_PORT']}"
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/utilization"

        def served_matches_status() -> bool:
            served = httpx.get(base + path, timeout=5).json()
            status = (get_sm(custom_objects, namespace, name)["status"]).get("autoscaling")
            return served["utilization"] == status["utilization"]

        wait_for(served_matches_status, timeout=20, interval=0.3,
                 message="the HTTP endpoint serving status.autoscaling.utilization")
        metrics = httpx.get(base + "/metrics", timeout=5).text
        gauge = [
            sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == "specula_operator_utilization"
            and sample.labels == {"namespace": namespace, "name": name}
        ]
        assert len(gauge) == 1 and gauge[0] > 0, metrics
        missing = httpx.get(base + path.replace(name, "absent"), timeout=5)
        assert missing.status_code == 404

        # The autoscaler writes replicas through the scale subresource; the operator
        # carries them to the Deployment, within [minReplicas, maxReplicas].
        for asked, expected in ((3, 3), (9, 4)):
            custom_objects.patch_namespaced_custom_object_scale(
                GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": asked}}
            )
            wait_for(
                lambda e=expected: apps_v1.read_namespaced_deployment(name, namespace)
                .spec.replicas == e,
                timeout=30, message=f"Deployment replicas {expected}",
            )
        wait_observed(custom_objects, namespace, name)

        patch_sm(custom_objects, namespace, name, {"spec": {"autoscaling": None}})
        wait_for(
            lambda: "autoscaling" not in (get_sm(custom_objects, namespace, name)["status"]),
            timeout=30, message="status.autoscaling removed",
        )
        wait_for(lambda: httpx.get(base + path, timeout=5).status_code == 404, timeout=20,
                 message="the endpoint forgetting the resource")
    finally:
        delete_sm_and_wait(custom_objects, namespace, name)
        discovery_v1.delete_collection_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={name}"
        )
