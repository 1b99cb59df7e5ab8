"""The SpeculativeModel pydantic models: defaults, camelCase wire format, validation,
and rendering of the runtime config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specula.api.capabilities import IMPLEMENTED_METHODS, is_method_implemented
from specula.api.models import (
    SpeculativeModel,
    SpeculativeModelSpec,
    SpeculativeModelStatus,
    parse_duration,
)
from specula.api.render import RUNTIME_PORT, render_runtime_config
from specula.api.runtime_config import RuntimeConfig


def spec_dict(**overrides):
    spec = {
        "model": {"uri": "hf://Qwen/Qwen3-8B"},
        "speculator": {"method": "draft_model", "model": {"uri": "hf://Qwen/Qwen3-0.6B"}},
    }
    spec.update(overrides)
    return spec


def test_defaults():
    spec = SpeculativeModelSpec.model_validate(spec_dict())
    assert spec.model.dtype == "auto"
    assert spec.model.tensor_parallel_size == 1
    assert spec.model.max_model_len is None
    assert spec.speculator.num_speculative_tokens == 3
    assert spec.speculator.draft_tensor_parallel_size == 1
    assert spec.replicas == 1
    assert spec.image is None
    assert spec.resources.gpu.count is None and spec.pod_gpus == 1
    assert spec.resources.gpu.resource_name == "nvidia.com/gpu"
    assert spec.resources.cpu is None and spec.resources.memory is None
    assert spec.node_selector == {} and spec.tolerations == [] and spec.env == []


def test_camel_case_round_trip():
    raw = spec_dict(
        replicas=2,
        resources={"gpu": {"count": 2, "resourceName": "amd.com/gpu"}, "cpu": 8, "memory": "64Gi"},
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        serviceAccountName="runtime",
    )
    raw["model"].update(maxModelLen=4096, tensorParallelSize=2, dtype="bfloat16")
    raw["speculator"].update(numSpeculativeTokens=5, draftTensorParallelSize=2)
    spec = SpeculativeModelSpec.model_validate(raw)
    assert spec.model.max_model_len == 4096
    assert spec.resources.gpu.resource_name == "amd.com/gpu"
    assert spec.resources.cpu == 8 and spec.resources.memory == "64Gi"
    out = spec.to_k8s()
    assert out["model"]["tensorParallelSize"] == 2
    assert out["speculator"]["draftTensorParallelSize"] == 2
    assert out["nodeSelector"] == {"gpu": "h100"}
    assert out["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    assert out["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert SpeculativeModelSpec.model_validate(out) == spec


def test_snake_case_construction():
    spec = SpeculativeModelSpec(
        model={"uri": "file:///models/t"},
        speculator={"method": "ngram", "num_speculative_tokens": 4},
    )
    assert spec.speculator.model is None
    assert spec.to_k8s()["speculator"] == {
        "method": "ngram",
        "numSpeculativeTokens": 4,
        "draftTensorParallelSize": 1,
        "draftSampleMethod": "greedy",
    }


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda s: s["speculator"].update(numSpeculativeTokens=0), "numSpeculativeTokens"),
        (lambda s: s["speculator"].update(numSpeculativeTokens=17), "numSpeculativeTokens"),
        (lambda s: s["speculator"].update(method="medusa"), "method"),
        (lambda s: s["model"].update(dtype="int4"), "dtype"),
        (lambda s: s["model"].update(uri="s3://bucket/model"), "uri"),
        (lambda s: s["model"].update(maxModelLen=8), "maxModelLen"),
        (lambda s: s["model"].update(tensorParallelSize=9), "tensorParallelSize"),
        (lambda s: s.update(replicas=-1), "replicas"),
        (lambda s: s["speculator"].pop("model"), "speculator.model.uri is required"),
        (lambda s: s["speculator"].update(draftTensorParallelSize=3), "draftTensorParallelSize"),
        (lambda s: s.update(env=[{"name": "A"}, {"name": "A"}]), "env names must be unique"),
        (lambda s: s.update(unknownField=1), "unknownField"),
        (lambda s: s.update(resources={"cpu": "lots"}), "resources.cpu"),
        (lambda s: s.update(resources={"memory": "64GB"}), "resources.memory"),
        (lambda s: s.update(resources={"cpu": -2}), "non-negative quantity"),
        (
            lambda s: (s["model"].update(tensorParallelSize=4),
                       s.update(resources={"gpu": {"count": 2}})),
            "resources.gpu.count (2) must be 0 (no GPU limit) or at least "
            "model.tensorParallelSize (4)",
        ),
        (lambda s: s.update(apiKeySecret={"name": "My_Secret"}), "apiKeySecret.name"),
        (lambda s: s.update(apiKeySecret={"name": "k", "key": "a/b"}), "apiKeySecret.key"),
        (lambda s: s.update(serviceAccountName="Runtime SA"), "serviceAccountName"),
        (
            lambda s: s.update(env=[{"name": "A", "value": "x", "valueFrom": {"fieldRef": {}}}]),
            "env[].value and env[].valueFrom are exclusive",
        ),
        (
            lambda s: s.update(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
            "tolerations[].value must be empty when operator is Exists",
        ),
    ],
)
def test_invalid_specs_are_rejected(change, fragment):
    raw = spec_dict()
    change(raw)
    with pytest.raises(ValidationError) as info:
        SpeculativeModelSpec.model_validate(raw)
    assert fragment in str(info.value)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_methods_without_draft_model(method):
    spec = SpeculativeModelSpec.model_validate(
        {"model": {"uri": "hf://a/b"}, "speculator": {"method": method}}
    )
    assert spec.speculator.model is None


@pytest.mark.parametrize(
    ("tp", "resources", "pod_gpus"),
    [
        (1, None, 1),
        (2, None, 2),
        (4, None, 4),
        (8, None, 8),
        (4, {"gpu": {"resourceName": "amd.com/gpu"}}, 4),
        (2, {"cpu": 8}, 2),
        (1, {"gpu": {"count": 2}}, 2),
        (2, {"gpu": {"count": 2}, "cpu": "7500m", "memory": "64Gi"}, 2),
        (2, {"gpu": {"count": 3}}, 3),
        (2, {"gpu": {"count": 0}}, 0),
        (1, {"gpu": {"count": 0}}, 0),
    ],
)
def test_pod_gpus_default_to_the_tensor_parallel_size(tp, resources, pod_gpus):
    """An omitted count follows model.tensorParallelSize; an explicit one is kept."""
    raw = spec_dict()
    raw["model"]["tensorParallelSize"] = tp
    if resources is not None:
        raw["resources"] = resources
    spec = SpeculativeModelSpec.model_validate(raw)
    assert spec.pod_gpus == pod_gpus
    explicit = (resources or {}).get("gpu", {}).get("count")
    assert spec.resources.gpu.count == explicit
    # An omitted count stays omitted on the wire: no stored default to pin it to 1.
    assert ("count" in spec.to_k8s()["resources"]["gpu"]) == (explicit is not None)


@pytest.mark.parametrize(("tp", "count"), [(2, 1), (4, 2), (4, 3), (8, 7)])
def test_explicit_gpu_count_below_tp_is_refused(tp, count):
    raw = spec_dict(resources={"gpu": {"count": count}})
    raw["model"]["tensorParallelSize"] = tp
    with pytest.raises(ValidationError) as info:
        SpeculativeModelSpec.model_validate(raw)
    assert (
        f"resources.gpu.count ({count}) must be 0 (no GPU limit) or at least "
        f"model.tensorParallelSize ({tp})"
    ) in str(info.value)


def test_draft_tp_equal_to_target_tp_is_accepted():
    raw = spec_dict()
    raw["model"]["tensorParallelSize"] = 4
    raw["speculator"]["draftTensorParallelSize"] = 4
    assert SpeculativeModelSpec.model_validate(raw).speculator.draft_tensor_parallel_size == 4


def test_whole_object_and_status_parse():
    obj = SpeculativeModel.model_validate({
        "apiVersion": "specula.dev/v1alpha1",
        "kind": "SpeculativeModel",
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": spec_dict(),
        "status": {
            "observedGeneration": 3,
            "readyReplicas": 1,
            "conditions": [{"type": "Ready", "status": "True", "reason": "ReplicasReady"}],
            "speculation": {"numSpeculativeTokens": 3},
        },
    })
    assert obj.status.observed_generation == 3
    assert obj.status.conditions[0].status == "True"
    assert SpeculativeModelStatus().to_k8s() == {"conditions": []}


def test_implemented_methods_in_one_place():
    assert {"draft_model", "eagle3", "mtp", "ngram"} <= IMPLEMENTED_METHODS
    assert is_method_implemented("ngram")
    assert is_method_implemented("draft_model")
    assert is_method_implemented("eagle3")
    assert is_method_implemented("mtp")
    assert not is_method_implemented("medusa")


def test_render_runtime_config():
    raw = spec_dict()
    raw["model"].update(revision="main", dtype="bfloat16", maxModelLen=2048)
    raw["speculator"].update(numSpeculativeTokens=5)
    config = render_runtime_config("qwen", SpeculativeModelSpec.model_validate(raw))
    assert isinstance(config, RuntimeConfig)
    assert config.model == "hf://Qwen/Qwen3-8B"
    assert config.served_model_name == "qwen"
    assert config.revision == "main"
    assert config.dtype == "bfloat16"
    assert config.max_model_len == 2048
    assert config.tensor_parallel_size == 1
    assert config.port == RUNTIME_PORT == 8000
    assert config.speculator.method == "draft_model"
    assert config.speculator.model == "hf://Qwen/Qwen3-0.6B"
    assert config.speculator.num_speculative_tokens == 5
    assert config.speculator.draft_tensor_parallel_size == 1
    # The runtime reads it back through the same model.
    assert RuntimeConfig.model_validate_json(config.model_dump_json()) == config


def test_render_runtime_config_without_draft_model():
    spec = SpeculativeModelSpec.model_validate(
        {"model": {"uri": "pvc://models/llama"}, "speculator": {"method": "mtp"}}
    )
    config = render_runtime_config("llama", spec)
    assert config.speculator.model is None
    assert config.model == "pvc://models/llama"


def test_tuning_defaults():
    spec = SpeculativeModelSpec.model_validate(spec_dict())
    t = spec.tuning
    assert (t.mode, t.min_speculative_tokens, t.max_speculative_tokens) == ("Recommend", 0, None)
    assert (t.interval_s, t.cooldown_s, t.min_gain) == (30.0, 120.0, 0.05)
    # Unset, the tuner's bound is the spec's k, and the pods start with it.
    assert spec.max_speculative_tokens == 3
    assert spec.pod_max_num_speculative_tokens == 3


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("2m", 120.0), ("1m30s", 90.0), ("500ms", 0.5), ("1.5h", 5400.0)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "-1s", "1d", "s", "1m 30s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("tuning", "k", "fragment"),
    [
        ({"minSpeculativeTokens": 3, "maxSpeculativeTokens": 2}, 2, "must not exceed"),
        ({"maxSpeculativeTokens": 2}, 3, "must lie within"),
        ({"minSpeculativeTokens": 4}, 3, "must lie within"),
        ({"maxSpeculativeTokens": 17}, 3, "less than or equal to 16"),
        ({"mode": "Sometimes"}, 3, "mode"),
        ({"interval": "500ms"}, 3, "at least 1s"),
        ({"interval": "soon"}, 3, "pattern"),
        ({"minGain": 1.5}, 3, "less than or equal to 1"),
    ],
)
def test_invalid_tuning_is_rejected(tuning, k, fragment):
    raw = spec_dict(tuning=tuning)
    raw["speculator"]["numSpeculativeTokens"] = k
    with pytest.raises(ValidationError, match=fragment):
        SpeculativeModelSpec.model_validate(raw)


def test_auto_mode_bounds_pods_by_the_tuning_maximum():
    raw = spec_dict(tuning={"mode": "Auto", "minSpeculativeTokens": 1, "maxSpeculativeTokens": 6})
    auto = SpeculativeModelSpec.model_validate(raw)
    assert auto.pod_max_num_speculative_tokens == 6
    rendered = render_runtime_config("m", auto).speculator
    assert (rendered.num_speculative_tokens, rendered.max_num_speculative_tokens) == (3, 6)
    raw["tuning"]["mode"] = "Recommend"
    recommend = SpeculativeModelSpec.model_validate(raw)
    assert recommend.pod_max_num_speculative_tokens == 3
    rendered = render_runtime_config("m", recommend).speculator
    assert (rendered.num_speculative_tokens, rendered.max_num_speculative_tokens) == (3, 3)
    assert render_runtime_config("m", recommend).speculator.num_speculative_tokens == 3
    assert auto.to_k8s()["tuning"] == {
        "mode": "Auto", "minSpeculativeTokens": 1, "maxSpeculativeTokens": 6,
        "interval": "30s", "cooldown": "2m", "minGain": 0.05, "perBatchSize": False,
    }


def test_per_batch_size_is_off_by_default_and_needs_auto():
    assert SpeculativeModelSpec.model_validate(spec_dict()).tuning.per_batch_size is False
    auto = SpeculativeModelSpec.model_validate(
        spec_dict(tuning={"mode": "Auto", "perBatchSize": True})
    )
    assert auto.tuning.per_batch_size is True
    assert auto.to_k8s()["tuning"]["perBatchSize"] is True
    for mode in ("Off", "Recommend"):
        with pytest.raises(ValidationError, match=r"tuning.perBatchSize applies to tuning.mode Auto"):
            SpeculativeModelSpec.model_validate(spec_dict(tuning={"mode": mode, "perBatchSize": True}))
    with pytest.raises(ValidationError, match=r"mode is Recommend"):  # the default mode
        SpeculativeModelSpec.model_validate(spec_dict(tuning={"perBatchSize": True}))
    # false is no contradiction in any mode
    SpeculativeModelSpec.model_validate(spec_dict(tuning={"mode": "Off", "perBatchSize": False}))


def test_tuning_status_round_trips():
    raw = {
        "speculation": {
            "numSpeculativeTokens": 2, "recommendedNumSpeculativeTokens": 3,
            "schedule": [[1, 8, 3], [9, 256, 2]], "acceptanceRate": 0.61,
            "meanAcceptanceLength": 2.2, "perPositionAcceptanceRate": [0.7, 0.5],
            "goodputTokensPerSecond": 812.5, "sampledDrafts": 4000,
            "lastUpdateTime": "2027-01-15T08:00:00Z",
        },
        "tuningHistory": [{"time": "2027-01-15T08:00:00Z", "from": 3, "to": 2,
                           "reason": "HigherGoodput", "predictedGain": 0.08, "applied": True,
                           "message": "k 3->2"}],
        "tuner": {"state": {"version": 1, "numSpeculativeTokens": 2},
                  "baselines": {"pod-a": {"generationTokens": 5.0}},
                  "lastScrapeTime": 1.8e9, "pendingPods": ["pod-b"]},
    }
    status = SpeculativeModelStatus.model_validate(raw)
    assert status.tuning_history[0].from_ == 3
    assert status.to_k8s() == {**raw, "conditions": []}
