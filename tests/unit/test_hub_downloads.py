"""``hf://`` checkpoints for engine ``specula``: the download init container and cache
volume the operator renders, the spec's validation, ``specula download`` against a
local Hub stand-in through the real ``huggingface_hub`` client, and the failure
reasons the operator copies into ``Degraded``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from specula.api.models import SpeculativeModelSpec
from specula.devcluster.hub import HubRepo, HubServer
from specula.operator.builders import MODEL_CACHE_DIR, Owner, build_children
from specula.operator.status import (
    REASON_CONTAINER_FAILED,
    REASON_MODEL_DOWNLOAD_FAILED,
    Observation,
    Problem,
    compute_status,
    pod_failure,
)

OWNER = Owner(name="qwen", namespace="llm", uid="0b8d4c2e-1111-2222-3333-444455556666")


def spec(**overrides) -> SpeculativeModelSpec:
    raw = {
        "model": {"uri": "hf://Qwen/Qwen3-8B", "revision": "v1"},
        "speculator": {"method": "draft_model", "model": {"uri": "pvc://models/draft"}},
    }
    raw.update(overrides)
    return SpeculativeModelSpec.model_validate(raw)


def pod_spec(s: SpeculativeModelSpec) -> dict:
    _, deployment, _ = build_children(OWNER, s)
    return deployment["spec"]["template"]["spec"]


def test_hf_checkpoint_gets_a_download_init_container_and_a_shared_cache():
    pod = pod_spec(spec(hfTokenSecret={"name": "hf", "key": "hf-token"},
                        modelCache={"claimName": "hf-cache"},
                        env=[{"name": "HF_ENDPOINT", "value": "http://hub.local"}]))
    (init,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert init["name"] == "download"
    assert init["image"] == main["image"]
    assert init["command"] == ["specula", "download", "--config", "/etc/specula/runtime.json"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    token = {"name": "HF_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": "hf", "key": "hf-token"}}}
    home = {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/huggingface"}
    endpoint = {"name": "HF_ENDPOINT", "value": "http://hub.local"}
    tmp_home = {"name": "HOME", "value": "/tmp"}  # the root filesystem is read-only
    assert init["env"] == [tmp_home, home, token, endpoint]
    assert main["env"] == [tmp_home, home, token, {"name": "HF_HUB_OFFLINE", "value": "1"}, endpoint]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == "model-cache")
    main_mount = next(m for m in main["volumeMounts"] if m["name"] == "model-cache")
    assert "readOnly" not in init_mount and main_mount["readOnly"] is True
    assert init["securityContext"] == main["securityContext"]


def test_default_cache_is_an_empty_dir_with_the_size_limit():
    pod = pod_spec(spec(modelCache={"sizeLimit": "20Gi"}))
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}}
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert all(e["name"] != "HF_TOKEN" for e in pod["initContainers"][0]["env"])


def test_no_download_without_an_hf_checkpoint():
    pod = pod_spec(spec(model={"uri": "pvc://models/target"}))
    assert "initContainers" not in pod
    assert all(v["name"] != "model-cache" for v in pod["volumes"])
    # Only HOME on the writable /tmp emptyDir: no Hugging Face settings.
    assert pod["containers"][0]["env"] == [{"name": "HOME", "value": "/tmp"}]


def test_vllm_uses_the_same_cache_claim_and_token():
    pod = pod_spec(spec(engine="vllm", speculator={"method": "ngram"},
                        hfTokenSecret={"name": "hf"}, modelCache={"claimName": "hf-cache"}))
    assert "initContainers" not in pod  # vLLM downloads itself
    (main,) = pod["containers"]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in main["env"]
    assert {"name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in main["env"]


@pytest.mark.parametrize("overrides, message", [
    ({"model": {"uri": "pvc://m/t"}, "modelCache": {"sizeLimit": "1Gi"}}, "hf:// checkpoints"),
    ({"model": {"uri": "pvc://m/t"}, "hfTokenSecret": {"name": "hf"}}, "hf:// checkpoints"),
    ({"modelCache": {"claimName": "c", "sizeLimit": "1Gi"}}, "emptyDir only"),
])
def test_hub_fields_are_rejected_where_they_cannot_take_effect(overrides, message):
    with pytest.raises(ValidationError, match=message):
        spec(**overrides)


# -- specula download through huggingface_hub ------------------------------------------


@pytest.fixture()
def hub(tmp_path: Path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text('{"model_type": "llama"}')
    (good / "model.safetensors").write_bytes(os.urandom(4096))
    readme = tmp_path / "readme"
    readme.mkdir()
    (readme / "README.md").write_text("main holds no checkpoint")
    server = HubServer({
        "org/model": HubRepo({"main": readme, "v1": good}),
        "org/private": HubRepo({"main": good}, token="s3cret"),
    }).start()
    yield server
    server.stop()


def _download(tmp_path, hub, uri, revision=None, token=None, fail_writes=False):
    """``specula download`` in a process of its own, as in the init container."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"))
    if token is not None:
        env["HF_TOKEN"] = token
    argv = [sys.executable, "-m", "specula.cli", "download", "--model", uri]
    if revision:
        argv += ["--revision", revision]
    if fail_writes:
        # A cache volume that is full: every file write fails with ENOSPC.
        argv = [sys.executable, "-c", FULL_DISK, *argv[3:]]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


FULL_DISK = """
import builtins, errno, io, sys
from specula.cli import main
real_open = io.open
def full_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax") and "/hf/" in str(file):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
    return real_open(file, mode, *args, **kwargs)
builtins.open = io.open = full_open
sys.exit(main(sys.argv[1:]))
"""


def test_download_honours_the_revision(tmp_path, hub):
    proc = _download(tmp_path, hub, "hf://org/model", revision="v1")
    assert proc.returncode == 0, proc.stderr
    snapshots = list((tmp_path / "hf" / "hub" / "models--org--model" / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model.safetensors").exists()
    assert any("/revision/v1" in r for r in hub.requests)


@pytest.mark.parametrize("uri, revision, token, expected", [
    ("hf://org/missing", None, None, "repository not found"),
    ("hf://org/model", "v9", None, "revision not found"),
    ("hf://org/private", None, None, "repository not found"),
    ("hf://org/private", None, "wrong", "refused access with the token from HF_TOKEN (401)"),
])
def test_download_failures_say_why(tmp_path, hub, uri, revision, token, expected):
    proc = _download(tmp_path, hub, uri, revision, token)
    assert proc.returncode == 1
    assert expected in proc.stderr and uri in proc.stderr


def test_a_private_repository_downloads_with_its_token(tmp_path, hub):
    proc = _download(tmp_path, hub, "hf://org/private", token="s3cret")
    assert proc.returncode == 0, proc.stderr


def test_a_full_disk_is_reported_as_such(tmp_path, hub):
    proc = _download(tmp_path, hub, "hf://org/model", "v1", fail_writes=True)
    assert proc.returncode == 1
    assert "no space left on device in the model cache" in proc.stderr, proc.stderr


# -- failed containers become Degraded ------------------------------------------------


def _pod(name: str, init=None, main=None) -> dict:
    status = {}
    if init is not None:
        status["initContainerStatuses"] = [init]
    if main is not None:
        status["containerStatuses"] = [main]
    return {"metadata": {"name": name}, "status": status}


def test_failed_download_is_a_model_download_failure():
    pod = _pod("p1", init={"name": "download", "ready": False, "state": {"waiting": {
        "reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {
            "exitCode": 1, "message": "hf://org/x: repository not found"}}})
    problem = pod_failure([pod])
    assert problem == Problem(
        REASON_MODEL_DOWNLOAD_FAILED,
        "pod p1: container download exited 1: hf://org/x: repository not found",
    )


def test_crashed_runtime_is_a_container_failure_and_long_messages_are_cut():
    pod = _pod("p2", main={"name": "runtime", "ready": False, "state": {"terminated": {
        "exitCode": 137, "reason": "OOMKilled", "message": "x" * 5000}}})
    problem = pod_failure([pod])
    assert problem.reason == REASON_CONTAINER_FAILED
    assert problem.message.startswith("pod p2: container runtime exited 137: xxx")
    assert len(problem.message) == 1024 and problem.message.endswith("...")


def test_recovered_and_clean_exits_are_no_failure():
    recovered = _pod("p3", main={"name": "runtime", "ready": True, "state": {"running": {}},
                                 "lastState": {"terminated": {"exitCode": 1}}})
    clean = _pod("p4", init={"name": "download", "ready": False,
                             "state": {"terminated": {"exitCode": 0}}})
    deleting = _pod("p5", main={"name": "runtime", "state": {"terminated": {"exitCode": 2}}})
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_failure([recovered, clean, deleting]) is None


def _degraded(ready: int, desired: int) -> dict:
    deployment = {"metadata": {"generation": 1},
                  "status": {"observedGeneration": 1, "replicas": desired,
                             "readyReplicas": ready, "updatedReplicas": desired}}
    status = compute_status(
        Observation(generation=1, selector="s", desired_replicas=desired,
                    num_speculative_tokens=3, deployment=deployment,
                    pod_problem=Problem(REASON_MODEL_DOWNLOAD_FAILED, "why")),
        None, "2026-01-01T00:00:00Z",
    )
    return next(c for c in status.conditions if c.type == "Degraded").model_dump()


def test_pod_problem_is_degraded_only_while_replicas_are_missing():
    missing = _degraded(ready=0, desired=1)
    assert (missing["status"], missing["reason"], missing["message"]) == (
        "True", REASON_MODEL_DOWNLOAD_FAILED, "why")
    assert _degraded(ready=1, desired=1)["status"] == "False"
