"""``engine: vllm`` against the real API server: the Deployment runs ``vllm serve`` with
the ``--speculative-config`` rendered from the spec, rolls without taking a serving
pod away, and the tuner reads a pod's ``vllm:`` counters and applies a new k by
changing the pod template (a rolling update), never through an admin API.

The pod is a stand-in (``metrics_server.py --prefix vllm``) serving vLLM's metric
names and labels, with counters growing at 400 drafts/s of k=2 and conditional
acceptance 0.8 then 0.5: acceptance rate (0.8 + 0.4) / 2 = 0.6, mean acceptance
length 1 + 1.2 = 2.2.
"""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from specula.devcluster.control_plane import wait_for

from .sm_objects import (
    Children,
    condition,
    create_sm,
    delete_sm_and_wait,
    endpoint_slice_body,
    get_sm,
    patch_sm,
    sm_body,
    wait_condition,
)
from .stand_in_pod import StandInPod

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def vllm_pod(stand_in_pods) -> StandInPod:
    return stand_in_pods("vllm", k=2, alphas=(0.8, 0.5))


def _vllm_sm(name: str, **spec) -> dict:
    return sm_body(name, {"engine": "vllm", "resources": {"gpu": {"count": 0}}, **spec})


def _speculative_config(deployment) -> dict | None:
    (container,) = deployment.spec.template.spec.containers
    args = container.args
    if "--speculative-config" not in args:
        return None
    return json.loads(args[args.index("--speculative-config") + 1])


def test_deployment_runs_vllm_serve(operator, custom_objects, core_v1, apps_v1, namespace):
    name = "vllm-eagle"
    sm = create_sm(custom_objects, namespace, _vllm_sm(
        name,
        model={"uri": "pvc://weights/qwen3-8b", "tensorParallelSize": 2, "maxModelLen": 4096},
        speculator={"method": "eagle3", "model": {"uri": "hf://org/qwen3-8b-eagle3"},
                    "numSpeculativeTokens": 4, "draftTensorParallelSize": 2},
        maxNumSeqs=64,
    ))
    try:
        _, deployment, service = Children(
            core_v1, apps_v1, namespace, sm["metadata"]["uid"]
        ).wait_all()
        (container,) = deployment.spec.template.spec.containers
        assert container.command == ["vllm", "serve"]
        assert container.image.startswith("vllm/vllm-openai:v")
        args = container.args
        assert args[0] == "/models/pvc/weights/qwen3-8b"
        for flag, value in (("--served-model-name", name), ("--tensor-parallel-size", "2"),
                            ("--max-model-len", "4096"), ("--max-num-seqs", "64"),
                            ("--port", "8000")):
            assert args[args.index(flag) + 1] == value
        assert _speculative_config(deployment) == {
            "method": "eagle3", "model": "org/qwen3-8b-eagle3", "num_speculative_tokens": 4,
            "draft_tensor_parallel_size": 2,
        }
        assert deployment.spec.strategy.type == "RollingUpdate"
        assert deployment.spec.strategy.rolling_update.max_unavailable == 0
        for probe in (container.startup_probe, container.readiness_probe,
                      container.liveness_probe):
            assert (probe.http_get.path, probe.http_get.port) == ("/health", "http")
        assert [(p.name, p.container_port) for p in container.ports] == [("http", 8000)]
        assert {p.name: p.target_port for p in service.spec.ports} == {
            "http": "http", "metrics": "http",
        }
        # vLLM runs every method the API names, whatever the runtime implements.
        sm = wait_condition(custom_objects, namespace, name, "Degraded", "False")
        assert condition(sm, "Degraded")["reason"] == "AsExpected"
    finally:
        delete_sm_and_wait(custom_objects, namespace, name)


def test_api_server_rejects_what_vllm_would(custom_objects, namespace):
    cases = {
        "must be 1 or equal to model.tensorParallelSize": {
            "model": {"uri": "hf://a/b", "tensorParallelSize": 4},
            "speculator": {"method": "eagle3", "model": {"uri": "hf://a/c"},
                           "draftTensorParallelSize": 2},
        },
        "must be a multiple of it": {
            "speculator": {"method": "mtp", "numSpeculativeTokens": 3, "nPredict": 2,
                           "model": None},
        },
        "must not exceed speculator.nPredict": {
            "speculator": {"method": "mtp", "numSpeculativeTokens": 2, "nPredict": 2,
                           "model": None},
            "tuning": {"mode": "Auto", "maxSpeculativeTokens": 4},
        },
        "Unsupported value": {"engine": "sglang"},
    }
    for message, spec in cases.items():
        with pytest.raises(ApiException) as err:
            create_sm(custom_objects, namespace, _vllm_sm("bad-vllm", **spec))
        assert err.value.status == 422 and message in err.value.body, (message, err.value.body)


def test_tuning_reads_vllm_counters_and_rolls_a_new_k(
    operator, custom_objects, apps_v1, discovery_v1, namespace, vllm_pod
):
    name = "vllm-tuned"
    create_sm(custom_objects, namespace, _vllm_sm(
        name,
        speculator={"method": "draft_model", "model": {"uri": "hf://org/draft"},
                    "numSpeculativeTokens": 2},
        tuning={"mode": "Auto", "minSpeculativeTokens": 0, "maxSpeculativeTokens": 4,
                "interval": "2s", "cooldown": "0s"},
    ))
    discovery_v1.create_namespaced_endpoint_slice(namespace, endpoint_slice_body(
        name, vllm_pod.address, {"http": vllm_pod.port, "metrics": vllm_pod.port},
    ))
    try:
        def measured() -> dict | None:
            sm = get_sm(custom_objects, namespace, name)
            speculation = (sm.get("status") or {}).get("speculation") or {}
            return speculation if speculation.get("sampledDrafts") else None

        speculation = wait_for(measured, timeout=60, interval=0.5, message="vllm: counters read")
        assert speculation["acceptanceRate"] == pytest.approx(0.6, abs=0.01)
        assert speculation["meanAcceptanceLength"] == pytest.approx(2.2, abs=0.02)
        deployment = apps_v1.read_namespaced_deployment(name, namespace)
        assert _speculative_config(deployment)["num_speculative_tokens"] == 2
        template_before = deployment.spec.template.metadata.annotations

        # Raising the lower bound past the k in effect makes the tuner move k (reason
        # Bounds); the reconcile of this spec change keeps the tuner's k in the pods.
        patch_sm(custom_objects, namespace, name, {"spec": {
            "speculator": {"numSpeculativeTokens": 3}, "tuning": {"minSpeculativeTokens": 3},
        }})

        def rolled() -> object:
            d = apps_v1.read_namespaced_deployment(name, namespace)
            config = _speculative_config(d)
            return d if config and config["num_speculative_tokens"] == 3 else None

        deployment = wait_for(rolled, timeout=60, interval=0.5, message="template at k=3")
        assert deployment.spec.template.metadata.annotations != template_before
        assert deployment.spec.strategy.rolling_update.max_unavailable == 0
        sm = get_sm(custom_objects, namespace, name)
        applied = [e for e in sm["status"].get("tuningHistory") or [] if e["applied"]]
        assert (applied[-1]["from"], applied[-1]["to"], applied[-1]["reason"]) == (2, 3, "Bounds")
        assert sm["status"]["speculation"]["numSpeculativeTokens"] == 3
        tuned = condition(sm, "Tuned")
        assert tuned is not None and tuned["status"] == "True", tuned
        # vLLM has no admin API: the tuner only read /metrics (the test's own start-up
        # polled /health).
        requests = set(vllm_pod.requests())
        assert requests == {"GET /metrics", "GET /health"}, requests
    finally:
        delete_sm_and_wait(custom_objects, namespace, name)
        discovery_v1.delete_collection_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={name}"
        )


def test_unrenderable_tuned_k_is_degraded_until_the_tuner_moves_it(
    operator, custom_objects, apps_v1, discovery_v1, namespace, vllm_pod
):
    """MTP with 4 layers, tuned k 4; the spec then says the checkpoint has 3 layers, so
    k 4 (not a multiple of 3) cannot be rendered: Degraded, with vLLM's rule as the
    reason, until the tuner's next window moves k into the new bounds and rolls."""
    name = "vllm-mtp"
    create_sm(custom_objects, namespace, _vllm_sm(
        name,
        speculator={"method": "mtp", "model": None, "numSpeculativeTokens": 4, "nPredict": 4},
        tuning={"mode": "Auto", "maxSpeculativeTokens": 4, "interval": "10s", "cooldown": "0s"},
    ))
    discovery_v1.create_namespaced_endpoint_slice(namespace, endpoint_slice_body(
        name, vllm_pod.address, {"http": vllm_pod.port, "metrics": vllm_pod.port},
    ))
    try:
        wait_for(
            lambda: ((get_sm(custom_objects, namespace, name).get("status") or {})
                     .get("tuner") or {}).get("state"),
            timeout=30, interval=0.3, message="the tuner's first window",
        )
        patch_sm(custom_objects, namespace, name, {"spec": {
            "speculator": {"numSpeculativeTokens": 3, "nPredict": 3},
            "tuning": {"maxSpeculativeTokens": 3},
        }})
        sm = wait_condition(custom_objects, namespace, name, "Degraded", "True",
                            reason="InvalidEngineConfig", timeout=10)
        assert "must be divisible by n_predict=3" in condition(sm, "Degraded")["message"]

        wait_condition(custom_objects, namespace, name, "Degraded", "False", timeout=30)
        deployment = apps_v1.read_namespaced_deployment(name, namespace)
        assert _speculative_config(deployment) == {
            "method": "mtp", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1,
        }
    finally:
        delete_sm_and_wait(custom_objects, namespace, name)
        discovery_v1.delete_collection_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={name}"
        )
