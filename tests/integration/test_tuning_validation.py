"""``spec.tuning`` on a real kube-apiserver: defaults applied, CEL bounds enforced."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from .sm_objects import api_error_message, create_sm, delete_sm, sm_body

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("k", "tuning", "fragments"),
    [
        pytest.param(
            3, {"minSpeculativeTokens": 4, "maxSpeculativeTokens": 2},
            ["spec.tuning.minSpeculativeTokens", "must not exceed maxSpeculativeTokens"],
            id="min-above-max",
        ),
        pytest.param(
            5, {"maxSpeculativeTokens": 4},
            ["spec.speculator.numSpeculativeTokens", "must lie within"],
            id="k-above-max",
        ),
        pytest.param(
            2, {"minSpeculativeTokens": 3},
            ["spec.speculator.numSpeculativeTokens", "must lie within"],
            id="k-below-min",
        ),
        pytest.param(
            3, {"maxSpeculativeTokens": 17}, ["spec.tuning.maxSpeculativeTokens"],
            id="max-above-16",
        ),
        pytest.param(3, {"interval": "500ms"}, ["interval must be at least 1s"], id="interval"),
        pytest.param(3, {"cooldown": "soon"}, ["spec.tuning.cooldown"], id="cooldown-format"),
        pytest.param(3, {"mode": "Always"}, ['spec.tuning.mode: Unsupported value'], id="mode"),
    ],
)
def test_invalid_tuning_is_rejected(control_plane, custom_objects, namespace, k, tuning, fragments):
    body = sm_body("bad-tuning", {"speculator": {"numSpeculativeTokens": k}, "tuning": tuning})
    with pytest.raises(ApiException) as excinfo:
        create_sm(custom_objects, namespace, body)
    assert excinfo.value.status == 422, excinfo.value.body
    message = api_error_message(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_tuning_defaults_and_bounds_are_accepted(control_plane, custom_objects, namespace):
    name = "tuning-defaults"
    body = sm_body(name, {"speculator": {"numSpeculativeTokens": 4}, "tuning": {}})
    try:
        created = create_sm(custom_objects, namespace, body)
        assert created["spec"]["tuning"] == {
            "mode": "Recommend", "minSpeculativeTokens": 0, "interval": "30s",
            "cooldown": "2m", "minGain": 0.05, "perBatchSize": False,
        }
    finally:
        delete_sm(custom_objects, namespace, name)
    name = "tuning-edges"
    body = sm_body(name, {"speculator": {"numSpeculativeTokens": 16}, "tuning": {
        "mode": "Auto", "minSpeculativeTokens": 16, "maxSpeculativeTokens": 16,
        "interval": "1s", "cooldown": "0s", "minGain": 0,
    }})
    try:
        assert create_sm(custom_objects, namespace, body)["spec"]["tuning"]["mode"] == "Auto"
    finally:
        delete_sm(custom_objects, namespace, name)
