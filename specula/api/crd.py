"""Generation of the ``SpeculativeModel`` CustomResourceDefinition from the pydantic models.

``specula crd`` prints :func:`crd_yaml`; ``crds/speculativemodel.yaml`` is that output,
checked in (regenerate with ``specula crd > crds/speculativemodel.yaml``).

Pydantic emits JSON Schema 2020-12 with ``$ref``/``$defs`` and ``anyOf: [T, null]`` for
optional fields; the API server wants a *structural* OpenAPI v3 schema
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema):
every node has a ``type`` (or ``x-kubernetes-int-or-string`` /
``x-kubernetes-preserve-unknown-fields``), no references, no ``null`` branches.
:func:`to_structural` performs that translation; :func:`structural_violations` checks
the result so a model change that cannot be expressed fails loudly in the unit tests.
"""

from __future__ import annotations

from typing import Any

import yaml

from specula.api.models import (
    GROUP,
    KIND,
    MAX_NAME_LENGTH,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    SpeculativeModelSpec,
    SpeculativeModelStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"

_HEADER = (
    "# Generated from specula.api.models by `specula crd`; do not edit.\n"
    "# Regenerate: specula crd > crds/speculativemodel.yaml\n"
)

# Keys copied from a pydantic node as they are; everything else is either
# translated below or dropped (title, examples, ...).
_KEPT_KEYS = (
    "description",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "maxProperties",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
)
_SCALARS = (str, int, float, bool)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` (and single-branch ``allOf``) into one flat node; the
    referring node's own keys (a field's description or default) win."""
    node = dict(node)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    ref = node.pop("$ref", None)
    if ref is not None:
        target = defs[ref.rsplit("/", 1)[-1]]
        node = {**_resolve(target, defs), **node}
    return node


def to_structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON-schema node into a structural OpenAPI v3 node.

    ``anyOf: [T, {type: null}]`` becomes ``T`` (the field is optional; the API server
    prunes explicit nulls).  Only scalar defaults are kept: object and list defaults
    come from ``default_factory`` and are applied by the models, not stored.

    Raises:
        ValueError: a construct with no structural equivalent (a real union).
    """
    node = _resolve(node, defs)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"union has no structural form: {branches}")
        node = {**_resolve(branches[0], defs), **node}
        if node.get("default", 0) is None:
            del node["default"]

    out: dict[str, Any] = {k: node[k] for k in _KEPT_KEYS if k in node}
    if "description" in out:
        # Docstrings use reStructuredText literals and wrap lines; kubectl explain
        # shows plain text and wraps it itself.
        out["description"] = " ".join(out["description"].replace("``", "`").split())
    if "const" in node:
        node.setdefault("enum", [node["const"]])
    if "enum" in node:
        out["enum"] = list(node["enum"])
        node.setdefault("type", _json_type(node["enum"][0]))
    if "default" in node and isinstance(node["default"], _SCALARS):
        out["default"] = node["default"]
    # JSON Schema 2020-12 gives the bound itself; OpenAPI v3.0 a flag on minimum/maximum.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(flag), int | float) and not isinstance(node[flag], bool):
            out[bound] = node[flag]
            out[flag] = True

    node_type = node.get("type")
    if node_type is not None:
        out["type"] = node_type
    if node_type == "object":
        props = node.get("properties")
        if props:
            out["properties"] = {k: to_structural(v, defs) for k, v in props.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = to_structural(extra, defs)
        elif extra is True and not props:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif node_type == "array":
        out["items"] = to_structural(node["items"], defs)
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def structural_violations(node: dict[str, Any], path: str = "") -> list[str]:
    """Reasons ``node`` is not a structural schema (empty when it is).

    Checks the rules the API server enforces that a generator can break: every
    node has a ``type`` unless it is int-or-string or preserves unknown fields; no
    ``$ref``/``anyOf``/``oneOf``/``allOf``/``nullable`` tricks; ``properties`` and
    ``additionalProperties`` never together; arrays have ``items``; list-map keys
    are required properties of the items.
    """
    problems: list[str] = []
    where = path or "<root>"
    for key in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title"):
        if key in node:
            problems.append(f"{where}: has {key}")
    exempt = node.get("x-kubernetes-int-or-string") or node.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in node and not exempt:
        problems.append(f"{where}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{where}: properties and additionalProperties together")
    if node.get("type") == "array":
        if "items" not in node:
            problems.append(f"{where}: array without items")
        else:
            items = node["items"]
            for key in node.get("x-kubernetes-list-map-keys", []):
                if key not in items.get("required", []):
                    problems.append(f"{where}: list-map key {key} is not required")
            problems += structural_violations(items, f"{path}[]")
    for name, child in node.get("properties", {}).items():
        problems += structural_violations(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_violations(node["additionalProperties"], f"{path}{{}}")
    return problems


def _model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    return to_structural(raw, raw.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of version ``v1alpha1``."""
    return {
        "type": "object",
        "description": (
            "A target model served with speculative decoding by the Specula runtime; "
            "the operator keeps the number of speculative tokens tuned."
        ),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _model_schema(SpeculativeModelSpec),
            "status": _model_schema(SpeculativeModelStatus),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                # size() is O(1) for CEL's cost estimator, unlike a regex match.
                "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                "message": (
                    f"metadata.name must be at most {MAX_NAME_LENGTH} characters: it names "
                    "the Service and is used as a label value"
                ),
            }
        ],
    }


def printer_columns() -> list[dict[str, Any]]:
    """``kubectl get sm`` columns: Method, K, Accept-Len, Ready, Replicas, Age; with
    ``-o wide`` also K-Per-Batch, the per-batch-size schedule in effect (blank while
    one k is)."""
    return [
        {"name": "Method", "type": "string", "jsonPath": ".spec.speculator.method"},
        {
            "name": "K",
            "type": "integer",
            "description": "Speculative tokens per step in effect (under a per-batch-size "
            "schedule: its k at the batch size the last window mostly ran at)",
            "jsonPath": ".status.speculation.numSpeculativeTokens",
        },
        {
            "name": "K-Per-Batch",
            "type": "string",
            "priority": 1,
            "description": "Per-batch-size schedule in effect, [[start, end, k], ...] "
            "(tuning.perBatchSize)",
            "jsonPath": ".status.speculation.numSpeculativeTokensPerBatchSize",
        },
        {
            "name": "Accept-Len",
            "type": "number",
            "format": "float",
            "description": "Mean acceptance length (tokens per draft round) measured last",
            "jsonPath": ".status.speculation.meanAcceptanceLength",
        },
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        },
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition (``apiextensions.k8s.io/v1``) as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "specula"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML, byte-for-byte deterministic (keys sorted)."""
    body = yaml.safe_dump(
        crd_manifest(), sort_keys=True, default_flow_style=False, width=100, allow_unicode=True
    )
    return _HEADER + body
