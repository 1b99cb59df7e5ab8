"""Status that follows the Deployment, the scale subresource and kubectl's view."""

from __future__ import annotations

import pytest

from specula.devcluster.control_plane import wait_for

from .sm_objects import Children, create_sm, get_sm, sm_body, wait_condition, wait_observed

pytestmark = pytest.mark.integration


def write_deployment_status(apps_v1, namespace: str, name: str, ready: int) -> None:
    """Write what the Deployment controller and kubelets would report for ``ready``
    ready pods; nothing else writes it here, since no kubelet runs."""
    dep = apps_v1.read_namespaced_deployment(name, namespace)
    replicas = dep.spec.replicas
    available = "True" if ready >= replicas else "False"
    apps_v1.patch_namespaced_deployment_status(
        name,
        namespace,
        {
            "status": {
                "observedGeneration": dep.metadata.generation,
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": ready,
                "availableReplicas": ready,
                "unavailableReplicas": replicas - ready,
                "conditions": [
                    {
                        "type": "Available",
                        "status": available,
                        "reason": "MinimumReplicasAvailable"
                        if available == "True"
                        else "MinimumReplicasUnavailable",
                        "message": f"{ready}/{replicas} ready",
                    },
                    {
                        "type": "Progressing",
                        "status": "True",
                        "reason": "NewReplicaSetAvailable",
                        "message": "rollout complete",
                    },
                ],
            }
        },
    )


def test_ready_follows_the_deployment(operator, custom_objects, core_v1, apps_v1, namespace):
    name = "readiness"
    sm = create_sm(custom_objects, namespace, sm_body(name, {"replicas": 2}))
    _, dep, _ = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"]).wait_all()
    sm = wait_observed(custom_objects, namespace, name)
    assert (sm["status"].get("readyReplicas") or 0) == 0

    write_deployment_status(apps_v1, namespace, dep.metadata.name, ready=2)
    sm = wait_condition(custom_objects, namespace, name, "Ready", "True")
    assert sm["status"]["readyReplicas"] == 2
    assert sm["status"]["replicas"] == 2

    write_deployment_status(apps_v1, namespace, dep.metadata.name, ready=0)
    sm = wait_condition(custom_objects, namespace, name, "Ready", "False")
    assert (sm["status"].get("readyReplicas") or 0) == 0


def test_kubectl_scale_goes_through_the_scale_subresource(
    operator, control_plane, custom_objects, core_v1, apps_v1, namespace
):
    name = "scaled"
    sm = create_sm(custom_objects, namespace, sm_body(name, {"replicas": 1}))
    children = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"])
    children.wait_all()
    wait_observed(custom_objects, namespace, name)

    # The scale subresource reads status.replicas and status.selector.
    scale = control_plane.run_kubectl(
        "get",
        "--raw",
        f"/apis/specula.dev/v1alpha1/namespaces/{namespace}/speculativemodels/{name}/scale",
    ).stdout
    assert '"kind":"Scale"' in scale.replace(" ", "")

    control_plane.run_kubectl("-n", namespace, "scale", f"sm/{name}", "--replicas=3")
    assert get_sm(custom_objects, namespace, name)["spec"]["replicas"] == 3
    wait_for(
        lambda: children.wait_all()[1].spec.replicas == 3,
        timeout=30,
        message="the Deployment to follow spec.replicas=3",
    )
    sm = wait_observed(custom_objects, namespace, name)
    assert sm["metadata"]["generation"] == 2


def test_kubectl_get_shows_printer_columns(
    operator, control_plane, custom_objects, core_v1, apps_v1, namespace
):
    name = "columns"
    sm = create_sm(
        custom_objects,
        namespace,
        sm_body(name, {"replicas": 2, "speculator": {"numSpeculativeTokens": 4}}),
    )
    Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"]).wait_all()
    wait_observed(custom_objects, namespace, name)
    # The K column reads status.speculation, which the tuner's first pass writes (not the
    # reconcile that sets observedGeneration): wait for it rather than race it.
    wait_for(
        lambda: ((get_sm(custom_objects, namespace, name).get("status") or {}).get("speculation")
                 or {}).get("numSpeculativeTokens") == 4,
        timeout=30, message=f"{name} status.speculation.numSpeculativeTokens",
    )

    out = control_plane.run_kubectl("-n", namespace, "get", "sm", name).stdout
    header, row = out.strip().splitlines()
    columns = header.split()
    for column in ("NAME", "METHOD", "K", "ACCEPT-LEN", "READY", "REPLICAS", "AGE"):
        assert column in columns, header
    # Cut the row at the header's column starts: an unmeasured Accept-Len is blank.
    starts = [header.index(c) for c in columns]
    ends = [*starts[1:], None]
    values = {c: row[a:b].strip() for c, a, b in zip(columns, starts, ends, strict=True)}
    assert values["ACCEPT-LEN"] == ""
    assert values["NAME"] == name
    assert values["METHOD"] == "draft_model"
    assert values["K"] == "4"
