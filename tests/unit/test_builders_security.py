"""Builders, security side: the admin-token Secret and its mount, API keys from a
Secret, read-only root filesystems with writable emptyDirs, and the NetworkPolicy."""

from __future__ import annotations

import base64
import json

import pytest

from specula.api.models import SpeculativeModelSpec
from specula.api.render import ADMIN_PORT
from specula.operator.builders import (
    Owner,
    admin_secret_name,
    build_admin_secret,
    build_children,
    build_network_policy,
)
from specula.operator.settings import OperatorSettings

OWNER = Owner(name="qwen", namespace="llm", uid="0b8d4c2e-1111-2222-3333-444455556666")
OPERATOR_LABELS = {"app.kubernetes.io/name": "specula", "app.kubernetes.io/component": "operator"}


def make_spec(**overrides) -> SpeculativeModelSpec:
    body = {
        "model": {"uri": "hf://Qwen/Qwen3-8B"},
        "speculator": {"method": "eagle3", "model": {"uri": "hf://org/qwen3-8b-eagle3"}},
        **overrides,
    }
    return SpeculativeModelSpec.model_validate(body)


def pod_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def all_containers(deployment: dict) -> list[dict]:
    pod = pod_of(deployment)
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("engine", ["specula", "vllm"])
def test_containers_are_hardened_with_writable_tmp(engine):
    spec = make_spec(engine=engine) if engine == "specula" else make_spec(
        engine="vllm", speculator={"method": "eagle3", "model": {"uri": "hf://org/head"}}
    )
    _, deployment, _ = build_children(OWNER, spec)
    pod = pod_of(deployment)
    assert pod["automountServiceAccountToken"] is False
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    containers = all_containers(deployment)
    assert len(containers) == (2 if engine == "specula" else 1)  # download + runtime
    for c in containers:
        ctx = c["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/tmp"]["name"] == "tmp"
        # HOME (caches: ~/.cache, ~/.triton) is on a writable volume, never the image's.
        home = next(v["value"] for v in c["env"] if v["name"] == "HOME")
        assert home in mounts and not mounts[home].get("readOnly")


def test_spec_home_wins():
    spec = make_spec(env=[{"name": "HOME", "value": "/work"}])
    _, deployment, _ = build_children(OWNER, spec)
    for c in all_containers(deployment):
        assert [v for v in c["env"] if v["name"] == "HOME"] == [{"name": "HOME", "value": "/work"}]


def test_admin_token_secret_is_mounted_and_named_in_the_config_only_by_path():
    configmap, deployment, service = build_children(OWNER, make_spec())
    pod = pod_of(deployment)
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-token")
    assert volume["secret"]["secretName"] == admin_secret_name("qwen") == "qwen-admin-token"
    runtime = pod["containers"][0]
    mount = next(m for m in runtime["volumeMounts"] if m["name"] == "admin-token")
    assert mount["readOnly"] is True
    config = json.loads(configmap["data"]["runtime.json"])
    assert config["admin_port"] == ADMIN_PORT
    assert config["admin_token_file"] == f"{mount['mountPath']}/token"
    assert {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"} in runtime["ports"]
    # The Service never exposes the admin port.
    assert [p["name"] for p in service["spec"]["ports"]] == ["http", "metrics"]
    assert ADMIN_PORT not in {p["port"] for p in service["spec"]["ports"]}
    # The download container has no business with the token.
    download = pod["initContainers"][0]
    assert all(m["name"] != "admin-token" for m in download["volumeMounts"])


def test_vllm_pods_have_no_admin_port_nor_token():
    spec = make_spec(engine="vllm")
    _, deployment, _ = build_children(OWNER, spec)
    pod = pod_of(deployment)
    assert all(v["name"] != "admin-token" for v in pod["volumes"])
    assert [p["name"] for p in pod["containers"][0]["ports"]] == ["http"]


def test_admin_secret_holds_the_token_and_is_owned():
    secret = build_admin_secret(OWNER, "s3cr3t-token")
    assert secret["metadata"]["name"] == "qwen-admin-token"
    assert secret["metadata"]["namespace"] == "llm"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cr3t-token"


@pytest.mark.parametrize("engine, variable", [
    ("specula", "SPECULA_API_KEY"), ("vllm", "VLLM_API_KEY"),
])
def test_api_key_comes_from_the_secret_never_a_literal(engine, variable):
    spec = make_spec(engine=engine, apiKeySecret={"name": "llm-keys", "key": "qwen"})
    configmap, deployment, _ = build_children(OWNER, spec)
    runtime = pod_of(deployment)["containers"][0]
    keyed = [v for v in runtime["env"] if v["name"] == variable]
    assert keyed == [{
        "name": variable,
        "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "qwen"}},
    }]
    # Only the runtime serves the API: the download container gets no key.
    for c in pod_of(deployment).get("initContainers", []):
        assert all(v["name"] != variable for v in c["env"])
    # Neither the ConfigMap nor any env literal refers to the key.
    assert "llm-keys" not in json.dumps(configmap)
    for c in all_containers(deployment):
        for v in c["env"]:
            assert "value" not in v or "KEY" not in v["name"] and "TOKEN" not in v["name"], v


def test_no_api_key_without_the_spec_field():
    _, deployment, _ = build_children(OWNER, make_spec())
    names = {v["name"] for c in all_containers(deployment) for v in c["env"]}
    assert not names & {"SPECULA_API_KEY", "VLLM_API_KEY"}


def test_network_policy_fences_admin_and_metrics_ports():
    policy = build_network_policy(OWNER, "specula", "specula-system", OPERATOR_LABELS,
                                  ("monitoring",))
    assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "qwen"
    open_rule, operator_rule, metrics_rule = spec["ingress"]
    # The model port: no `from`, so every client.
    assert open_rule == {"ports": [{"port": "http", "protocol": "TCP"}]}
    assert operator_rule["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "specula-system"}},
        "podSelector": {"matchLabels": OPERATOR_LABELS},
    }]
    assert {p["port"] for p in operator_rule["ports"]} == {"admin", "metrics"}
    assert metrics_rule == {
        "from": [{"namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"port": "metrics", "protocol": "TCP"}],
    }
    # No scraper namespaces: no third rule.  vLLM pods serve only `http`.
    assert len(build_network_policy(OWNER, "specula", "ns", OPERATOR_LABELS)["spec"]["ingress"]) == 2
    assert build_network_policy(OWNER, "vllm", "ns", OPERATOR_LABELS)["spec"]["ingress"] == [
        open_rule
    ]


def test_network_policy_settings_from_env():
    settings = OperatorSettings.from_env({
        "SPECULA_NETWORK_POLICY": "true",
        "SPECULA_OPERATOR_POD_LABELS": "app.kubernetes.io/name=specula,app.kubernetes.io/component=operator",
        "SPECULA_METRICS_NAMESPACES": "monitoring, obs",
    })
    assert settings.network_policy is True
    assert settings.operator_pod_labels == OPERATOR_LABELS
    assert settings.metrics_namespaces == ("monitoring", "obs")
    assert OperatorSettings.from_env({}).network_policy is False
    with pytest.raises(ValueError, match="needs SPECULA_OPERATOR_POD_LABELS"):
        OperatorSettings.from_env({"SPECULA_NETWORK_POLICY": "true"})
    with pytest.raises(ValueError, match="true or false"):
        OperatorSettings.from_env({"SPECULA_NETWORK_POLICY": "yes"})


def test_unpinned_default_images_are_listed_for_a_warning():
    pinned = "registry.example.com/vllm-openai:v1@sha256:" + "0" * 64
    settings = OperatorSettings(runtime_image="specula-runtime:0.1.0", vllm_image=pinned)
    assert settings.unpinned_images == ["specula-runtime:0.1.0"]
