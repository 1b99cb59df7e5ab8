"""The operator against a real API server: children, spec changes, idempotence,
unsupported methods and garbage collection."""

from __future__ import annotations

import pytest

from specula.api.runtime_config import RuntimeConfig
from specula.devcluster.control_plane import wait_for

from .sm_objects import (
    DRAFT_URI,
    GROUP,
    KIND,
    PLURAL,
    TARGET_URI,
    VERSION,
    Children,
    condition,
    create_sm,
    delete_sm,
    get_sm,
    patch_sm,
    sm_body,
    wait_condition,
    wait_observed,
)

pytestmark = pytest.mark.integration

CONFIG_MOUNT = "/etc/specula"


def config_hash(deployment) -> tuple[str, str]:
    """The (key, value) of the pod template's config-hash annotation."""
    annotations = deployment.spec.template.metadata.annotations or {}
    found = [(k, v) for k, v in annotations.items() if k.endswith("config-hash")]
    assert len(found) == 1, annotations
    return found[0]


def runtime_config(config_map) -> RuntimeConfig:
    return RuntimeConfig.model_validate_json(config_map.data["runtime.json"])


def assert_controlled_by(obj, sm: dict) -> None:
    refs = obj.metadata.owner_references or []
    controllers = [r for r in refs if r.controller]
    assert len(controllers) == 1, refs
    ref = controllers[0]
    assert ref.api_version == f"{GROUP}/{VERSION}"
    assert ref.kind == KIND
    assert ref.name == sm["metadata"]["name"]
    assert ref.uid == sm["metadata"]["uid"]


def test_valid_resource_gets_configmap_deployment_and_service(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    name = "children"
    sm = create_sm(custom_objects, namespace, sm_body(name, {"replicas": 2}))
    cm, dep, svc = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"]).wait_all()

    for child in (cm, dep, svc):
        assert_controlled_by(child, sm)

    config = runtime_config(cm)
    assert config.model == TARGET_URI
    assert config.served_model_name == name
    assert config.dtype == "bfloat16"
    assert config.max_model_len == 2048
    assert config.tensor_parallel_size == 1
    assert config.speculator is not None
    assert config.speculator.method == "draft_model"
    assert config.speculator.model == DRAFT_URI
    assert config.speculator.num_speculative_tokens == 3

    assert dep.spec.replicas == 2
    pod = dep.spec.template.spec
    assert len(pod.containers) == 1
    container = pod.containers[0]
    for probe in (container.startup_probe, container.readiness_probe, container.liveness_probe):
        assert probe is not None and probe.http_get is not None, container
        assert probe.http_get.path == "/health"
    # The pod's ports are the ones the runtime config tells the server to listen on.
    ports = {p.name: p.container_port for p in container.ports or []}
    assert ports.get("http") == config.port, container.ports
    assert ports.get("metrics") == config.metrics_port, container.ports
    for probe in (container.startup_probe, container.readiness_probe, container.liveness_probe):
        assert probe.http_get.port in ("http", config.port)
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    run_as_non_root = (
        container.security_context and container.security_context.run_as_non_root
    ) or (pod.security_context and pod.security_context.run_as_non_root)
    assert run_as_non_root, (pod.security_context, container.security_context)
    assert container.security_context.allow_privilege_escalation is False
    _, hash_value = config_hash(dep)
    assert hash_value

    # The ConfigMap reaches the container as the runtime config file.
    config_volumes = [
        v.name
        for v in pod.volumes or []
        if v.config_map is not None and v.config_map.name == cm.metadata.name
    ]
    assert config_volumes, pod.volumes
    mounts = [m for m in container.volume_mounts or [] if m.name in config_volumes]
    assert mounts and mounts[0].mount_path.startswith(CONFIG_MOUNT), container.volume_mounts

    # The Service selects exactly the Deployment's pods and exposes http and metrics.
    assert svc.spec.selector == dep.spec.selector.match_labels
    service_targets = {p.name: p.target_port for p in svc.spec.ports}
    assert service_targets.get("http") in ("http", config.port), svc.spec.ports
    assert service_targets.get("metrics") in ("metrics", config.metrics_port), svc.spec.ports

    sm = wait_observed(custom_objects, namespace, name)
    assert sm["status"]["observedGeneration"] == 1
    assert condition(sm, "Degraded") is None or condition(sm, "Degraded")["status"] == "False"


def test_spec_change_updates_configmap_deployment_and_observed_generation(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    name = "spec-change"
    sm = create_sm(custom_objects, namespace, sm_body(name))
    children = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"])
    _, dep, _ = children.wait_all()
    key, old_hash = config_hash(dep)
    wait_observed(custom_objects, namespace, name)

    patched = patch_sm(
        custom_objects, namespace, name, {"spec": {"speculator": {"numSpeculativeTokens": 5}}}
    )
    assert patched["metadata"]["generation"] == 2

    def rolled():
        cm, dep, _ = children.wait_all()
        if runtime_config(cm).speculator.num_speculative_tokens != 5:
            return None
        new_hash = (dep.spec.template.metadata.annotations or {}).get(key)
        return new_hash if new_hash != old_hash else None

    wait_for(rolled, timeout=30, message="ConfigMap k=5 and a new config hash on the Deployment")
    sm = wait_observed(custom_objects, namespace, name)
    assert sm["status"]["observedGeneration"] == 2


def test_unchanged_object_is_not_rewritten(operator, custom_objects, core_v1, apps_v1, namespace):
    name = "idempotent"
    sm = create_sm(custom_objects, namespace, sm_body(name))
    children = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"])
    children.wait_all()
    wait_observed(custom_objects, namespace, name)
    operator.settle(2)
    before = children.resource_versions()
    status_before = get_sm(custom_objects, namespace, name)["status"]

    # An annotation is not part of the spec: the operator runs its update handler
    # (kopf counts annotations as changes) but must write nothing.
    since = operator.log_size()
    patch_sm(
        custom_objects,
        namespace,
        name,
        {"metadata": {"annotations": {"example.com/touched": "yes"}}},
    )
    operator.wait_for_log_count(r"Updating is processed", 1, since=since, timeout=30)
    operator.settle(2)
    assert children.resource_versions() == before
    assert get_sm(custom_objects, namespace, name)["status"] == status_before
    sm_version = get_sm(custom_objects, namespace, name)["metadata"]["resourceVersion"]

    # A restarted operator resumes every object it finds; an unchanged one stays untouched.
    existing = len(
        custom_objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    )
    since = operator.log_size()
    operator.restart()
    operator.wait_for_log_count(r"Resuming is processed", existing, since=since, timeout=30)
    operator.settle(2)
    assert children.resource_versions() == before
    assert get_sm(custom_objects, namespace, name)["metadata"]["resourceVersion"] == sm_version


def test_tensor_parallel_resource_without_a_gpu_count_gets_one_gpu_per_shard(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    """resources.gpu.count omitted: the pods ask for model.tensorParallelSize GPUs, not
    one, and /dev/shm grows with them (NCCL between the ranks)."""
    name = "tp-two"
    body = sm_body(name, {"model": {"tensorParallelSize": 2}, "resources": None})
    created = create_sm(custom_objects, namespace, body)
    assert "resources" not in created["spec"]
    children = Children(core_v1, apps_v1, namespace, created["metadata"]["uid"])
    config_map, dep, _ = children.wait_all()
    assert runtime_config(config_map).tensor_parallel_size == 2
    pod = dep.spec.template.spec
    (container,) = pod.containers
    assert container.resources.limits == {"nvidia.com/gpu": "2"}
    (shm,) = [v for v in pod.volumes if v.name == "dshm"]
    assert shm.empty_dir.medium == "Memory"
    assert shm.empty_dir.size_limit == "3Gi"
    assert any(m.name == "dshm" and m.mount_path == "/dev/shm" for m in container.volume_mounts)
    sm = wait_observed(custom_objects, namespace, name)
    assert condition(sm, "Degraded") is None or condition(sm, "Degraded")["status"] == "False"


def test_eagle3_resource_is_reconciled_into_runtime_pods(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    """Every method the API names is implemented by the runtime, so an EAGLE-3 resource
    gets its children and no MethodNotSupported (the path for methods named ahead of
    the runtime is unit-tested in tests/unit/test_operator_status.py)."""
    name = "eagle3-head"
    body = sm_body(
        name, {"speculator": {"method": "eagle3", "model": {"uri": "hf://org/eagle3-head"}}}
    )
    created = create_sm(custom_objects, namespace, body)
    children = Children(core_v1, apps_v1, namespace, created["metadata"]["uid"])
    config_map, _, _ = children.wait_all()
    sm = wait_condition(custom_objects, namespace, name, "Degraded", "False")
    assert sm["status"]["observedGeneration"] == 1
    speculator = runtime_config(config_map).speculator
    assert (speculator.method, speculator.model) == ("eagle3", "hf://org/eagle3-head")
    operator.check_alive()


def test_deleting_the_resource_garbage_collects_children(
    operator, custom_objects, core_v1, apps_v1, namespace
):
    name = "collected"
    sm = create_sm(custom_objects, namespace, sm_body(name))
    children = Children(core_v1, apps_v1, namespace, sm["metadata"]["uid"])
    children.wait_all()

    delete_sm(custom_objects, namespace, name)
    wait_for(
        lambda: children.all() == ([], [], []),
        timeout=60,
        message="the garbage collector to delete the children",
    )
