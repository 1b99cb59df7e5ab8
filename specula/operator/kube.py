"""The few Kubernetes API calls the operator makes, on the official client.

Everything is exchanged as plain dicts (the builders' output, the API server's
JSON), so no client model classes leak into the reconcile logic.  Children are
written with server-side apply under one fixed field manager: applying content the
server already holds is a no-op there (no ``resourceVersion`` bump, no watch event),
which is what makes reconciling an unchanged resource change nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kubernetes

from specula.api.models import GROUP, PLURAL, VERSION
from specula.operator.autoscaling import HPA, SCALED_OBJECT

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"

ApiException = kubernetes.client.exceptions.ApiException

log = logging.getLogger(__name__)

KEDA_GROUP, KEDA_VERSION, SCALED_OBJECTS = "keda.sh", "v1alpha1", "scaledobjects"


def _json(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


def _wrote(kind: str, namespace: str, name: str, live: dict[str, Any]) -> None:
    """One DEBUG line per write the API server accepted (``--verbose``): what changed
    when, for a reader of the log and for the fault tests, which stop the operator at
    these points.  Names only, never content (a Secret's data stays out of the log)."""
    version = (live.get("metadata") or {}).get("resourceVersion")
    log.debug("wrote %s %s/%s (resourceVersion %s)", kind, namespace, name, version)


class Kube:
    """Typed-by-kind wrappers over one ``kubernetes.client.ApiClient``.

    The client reads the process-wide default configuration, which kopf's login
    handler (``kopf.login_via_client``) fills from the in-cluster service account or
    ``$KUBECONFIG``.
    """

    def __init__(self, field_manager: str, api_client: Any | None = None) -> None:
        self.field_manager = field_manager
        self._client = api_client or kubernetes.client.ApiClient()
        self._core = kubernetes.client.CoreV1Api(self._client)
        self._apps = kubernetes.client.AppsV1Api(self._client)
        self._custom = kubernetes.client.CustomObjectsApi(self._client)
        self._discovery = kubernetes.client.DiscoveryV1Api(self._client)
        self._autoscaling = kubernetes.client.AutoscalingV2Api(self._client)
        self._networking = kubernetes.client.NetworkingV1Api(self._client)

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``manifest`` (ConfigMap, Deployment, Service, NetworkPolicy,
        HorizontalPodAutoscaler or KEDA ScaledObject), taking over fields another
        manager changed (``force``); returns the live object.

        Raises:
            ApiException: the API server refused the request (404 for a ScaledObject
                when KEDA's CRD is not installed).
            ValueError: an unsupported kind.
        """
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        name = manifest["metadata"]["name"]
        namespace = manifest["metadata"]["namespace"]
        options = {
            "field_manager": self.field_manager,
            "force": True,
            "_content_type": APPLY_PATCH,
            "_preload_content": False,
        }
        if (api_version, kind) == SCALED_OBJECT:
            live = _json(self._custom.patch_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECTS, name, manifest, **options
            ))
            _wrote(kind, namespace, name, live)
            return live
        patch = {
            ("v1", "ConfigMap"): self._core.patch_namespaced_config_map,
            ("apps/v1", "Deployment"): self._apps.patch_namespaced_deployment,
            ("v1", "Service"): self._core.patch_namespaced_service,
            ("networking.k8s.io/v1", "NetworkPolicy"):
                self._networking.patch_namespaced_network_policy,
            HPA: self._autoscaling.patch_namespaced_horizontal_pod_autoscaler,
        }.get((api_version, kind))
        if patch is None:
            raise ValueError(f"cannot apply {api_version} {kind}")
        live = _json(patch(name, namespace, manifest, **options))
        _wrote(kind, namespace, name, live)
        return live

    def get_autoscaler(
        self, kind: tuple[str, str], namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The HorizontalPodAutoscaler or ScaledObject (``kind`` is ``(apiVersion,
        kind)``), or ``None`` if it does not exist or its kind is not served (KEDA
        not installed).

        Raises:
            ApiException: any error but 404.
            ValueError: another kind.
        """
        try:
            if kind == SCALED_OBJECT:
                return _json(self._custom.get_namespaced_custom_object(
                    KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECTS, name,
                    _preload_content=False,
                ))
            if kind == HPA:
                return _json(self._autoscaling.read_namespaced_horizontal_pod_autoscaler(
                    name, namespace, _preload_content=False
                ))
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raise ValueError(f"not an autoscaler kind: {kind}")

    def delete_autoscaler(
        self, kind: tuple[str, str], namespace: str, name: str, uid: str
    ) -> None:
        """Delete that autoscaler if it still is the object of ``uid`` (a precondition,
        so an object recreated meanwhile by someone else survives); gone is fine.

        Raises:
            ApiException: any error but 404 and 409.
        """
        options = kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=uid),
            propagation_policy="Background",
        )
        try:
            if kind == SCALED_OBJECT:
                self._custom.delete_namespaced_custom_object(
                    KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECTS, name,
                    body=options, _preload_content=False,
                )
            else:
                self._autoscaling.delete_namespaced_horizontal_pod_autoscaler(
                    name, namespace, body=options, _preload_content=False
                )
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Deployment, or ``None`` if it does not exist.

        Raises:
            ApiException: any error but 404.
        """
        try:
            return _json(self._apps.read_namespaced_deployment(
                name, namespace, _preload_content=False
            ))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret, or ``None`` if it does not exist.

        Raises:
            ApiException: any error but 404.
        """
        try:
            return _json(self._core.read_namespaced_secret(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_secret(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create the Secret ``manifest`` (never server-side apply: its data is written
        once); returns it as stored.

        Raises:
            ApiException: 409 if it exists; any other refusal.
        """
        live = _json(self._core.create_namespaced_secret(
            manifest["metadata"]["namespace"], manifest, field_manager=self.field_manager,
            _preload_content=False,
        ))
        _wrote("Secret", live["metadata"]["namespace"], live["metadata"]["name"], live)
        return live

    def get_speculative_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The SpeculativeModel, or ``None`` if it does not exist.

        Raises:
            ApiException: any error but 404.
        """
        try:
            return _json(self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            ))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch ``status`` onto the SpeculativeModel's status subresource.

        Lists (``conditions``) are replaced whole.  With ``resource_version`` the write
        is conditional: the API server answers 409 if the object changed since.

        Raises:
            ApiException: the API server refused the request (409 on a stale
                ``resource_version``, 404 if the object is gone).
        """
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        live = _json(self._custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
        ))
        _wrote("SpeculativeModel status", namespace, name, live)
        return live

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching label ``selector``.

        Raises:
            ApiException: the API server refused the request.
        """
        return _json(self._core.list_namespaced_pod(
            namespace, label_selector=selector, _preload_content=False
        )).get("items") or []

    def list_endpoint_slices(self, namespace: str, service: str) -> list[dict[str, Any]]:
        """EndpointSlices of Service ``service`` (label ``kubernetes.io/service-name``).

        Raises:
            ApiException: the API server refused the request.
        """
        return _json(self._discovery.list_namespaced_endpoint_slice(
            namespace,
            label_selector=f"kubernetes.io/service-name={service}",
            _preload_content=False,
        )).get("items") or []

    def post_event(
        self, body: dict[str, Any], type_: str, reason: str, message: str, now: str
    ) -> None:
        """Record a ``core/v1`` Event about the SpeculativeModel ``body``.

        Raises:
            ApiException: the API server refused the request.
        """
        meta = body["metadata"]
        self._core.create_namespaced_event(meta["namespace"], {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": self.field_manager},
            "reportingComponent": self.field_manager,
            "reportingInstance": self.field_manager,
        }, _preload_content=False)
