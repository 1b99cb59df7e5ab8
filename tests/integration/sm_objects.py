"""Building, reading and waiting on SpeculativeModel objects and their children."""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes.client.rest import ApiException

from specula.devcluster.control_plane import wait_for

GROUP = "specula.dev"
VERSION = "v1alpha1"
PLURAL = "speculativemodels"
KIND = "SpeculativeModel"
TARGET_URI = "file:///models/target"
DRAFT_URI = "file:///models/draft"


def sm_body(name: str, spec_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid ``draft_model`` SpeculativeModel; ``spec_overrides`` is deep-merged
    into ``spec`` (a ``None`` value deletes the key)."""
    spec: dict[str, Any] = {
        "model": {"uri": TARGET_URI, "dtype": "bfloat16", "maxModelLen": 2048},
        "speculator": {
            "method": "draft_model",
            "model": {"uri": DRAFT_URI},
            "numSpeculativeTokens": 3,
        },
        "replicas": 1,
        "resources": {"gpu": {"count": 1}},
    }
    _merge(spec, spec_overrides or {})
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def create_sm(custom_objects, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return custom_objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def get_sm(custom_objects, namespace: str, name: str) -> dict[str, Any]:
    return custom_objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def patch_sm(custom_objects, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    return custom_objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, patch
    )


def delete_sm(custom_objects, namespace: str, name: str) -> None:
    try:
        custom_objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def api_error_message(exc: ApiException) -> str:
    """The Status message the API server sent with an error response."""
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(exc.body)


def condition(sm: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in (sm.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def owned_by(items: list, uid: str) -> list:
    """Objects (kubernetes client models) whose owner references include ``uid``."""
    return [
        item
        for item in items
        if any(ref.uid == uid for ref in (item.metadata.owner_references or []))
    ]


class Children:
    """The ConfigMap, Deployment and Service a SpeculativeModel owns, found by owner uid
    rather than by name, so the tests pin ownership and not a naming scheme."""

    def __init__(self, core_v1, apps_v1, namespace: str, uid: str) -> None:
        self.core_v1 = core_v1
        self.apps_v1 = apps_v1
        self.namespace = namespace
        self.uid = uid

    def config_maps(self) -> list:
        return owned_by(self.core_v1.list_namespaced_config_map(self.namespace).items, self.uid)

    def deployments(self) -> list:
        return owned_by(self.apps_v1.list_namespaced_deployment(self.namespace).items, self.uid)

    def services(self) -> list:
        return owned_by(self.core_v1.list_namespaced_service(self.namespace).items, self.uid)

    def all(self) -> tuple[list, list, list]:
        return self.config_maps(), self.deployments(), self.services()

    def wait_all(self, timeout: float = 30) -> tuple[Any, Any, Any]:
        """Wait until exactly one of each child exists; return (configmap, deployment, service)."""

        def one_each():
            cms, deps, svcs = self.all()
            if len(cms) == 1 and len(deps) == 1 and len(svcs) == 1:
                return cms[0], deps[0], svcs[0]
            assert len(cms) <= 1 and len(deps) <= 1 and len(svcs) <= 1, (cms, deps, svcs)
            return None

        return wait_for(
            one_each,
            timeout=timeout,
            message=f"ConfigMap, Deployment and Service owned by {self.uid}",
        )

    def resource_versions(self) -> dict[str, str]:
        cm, dep, svc = self.wait_all()
        return {
            "configmap": cm.metadata.resource_version,
            "deployment": dep.metadata.resource_version,
            "service": svc.metadata.resource_version,
        }


def wait_observed(custom_objects, namespace: str, name: str, timeout: float = 30) -> dict[str, Any]:
    """Wait until ``status.observedGeneration`` equals ``metadata.generation``."""

    def observed():
        sm = get_sm(custom_objects, namespace, name)
        status = sm.get("status") or {}
        return sm if status.get("observedGeneration") == sm["metadata"]["generation"] else None

    return wait_for(
        observed,
        timeout=timeout,
        message=f"{name} status.observedGeneration to reach metadata.generation",
    )


def wait_condition(
    custom_objects,
    namespace: str,
    name: str,
    type_: str,
    status: str,
    reason: str | None = None,
    timeout: float = 30,
) -> dict[str, Any]:
    """Wait until condition ``type_`` has ``status`` (and ``reason``); return the object."""

    def matches():
        sm = get_sm(custom_objects, namespace, name)
        cond = condition(sm, type_)
        if cond is None or cond.get("status") != status:
            return None
        if reason is not None and cond.get("reason") != reason:
            return None
        return sm

    def describe() -> str:
        try:
            conds = (get_sm(custom_objects, namespace, name).get("status") or {}).get("conditions")
        except ApiException as exc:
            conds = f"unreadable: {exc.status}"
        return f"{name} condition {type_}={status} reason={reason}; conditions now {conds}"

    return wait_for(matches, timeout=timeout, message=describe)


def endpoint_slice_body(service: str, address: str, ports: dict[str, int]) -> dict[str, Any]:
    """An EndpointSlice of Service ``service`` with one ready endpoint at ``address``.

    No kubelet runs pods in this tier, and kube-controller-manager runs no
    EndpointSlice controller for them, so a slice written by a test stays as written;
    ``ports`` maps port names (``http``, ``metrics``) to numbers.
    """
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-test",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "specula-integration-test",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in sorted(ports.items())],
    }


def delete_sm_and_wait(custom_objects, namespace: str, name: str, timeout: float = 90) -> None:
    """Delete the resource and wait until it is gone (the operator has removed its
    finalizer), so later tests that count a namespace's objects do not see it. The
    operator finishes a running tuning tick first, which on a loaded machine with many
    resources in the namespace can take tens of seconds."""
    delete_sm(custom_objects, namespace, name)

    def gone() -> bool:
        try:
            get_sm(custom_objects, namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(gone, timeout=timeout, message=f"{name} deleted")
