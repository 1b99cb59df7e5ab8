"""Builders for ``engine: vllm`` and the autoscaler objects; the pure engine functions."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError

from specula.api.capabilities import is_method_implemented
from specula.api.models import SpeculativeModelSpec, SpeculativeModelStatus, TunerStatus
from specula.api.render_vllm import DEFAULT_VLLM_IMAGE, PodSpeculation
from specula.api.runtime_config import SpeculatorMethod
from specula.operator.builders import (
    CONFIG_HASH_ANNOTATION,
    VLLM_ARGS_KEY,
    Owner,
    build_autoscaler,
    build_children,
)
from specula.operator.engine import pod_speculation, rollout_in_progress
from specula.operator.reconcile import parse_spec
from specula.operator.settings import OperatorSettings
from specula.tuning import TuningSettings, TuningState

OWNER = Owner(name="qwen", namespace="llm", uid="0b8d4c2e-1111-2222-3333-444455556666")
BASE = "http://specula-operator.specula-system.svc:8080"


def make_spec(**overrides) -> SpeculativeModelSpec:
    raw = {
        "model": {"uri": "hf://Qwen/Qwen3-8B"},
        "speculator": {"method": "eagle3", "model": {"uri": "hf://org/eagle3"}},
        "engine": "vllm",
    }
    raw.update(overrides)
    return SpeculativeModelSpec.model_validate(raw)


def vllm_children(spec=None, **kwargs):
    return build_children(OWNER, spec or make_spec(), **kwargs)


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def speculative_config(deployment) -> dict:
    args = container(deployment)["args"]
    return json.loads(args[args.index("--speculative-config") + 1])


def test_vllm_pods_run_vllm_serve_with_the_rendered_config():
    configmap, deployment, service = vllm_children()
    c = container(deployment)
    assert c["image"] == DEFAULT_VLLM_IMAGE
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][0] == "Qwen/Qwen3-8B"
    assert speculative_config(deployment) == {
        "method": "eagle3", "model": "org/eagle3", "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    assert json.loads(configmap["data"][VLLM_ARGS_KEY]) == c["args"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # HOME for the caches; HF_HOME in the cache volume, the layout engine specula's
    # download cache uses too, so one claim serves both engines.
    assert c["env"] == [
        {"name": "HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
    ]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "tmp": "/tmp", "cache": "/cache"}
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    # vLLM serves /metrics on its API port: the Service's "metrics" port leads there.
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports == {"http": "http", "metrics": "http"}


def test_specula_engine_keeps_its_own_ports_and_rolls_with_a_drain():
    _, deployment, service = build_children(OWNER, make_spec(
        engine="specula", speculator={"method": "draft_model", "model": {"uri": "hf://a/b"}}
    ))
    # A rollout never takes a serving pod away first; a replaced pod keeps serving
    # while its endpoint is withdrawn, then finishes its requests within the grace.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert container(deployment)["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert pod["terminationGracePeriodSeconds"] == 120
    assert container(deployment)["command"][:2] == ["specula", "serve"]
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        "http": "http", "metrics": "metrics",
    }


def test_image_override_and_spec_home_win():
    spec = make_spec(image="registry.local/vllm:custom", env=[{"name": "HOME", "value": "/x"}])
    _, deployment, _ = vllm_children(spec, vllm_image="ignored")
    assert container(deployment)["image"] == "registry.local/vllm:custom"
    assert container(deployment)["env"] == [
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "HOME", "value": "/x"},
    ]
    _, deployment, _ = vllm_children(make_spec(), vllm_image="mirror/vllm:v1")
    assert container(deployment)["image"] == "mirror/vllm:v1"


def test_a_new_k_changes_the_pod_template():
    _, before, _ = vllm_children()
    _, same, _ = vllm_children(speculation=PodSpeculation(3))
    _, after, _ = vllm_children(speculation=PodSpeculation(5))
    assert same["spec"]["template"] == before["spec"]["template"]
    assert speculative_config(after)["num_speculative_tokens"] == 5
    hash_of = lambda d: d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]  # noqa: E731
    assert hash_of(after) != hash_of(before)


def test_scaled_object_targets_the_scale_subresource():
    spec = make_spec(autoscaling={"minReplicas": 2, "maxReplicas": 6, "targetUtilization": 0.65})
    so = build_autoscaler(OWNER, spec, BASE)
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert so["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "specula.dev/v1alpha1", "kind": "SpeculativeModel", "name": "qwen",
    }
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metricType"] == "Value"
    assert trigger["metadata"] == {
        "url": f"{BASE}/apis/specula.dev/v1alpha1/namespaces/llm/speculativemodels/qwen/utilization",
        "format": "json",
        "valueLocation": "utilization",
        "targetValue": "0.65",
    }


def test_hpa_reads_the_object_metric():
    spec = make_spec(autoscaling={"maxReplicas": 3, "provider": "hpa"})
    hpa = build_autoscaler(OWNER, spec, BASE)
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "SpeculativeModel"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {
        "type": "Object",
        "object": {
            "describedObject": hpa["spec"]["scaleTargetRef"],
            "metric": {"name": "specula_operator_utilization"},
            "target": {"type": "Value", "value": "700m"},
        },
    }
    assert build_autoscaler(OWNER, make_spec(), BASE) is None


def test_deployment_replicas_follow_spec_within_autoscaling_bounds():
    for replicas, expected in ((0, 2), (3, 3), (9, 5)):
        spec = make_spec(replicas=replicas, autoscaling={"minReplicas": 2, "maxReplicas": 5})
        _, deployment, _ = vllm_children(spec)
        assert deployment["spec"]["replicas"] == expected
    _, deployment, _ = vllm_children(make_spec(replicas=7))
    assert deployment["spec"]["replicas"] == 7


def test_autoscaling_spec_validation():
    with pytest.raises(ValidationError, match="must not exceed autoscaling.maxReplicas"):
        make_spec(autoscaling={"minReplicas": 4, "maxReplicas": 2})
    with pytest.raises(ValidationError, match="greater than 0"):
        make_spec(autoscaling={"maxReplicas": 2, "targetUtilization": 0})
    with pytest.raises(ValidationError, match="Recommend or Auto"):
        make_spec(autoscaling={"maxReplicas": 2}, tuning={"mode": "Off"})
    with pytest.raises(ValidationError, match="keda"):
        make_spec(autoscaling={"maxReplicas": 2, "provider": "prometheus"})


def _status_with_state(k: int, schedule=None) -> SpeculativeModelStatus:
    state = TuningState.initial(k, TuningSettings(max_speculative_tokens=8))
    if schedule is not None:
        state = TuningState.from_dict({**state.to_dict(), "schedule": schedule})
    return SpeculativeModelStatus(tuner=TunerStatus(state=state.to_dict()))


def test_pod_speculation_follows_the_tuner_only_in_auto():
    auto = make_spec(speculator={"method": "eagle3", "model": {"uri": "hf://a/b"},
                                 "numSpeculativeTokens": 2},
                     tuning={"mode": "Auto", "maxSpeculativeTokens": 6})
    assert pod_speculation(auto, None) == PodSpeculation(2)
    assert pod_speculation(auto, _status_with_state(5)) == PodSpeculation(5)
    sched = [[1, 8, 4], [9, 256, 1]]
    # Without tuning.perBatchSize a stored schedule gives way to its headline k.
    assert pod_speculation(auto, _status_with_state(4, sched)) == PodSpeculation(4)
    per_batch = auto.model_copy(
        update={"tuning": auto.tuning.model_copy(update={"per_batch_size": True})}
    )
    assert pod_speculation(per_batch, _status_with_state(4, sched)) == PodSpeculation(
        4, ((1, 8, 4), (9, 256, 1))
    )
    # A single k becomes the schedule drafting it at every batch size (up to maxNumSeqs).
    assert pod_speculation(per_batch, _status_with_state(5)) == PodSpeculation(
        5, ((1, 256, 5),)
    )
    recommend = make_spec(tuning={"mode": "Recommend"})
    assert pod_speculation(recommend, _status_with_state(5)) == PodSpeculation(3)
    specula = make_spec(engine="specula", tuning={"mode": "Auto", "maxSpeculativeTokens": 6})
    assert pod_speculation(specula, _status_with_state(5)) is None


@pytest.mark.parametrize(
    ("deployment", "rolling"),
    [
        (None, False),
        ({"metadata": {"generation": 3}, "spec": {"replicas": 2}}, False),
        ({"metadata": {"generation": 3}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 2}}, True),
        ({"metadata": {"generation": 3}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 3, "updatedReplicas": 1, "replicas": 2}}, True),
        ({"metadata": {"generation": 3}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 3, "updatedReplicas": 2, "replicas": 3}}, True),
        ({"metadata": {"generation": 3}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 3, "updatedReplicas": 2, "replicas": 2}}, False),
    ],
)
def test_rollout_in_progress(deployment, rolling):
    assert rollout_in_progress(deployment) is rolling


def test_settings_from_env():
    s = OperatorSettings.from_env({
        "SPECULA_VLLM_IMAGE": "mirror/vllm:v0",
        "SPECULA_HTTP_PORT": "9443",
        "POD_NAMESPACE": "ops",
        "SPECULA_OPERATOR_SERVICE": "specula",
    })
    assert s.vllm_image == "mirror/vllm:v0"
    assert s.utilization_url_base == "http://specula.ops.svc:9443"
    s = OperatorSettings.from_env({"SPECULA_UTILIZATION_BASE_URL": "http://127.0.0.1:8080/"})
    assert s.utilization_url_base == "http://127.0.0.1:8080"
    assert OperatorSettings.from_env({}).http_port == 8080
    with pytest.raises(ValueError, match="0..65535"):
        OperatorSettings.from_env({"SPECULA_HTTP_PORT": "70000"})


@pytest.mark.parametrize("method", typing.get_args(SpeculatorMethod))
def test_vllm_runs_every_method_the_runtime_some(method):
    raw = {
        "model": {"uri": "hf://org/target"},
        "speculator": {"method": method, "model": {"uri": "hf://org/draft"}},
    }
    _, problem = parse_spec({"spec": {**raw, "engine": "vllm"}})
    assert problem is None
    _, problem = parse_spec({"spec": raw})
    assert (problem is None) is is_method_implemented(method)
    if problem is not None:
        assert problem.reason == "MethodNotSupported"
