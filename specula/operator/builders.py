"""Pure builders: a parsed ``SpeculativeModel`` spec in, Kubernetes manifests (dicts) out.

No kopf, no Kubernetes client: handlers call these and apply the result with
server-side apply, so every manifest here is the complete *intent* of the operator
for its object (fields it omits are left to the API server's defaults).

All three children of a resource share its name: ConfigMap ``<name>`` (the runtime
config, or the ``vllm serve`` arguments for ``engine: vllm``), Deployment ``<name>`` and
Service ``<name>``; with ``spec.autoscaling`` a fourth, the KEDA ScaledObject or the
HorizontalPodAutoscaler ``<name>``, targets the resource's ``scale`` subresource; with
the operator's ``network_policy`` setting a NetworkPolicy ``<name>`` fences the pods'
admin and metrics ports.  ``engine: specula`` resources also own the Secret
``<name>-admin-token`` (:func:`build_admin_secret`), created once, never applied.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specula.api.autoscaling import AutoscalingSpec
from specula.api.models import API_VERSION, KIND, SpeculativeModelSpec
from specula.api.render import (
    ADMIN_PORT,
    ADMIN_TOKEN_DIR,
    ADMIN_TOKEN_KEY,
    METRICS_PORT,
    RUNTIME_PORT,
    render_runtime_config,
)
from specula.api.render_vllm import (
    DEFAULT_VLLM_IMAGE,
    VLLM_PORT,
    PodSpeculation,
    render_vllm_args,
)
from specula.api.runtime_config import PVC_MOUNT_ROOT
from specula.operator.autoscaling import (
    HPA,
    SCALED_OBJECT,
    UTILIZATION_METRIC,
    utilization_path,
)
from specula.operator.settings import DEFAULT_RUNTIME_IMAGE

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "specula"
COMPONENT_RUNTIME = "runtime"
MANAGED_BY = "specula-operator"

CONFIG_HASH_ANNOTATION = "specula.dev/config-hash"
"""Pod-template annotation: sha256 of the ConfigMap data.  A config change alters the
template and so rolls the pods; an unchanged config leaves the template untouched."""

CONFIG_KEY = "runtime.json"
VLLM_ARGS_KEY = "vllm-args.json"
"""ConfigMap key of an ``engine: vllm`` resource: the ``vllm serve`` arguments (the
pods take them from their template; the ConfigMap records them and, through the
config hash, ties a change of them to a rollout)."""
VLLM_CACHE_DIR = "/cache"
"""emptyDir that ``engine: vllm`` pods use as ``HOME``: the Hugging Face, torch and
compile caches need a writable directory, and the pods run as a non-root user."""
CONFIG_DIR = "/etc/specula"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
MODEL_CACHE_DIR = "/var/cache/specula"
"""Mount point of the ``hf://`` download cache in ``engine: specula`` pods; ``HF_HOME``
is its ``huggingface`` directory, as it is under ``VLLM_CACHE_DIR`` in vLLM pods, so
one claim serves both engines."""
DOWNLOAD_CONTAINER_NAME = "download"
"""Init container of ``engine: specula`` pods with ``hf://`` checkpoints: ``specula
download`` fills the cache before the engine starts (the engine reads it offline)."""

CONTAINER_NAME = "runtime"
HTTP_PORT_NAME = "http"
METRICS_PORT_NAME = "metrics"
ADMIN_PORT_NAME = "admin"
"""Container port of the runtime's admin API; no Service port leads to it."""
TMP_DIR = "/tmp"
"""emptyDir of every container: the root filesystems are read-only, and Python, torch
(inductor), Triton and the Hugging Face libraries write caches and scratch files; the
``engine: specula`` containers get ``HOME`` there too, so ``~/.cache`` and ``~/.triton``
land in it (``engine: vllm`` pods use :data:`VLLM_CACHE_DIR` as ``HOME``)."""
API_KEY_ENV = {"specula": "SPECULA_API_KEY", "vllm": "VLLM_API_KEY"}
"""Variable each engine reads its API key from (``vllm serve`` reads ``VLLM_API_KEY``)."""
SERVICE_HTTP_PORT = RUNTIME_PORT
SERVICE_METRICS_PORT = METRICS_PORT
"""Service port named ``metrics``: the runtime serves ``/metrics`` on a port of its own
(``metrics_port`` in the runtime config) so a PodMonitor or ServiceMonitor selects it by
name and never reaches the API port."""

SHM_BASE_GI = 1
"""``sizeLimit`` (GiB) of the pod's ``/dev/shm`` (a memory-backed emptyDir) with one GPU
or none: the container runtime's default of 64 MiB is too small for PyTorch's shared
tensors and for NCCL, whose containers are commonly run with ``--shm-size=1g``."""
SHM_PER_EXTRA_GPU_GI = 2
"""GiB of ``/dev/shm`` added for each GPU beyond the first (see :func:`shm_size_limit`).
With tensor parallelism one process per GPU talks over NCCL; where the GPUs cannot reach
each other directly (no P2P between them), NCCL's shared-memory transport keeps send and
receive buffers for every peer, channel and protocol (``NCCL_BUFFSIZE``, 4 MiB by default,
for the simple protocol alone) in ``/dev/shm``, so the need grows with the ranks.  Buffers
that do not fit fail the group's setup ("Error while creating shared memory segment"),
they do not slow it down."""

RUN_AS_USER = 1000
"""Non-root uid (and gid) of the runtime process; the runtime image owns its files as 1000."""

STARTUP_FAILURE_THRESHOLD = 360
"""Startup probe attempts at 10 s: up to one hour to download and load a checkpoint
before the kubelet restarts the pod."""

DRAIN_SECONDS = 10
"""A deleted pod's ``preStop`` sleep: it keeps serving while its endpoint leaves the
Service's EndpointSlice and kube-proxy's rules, so that no new connection is sent to
a server that has stopped listening."""

TERMINATION_GRACE_SECONDS = DRAIN_SECONDS + 110
"""``terminationGracePeriodSeconds``: the drain, then up to 110 s for the requests
in flight to finish (the server stops accepting on SIGTERM and completes them)
before the kubelet kills the container."""


@dataclass(frozen=True)
class Owner:
    """The ``SpeculativeModel`` that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        """An ownerReference making the resource the children's controller, so the
        garbage collector deletes them with it (foreground deletion waits for them)."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the runtime pods of resource ``name``; stable across
    versions because a Deployment's selector is immutable."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: COMPONENT_RUNTIME,
    }


def labels(name: str) -> dict[str, str]:
    """Labels of every child and of the pods."""
    return {**selector_labels(name), LABEL_MANAGED_BY: MANAGED_BY}


def selector_string(name: str) -> str:
    """:func:`selector_labels` in label-selector syntax (``status.selector``, read by
    the ``scale`` subresource and so by HPA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [owner.reference()],
    }


def configmap_data(
    owner_name: str, spec: SpeculativeModelSpec, speculation: PodSpeculation | None = None
) -> dict[str, str]:
    """``{"runtime.json": <RuntimeConfig JSON>}`` (``engine: specula``) or
    ``{"vllm-args.json": <argument list JSON>}`` (``engine: vllm``, at ``speculation``),
    serialised deterministically so equal inputs give byte-equal data (and hashes).

    Raises:
        VllmConfigError: the vLLM arguments would be refused by vLLM.
    """
    if spec.engine == "vllm":
        args = render_vllm_args(owner_name, spec, speculation)
        return {VLLM_ARGS_KEY: json.dumps(args, indent=2) + "\n"}
    config = render_runtime_config(owner_name, spec)
    text = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    return {CONFIG_KEY: text}


def config_hash(data: dict[str, str]) -> str:
    """sha256 hex digest of ConfigMap ``data`` (keys sorted)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def build_configmap(
    owner: Owner, spec: SpeculativeModelSpec, speculation: PodSpeculation | None = None
) -> dict[str, Any]:
    """The ConfigMap ``<name>`` with :func:`configmap_data`."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner),
        "data": configmap_data(owner.name, spec, speculation),
    }


def pvc_claims(spec: SpeculativeModelSpec) -> list[str]:
    """Claim names of the ``pvc://claim/...`` URIs of target and draft, sorted, unique."""
    uris = [spec.model.uri]
    if spec.speculator.model is not None:
        uris.append(spec.speculator.model.uri)
    prefix = "pvc://"
    return sorted({u[len(prefix):].split("/", 1)[0] for u in uris if u.startswith(prefix)})


def _quantity(value: int | str) -> str:
    return str(value)


def shm_size_limit(gpus: int) -> str:
    """``sizeLimit`` of ``/dev/shm`` for a pod with ``gpus`` GPUs: :data:`SHM_BASE_GI`
    GiB, plus :data:`SHM_PER_EXTRA_GPU_GI` GiB per GPU beyond the first (1 GPU: 1Gi,
    2: 3Gi, 4: 7Gi, 8: 15Gi).

    A limit, not a reservation: tmpfs pages take memory only once written, and then
    count against the container's memory limit (``resources.memory``) like any other.
    The 64 MiB that a container gets by default is too small even for one GPU.
    """
    return f"{SHM_BASE_GI + SHM_PER_EXTRA_GPU_GI * max(gpus - 1, 0)}Gi"


def _resources(spec: SpeculativeModelSpec) -> dict[str, Any]:
    res = spec.resources
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    gpus = spec.pod_gpus
    if gpus > 0:
        # Extended resources need only a limit; the request defaults to it.
        limits[res.gpu.resource_name] = str(gpus)
    for key, value in (("cpu", res.cpu), ("memory", res.memory)):
        if value is not None:
            limits[key] = requests[key] = _quantity(value)
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _probe(period_s: int, failure_threshold: int, timeout_s: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
        "periodSeconds": period_s,
        "failureThreshold": failure_threshold,
        "timeoutSeconds": timeout_s,
    }


def _security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def admin_secret_name(name: str) -> str:
    """Name of the Secret holding the admin token of resource ``name``."""
    return f"{name}-admin-token"


def build_admin_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The Secret ``<name>-admin-token`` holding ``token`` under :data:`ADMIN_TOKEN_KEY`,
    owned by the resource (garbage-collected with it).  Created once and never applied
    again: a new token each reconcile would lock the operator out of running pods."""
    meta = _metadata(owner)
    meta["name"] = admin_secret_name(owner.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _hub_env(spec: SpeculativeModelSpec, cache_dir: str) -> list[dict[str, Any]]:
    """``HF_HOME`` in the cache volume and, with ``hfTokenSecret``, ``HF_TOKEN``; a
    variable of the spec's ``env`` of the same name wins."""
    own = {var.name for var in spec.env}
    env: list[dict[str, Any]] = []
    if "HF_HOME" not in own:
        env.append({"name": "HF_HOME", "value": f"{cache_dir}/huggingface"})
    if spec.hf_token_secret is not None and "HF_TOKEN" not in own:
        ref = spec.hf_token_secret
        env.append({
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
        })
    return env


def _cache_volume(spec: SpeculativeModelSpec, name: str) -> dict[str, Any]:
    cache = spec.model_cache
    if cache is not None and cache.claim_name is not None:
        return {"name": name, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    empty: dict[str, Any] = {}
    if cache is not None and cache.size_limit is not None:
        empty["sizeLimit"] = _quantity(cache.size_limit)
    return {"name": name, "emptyDir": empty}


def _home_env(spec: SpeculativeModelSpec, home: str) -> list[dict[str, Any]]:
    """``HOME`` in a writable volume, unless the spec's ``env`` sets it."""
    return [] if any(var.name == "HOME" for var in spec.env) else [{"name": "HOME", "value": home}]


def _api_key_env(spec: SpeculativeModelSpec) -> list[dict[str, Any]]:
    """The engine's API-key variable from ``spec.apiKeySecret`` (a reference: the key
    itself never enters the pod spec)."""
    ref = spec.api_key_secret
    if ref is None:
        return []
    return [{
        "name": API_KEY_ENV[spec.engine],
        "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
    }]


def _download_container(spec: SpeculativeModelSpec, image: str) -> dict[str, Any]:
    """``specula download`` of the runtime config's ``hf://`` checkpoints into the cache;
    a failure's reason (missing repository, refused token, full disk) becomes its
    termination message, which the operator copies into ``Degraded``."""
    return {
        "name": DOWNLOAD_CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["specula", "download", "--config", CONFIG_PATH],
        "env": [*_home_env(spec, TMP_DIR), *_hub_env(spec, MODEL_CACHE_DIR),
                *(var.to_k8s() for var in spec.env)],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
        ],
        "securityContext": _security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _container(
    spec: SpeculativeModelSpec,
    image: str,
    mounts: list[dict[str, Any]],
    vllm_args: list[str] | None = None,
) -> dict[str, Any]:
    if vllm_args is None:
        command = {"command": ["specula", "serve", "--config", CONFIG_PATH]}
        ports = [
            {"name": HTTP_PORT_NAME, "containerPort": RUNTIME_PORT, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ]
    else:
        # Explicit command: the image's entrypoint differs between vLLM releases.
        command = {"command": ["vllm", "serve"], "args": vllm_args}
        # vLLM serves /metrics on its API port; the Service maps "metrics" onto it.
        ports = [{"name": HTTP_PORT_NAME, "containerPort": VLLM_PORT, "protocol": "TCP"}]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        **command,
        "ports": ports,
        "startupProbe": _probe(10, STARTUP_FAILURE_THRESHOLD, 5),
        "readinessProbe": _probe(5, 3, 5),
        "livenessProbe": _probe(15, 4, 10),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        # Serve on while the endpoint is withdrawn; SIGTERM (graceful stop) comes after.
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}},
        # A crash's reason reaches the pod status even when it wrote no termination
        # message: the last lines of its log.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    env = [var.to_k8s() for var in spec.env]
    if spec.hf_uris:
        cache_dir = MODEL_CACHE_DIR if vllm_args is None else VLLM_CACHE_DIR
        hub = _hub_env(spec, cache_dir)
        if vllm_args is None and all(var.name != "HF_HUB_OFFLINE" for var in spec.env):
            # The download container filled the cache; the engine never goes online.
            hub.append({"name": "HF_HUB_OFFLINE", "value": "1"})
        env = hub + env
    # A spec's own HOME wins (env is keyed by name, so it cannot be given twice).
    env = _home_env(spec, VLLM_CACHE_DIR if vllm_args is not None else TMP_DIR) + env
    env += _api_key_env(spec)
    if env:
        container["env"] = env
    return container


def build_deployment(
    owner: Owner,
    spec: SpeculativeModelSpec,
    *,
    config_hash: str,
    default_image: str = DEFAULT_RUNTIME_IMAGE,
    vllm_image: str = DEFAULT_VLLM_IMAGE,
    speculation: PodSpeculation | None = None,
) -> dict[str, Any]:
    """The Deployment ``<name>`` running ``spec.desiredReplicas`` pods.

    ``config_hash`` is :func:`config_hash` of the ConfigMap's data; it goes into the
    pod template so that only a config change rolls the pods.  ``engine: vllm`` pods
    run ``vllm serve`` with the k (or schedule) of ``speculation`` (default: the spec's
    k) in their arguments, so a new k rolls them.  A rollout surges one pod at a time
    and never takes a serving pod away first (``maxUnavailable: 0``); a pod being
    replaced drains (``preStop`` sleep of :data:`DRAIN_SECONDS`) before its server
    stops accepting and finishes the requests in flight.  Each pod asks for
    ``spec.pod_gpus`` GPUs (``model.tensorParallelSize`` unless ``resources.gpu.count``
    says otherwise) and gets a ``/dev/shm`` of :func:`shm_size_limit` of them.

    Raises:
        VllmConfigError: the vLLM arguments would be refused by vLLM.
    """
    vllm = spec.engine == "vllm"
    mounts: list[dict[str, Any]] = [
        # PyTorch and NCCL use shared memory; the container default is 64 MiB.
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {
            "medium": "Memory", "sizeLimit": shm_size_limit(spec.pod_gpus),
        }},
        {"name": "tmp", "emptyDir": {}},
    ]
    init_containers: list[dict[str, Any]] = []
    image = spec.image or (vllm_image if vllm else default_image)
    if vllm:
        # vLLM downloads hf:// checkpoints itself, into HOME's cache (a claim if named).
        mounts.append({"name": "cache", "mountPath": VLLM_CACHE_DIR})
        volumes.append(_cache_volume(spec, "cache"))
    else:
        mounts.insert(0, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
        volumes.insert(0, {"name": "config", "configMap": {"name": owner.name}})
        # The admin token: a file the runtime reads per admin request, so the kubelet's
        # refresh of a replaced Secret reaches it without a restart.
        mounts.insert(1, {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True})
        volumes.insert(1, {"name": "admin-token", "secret": {
            "secretName": admin_secret_name(owner.name), "defaultMode": 0o440,
        }})
        if spec.hf_uris:
            mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR,
                           "readOnly": True})
            volumes.append(_cache_volume(spec, "model-cache"))
            init_containers.append(_download_container(spec, image))
    for index, claim in enumerate(pvc_claims(spec)):
        # Indexed volume names: claim names may be longer than a volume name allows.
        volume = f"model-pvc-{index}"
        volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append(
            {"name": volume, "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True}
        )

    pod_spec: dict[str, Any] = {
        # The runtime never calls the Kubernetes API.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            _container(
                spec,
                image,
                mounts,
                render_vllm_args(owner.name, spec, speculation) if vllm else None,
            )
        ],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in spec.tolerations]

    deployment_spec: dict[str, Any] = {
        "replicas": spec.desired_replicas,
        "selector": {"matchLabels": selector_labels(owner.name)},
        "template": {
            "metadata": {
                "labels": labels(owner.name),
                "annotations": {CONFIG_HASH_ANNOTATION: config_hash},
            },
            "spec": pod_spec,
        },
    }
    deployment_spec["strategy"] = {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": deployment_spec,
    }


def build_service(owner: Owner, engine: str = "specula") -> dict[str, Any]:
    """The ClusterIP Service ``<name>``: port ``http`` (the OpenAI API) and port
    ``metrics`` (Prometheus), to the pods' ports of the same names; for ``engine:
    vllm``, whose pods serve ``/metrics`` on the API port, ``metrics`` leads there."""
    metrics_target = HTTP_PORT_NAME if engine == "vllm" else METRICS_PORT_NAME
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": SERVICE_HTTP_PORT,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                },
                {
                    "name": METRICS_PORT_NAME,
                    "port": SERVICE_METRICS_PORT,
                    "targetPort": metrics_target,
                    "protocol": "TCP",
                },
            ],
        },
    }


NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Label the API server sets on every Namespace to its name (Kubernetes >= 1.22)."""


def _namespace_peer(namespace: str, pods: dict[str, str] | None = None) -> dict[str, Any]:
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}
    if pods is not None:
        peer["podSelector"] = {"matchLabels": dict(pods)}
    return peer


def build_network_policy(
    owner: Owner,
    engine: str,
    operator_namespace: str,
    operator_pod_labels: dict[str, str],
    metrics_namespaces: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The NetworkPolicy ``<name>`` of the runtime pods: port ``http`` open to every
    client; ports ``admin`` and ``metrics`` only to the operator's pods (those of
    ``operator_pod_labels`` in ``operator_namespace``), and ``metrics`` also to every
    pod of ``metrics_namespaces`` (a Prometheus).  ``engine: vllm`` pods serve only
    ``http`` (metrics included, no admin API), so their policy has the first rule.

    Enforced only where the cluster's network plugin implements NetworkPolicy (Calico,
    Cilium, ...); elsewhere the API server stores it and nothing filters.
    """
    rules: list[dict[str, Any]] = [
        {"ports": [{"port": HTTP_PORT_NAME, "protocol": "TCP"}]},
    ]
    if engine != "vllm":
        rules.append({
            "from": [_namespace_peer(operator_namespace, operator_pod_labels)],
            "ports": [{"port": name, "protocol": "TCP"}
                      for name in (ADMIN_PORT_NAME, METRICS_PORT_NAME)],
        })
        if metrics_namespaces:
            rules.append({
                "from": [_namespace_peer(ns) for ns in metrics_namespaces],
                "ports": [{"port": METRICS_PORT_NAME, "protocol": "TCP"}],
            })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def build_children(
    owner: Owner,
    spec: SpeculativeModelSpec,
    *,
    default_image: str = DEFAULT_RUNTIME_IMAGE,
    vllm_image: str = DEFAULT_VLLM_IMAGE,
    speculation: PodSpeculation | None = None,
) -> list[dict[str, Any]]:
    """ConfigMap, Deployment and Service, in the order to apply them (the config
    exists before pods that mount it).

    Raises:
        VllmConfigError: ``engine: vllm`` arguments that vLLM would refuse.
    """
    configmap = build_configmap(owner, spec, speculation)
    deployment = build_deployment(
        owner,
        spec,
        config_hash=config_hash(configmap["data"]),
        default_image=default_image,
        vllm_image=vllm_image,
        speculation=speculation,
    )
    return [configmap, deployment, build_service(owner, spec.engine)]


def _scale_target(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name}


def _milli(value: float) -> str:
    """A quantity in thousandths (``0.7 -> "700m"``), the form the API server keeps."""
    return f"{round(value * 1000)}m"


def build_scaled_object(
    owner: Owner, autoscaling: AutoscalingSpec, utilization_url_base: str
) -> dict[str, Any]:
    """A KEDA ``ScaledObject`` scaling the resource (its ``scale`` subresource) on the
    operator's utilization endpoint with a ``metrics-api`` trigger.

    ``metricType: Value`` makes the HPA that KEDA creates compute ``ceil(replicas *
    utilization / targetUtilization)``; the default ``AverageValue`` would divide the
    (already per-capacity) utilization by the replica count once more.
    """
    url = utilization_url_base.rstrip("/") + utilization_path(owner.namespace, owner.name)
    api_version, kind = SCALED_OBJECT
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "triggers": [
                {
                    "type": "metrics-api",
                    "metricType": "Value",
                    "metadata": {
                        "url": url,
                        "format": "json",
                        "valueLocation": "utilization",
                        "targetValue": f"{autoscaling.target_utilization:g}",
                    },
                }
            ],
        },
    }


def build_hpa(owner: Owner, autoscaling: AutoscalingSpec) -> dict[str, Any]:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler scaling the resource (its ``scale``
    subresource) on the ``Object`` metric ``specula_operator_utilization`` of the
    resource, which a Prometheus adapter serves from the operator's gauge of that name
    (labels ``namespace`` and ``name``)."""
    api_version, kind = HPA
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "Object",
                    "object": {
                        "describedObject": _scale_target(owner),
                        "metric": {"name": UTILIZATION_METRIC},
                        "target": {
                            "type": "Value",
                            "value": _milli(autoscaling.target_utilization),
                        },
                    },
                }
            ],
        },
    }


def build_autoscaler(
    owner: Owner, spec: SpeculativeModelSpec, utilization_url_base: str
) -> dict[str, Any] | None:
    """The autoscaler of ``spec.autoscaling.provider``, or ``None`` without autoscaling."""
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return None
    if autoscaling.provider == "keda":
        return build_scaled_object(owner, autoscaling, utilization_url_base)
    return build_hpa(owner, autoscaling)
