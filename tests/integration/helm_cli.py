"""The Helm CLI for the chart tests: located (built once by ``hack/helm.sh``), run with
its own config and cache directories, and its rendered output parsed.

``SPECULA_HELM_BIN`` (the directory holding ``helm``, as ``make test`` sets it) wins;
otherwise ``hack/helm.sh`` builds Helm from the Go module proxy or reuses its cache.
If neither gives a working binary, the tests fail; they never skip.
"""

from __future__ import annotations

from typing import Any

from specula.devcluster.helm import (  # noqa: F401 - re-exported for the chart tests
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    Helm,
    HelmError,
    find_helm,
    parse_manifests,
)

CI_VALUES = CHART / "ci"


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict]:
    """Objects of ``kind`` (and ``metadata.name``, when given)."""
    return [
        o for o in objects
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}: {[o['metadata'] for o in found]}"
    return found[0]


def rules_table(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """RBAC rules flattened to ``(apiGroup, resource, verb)`` triples."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def _triples(group: str, resources: list[str], verbs: list[str]) -> set[tuple[str, str, str]]:
    return {(group, r, v) for r in resources for v in verbs}


_WRITE = ["get", "list", "watch", "create", "patch"]
OPERATOR_RULES = (
    _triples("specula.dev", ["speculativemodels"], ["get", "list", "watch", "patch"])
    | _triples("specula.dev", ["speculativemodels/status"], ["patch"])
    | _triples("specula.dev", ["speculativemodels/finalizers"], ["update"])
    | _triples("", ["configmaps", "services"], _WRITE)
    | _triples("apps", ["deployments"], _WRITE)
    | _triples("keda.sh", ["scaledobjects"], [*_WRITE, "delete"])
    | _triples("autoscaling", ["horizontalpodautoscalers"], [*_WRITE, "delete"])
    | _triples("discovery.k8s.io", ["endpointslices"], ["list", "watch"])
    | _triples("", ["pods"], ["list", "watch"])
    | _triples("", ["secrets"], ["get", "create"])
    | _triples("networking.k8s.io", ["networkpolicies"], ["get", "create", "patch"])
    | _triples("", ["events"], ["create"])
    | _triples("events.k8s.io", ["events"], ["create"])
)
"""Least privilege: exactly the operator's calls within the namespaces it watches.  Secrets:
``get`` and ``create`` only (its own admin-token Secrets, by name; no ``list`` or
``watch``, which would expose every Secret of the namespace)."""
CRD_WATCH = _triples("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"])
"""kopf lists and watches CRDs to notice its resources appear or change."""
NAMESPACE_WATCH = _triples("", ["namespaces"], ["list", "watch"])
"""kopf lists and watches Namespaces when it watches named namespaces (not cluster-wide)."""
