"""``specula demo`` on a local Kubernetes node: the main job end to end.

1. Train (first run) or load the demo target and draft (:mod:`specula.demo.train`).
2. Build the images from the Dockerfile and the node binaries
   (``python -m specula.devcluster prepare``), and bring a single-node cluster up
   (:mod:`specula.devcluster.cluster`).
3. ``helm install`` the chart: the operator runs in a pod under its ServiceAccount.
4. Apply a ``SpeculativeModel`` of the demo target with its EAGLE-3 head, served from a
   local PersistentVolume (``tuning.mode: Recommend`` while measuring).
5. Through the Service, send the demo's prompts at every k from 0 (speculation off) to
   ``MAX_K``, set through the pod's admin API and alternating round by round: tokens/s
   per k, the speedup at the demo's k over k = 0, and the greedy outputs must be
   identical at every k.
6. Switch the resource to ``tuning.mode: Auto`` and send code, then prose, then code
   prompts through the Service, printing ``kubectl get sm`` as the operator's tuner moves
   k; each phase lasts a fixed number of tuner windows, not seconds.
7. Delete the resource, ``helm uninstall``, tear the node down.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from specula.api.render import ADMIN_PORT
from specula.demo.measure import DemoClient
from specula.demo.prompts import PROMPTS
from specula.demo.tuning import PROSE_PROMPTS

NAMESPACE = "demo"
NAME = "demo"
METHOD = "eagle3"
MAX_K = 4
ROUNDS = 3
WINDOWS_PER_PHASE = 5


def _step(i: int, text: str) -> None:
    print(f"\n[{i}/7] {text}", flush=True)


def _objects(models: Path) -> list[dict]:
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": "specula-demo-models"},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "local": {"path": str(models)},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{
                "key": "kubernetes.io/hostname", "operator": "Exists"}]}]}},
        },
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "demo-models", "namespace": NAMESPACE},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "volumeName": "specula-demo-models",
                 "resources": {"requests": {"storage": "1Gi"}}},
    }
    sm = {
        "apiVersion": "specula.dev/v1alpha1", "kind": "SpeculativeModel",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "pvc://demo-models/target", "dtype": "float32"},
            "speculator": {"method": METHOD, "model": {"uri": f"pvc://demo-models/{METHOD}"},
                           "numSpeculativeTokens": MAX_K},
            "replicas": 1,
            "maxNumSeqs": 16,
            "resources": {"gpu": {"count": 0}, "memory": "2Gi"},
            "tuning": {"mode": "Recommend", "minSpeculativeTokens": 0,
                       "maxSpeculativeTokens": MAX_K, "interval": "4s", "cooldown": "0s",
                       "minGain": 0.02},
        },
    }
    return [pv, pvc, sm]


def _get(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _wait(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _ready_pods(cluster) -> list[dict]:
    pods = _get(cluster, "pods", "-n", NAMESPACE, "-l",
                f"app.kubernetes.io/instance={NAME}")["items"]
    return [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                   for c in p["status"].get("conditions", []))]


def _admin_token(cluster) -> str:
    """The resource's admin token, from the Secret the operator keeps it in."""
    secret = _get(cluster, "secret", "-n", NAMESPACE, f"{NAME}-admin-token")
    return base64.b64decode(secret["data"]["token"]).decode()


def _put_k(pods: list[dict], k: int, token: str) -> None:
    # The pods' admin port, straight from the node: the node's bridge network plugin
    # does not enforce the NetworkPolicy that keeps other pods away from it.
    for pod in pods:
        response = httpx.put(
            f"http://{pod['status']['podIP']}:{ADMIN_PORT}/v1/speculative_config",
            json={"num_speculative_tokens": k}, timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )
        response.raise_for_status()


def _measure(
    client: DemoClient, pods: list[dict], max_tokens: int, k_demo: int, token: str
) -> dict:
    """Tokens/s through the Service at k = 0..MAX_K (all prompts at once, ``ROUNDS``
    rounds, the k alternating within each round so that drifts of a shared CPU fall on
    all of them); the speedup is that of ``k_demo`` over k = 0."""
    model = client.model_name()
    client.run_batch(model, list(PROMPTS), 8)  # warm-up
    ks = range(MAX_K + 1)
    totals = {k: [0, 0.0] for k in ks}
    texts: dict[int, list[str]] = {}
    for _ in range(ROUNDS):
        for k in ks:
            _put_k(pods, k, token)
            batch = client.run_batch(model, list(PROMPTS), max_tokens)
            totals[k][0] += batch.completion_tokens
            totals[k][1] += batch.wall_s
            texts.setdefault(k, [c.text for c in batch.completions])
    rate = {k: tokens / wall for k, (tokens, wall) in totals.items()}
    _put_k(pods, MAX_K, token)
    return {"tokens_per_s": {"target_only": rate[0], "speculative": rate[k_demo]},
            "tokens_per_s_by_k": {str(k): rate[k] for k in ks},
            "speedup": rate[k_demo] / rate[0],
            "identical": all(texts[k] == texts[0] for k in ks),
            "num_speculative_tokens": k_demo}


def _tuning_phases(cluster, client: DemoClient, max_tokens: int) -> list[dict]:
    model = client.model_name()
    rows: list[dict] = []

    def decisions() -> int:
        status = _get(cluster, "sm", NAME, "-n", NAMESPACE).get("status") or {}
        return int((((status.get("tuner") or {}).get("state")) or {}).get("decisions") or 0)

    for phase, prompts in (("code", PROMPTS), ("prose", PROSE_PROMPTS), ("code", PROMPTS)):
        print(f"\nphase: {phase} prompts through the Service, "
              f"{WINDOWS_PER_PHASE} tuner windows", flush=True)
        start = decisions()
        shown: list[str] | None = None
        while decisions() < start + WINDOWS_PER_PHASE:
            client.run_batch(model, list(prompts), max_tokens)
            table = cluster.kubectl("get", "sm", "-n", NAMESPACE).stdout.rstrip().splitlines()
            # A row when K, ACCEPT-LEN, READY or REPLICAS move (not for AGE alone).
            if shown is None or table[-1].split()[:-1] != shown[-1].split()[:-1]:
                print("\n".join(table if shown is None else table[-1:]), flush=True)
                shown = table
        status = _get(cluster, "sm", NAME, "-n", NAMESPACE)["status"]
        speculation = status.get("speculation") or {}
        rows.append({"phase": phase, "k": speculation.get("numSpeculativeTokens"),
                     "mean_acceptance_length": speculation.get("meanAcceptanceLength")})
    return rows


def run_cluster_demo(args) -> int:
    """Entry point of ``specula demo`` where a node can run (see module docstring).

    Returns:
        0 on success; 1 when a step fails or greedy outputs differ; 130 on Ctrl-C.
    """
    from specula.demo.run import DEMO_NUM_SPECULATIVE_TOKENS
    from specula.demo.train import ensure_models
    from specula.demo.train_heads import ensure_heads
    from specula.devcluster.__main__ import prepare
    from specula.devcluster.cluster import LocalCluster
    from specula.devcluster.helm import CHART, RELEASE, RELEASE_NAMESPACE, Helm, find_helm
    from specula.devcluster.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE

    t0 = time.monotonic()
    max_tokens = args.max_tokens
    k_demo = args.num_speculative_tokens or DEMO_NUM_SPECULATIVE_TOKENS
    if not 1 <= k_demo <= MAX_K or max_tokens < 1:
        print(f"specula demo: --num-speculative-tokens must be in [1, {MAX_K}] and "
              "--max-tokens >= 1")
        return 2
    _step(1, "demo models (trained on first run, then cached)")
    model_dir, report, trained_now = ensure_models(retrain=args.retrain)
    heads_dir, heads_report, heads_now = ensure_heads(model_dir, retrain=args.retrain)
    print(f"models: {model_dir} ({'trained now' if trained_now else 'cached'}; "
          f"target {report['params']['target'] / 1e6:.1f}M params); EAGLE-3 head "
          f"{heads_report['params']['eagle3'] / 1e6:.2f}M params "
          f"({'trained now' if heads_now else 'cached'})")
    _step(2, "binaries and images (built on first run, then cached)")
    timings = prepare(log=print)
    workdir = Path(tempfile.mkdtemp(prefix="specula-demo-"))
    cluster = LocalCluster(workdir=workdir, log=print)
    helm = Helm(find_helm(), workdir / "helm")
    result: dict = {"timings": timings}
    try:
        _step(3, "bringing a single-node cluster up")
        cluster.up(images=(OPERATOR_IMAGE, RUNTIME_CPU_IMAGE))
        print(cluster.kubectl("get", "nodes", "-o", "wide").stdout.rstrip())

        _step(4, "helm install the chart (the operator runs in a pod)")
        helm.run("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                 "--create-namespace", "--set", "operator.image.pullPolicy=Never",
                 "--set", f"runtime.image.tag={RUNTIME_CPU_IMAGE.rsplit(':', 1)[1]}",
                 "--set", "operator.settings.tuningTickSeconds=1", "--set", "crds.keep=false",
                 "--wait", "--timeout", "3m", kubeconfig=cluster.kubeconfig, timeout=240)
        print(cluster.kubectl("get", "pods", "-n", RELEASE_NAMESPACE).stdout.rstrip())

        _step(5, "kubectl apply the demo SpeculativeModel (checkpoints on a local volume)")
        models = workdir / "models"
        shutil.copytree(model_dir / "target", models / "target")
        shutil.copytree(heads_dir / METHOD, models / METHOD)
        for path in [models, *models.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(_objects(models)))
        pods = _wait(lambda: _ready_pods(cluster), 300, "the runtime pod to pass its probes")
        print(cluster.kubectl("get", "sm", "-n", NAMESPACE).stdout.rstrip())
        svc = _get(cluster, "service", NAME, "-n", NAMESPACE)
        base_url = f"http://{svc['spec']['clusterIP']}:8000"
        client = DemoClient(base_url)

        _step(6, f"speculation off (k=0) and on (k=1..{MAX_K}) through the Service "
                 f"{base_url}, {len(PROMPTS)} concurrent prompts, {ROUNDS} rounds each")
        measured = _measure(client, pods, max_tokens, k_demo, _admin_token(cluster))
        result["measured"] = measured
        by_k = measured["tokens_per_s_by_k"]
        for k, rate in by_k.items():
            label = "target only" if k == "0" else f"EAGLE-3 k={k}"
            print(f"  {label:<13} {rate:8.1f} tokens/s  {rate / by_k['0']:.2f}x")
        print(f"  speedup at k={k_demo}: {measured['speedup']:.2f}x, greedy outputs "
              f"{'identical at every k' if measured['identical'] else 'DIFFER'}")

        _step(7, "tuning.mode Auto: the operator's tuner picks k as the prompts change")
        cluster.kubectl("patch", "sm", NAME, "-n", NAMESPACE, "--type=merge",
                        "-p", json.dumps({"spec": {"tuning": {"mode": "Auto"}}}))
        result["tuning"] = _tuning_phases(cluster, client, max_tokens)
        client.close()
        cluster.kubectl("delete", "sm", NAME, "-n", NAMESPACE, "--wait=true")
        helm.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
                 kubeconfig=cluster.kubeconfig, timeout=180)
    except KeyboardInterrupt:
        print("\nspecula demo: interrupted")
        return 130
    except (RuntimeError, TimeoutError, httpx.HTTPError, AssertionError) as exc:
        print(f"\nspecula demo: {exc}")
        print(cluster.logs_tail(20))
        return 1
    finally:
        print("\ntearing the node down")
        leftovers = cluster.down()
        print("node down; " + (f"left behind: {leftovers}" if leftovers else "nothing left behind"))
    result["wall_s"] = time.monotonic() - t0
    out = model_dir / "cluster-demo-results.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nfigures written to {out}; total {result['wall_s']:.0f}s")
    if not result["measured"]["identical"]:
        print("ERROR: greedy speculative decoding differs from the target's greedy output")
        return 1
    return 0
