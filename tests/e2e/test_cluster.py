"""The main job on a real node, as a user runs it: ``helm install`` the chart, ``kubectl
apply`` a SpeculativeModel of the demo target and draft served from a local
PersistentVolume, and use it through its Service; then tune, scale, roll, lose a pod,
serve ``hf://`` checkpoints downloaded from a Hub (a local stand-in reached through
``HF_ENDPOINT``, with ``huggingface_hub`` as the client), see download failures in
``Degraded``, and uninstall.

The tests run in file order and build on one another (one operator, one resource),
like the steps of a user's session; each asserts its own step.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from specula.api.render import ADMIN_PORT
from specula.devcluster.cluster import NODE_NAME, LocalCluster
from specula.devcluster.control_plane import wait_for
from specula.devcluster.helm import CHART, RELEASE, RELEASE_NAMESPACE, Helm
from specula.devcluster.host import NODE_IP
from specula.devcluster.hub import HubRepo, HubServer
from specula.devcluster.images import RUNTIME_CPU_IMAGE

from .kube import (
    API_KEY_SECRET,
    apply,
    describe_pods,
    finish_client,
    get,
    ready_pods,
    start_client,
)

# The first test also waits for the session's node: its builds (tens of minutes on a cold
# machine, when `make test-e2e` runs alone) and a multi-GB image import. Each step of a test
# is bounded by its own wait.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

NS = "e2e"
SM = "demo"
API_KEY = "e2e-api-key-0123456789"
"""The resource's API key (in Secret :data:`kube.API_KEY_SECRET`)."""
SELECTOR = f"app.kubernetes.io/instance={SM},app.kubernetes.io/component=runtime"
CLAIM = "demo-models"
PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
POD_READY_TIMEOUT = 300
"""Seconds for a runtime pod to start: python and torch import, the model loads."""


def sm_object(k: int = 2) -> dict:
    return {
        "apiVersion": "specula.dev/v1alpha1",
        "kind": "SpeculativeModel",
        "metadata": {"name": SM, "namespace": NS},
        "spec": {
            "model": {"uri": f"pvc://{CLAIM}/target", "dtype": "float32"},
            "speculator": {
                "method": "draft_model",
                "model": {"uri": f"pvc://{CLAIM}/draft"},
                "numSpeculativeTokens": k,
            },
            "replicas": 1,
            "maxNumSeqs": 8,
            "apiKeySecret": {"name": API_KEY_SECRET, "key": "key"},
            "resources": {"gpu": {"count": 0}, "memory": "2Gi"},
            "tuning": {
                "mode": "Auto",
                "minSpeculativeTokens": 1,
                "maxSpeculativeTokens": 4,
                "interval": "3s",
                "cooldown": "0s",
                "minGain": 0.01,
            },
        },
    }


def volume_objects(path: Path) -> list[dict]:
    """A local PersistentVolume on the node holding the checkpoints, and its claim."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{NS}-{CLAIM}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "local": {"path": str(path)},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{
                "key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME],
            }]}]}},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NS},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": f"{NS}-{CLAIM}",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [pv, pvc]


@pytest.fixture(scope="module")
def expected_text(demo_checkpoints: Path) -> str:
    """The target's greedy continuation of :data:`PROMPT`, by Hugging Face
    ``transformers`` on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = demo_checkpoints / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def installed(cluster: LocalCluster, helm: Helm) -> Iterator[None]:
    """The chart installed; uninstalled at the end if a test left it."""
    helm.run(
        "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        "--set", "operator.image.pullPolicy=Never",
        "--set", f"runtime.image.tag={RUNTIME_CPU_IMAGE.rsplit(':', 1)[1]}",
        "--set", "operator.settings.tuningTickSeconds=1",
        "--set", "crds.keep=false",
        "--wait", "--timeout", "3m",
        kubeconfig=cluster.kubeconfig, timeout=240,
    )
    try:
        yield
    finally:
        helm.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
                 kubeconfig=cluster.kubeconfig, check=False, timeout=180)


def service_url(cluster: LocalCluster, name: str = SM) -> str:
    svc = get(cluster, "service", name, "-n", NS)
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    return f"http://{svc['spec']['clusterIP']}:{port}"


def wait_serving(cluster: LocalCluster, replicas: int) -> list[dict]:
    """Wait until ``replicas`` runtime pods are Ready (their real probes passed) and no
    other runtime pod exists; returns them."""
    def settled():
        pods = get(cluster, "pods", "-n", NS, "-l", SELECTOR)["items"]
        ready = ready_pods(cluster, NS, SELECTOR)
        return ready if len(ready) == replicas == len(pods) else None

    return wait_for(settled, timeout=POD_READY_TIMEOUT, interval=1,
                    message=lambda: f"{replicas} ready runtime pods\n{describe_pods(cluster, NS)}")


def sm_status(cluster: LocalCluster) -> dict:
    return get(cluster, "sm", SM, "-n", NS).get("status") or {}


def test_operator_runs_under_its_service_account(cluster: LocalCluster, installed) -> None:
    pods = ready_pods(cluster, RELEASE_NAMESPACE, "app.kubernetes.io/name=specula")
    assert len(pods) == 1, describe_pods(cluster, RELEASE_NAMESPACE)
    spec = pods[0]["spec"]
    assert spec["serviceAccountName"] == RELEASE
    assert spec["containers"][0]["image"].endswith(":0.1.0")
    # The token it runs with is its ServiceAccount's: it may read SpeculativeModels...
    auth = cluster.kubectl(
        "auth", "can-i", "list", "speculativemodels.specula.dev", "--all-namespaces",
        f"--as=system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}", check=False,
    )
    assert auth.stdout.strip() == "yes"
    # ...and nothing it was not granted.
    denied = cluster.kubectl(
        "auth", "can-i", "delete", "nodes",
        f"--as=system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}", check=False,
    )
    assert denied.stdout.strip() == "no"


def test_demo_model_from_pvc_passes_its_probes(
    cluster: LocalCluster, installed, demo_checkpoints: Path
) -> None:
    cluster.kubectl("create", "namespace", NS)
    apply(cluster, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": API_KEY_SECRET, "namespace": NS},
                    "stringData": {"key": API_KEY}})
    apply(cluster, *volume_objects(demo_checkpoints))
    # The pod only after its claim is bound: a pod the scheduler sees before its claim
    # is parked as unschedulable and may wait out the scheduler's 5-minute flush.
    wait_for(
        lambda: cluster.kubectl("get", "pvc", CLAIM, "-n", NS,
                                "-o", "jsonpath={.status.phase}").stdout == "Bound",
        timeout=60, interval=1, message=f"PersistentVolumeClaim {CLAIM} Bound",
    )
    apply(cluster, sm_object())
    pods = wait_serving(cluster, 1)
    container = pods[0]["spec"]["containers"][0]
    assert container["image"] == RUNTIME_CPU_IMAGE
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert pods[0]["status"]["containerStatuses"][0]["restartCount"] == 0
    wait_for(
        lambda: any(c["type"] == "Ready" and c["status"] == "True"
                    for c in sm_status(cluster).get("conditions", [])),
        timeout=60, interval=1, message="SpeculativeModel Ready",
    )


def test_completions_through_service_equal_target_greedy(
    cluster: LocalCluster, installed, expected_text: str
) -> None:
    start_client(cluster, NS, "client-once", service_url(cluster), PROMPT, MAX_TOKENS,
                 loop=False)
    lines = finish_client(cluster, NS, "client-once")
    results = [line for line in lines if "ok" in line]
    assert results and results[-1]["ok"], lines
    assert results[-1]["text"] == expected_text
    assert expected_text, "the target produced no tokens"


def _admin_token(cluster: LocalCluster) -> str:
    secret = get(cluster, "secret", f"{SM}-admin-token", "-n", NS)
    return base64.b64decode(secret["data"]["token"]).decode()


def _http(url: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET (or a POST of ``body``) with an optional bearer."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _runtime_k(cluster: LocalCluster, pod: dict) -> int:
    # The pod's admin port, straight from the node (whose bridge network plugin does not
    # enforce the NetworkPolicy), with the resource's token.
    status, body = _http(f"http://{pod['status']['podIP']}:{ADMIN_PORT}/v1/speculative_config",
                         _admin_token(cluster))
    assert status == 200, body
    return body["num_speculative_tokens"]


def test_runtime_pod_is_hardened_and_refuses_without_credentials(
    cluster: LocalCluster, installed
) -> None:
    (pod,) = ready_pods(cluster, NS, SELECTOR)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"]:
        ctx = c["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"]["drop"] == ["ALL"]
    ip, token = pod["status"]["podIP"], _admin_token(cluster)
    admin = f"http://{ip}:{ADMIN_PORT}/v1/speculative_config"
    for credentials in (None, "wrong-token"):
        status, body = _http(admin, credentials)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    # The model port has no admin route, and the Service no admin port.
    assert _http(f"http://{ip}:8000/v1/speculative_config", token)[0] == 404
    svc = get(cluster, "service", SM, "-n", NS)
    assert ADMIN_PORT not in {p["targetPort"] for p in svc["spec"]["ports"]}
    assert "admin" not in {p["name"] for p in svc["spec"]["ports"]}
    # The API key guards the OpenAI routes, not the probes' and scrapers'.
    assert _http(f"http://{ip}:8000/v1/models")[0] == 401
    with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=10) as response:
        assert response.status == 200
    policy = get(cluster, "networkpolicy", SM, "-n", NS)
    assert {p["port"] for p in policy["spec"]["ingress"][1]["ports"]} == {"admin", "metrics"}
    # The key is nowhere in the pod spec (env literals included) or the ConfigMap.
    secret = get(cluster, "secret", API_KEY_SECRET, "-n", NS)
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert key not in json.dumps(pod["spec"])
    assert key not in json.dumps(get(cluster, "configmap", SM, "-n", NS)["data"])
    assert token not in json.dumps(get(cluster, "configmap", SM, "-n", NS)["data"])


def test_tuner_scrapes_pods_and_applies_k(cluster: LocalCluster, installed) -> None:
    start_client(cluster, NS, "client-load", service_url(cluster), PROMPT, MAX_TOKENS,
                 loop=True)
    try:
        status = wait_for(
            lambda: (s := sm_status(cluster)).get("speculation", {}).get(
                "meanAcceptanceLength") is not None and s,
            timeout=180, interval=1,
            message=lambda: f"a measured window\n{json.dumps(sm_status(cluster))[:3000]}",
        )
        k_now = status["speculation"]["numSpeculativeTokens"]
        # Moving the bounds past the k in effect makes the tuner move k (reason Bounds)
        # through the pods' admin API, without rolling them (their bound stays 4).
        if k_now < 4:
            bounds, k_spec = {"minSpeculativeTokens": k_now + 1}, max(2, k_now + 1)
        else:
            bounds, k_spec = {"maxSpeculativeTokens": k_now - 1}, min(2, k_now - 1)
        pod_before = ready_pods(cluster, NS, SELECTOR)[0]["metadata"]["name"]
        cluster.kubectl("patch", "sm", SM, "-n", NS, "--type=merge", "-p", json.dumps(
            {"spec": {"speculator": {"numSpeculativeTokens": k_spec}, "tuning": bounds}}))

        def applied():
            history = sm_status(cluster).get("tuningHistory") or []
            moved = [e for e in history if e["applied"] and e["from"] == k_now]
            return moved[-1] if moved else None

        entry = wait_for(applied, timeout=120, interval=1,
                         message=lambda: json.dumps(sm_status(cluster))[:3000])
        pods = ready_pods(cluster, NS, SELECTOR)
        assert [p["metadata"]["name"] for p in pods] == [pod_before], "the pods rolled"
        k_status = sm_status(cluster)["speculation"]["numSpeculativeTokens"]
        assert entry["to"] != k_now
        assert _runtime_k(cluster, pods[0]) == k_status
        table = cluster.kubectl("get", "sm", "-n", NS).stdout
        header, row = table.splitlines()[:2]
        for column in ("K", "ACCEPT-LEN", "READY"):
            assert column in header.split()
        values = dict(zip(header.split(), row.split(), strict=False))
        assert values["K"] == str(k_status)
        assert float(values["ACCEPT-LEN"]) >= 1.0
        assert values["READY"] == "True"
    finally:
        lines = finish_client(cluster, NS, "client-load")
    assert all(line["ok"] for line in lines if "ok" in line), lines


def test_scale_adds_a_serving_pod(cluster: LocalCluster, installed, expected_text: str) -> None:
    cluster.kubectl("scale", f"sm/{SM}", "-n", NS, "--replicas=2")
    pods = wait_serving(cluster, 2)
    key = API_KEY
    for pod in pods:
        base = f"http://{pod['status']['podIP']}:8000"
        status, models = _http(f"{base}/v1/models", key)
        assert status == 200, models
        status, body = _http(f"{base}/v1/completions", key, {
            "model": models["data"][0]["id"], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0,
        })
        assert status == 200, body
        assert body["choices"][0]["text"] == expected_text


def _assert_all_served(lines: list[dict], expected_text: str) -> None:
    results = [line for line in lines if "ok" in line]
    failed = [line for line in results if not line["ok"]]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    assert len(results) >= 3, lines
    assert {line["text"] for line in results} == {expected_text}


def test_spec_change_rolls_pods_without_a_failed_request(
    cluster: LocalCluster, installed, expected_text: str
) -> None:
    before = {p["metadata"]["name"] for p in ready_pods(cluster, NS, SELECTOR)}
    start_client(cluster, NS, "client-roll", service_url(cluster), PROMPT, MAX_TOKENS,
                 loop=True)
    try:
        cluster.kubectl("patch", "sm", SM, "-n", NS, "--type=merge", "-p", json.dumps(
            {"spec": {"env": [{"name": "E2E_ROLLOUT", "value": "1"}]}}))

        def rolled():
            pods = wait_serving(cluster, 2)
            names = {p["metadata"]["name"] for p in pods}
            return names.isdisjoint(before) and pods

        pods = wait_for(rolled, timeout=2 * POD_READY_TIMEOUT, interval=2,
                        message=lambda: describe_pods(cluster, NS))
        for pod in pods:
            env = pod["spec"]["containers"][0].get("env", [])
            assert {"name": "E2E_ROLLOUT", "value": "1"} in env
    finally:
        lines = finish_client(cluster, NS, "client-roll")
    _assert_all_served(lines, expected_text)


def test_deleted_pod_is_replaced_and_service_keeps_answering(
    cluster: LocalCluster, installed, expected_text: str
) -> None:
    victim = ready_pods(cluster, NS, SELECTOR)[0]["metadata"]["name"]
    start_client(cluster, NS, "client-kill", service_url(cluster), PROMPT, MAX_TOKENS,
                 loop=True)
    try:
        cluster.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
        pods = wait_for(
            lambda: (p := wait_serving(cluster, 2))
            and victim not in {x["metadata"]["name"] for x in p} and p,
            timeout=POD_READY_TIMEOUT, interval=2, message=lambda: describe_pods(cluster, NS),
        )
        assert len(pods) == 2
    finally:
        lines = finish_client(cluster, NS, "client-kill")
    _assert_all_served(lines, expected_text)


HUB_TOKEN = "e2e-hub-token"


@pytest.fixture(scope="module")
def hub(cluster: LocalCluster, demo_checkpoints: Path) -> Iterator[HubServer]:
    """The Hub stand-in on the node's address: a private target repository whose
    ``main`` holds no checkpoint (only revision ``e2e`` does) and a public draft."""
    empty = cluster.workdir / "hub-main"
    empty.mkdir(exist_ok=True)
    (empty / "README.md").write_text("the checkpoint is on revision e2e\n")
    server = HubServer({
        "specula/demo-target": HubRepo({"main": empty, "e2e": demo_checkpoints / "target"},
                                       token=HUB_TOKEN),
        "specula/demo-draft": HubRepo({"main": demo_checkpoints / "draft"}),
        **_broken_repos(cluster.workdir / "hub-broken", demo_checkpoints),
    }, host=NODE_IP).start()
    yield server
    server.stop()


def _broken_repos(root: Path, demo: Path) -> dict[str, HubRepo]:
    """Checkpoints that download fine but that only the runtime can refuse: a draft
    whose vocabulary differs from the target's, a target of an unknown architecture,
    and a target without its weights."""
    import shutil

    def edited(name: str, source: Path, edit) -> HubRepo:
        path = root / name
        shutil.copytree(source, path, dirs_exist_ok=True)
        config = json.loads((path / "config.json").read_text())
        edit(path, config)
        (path / "config.json").write_text(json.dumps(config))
        return HubRepo({"main": path})

    def drop_weights(path: Path, _config: dict) -> None:
        for weights in path.glob("*.safetensors"):
            weights.unlink()

    def other_vocab(path: Path, config: dict) -> None:
        # A draft of another tokenizer: 64 more ids, in its config and its weights.
        from safetensors.torch import load_file, save_file

        config["vocab_size"] += 64
        for file in path.glob("*.safetensors"):
            tensors = load_file(file)
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in tensors:
                    t = tensors[name]
                    tensors[name] = t.new_zeros(config["vocab_size"], t.shape[1])
                    tensors[name][: t.shape[0]] = t
            save_file(tensors, file, metadata={"format": "pt"})

    return {
        "specula/draft-other-vocab": edited("draft-other-vocab", demo / "draft", other_vocab),
        "specula/unknown-architecture": edited(
            "unknown-architecture", demo / "target",
            lambda _p, c: c.update(architectures=["NoSuchModelForCausalLM"])),
        "specula/no-weights": edited("no-weights", demo / "target", drop_weights),
    }


def hf_sm(name: str, hub: HubServer, target: str = "hf://specula/demo-target",
          secret: str = "hf-token", cache: dict | None = None) -> dict:
    body = sm_object()
    body["metadata"]["name"] = name
    spec = body["spec"]
    spec["model"] = {"uri": target, "revision": "e2e", "dtype": "float32"}
    spec["speculator"]["model"] = {"uri": "hf://specula/demo-draft"}
    spec["tuning"] = {"mode": "Off"}
    spec["env"] = [{"name": "HF_ENDPOINT", "value": hub.url}]
    spec["hfTokenSecret"] = {"name": secret}
    if cache is not None:
        spec["modelCache"] = cache
    return body


def _secret(name: str, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
            "stringData": {"token": token}}


def _cache_volume(name: str, path: Path) -> list[dict]:
    pv, pvc = volume_objects(path)
    pv["metadata"]["name"] = f"{NS}-{name}"
    pv["spec"]["accessModes"] = pvc["spec"]["accessModes"] = ["ReadWriteOnce"]
    pvc["metadata"]["name"] = name
    pvc["spec"]["volumeName"] = f"{NS}-{name}"
    return [pv, pvc]


def _file_downloads(hub: HubServer) -> int:
    return sum(1 for r in hub.requests if r.startswith("GET ") and "/resolve/" in r)


def test_hf_checkpoint_downloads_into_a_shared_cache(
    cluster: LocalCluster, installed, hub: HubServer, expected_text: str
) -> None:
    cache_dir = cluster.workdir / "volumes" / "hf-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_dir.chmod(0o777)
    apply(cluster, _secret("hf-token", HUB_TOKEN), *_cache_volume("hf-cache", cache_dir),
          hf_sm("demo-hf", hub, cache={"claimName": "hf-cache"}))
    selector = "app.kubernetes.io/instance=demo-hf"
    wait_for(lambda: len(ready_pods(cluster, NS, selector)) == 1, timeout=POD_READY_TIMEOUT,
             interval=1, message=lambda: describe_pods(cluster, NS))
    # The revision is honoured (main has no checkpoint) and the token was sent.
    assert any("/revision/e2e" in r for r in hub.requests)
    downloads = _file_downloads(hub)
    assert downloads >= 2
    start_client(cluster, NS, "client-hf", service_url(cluster, "demo-hf"), PROMPT,
                 MAX_TOKENS, loop=False)
    results = [x for x in finish_client(cluster, NS, "client-hf") if "ok" in x]
    assert results and results[-1] == {"ok": True, "text": expected_text}
    # A second replica finds the files in the claimed cache: no file is fetched again.
    cluster.kubectl("scale", "sm/demo-hf", "-n", NS, "--replicas=2")
    wait_for(lambda: len(ready_pods(cluster, NS, selector)) == 2, timeout=POD_READY_TIMEOUT,
             interval=1, message=lambda: describe_pods(cluster, NS))
    assert _file_downloads(hub) == downloads
    cluster.kubectl("delete", "sm", "demo-hf", "-n", NS, "--wait=true", "--timeout=120s")


def test_download_failures_are_reported_in_degraded(
    cluster: LocalCluster, installed, hub: HubServer
) -> None:
    tiny = cluster.workdir / "volumes" / "tiny-cache"
    tiny.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0777", "tmpfs", str(tiny)],
                   check=True)
    cases = {
        "hf-missing": (hf_sm("hf-missing", hub, target="hf://specula/no-such-model"),
                       "repository not found"),
        "hf-bad-token": (hf_sm("hf-bad-token", hub, secret="hf-wrong"),
                         "refused access with the token from HF_TOKEN (401)"),
        "hf-full-disk": (hf_sm("hf-full-disk", hub, cache={"claimName": "tiny-cache"}),
                         "no space left on device in the model cache"),
    }
    try:
        apply(cluster, _secret("hf-wrong", "not-the-token"),
              *_cache_volume("tiny-cache", tiny), *(body for body, _ in cases.values()))
        for name, (_, reason) in cases.items():
            def degraded(name=name):
                conditions = (get(cluster, "sm", name, "-n", NS).get("status") or {}).get(
                    "conditions", [])
                found = [c for c in conditions if c["type"] == "Degraded"]
                return found and found[0]["status"] == "True" and found[0]

            condition = wait_for(degraded, timeout=180, interval=1,
                                 message=lambda name=name: describe_pods(cluster, NS))
            assert condition["reason"] == "ModelDownloadFailed", condition
            assert reason in condition["message"], condition
            ready = next(c for c in get(cluster, "sm", name, "-n", NS)["status"]["conditions"]
                         if c["type"] == "Ready")
            assert ready["status"] == "False"
    finally:
        cluster.kubectl("delete", "sm", *cases, "-n", NS, "--wait=true", "--timeout=120s",
                        check=False)
        cluster.kubectl("delete", "pvc", "tiny-cache", "hf-cache", "-n", NS, "--wait=true",
                        "--timeout=60s", check=False)
        cluster.kubectl("delete", "pv", f"{NS}-tiny-cache", f"{NS}-hf-cache", "--wait=true",
                        "--timeout=60s", check=False)
        subprocess.run(["umount", str(tiny)], check=False)


def test_checkpoints_the_runtime_refuses_are_reported_in_degraded(
    cluster: LocalCluster, installed, hub: HubServer
) -> None:
    """What only the runtime can know (the draft's vocabulary, the architecture, the
    weights present) reaches ``Degraded`` with the runtime's own message: it exits at
    load and the operator reads the container's termination message."""
    cases = {
        "bad-vocab": ({"draft": "hf://specula/draft-other-vocab"},
                      "draft model vocab_size 2112 != target vocab_size 2048"),
        "bad-arch": ({"target": "hf://specula/unknown-architecture"},
                     "architecture 'NoSuchModelForCausalLM' is not supported"),
        "no-weights": ({"target": "hf://specula/no-weights"}, "no *.safetensors files"),
    }
    bodies = []
    for name, (uris, _) in cases.items():
        body = hf_sm(name, hub, target=uris.get("target", "hf://specula/demo-target"))
        if "draft" in uris:
            body["spec"]["speculator"]["model"] = {"uri": uris["draft"]}
        if "target" in uris:
            body["spec"]["model"].pop("revision")
        bodies.append(body)
    try:
        apply(cluster, *bodies)
        for name, (_, text) in cases.items():
            def degraded(name=name, text=text):
                conditions = (get(cluster, "sm", name, "-n", NS).get("status") or {}).get(
                    "conditions", [])
                found = [c for c in conditions if c["type"] == "Degraded"]
                return found and found[0]["status"] == "True" and text in found[0][
                    "message"] and found[0]

            condition = wait_for(degraded, timeout=300, interval=2,
                                 message=lambda name=name: describe_pods(cluster, NS))
            assert condition["reason"] in ("ContainerFailed", "ContainerRestarting"), condition
    finally:
        cluster.kubectl("delete", "sm", *cases, "-n", NS, "--wait=true", "--timeout=120s",
                        check=False)


def test_delete_and_uninstall_leave_nothing(
    cluster: LocalCluster, helm: Helm, installed
) -> None:
    cluster.kubectl("delete", "sm", SM, "-n", NS, "--wait=true", "--timeout=120s")
    wait_for(
        lambda: not get(cluster, "deploy,svc,cm,pods", "-n", NS,
                        "-l", f"app.kubernetes.io/instance={SM}")["items"],
        timeout=120, interval=1, message=lambda: describe_pods(cluster, NS),
    )
    helm.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
             kubeconfig=cluster.kubeconfig, timeout=180)

    def release_objects() -> list[str]:
        return [f"{o['kind']}/{o['metadata']['name']}" for o in get(
            cluster, "all,cm,sa,role,rolebinding", "-A",
            "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]]

    # The Deployment is gone when uninstall returns; its pod is deleted by the garbage
    # collector and may still be in its termination grace period.
    wait_for(lambda: not release_objects(), timeout=90, interval=1,
             message=lambda: f"left behind: {release_objects()}")
    cluster_scoped = get(cluster, "clusterrole,clusterrolebinding",
                         "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    assert not cluster_scoped
    crds = cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "speculativemodels.specula.dev" not in crds
    cluster.kubectl("delete", "namespace", NS, RELEASE_NAMESPACE, "--wait=true",
                    "--timeout=120s")
    cluster.kubectl("delete", "pv", f"{NS}-{CLAIM}", "--wait=true", "--timeout=60s")
    assert not get(cluster, "pods", "-A")["items"]
