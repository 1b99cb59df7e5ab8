"""The CRD's structural schema and CEL rules, enforced by a real kube-apiserver:
bad specs are refused at admission and never reach the operator."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from .sm_objects import api_error_message, create_sm, delete_sm, get_sm, sm_body

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
]


@pytest.mark.parametrize(("spec_overrides", "expected"), INVALID_SPECS)
def test_invalid_spec_is_rejected(
    control_plane, custom_objects, namespace, spec_overrides, expected
):
    """422 from admission, naming the offending field (``expected``: message fragments)."""
    name = "invalid"
    with pytest.raises(ApiException) as excinfo:
        create_sm(custom_objects, namespace, sm_body(name, spec_overrides))
    assert excinfo.value.status == 422, excinfo.value.body
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
