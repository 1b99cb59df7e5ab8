"""kubectl-driven helpers of the end-to-end tests: objects as JSON, waits, client pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from specula.devcluster.cluster import LocalCluster
from specula.devcluster.control_plane import wait_for
from specula.devcluster.images import OPERATOR_IMAGE

CLIENT_SOURCE = (Path(__file__).parent / "client_script.py").read_text()


def get(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    """``kubectl get ARGS -o json``, parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def apply(cluster: LocalCluster, *objects: dict[str, Any]) -> None:
    """``kubectl apply -f -`` of ``objects``."""
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def ready_pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching ``selector`` that are Ready and not being deleted."""
    pods = get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return [
        p for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", []))
    ]


def pod_phase(cluster: LocalCluster, namespace: str, name: str) -> str:
    return get(cluster, "pod", name, "-n", namespace)["status"].get("phase", "")


def describe_pods(cluster: LocalCluster, namespace: str) -> str:
    """Pod states, events and the runtime containers' last log lines, for failure messages."""
    out = cluster.kubectl("get", "pods,deploy,svc,sm", "-n", namespace, "-o", "wide",
                          check=False).stdout
    out += cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp",
                           check=False).stdout[-4000:]
    for pod in get(cluster, "pods", "-n", namespace)["items"]:
        name = pod["metadata"]["name"]
        out += f"\n--- logs {name} ---\n"
        out += cluster.kubectl("logs", name, "-n", namespace, "--all-containers", "--tail=30",
                               check=False).stdout
    return out


API_KEY_SECRET = "api-key"
"""Secret (key ``key``) holding the API key of the test's resources, in their namespace."""


def start_client(cluster: LocalCluster, namespace: str, name: str, base_url: str, prompt: str,
                 max_tokens: int, loop: bool) -> None:
    """A pod of the operator image running :mod:`client_script` against ``base_url``."""
    args = ["python", "-c", CLIENT_SOURCE, base_url, prompt, str(max_tokens)]
    if loop:
        args.append("loop")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "e2e-client"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "client",
                "image": OPERATOR_IMAGE,
                "imagePullPolicy": "Never",
                "command": args,
                # The resource's API key, from its Secret where the test made one.
                "env": [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {
                    "name": API_KEY_SECRET, "key": "key", "optional": True}}}],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }
    apply(cluster, pod)
    wait_for(lambda: pod_phase(cluster, namespace, name) in ("Running", "Succeeded", "Failed"),
             timeout=60, interval=0.5, message=f"client pod {name} started")


def finish_client(cluster: LocalCluster, namespace: str, name: str,
                  timeout: float = 180) -> list[dict[str, Any]]:
    """Stop a looping client (one-shot clients stop themselves), wait for it to exit,
    and return its JSON lines; the pod is deleted."""
    if pod_phase(cluster, namespace, name) == "Running":
        cluster.kubectl("exec", name, "-n", namespace, "--", "touch", "/tmp/stop", check=False)
    wait_for(lambda: pod_phase(cluster, namespace, name) in ("Succeeded", "Failed"),
             timeout=timeout, interval=0.5, message=f"client pod {name} finished")
    logs = cluster.kubectl("logs", name, "-n", namespace).stdout
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")
    return [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
