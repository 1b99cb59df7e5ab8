"""The CRD's structural schema and CEL rules, enforced by a real kube-apiserver:
bad specs are refused at admission and never reach the operator."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from .sm_objects import (
    GROUP,
    PLURAL,
    VERSION,
    api_error_message,
    create_sm,
    delete_sm,
    get_sm,
    sm_body,
)

pytestmark = pytest.mark.integration


INVALID_SPECS = [
    pytest.param(
        {"speculator": {"method": "eagle3", "model": None}},
        ["spec.speculator.model: Required value"],
        id="eagle3-without-draft-model",
    ),
    pytest.param(
        {"speculator": {"numSpeculativeTokens": 0}},
        ["spec.speculator.numSpeculativeTokens: Invalid value: 0"],
        id="num-speculative-tokens-0",
    ),
    pytest.param(
        {"speculator": {"numSpeculativeTokens": 17}},
        ["spec.speculator.numSpeculativeTokens: Invalid value: 17"],
        id="num-speculative-tokens-17",
    ),
    pytest.param(
        {"model": {"tensorParallelSize": 2}, "speculator": {"draftTensorParallelSize": 3}},
        ["spec.speculator.draftTensorParallelSize: Invalid value", "model.tensorParallelSize"],
        id="draft-tp-3-with-target-tp-2",
    ),
    pytest.param(
        {"model": {"dtype": "int3"}},
        ['spec.model.dtype: Unsupported value: "int3"'],
        id="unknown-dtype",
    ),
    pytest.param(
        {"speculator": {"method": "medusa7"}},
        ['spec.speculator.method: Unsupported value: "medusa7"'],
        id="unknown-method",
    ),
    pytest.param(
        {"model": {"uri": "s3://bucket/model"}},
        ['spec.model.uri: Invalid value: "s3://bucket/model"'],
        id="bad-uri-scheme",
    ),
    pytest.param(
        {"speculator": {"model": {"uri": "http://example.com/draft"}}},
        ['spec.speculator.model.uri: Invalid value: "http://example.com/draft"'],
        id="bad-draft-uri-scheme",
    ),
    pytest.param(
        {"tuning": {"perBatchSize": True}},
        ["spec.tuning.perBatchSize: Forbidden", "applies to tuning.mode Auto only"],
        id="per-batch-size-in-default-recommend-mode",
    ),
    pytest.param(
        {"tuning": {"mode": "Off", "perBatchSize": True}},
        ["spec.tuning.perBatchSize: Forbidden", "applies to tuning.mode Auto only"],
        id="per-batch-size-with-tuning-off",
    ),
    # Wrong types.
    pytest.param(
        {"replicas": "two"},
        ["spec.replicas: Invalid value", "must be of type integer"],
        id="replicas-string",
    ),
    pytest.param(
        {"speculator": {"numSpeculativeTokens": "3"}},
        ["spec.speculator.numSpeculativeTokens: Invalid value", "must be of type integer"],
        id="num-speculative-tokens-string",
    ),
    pytest.param(
        {"nodeSelector": {"gpu": 1}},
        ["spec.nodeSelector.gpu: Invalid value", "must be of type string"],
        id="node-selector-value-int",
    ),
    pytest.param(
        {"resources": {"gpu": {"count": "one"}}},
        ["spec.resources.gpu.count: Invalid value", "must be of type integer"],
        id="gpu-count-string",
    ),
    # Out-of-range numbers.
    pytest.param({"replicas": -1}, ["spec.replicas: Invalid value: -1"], id="replicas-negative"),
    pytest.param(
        {"model": {"maxModelLen": 8}}, ["spec.model.maxModelLen: Invalid value: 8"],
        id="max-model-len-8",
    ),
    pytest.param(
        {"model": {"tensorParallelSize": 0}}, ["spec.model.tensorParallelSize: Invalid value: 0"],
        id="tensor-parallel-size-0",
    ),
    pytest.param(
        {"resources": {"gpu": {"count": 9}}}, ["spec.resources.gpu.count: Invalid value: 9"],
        id="gpu-count-9",
    ),
    pytest.param({"maxNumSeqs": 0}, ["spec.maxNumSeqs: Invalid value: 0"], id="max-num-seqs-0"),
    pytest.param(
        {"speculator": {"method": "ngram", "model": None, "promptLookupMin": 0}},
        ["spec.speculator.promptLookupMin: Invalid value: 0"],
        id="prompt-lookup-min-0",
    ),
    # Unsupported values.
    pytest.param({"engine": "sglang"}, ['spec.engine: Unsupported value: "sglang"'], id="engine"),
    pytest.param(
        {"speculator": {"draftSampleMethod": "random"}},
        ['spec.speculator.draftSampleMethod: Unsupported value: "random"'],
        id="draft-sample-method",
    ),
    pytest.param(
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Maybe"}]},
        ['spec.tolerations[0].operator: Unsupported value: "Maybe"'],
        id="toleration-operator",
    ),
    # Required fields and empty strings.
    pytest.param({"model": None}, ["spec.model: Required value"], id="no-target-model"),
    pytest.param({"speculator": None}, ["spec.speculator: Required value"], id="no-speculator"),
    pytest.param({"model": {"uri": ""}}, ['spec.model.uri: Invalid value: ""'], id="empty-uri"),
    pytest.param(
        {"env": [{"name": "", "value": "1"}]}, ["spec.env[0].name: Invalid value: \"\""],
        id="env-empty-name",
    ),
    # Fields that contradict each other.
    pytest.param(
        {"model": {"tensorParallelSize": 4}, "resources": {"gpu": {"count": 2}}},
        ["spec.resources.gpu.count: Invalid value",
         "resources.gpu.count must be 0 (no GPU limit) or at least "
         "model.tensorParallelSize"],
        id="gpu-count-below-tensor-parallel-size",
    ),
    pytest.param(
        {"model": {"tensorParallelSize": 2},
         "resources": {"gpu": {"count": 1, "resourceName": "amd.com/gpu"}}},
        ["spec.resources.gpu.count: Invalid value",
         "resources.gpu.count must be 0 (no GPU limit) or at least "
         "model.tensorParallelSize"],
        id="one-gpu-with-tensor-parallel-size-2",
    ),
    pytest.param(
        {"speculator": {"method": "ngram", "model": None,
                        "promptLookupMin": 5, "promptLookupMax": 2}},
        ["spec.speculator.promptLookupMin: Invalid value",
         "speculator.promptLookupMin must not exceed speculator.promptLookupMax"],
        id="prompt-lookup-min-above-max",
    ),
    pytest.param(
        {"speculator": {"nPredict": 1}},
        ["spec.speculator.nPredict: Forbidden", "applies to methods mtp and gemma4_mtp only"],
        id="n-predict-with-draft-model",
    ),
    pytest.param(
        {"speculator": {"method": "mtp", "model": None, "nPredict": 4,
                        "numSpeculativeTokens": 6}},
        ["spec.speculator.numSpeculativeTokens: Invalid value",
         "above speculator.nPredict must be a multiple of it"],
        id="k-not-a-multiple-of-n-predict",
    ),
    pytest.param(
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        ['spec.env[1]: Duplicate value: {"name":"A"}'],
        id="env-duplicate-name",
    ),
    pytest.param(
        {"env": [{"name": "HF_TOKEN", "value": "x",
                  "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
        ["spec.env[0].valueFrom: Invalid value",
         "env[].value and env[].valueFrom are exclusive"],
        id="env-value-and-value-from",
    ),
    pytest.param(
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "h100"}]},
        ["spec.tolerations[0].value: Invalid value",
         "tolerations[].value must be empty when operator is Exists"],
        id="toleration-exists-with-value",
    ),
    # Bad quantities.
    pytest.param(
        {"resources": {"cpu": "lots"}}, ['spec.resources.cpu: Invalid value: "lots"'],
        id="cpu-not-a-quantity",
    ),
    pytest.param(
        {"resources": {"memory": "64GB"}}, ['spec.resources.memory: Invalid value: "64GB"'],
        id="memory-unit-gb",
    ),
    pytest.param(
        {"resources": {"cpu": -2}},
        ["spec.resources.cpu: Invalid value", "must be a non-negative quantity"],
        id="cpu-negative",
    ),
    # Bad secret references and names.
    pytest.param(
        {"apiKeySecret": {"key": "token"}}, ["spec.apiKeySecret.name: Required value"],
        id="api-key-secret-without-name",
    ),
    pytest.param(
        {"apiKeySecret": {"name": "My_Secret"}},
        ['spec.apiKeySecret.name: Invalid value: "My_Secret"'],
        id="api-key-secret-name-not-dns",
    ),
    pytest.param(
        {"apiKeySecret": {"name": "keys", "key": "api/key"}},
        ['spec.apiKeySecret.key: Invalid value: "api/key"'],
        id="api-key-secret-key-with-slash",
    ),
    pytest.param(
        {"hfTokenSecret": {"name": "hf"}},
        ["spec: Forbidden", "modelCache and hfTokenSecret apply to hf:// checkpoints only"],
        id="hf-token-secret-without-hf-uri",
    ),
    pytest.param(
        {"model": {"uri": "hf://Qwen/Qwen3-8B"},
         "modelCache": {"claimName": "hf-cache", "sizeLimit": "40Gi"}},
        ["spec.modelCache.sizeLimit: Forbidden", "applies to the default emptyDir only"],
        id="model-cache-claim-and-size-limit",
    ),
    pytest.param(
        {"serviceAccountName": "Runtime SA"},
        ['spec.serviceAccountName: Invalid value: "Runtime SA"'],
        id="service-account-name-not-dns",
    ),
]


UNKNOWN_FIELDS = [
    pytest.param(
        {"speculator": {"numSpeculativeToken": 4}},
        ['unknown field "spec.speculator.numSpeculativeToken"'],
        id="unknown-field-typo",
    ),
    pytest.param({"gpus": 2}, ['unknown field "spec.gpus"'], id="unknown-top-level-field"),
    pytest.param(
        {"tolerations": {"key": "nvidia.com/gpu"}},
        ['unknown field "spec.tolerations.key"'],
        id="tolerations-not-a-list",
    ),
]
"""Refused with 400 (``strict decoding error``) before the schema is checked: the schema
is closed, and ``kubectl`` asks for strict field validation by default."""


def _create_strict(custom_objects, namespace: str, body: dict) -> dict:
    """Create as ``kubectl apply`` and ``kubectl create`` do: with strict field
    validation, so that an unknown field is refused rather than pruned."""
    return custom_objects.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict"
    )


@pytest.mark.parametrize(("spec_overrides", "expected"), INVALID_SPECS)
def test_invalid_spec_is_rejected(
    control_plane, custom_objects, namespace, spec_overrides, expected
):
    """422 from admission, naming the offending field (``expected``: message fragments)."""
    _assert_refused(custom_objects, namespace, spec_overrides, 422, expected)


@pytest.mark.parametrize(("spec_overrides", "expected"), UNKNOWN_FIELDS)
def test_unknown_field_is_rejected(
    control_plane, custom_objects, namespace, spec_overrides, expected
):
    """400 from strict decoding, naming the unknown field."""
    _assert_refused(custom_objects, namespace, spec_overrides, 400, expected)


def _assert_refused(custom_objects, namespace, spec_overrides, status, expected) -> None:
    name = "invalid"
    with pytest.raises(ApiException) as excinfo:
        _create_strict(custom_objects, namespace, sm_body(name, spec_overrides))
    assert excinfo.value.status == status, excinfo.value.body
    message = api_error_message(excinfo.value)
    for fragment in expected:
        assert fragment in message, message
    with pytest.raises(ApiException) as missing:
        get_sm(custom_objects, namespace, name)
    assert missing.value.status == 404


def test_per_batch_size_is_accepted_in_auto_mode(control_plane, custom_objects, namespace):
    name = "per-batch-size"
    created = create_sm(custom_objects, namespace, sm_body(
        name, {"tuning": {"mode": "Auto", "perBatchSize": True}}
    ))
    try:
        assert created["spec"]["tuning"]["perBatchSize"] is True
    finally:
        delete_sm(custom_objects, namespace, name)
    # Another name: an operator started by an earlier test may hold the first one's
    # deletion on its finalizer.
    defaulted = create_sm(
        custom_objects, namespace, sm_body(f"{name}-default", {"tuning": {"mode": "Auto"}})
    )
    try:
        assert defaulted["spec"]["tuning"]["perBatchSize"] is False
    finally:
        delete_sm(custom_objects, namespace, f"{name}-default")


@pytest.mark.parametrize("k", [1, 16])
def test_bounds_of_num_speculative_tokens_are_accepted(control_plane, custom_objects, namespace, k):
    name = f"k-bound-{k}"
    created = create_sm(
        custom_objects, namespace, sm_body(name, {"speculator": {"numSpeculativeTokens": k}})
    )
    try:
        assert created["spec"]["speculator"]["numSpeculativeTokens"] == k
    finally:
        delete_sm(custom_objects, namespace, name)


def test_defaults_are_applied_by_the_api_server(control_plane, custom_objects, namespace):
    name = "defaults"
    body = sm_body(
        name,
        {"speculator": {"numSpeculativeTokens": None}, "replicas": None, "model": {"dtype": None}},
    )
    created = create_sm(custom_objects, namespace, body)
    try:
        spec = created["spec"]
        assert spec["speculator"]["numSpeculativeTokens"] == 3
        assert spec["replicas"] == 1
        assert spec["model"]["dtype"] == "auto"
        assert spec["model"]["tensorParallelSize"] == 1
    finally:
        delete_sm(custom_objects, namespace, name)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_methods_without_a_draft_checkpoint_need_no_draft_uri(
    control_plane, custom_objects, namespace, method
):
    name = f"no-draft-{method.replace('_', '-')}"
    body = sm_body(name, {"speculator": {"method": method, "model": None}})
    created = create_sm(custom_objects, namespace, body)
    try:
        assert created["spec"]["speculator"]["method"] == method
        assert "model" not in created["spec"]["speculator"]
    finally:
        delete_sm(custom_objects, namespace, name)


@pytest.mark.parametrize(
    ("tp", "resources"),
    [
        pytest.param(2, None, id="tp-2-no-resources"),
        pytest.param(4, {"gpu": {"resourceName": "amd.com/gpu"}}, id="tp-4-gpu-without-count"),
        pytest.param(8, {"gpu": {}, "cpu": 16}, id="tp-8-empty-gpu"),
    ],
)
def test_gpu_count_may_be_omitted_with_tensor_parallelism(
    control_plane, custom_objects, namespace, tp, resources
):
    """An omitted resources.gpu.count is accepted whatever model.tensorParallelSize, and
    the API server stores no default for it (the operator asks for one GPU per shard)."""
    name = f"omitted-gpu-count-{tp}"
    body = sm_body(name, {"model": {"tensorParallelSize": tp}, "resources": None})
    if resources is not None:
        body["spec"]["resources"] = resources
    try:
        created = _create_strict(custom_objects, namespace, body)
        assert created["spec"]["model"]["tensorParallelSize"] == tp
        assert "count" not in created["spec"].get("resources", {}).get("gpu", {})
    finally:
        delete_sm(custom_objects, namespace, name)


def test_specs_beside_the_refused_ones_are_accepted(control_plane, custom_objects, namespace):
    """The neighbours of refused specs pass: as many GPUs as shards, no GPU limit with
    tensor parallelism, quantities in each form, well-formed Secret references, an
    empty value beside a valueFrom, Exists without a value."""
    name = "edges"
    body = sm_body(name, {
        "model": {"uri": "hf://Qwen/Qwen3-8B", "tensorParallelSize": 2},
        "resources": {"gpu": {"count": 2}, "cpu": "7500m", "memory": "64Gi"},
        "modelCache": {"sizeLimit": "1e11"},
        "apiKeySecret": {"name": "api-keys.v1", "key": "api_key"},
        "hfTokenSecret": {"name": "hf"},
        "serviceAccountName": "runtime",
        "env": [{"name": "HF_TOKEN", "value": "",
                 "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    })
    try:
        created = _create_strict(custom_objects, namespace, body)
        assert created["spec"]["resources"]["memory"] == "64Gi"
    finally:
        delete_sm(custom_objects, namespace, name)
    name = "edges-cpu"
    body = sm_body(name, {
        "model": {"tensorParallelSize": 2}, "resources": {"gpu": {"count": 0}, "cpu": 8},
    })
    try:
        assert _create_strict(custom_objects, namespace, body)["spec"]["resources"]["cpu"] == 8
    finally:
        delete_sm(custom_objects, namespace, name)
