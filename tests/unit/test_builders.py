"""Pure builders: ConfigMap, Deployment and Service manifests of a SpeculativeModel."""

from __future__ import annotations

import json

import pytest

from specula.api.models import SpeculativeModelSpec
from specula.api.runtime_config import RuntimeConfig
from specula.operator.builders import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_PATH,
    SHM_BASE_GI,
    SHM_PER_EXTRA_GPU_GI,
    Owner,
    build_children,
    build_configmap,
    build_deployment,
    build_service,
    config_hash,
    labels,
    pvc_claims,
    selector_labels,
    selector_string,
    shm_size_limit,
)
from specula.operator.settings import DEFAULT_RUNTIME_IMAGE

OWNER = Owner(name="qwen", namespace="llm", uid="0b8d4c2e-1111-2222-3333-444455556666")


def make_spec(**overrides) -> SpeculativeModelSpec:
    raw = {
        "model": {"uri": "hf://Qwen/Qwen3-8B"},
        "speculator": {"method": "draft_model", "model": {"uri": "hf://Qwen/Qwen3-0.6B"}},
    }
    raw.update(overrides)
    return SpeculativeModelSpec.model_validate(raw)


def children(spec=None, **kwargs):
    configmap, deployment, service = build_children(OWNER, spec or make_spec(), **kwargs)
    return configmap, deployment, service


def container_of(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_children_kinds_names_and_labels():
    objs = children()
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service"]
    expected_labels = {
        "app.kubernetes.io/name": "specula",
        "app.kubernetes.io/instance": "qwen",
        "app.kubernetes.io/component": "runtime",
        "app.kubernetes.io/managed-by": "specula-operator",
    }
    for obj in objs:
        assert obj["metadata"]["name"] == "qwen"
        assert obj["metadata"]["namespace"] == "llm"
        assert obj["metadata"]["labels"] == expected_labels
    assert labels("qwen") == expected_labels


def test_owner_references():
    for obj in children():
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "specula.dev/v1alpha1",
            "kind": "SpeculativeModel",
            "name": "qwen",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }]


def test_configmap_holds_the_runtime_config():
    cm = build_configmap(OWNER, make_spec())
    assert list(cm["data"]) == ["runtime.json"]
    config = RuntimeConfig.model_validate(json.loads(cm["data"]["runtime.json"]))
    assert config.model == "hf://Qwen/Qwen3-8B"
    assert config.served_model_name == "qwen"
    assert config.speculator.model == "hf://Qwen/Qwen3-0.6B"
    assert config.speculator.num_speculative_tokens == 3
    assert config.port == 8000


def test_config_hash_changes_with_config_only():
    _, base, _ = children()
    _, same, _ = children()
    _, more_replicas, _ = children(make_spec(replicas=4))
    k5 = make_spec(speculator={
        "method": "draft_model", "model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "numSpeculativeTokens": 5,
    })
    _, other_k, _ = children(k5)

    def template_hash(d):
        return d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    assert len(template_hash(base)) == 64
    assert template_hash(base) == template_hash(same)
    # Scaling is not a config change: pods must not roll.
    assert template_hash(base) == template_hash(more_replicas)
    assert base["spec"]["template"] == more_replicas["spec"]["template"]
    assert template_hash(base) != template_hash(other_k)
    cm = build_configmap(OWNER, k5)
    assert template_hash(other_k) == config_hash(cm["data"])


def test_deployment_selector_is_stable_and_matches_pods():
    _, deployment, _ = children()
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == selector_labels("qwen")
    assert "app.kubernetes.io/version" not in selector
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert selector_string("qwen") == (
        "app.kubernetes.io/component=runtime,"
        "app.kubernetes.io/instance=qwen,"
        "app.kubernetes.io/name=specula"
    )


def test_container_command_image_ports_and_probes():
    _, deployment, _ = children()
    assert deployment["spec"]["replicas"] == 1
    container = container_of(deployment)
    assert container["command"] == ["specula", "serve", "--config", CONFIG_PATH]
    assert CONFIG_PATH == "/etc/specula/runtime.json"
    assert container["image"] == DEFAULT_RUNTIME_IMAGE
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
        {"name": "admin", "containerPort": 8001, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Loading a checkpoint is slow: the startup probe allows far longer than liveness.
    startup = container["startupProbe"]
    liveness = container["livenessProbe"]
    assert (startup["periodSeconds"] * startup["failureThreshold"]
            > 10 * liveness["periodSeconds"] * liveness["failureThreshold"])


def test_image_override():
    _, deployment, _ = children(make_spec(image="registry.local/specula:dev"))
    assert container_of(deployment)["image"] == "registry.local/specula:dev"
    _, deployment, _ = children(default_image="example.org/runtime:1")
    assert container_of(deployment)["image"] == "example.org/runtime:1"


def test_security_context():
    _, deployment, _ = children()
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = container_of(deployment)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_gpu_cpu_memory_resources():
    _, deployment, _ = children()
    assert container_of(deployment)["resources"] == {"limits": {"nvidia.com/gpu": "1"}}

    spec = make_spec(resources={
        "gpu": {"count": 2, "resourceName": "amd.com/gpu"}, "cpu": 8, "memory": "64Gi",
    })
    _, deployment, _ = children(spec)
    assert container_of(deployment)["resources"] == {
        "limits": {"amd.com/gpu": "2", "cpu": "8", "memory": "64Gi"},
        "requests": {"cpu": "8", "memory": "64Gi"},
    }

    _, deployment, _ = children(make_spec(resources={"gpu": {"count": 0}}))
    assert "resources" not in container_of(deployment)


@pytest.mark.parametrize(
    ("tp", "gpu", "limit", "shm"),
    [
        (1, None, "1", "1Gi"),
        (2, None, "2", "3Gi"),
        (4, None, "4", "7Gi"),
        (8, None, "8", "15Gi"),
        (4, {"resourceName": "amd.com/gpu"}, "4", "7Gi"),
        (2, {"count": 2}, "2", "3Gi"),
        (2, {"count": 4}, "4", "7Gi"),
        (1, {"count": 2}, "2", "3Gi"),
        (4, {"count": 0}, None, "1Gi"),
    ],
)
def test_gpus_follow_the_tensor_parallel_size_and_size_shm(tp, gpu, limit, shm):
    """Without resources.gpu.count a pod asks for one GPU per shard; /dev/shm grows
    with the GPUs of the pod (NCCL's shared-memory transport keeps its buffers there)."""
    resources = {"gpu": gpu} if gpu is not None else {}
    spec = make_spec(model={"uri": "hf://Qwen/Qwen3-8B", "tensorParallelSize": tp},
                     resources=resources)
    _, deployment, _ = children(spec)
    limits = container_of(deployment).get("resources", {}).get("limits", {})
    name = (gpu or {}).get("resourceName", "nvidia.com/gpu")
    assert limits.get(name) == limit
    pod = deployment["spec"]["template"]["spec"]
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
    (mount,) = [m for m in container_of(deployment)["volumeMounts"] if m["name"] == "dshm"]
    assert mount["mountPath"] == "/dev/shm"
    # The runtime config carries the degree the GPUs are counted for.
    config = RuntimeConfig.model_validate_json(build_configmap(OWNER, spec)["data"]["runtime.json"])
    assert config.tensor_parallel_size == tp


def test_shm_size_limit_rule():
    assert [shm_size_limit(n) for n in range(9)] == [
        "1Gi", "1Gi", "3Gi", "5Gi", "7Gi", "9Gi", "11Gi", "13Gi", "15Gi",
    ]
    assert shm_size_limit(1) == f"{SHM_BASE_GI}Gi"
    assert shm_size_limit(3) == f"{SHM_BASE_GI + 2 * SHM_PER_EXTRA_GPU_GI}Gi"


def test_vllm_pods_ask_for_the_shards_gpus_too():
    spec = make_spec(engine="vllm", model={"uri": "hf://Qwen/Qwen3-8B", "tensorParallelSize": 2})
    _, deployment, _ = children(spec)
    container = container_of(deployment)
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    pod = deployment["spec"]["template"]["spec"]
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["sizeLimit"] == "3Gi"


def test_volumes_config_shm_and_pvc():
    _, deployment, _ = children()
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"] == {"name": "config", "configMap": {"name": "qwen"}}
    assert volumes["dshm"] == {
        "name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"},
    }
    mounts = {m["name"]: m for m in container_of(deployment)["volumeMounts"]}
    assert mounts["config"]["mountPath"] == "/etc/specula"
    assert mounts["config"]["readOnly"] is True
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])

    spec = make_spec(
        model={"uri": "pvc://models/qwen3-8b"},
        speculator={"method": "draft_model", "model": {"uri": "pvc://drafts/qwen3-0.6b"}},
    )
    assert pvc_claims(spec) == ["drafts", "models"]
    _, deployment, _ = children(spec)
    pod = deployment["spec"]["template"]["spec"]
    pvcs = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [v["persistentVolumeClaim"] for v in pvcs] == [
        {"claimName": "drafts", "readOnly": True},
        {"claimName": "models", "readOnly": True},
    ]
    mounts = {m["name"]: m for m in container_of(deployment)["volumeMounts"]}
    assert [mounts[v["name"]]["mountPath"] for v in pvcs] == [
        "/models/pvc/drafts", "/models/pvc/models",
    ]
    assert all(mounts[v["name"]]["readOnly"] for v in pvcs)


def test_same_claim_mounted_once():
    spec = make_spec(
        model={"uri": "pvc://models/target"},
        speculator={"method": "draft_model", "model": {"uri": "pvc://models/draft"}},
    )
    _, deployment, _ = children(spec)
    pod = deployment["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == ["model-pvc-0"]


def test_scheduling_env_and_service_account():
    spec = make_spec(
        nodeSelector={"nvidia.com/gpu.product": "H100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        env=[
            {"name": "LOG_LEVEL", "value": "debug"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
        serviceAccountName="llm-runtime",
        replicas=3,
    )
    _, deployment, _ = children(spec)
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["serviceAccountName"] == "llm-runtime"
    # HOME on the writable emptyDir, then for hf:// checkpoints the cache's HF_HOME and
    # offline mode; the spec's own HF_TOKEN is kept as written.
    assert container_of(deployment)["env"] == [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/var/cache/specula/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "LOG_LEVEL", "value": "debug"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]


def test_optional_pod_fields_omitted_when_unset():
    _, deployment, _ = children()
    pod = deployment["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "serviceAccountName"):
        assert key not in pod
    # Only what hf:// checkpoints need (the default spec's URIs are hf://).
    assert [v["name"] for v in container_of(deployment)["env"]] == [
        "HOME", "HF_HOME", "HF_HUB_OFFLINE"
    ]


def test_service_ports():
    service = build_service(OWNER)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == selector_labels("qwen")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"http", "metrics"}
    assert ports["http"]["port"] == 8000
    assert ports["http"]["targetPort"] == "http"
    assert ports["metrics"]["port"] == 9090
    assert ports["metrics"]["targetPort"] == "metrics"
    # The API server rejects two Service ports with the same port and protocol.
    assert len({(p["port"], p["protocol"]) for p in ports.values()}) == 2


@pytest.mark.parametrize("spec", [make_spec(), make_spec(replicas=0, image="x:y")])
def test_builders_are_deterministic(spec):
    assert build_children(OWNER, spec) == build_children(OWNER, spec)
    assert json.dumps(build_deployment(OWNER, spec, config_hash="h"), sort_keys=True) == \
        json.dumps(build_deployment(OWNER, spec, config_hash="h"), sort_keys=True)
