"""Status computation: conditions, lastTransitionTime stability, spec problems."""

from __future__ import annotations

import typing

from specula.api import capabilities
from specula.api.models import Condition, SpeculativeModelStatus
from specula.api.runtime_config import SpeculatorMethod
from specula.operator.reconcile import controller_owner, parse_spec
from specula.operator.settings import OperatorSettings
from specula.operator.status import (
    DEGRADED,
    PROGRESSING,
    READY,
    Observation,
    Problem,
    compute_status,
    get_condition,
    set_condition,
)

T0 = "2025-01-01T00:00:00Z"
T1 = "2025-01-01T00:05:00Z"
T2 = "2025-01-01T00:10:00Z"
SELECTOR = "app.kubernetes.io/component=runtime,app.kubernetes.io/instance=m,app.kubernetes.io/name=specula"


def deployment(ready=0, replicas=0, *, generation=1, observed=None, updated=None, conditions=()):
    status = {"replicas": replicas, "readyReplicas": ready, "conditions": list(conditions)}
    if observed is not None:
        status["observedGeneration"] = observed
    if updated is not None:
        status["updatedReplicas"] = updated
    return {"metadata": {"generation": generation}, "status": status}


def observe(**kwargs):
    base = {"generation": 1, "selector": SELECTOR, "desired_replicas": 1, "num_speculative_tokens": 3}
    base.update(kwargs)
    return Observation(**base)


def conditions_of(status):
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_set_condition_keeps_transition_time_while_status_holds():
    first = set_condition([], Condition(type=READY, status="False", reason="A"), T0)
    assert first[0].last_transition_time == T0
    same = set_condition(first, Condition(type=READY, status="False", reason="B", message="m"), T1)
    assert same[0].last_transition_time == T0
    assert (same[0].reason, same[0].message) == ("B", "m")
    flipped = set_condition(same, Condition(type=READY, status="True", reason="C"), T2)
    assert flipped[0].last_transition_time == T2


def test_set_condition_keeps_other_types_and_order():
    conds = set_condition([], Condition(type=READY, status="True"), T0)
    conds = set_condition(conds, Condition(type=DEGRADED, status="False"), T0)
    conds = set_condition(conds, Condition(type=READY, status="False"), T1)
    assert [c.type for c in conds] == [READY, DEGRADED]
    assert get_condition(conds, DEGRADED).last_transition_time == T0
    assert get_condition(conds, READY).last_transition_time == T1
    assert get_condition(conds, PROGRESSING) is None


def test_new_deployment_not_ready():
    status = compute_status(observe(deployment=deployment()), None, T0)
    assert conditions_of(status) == {
        READY: ("False", "ReplicasNotReady"),
        PROGRESSING: ("True", "RollingOut"),
        DEGRADED: ("False", "AsExpected"),
    }
    assert status.observed_generation == 1
    assert (status.replicas, status.ready_replicas) == (0, 0)
    assert status.selector == SELECTOR
    assert status.speculation.num_speculative_tokens == 3
    assert all(c.observed_generation == 1 for c in status.conditions)
    assert all(c.last_transition_time == T0 for c in status.conditions)


def test_ready_follows_deployment_and_recomputing_is_stable():
    not_ready = compute_status(observe(deployment=deployment()), None, T0)
    ready = compute_status(observe(deployment=deployment(ready=1, replicas=1)), not_ready, T1)
    assert conditions_of(ready)[READY] == ("True", "ReplicasReady")
    assert conditions_of(ready)[PROGRESSING] == ("False", "RolloutComplete")
    assert get_condition(ready.conditions, READY).last_transition_time == T1
    assert get_condition(ready.conditions, DEGRADED).last_transition_time == T0
    assert ready.ready_replicas == 1 and ready.replicas == 1
    again = compute_status(observe(deployment=deployment(ready=1, replicas=1)), ready, T2)
    assert again == ready
    assert again.to_k8s() == ready.to_k8s()


def test_rollout_in_progress():
    rolling = deployment(ready=2, replicas=3, generation=2, observed=1, updated=1)
    status = compute_status(observe(desired_replicas=2, deployment=rolling), None, T0)
    assert conditions_of(status)[READY] == ("True", "ReplicasReady")
    assert conditions_of(status)[PROGRESSING] == ("True", "RollingOut")


def test_scaled_to_zero():
    status = compute_status(observe(desired_replicas=0, deployment=deployment()), None, T0)
    assert conditions_of(status)[READY] == ("False", "ScaledToZero")
    assert conditions_of(status)[PROGRESSING] == ("False", "RolloutComplete")


def test_deployment_failure_is_degraded():
    stuck = deployment(conditions=[{
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": "ReplicaSet has timed out progressing.",
    }])
    status = compute_status(observe(deployment=stuck), None, T0)
    assert conditions_of(status)[DEGRADED] == ("True", "ProgressDeadlineExceeded")


def test_problem_sets_all_conditions_and_keeps_k():
    before = compute_status(observe(deployment=deployment(ready=1, replicas=1)), None, T0)
    problem = Problem("InvalidSpec", "spec.model.uri: Field required")
    status = compute_status(
        observe(generation=2, desired_replicas=None, num_speculative_tokens=None, problem=problem),
        before,
        T1,
    )
    assert conditions_of(status) == {
        READY: ("False", "InvalidSpec"),
        PROGRESSING: ("False", "InvalidSpec"),
        DEGRADED: ("True", "InvalidSpec"),
    }
    assert get_condition(status.conditions, DEGRADED).message == problem.message
    assert status.observed_generation == 2
    assert status.speculation.num_speculative_tokens == 3


def test_parse_spec_reports_invalid_spec():
    spec, problem = parse_spec({"spec": {"model": {"uri": "s3://x"}, "speculator": {}}})
    assert spec is None
    assert problem.reason == "InvalidSpec"
    assert "spec.model.uri" in problem.message
    assert "spec.speculator.method" in problem.message


def test_every_api_method_is_implemented():
    assert set(typing.get_args(SpeculatorMethod)) == capabilities.IMPLEMENTED_METHODS


def test_parse_spec_reports_unimplemented_method(monkeypatch):
    # Every method the API names is implemented today; a later API version may name
    # methods ahead of the runtime, which this path reports.
    monkeypatch.setattr(
        capabilities, "IMPLEMENTED_METHODS", capabilities.IMPLEMENTED_METHODS - {"eagle3"}
    )
    spec, problem = parse_spec({"spec": {
        "model": {"uri": "hf://a/b"},
        "speculator": {"method": "eagle3", "model": {"uri": "hf://a/eagle3"}},
    }})
    assert spec is not None
    assert problem.reason == "MethodNotSupported"
    assert "'eagle3'" in problem.message and "draft_model" in problem.message


def test_parse_spec_reports_mtp_without_checkpoint_for_the_specula_engine():
    body = {"model": {"uri": "hf://a/b"}, "speculator": {"method": "mtp"}}
    spec, problem = parse_spec({"spec": body})
    assert spec is not None
    assert problem.reason == "DraftModelRequired"
    assert "speculator.model" in problem.message and "'mtp'" in problem.message
    # vLLM reads MTP layers from the target checkpoint; ngram needs no model at all.
    assert parse_spec({"spec": {**body, "engine": "vllm"}})[1] is None
    ngram = {"model": {"uri": "hf://a/b"}, "speculator": {"method": "ngram"}}
    assert parse_spec({"spec": ngram})[1] is None
    with_head = {**body, "speculator": {"method": "mtp", "model": {"uri": "hf://a/mtp"}}}
    assert parse_spec({"spec": with_head})[1] is None


def test_parse_spec_accepts_draft_model():
    spec, problem = parse_spec({"spec": {
        "model": {"uri": "hf://a/b"},
        "speculator": {"method": "draft_model", "model": {"uri": "hf://a/c"}},
    }})
    assert problem is None and spec.speculator.method == "draft_model"


def test_controller_owner():
    ref = {"apiVersion": "specula.dev/v1alpha1", "kind": "SpeculativeModel", "name": "m",
           "uid": "u", "controller": True}
    assert controller_owner({"metadata": {"ownerReferences": [ref]}}) == ref
    other = {**ref, "kind": "ReplicaSet", "apiVersion": "apps/v1"}
    assert controller_owner({"metadata": {"ownerReferences": [other]}}) is None
    assert controller_owner({"metadata": {}}) is None


def test_status_round_trips_through_the_wire_format():
    status = compute_status(observe(deployment=deployment(ready=1, replicas=1)), None, T0)
    assert SpeculativeModelStatus.model_validate(status.to_k8s()) == status
    wire = status.to_k8s()
    assert wire["readyReplicas"] == 1 and wire["observedGeneration"] == 1
    assert {c["type"] for c in wire["conditions"]} == {READY, PROGRESSING, DEGRADED}
    assert all("lastTransitionTime" in c for c in wire["conditions"])


def test_settings_from_env():
    assert OperatorSettings.from_env({}) == OperatorSettings()
    custom = OperatorSettings.from_env({"SPECULA_RUNTIME_IMAGE": "r:1"})
    assert custom.runtime_image == "r:1"
    assert custom.field_manager == "specula-operator"


# --- a runtime container that restarts (issue 14: the engine dies) ---------------------


def _runtime_pod(**container) -> dict:
    return {"metadata": {"name": "p"}, "status": {"containerStatuses": [
        {"name": "runtime", **container}]}}


def test_a_liveness_restart_with_a_clean_exit_is_reported_while_not_ready():
    from specula.operator.status import REASON_CONTAINER_RESTARTING, pod_failure

    pod = _runtime_pod(ready=False, restartCount=2, state={"running": {}},
                       lastState={"terminated": {"exitCode": 0, "reason": "Completed"}})
    problem = pod_failure([pod])
    assert problem is not None and problem.reason == REASON_CONTAINER_RESTARTING
    assert problem.message == (
        "pod p: container runtime is not ready (restarted 2 times); last run exited 0: Completed"
    )
    # Ready again: nothing to report.  Never restarted (first start): nothing either.
    assert pod_failure([_runtime_pod(ready=True, restartCount=2, state={"running": {}})]) is None
    assert pod_failure([_runtime_pod(ready=False, restartCount=0, state={"running": {}})]) is None


def test_crash_loop_back_off_and_failed_exits_carry_the_restarts():
    from specula.operator.status import (
        REASON_CONTAINER_FAILED,
        REASON_CONTAINER_RESTARTING,
        REASON_IMAGE_PULL_FAILED,
        pod_failure,
    )

    looping = _runtime_pod(ready=False, restartCount=5,
                           state={"waiting": {"reason": "CrashLoopBackOff"}})
    problem = pod_failure([looping])
    assert (problem.reason, problem.message) == (
        REASON_CONTAINER_RESTARTING,
        "pod p: container runtime is not ready (restarted 5 times, CrashLoopBackOff)",
    )
    failed = _runtime_pod(ready=False, restartCount=1,
                          state={"waiting": {"reason": "CrashLoopBackOff"}},
                          lastState={"terminated": {"exitCode": 1, "message": "engine died"}})
    problem = pod_failure([failed])
    assert (problem.reason, problem.message) == (
        REASON_CONTAINER_FAILED,
        "pod p: container runtime exited 1 (restarted 1 time, CrashLoopBackOff): engine died",
    )
    pulling = _runtime_pod(ready=False, restartCount=0, state={"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}})
    problem = pod_failure([pulling])
    assert problem.reason == REASON_IMAGE_PULL_FAILED
    assert problem.message == 'pod p: container runtime ImagePullBackOff: Back-off pulling image "x"'
