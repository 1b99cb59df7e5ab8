"""The operator's pure tuning steps: endpoints from EndpointSlices, windows against
stored baselines, decisions turned into status, conditions and events."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specula.api.models import SpeculativeModelSpec, SpeculativeModelStatus, TuningHistoryEntry
from specula.operator import tuner
from specula.operator.status import TUNED, Observation, compute_status, get_condition
from specula.operator.tuner import Endpoint, PodReading
from specula.operator.tuning import merge_patch
from specula.tuning import QueueGauges, RuntimeMetrics, TuningState

NOW = 1_800_000_000.0
NOW_S = "2027-01-15T08:00:00Z"


def spec(mode="Auto", k=2, **tuning):
    return SpeculativeModelSpec.model_validate({
        "model": {"uri": "hf://org/target"},
        "speculator": {
            "method": "draft_model", "model": {"uri": "hf://org/draft"},
            "numSpeculativeTokens": k,
        },
        "tuning": {"mode": mode, "maxSpeculativeTokens": 4, "interval": "10s",
                   "cooldown": "0s", **tuning},
    })


def exposition(*, drafts, accepted_per_pos, k, steps, step_s, generated, batch_bucket="3-4"):
    """``/metrics`` text as the runtime exports it (counters are cumulative)."""
    per_pos = list(accepted_per_pos) + [0] * (k - len(accepted_per_pos))
    lab = 'model_name="m"'
    lines = [
        "# TYPE specula:spec_decode_num_drafts counter",
        f"specula:spec_decode_num_drafts_total{{{lab}}} {drafts}",
        "# TYPE specula:spec_decode_num_draft_tokens counter",
        f"specula:spec_decode_num_draft_tokens_total{{{lab}}} {drafts * k}",
        "# TYPE specula:spec_decode_num_accepted_tokens counter",
        f"specula:spec_decode_num_accepted_tokens_total{{{lab}}} {sum(per_pos)}",
        "# TYPE specula:spec_decode_num_accepted_tokens_per_pos counter",
        *(
            f'specula:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{j}"}} {n}'
            for j, n in enumerate(per_pos)
        ),
        "# TYPE specula:generation_tokens counter",
        f"specula:generation_tokens_total{{{lab}}} {generated}",
        "# TYPE specula:step_duration_seconds histogram",
        f'specula:step_duration_seconds_bucket{{{lab},batch_bucket="{batch_bucket}",'
        f'num_speculative_tokens="{k}",le="+Inf"}} {steps}',
        f'specula:step_duration_seconds_count{{{lab},batch_bucket="{batch_bucket}",'
        f'num_speculative_tokens="{k}"}} {steps}',
        f'specula:step_duration_seconds_sum{{{lab},batch_bucket="{batch_bucket}",'
        f'num_speculative_tokens="{k}"}} {step_s}',
    ]
    return "\n".join(lines) + "\n"


def reading(pod, k, scale=1.0, *, configured=None, rate=0.6):
    """A pod that drafted ``1000 * scale`` rounds at ``k`` with acceptance ``rate`` per
    position (conditional), 4 sequences per step."""
    drafts = int(1000 * scale)
    per_pos, alive = [], float(drafts)
    for _ in range(k):
        alive *= rate
        per_pos.append(int(alive))
    steps = drafts // 4
    text = exposition(
        drafts=drafts, accepted_per_pos=per_pos, k=k, steps=steps,
        step_s=steps * 0.02, generated=drafts + sum(per_pos),
    )
    cfg = {"num_speculative_tokens": k if configured is None else configured,
           "num_speculative_tokens_per_batch_size": None, "max_num_speculative_tokens": 4}
    return PodReading(
        Endpoint(pod, "10.0.0.1", 8000, 9090),
        metrics=RuntimeMetrics.from_prometheus_text(text),
        speculative_config=cfg,
    )


def roundtrip(status: SpeculativeModelStatus, update: tuner.StatusUpdate) -> SpeculativeModelStatus:
    """``status`` after the API server applied ``update.patch`` as a JSON merge patch."""
    raw = merge_patch(status.to_k8s(), update.patch)
    # Everything written must be JSON (the CRD's preserve-unknown-fields included).
    return SpeculativeModelStatus.model_validate(json.loads(json.dumps(raw)))


# --- endpoints ---------------------------------------------------------------------


def test_ready_endpoints_from_slices():
    slices = [
        {
            "ports": [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9090}],
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": "sm-b"}},
                {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "sm-a"}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": False},
                 "targetRef": {"name": "sm-c"}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True},
                 "targetRef": {"name": "sm-d"}},
                {"addresses": [], "conditions": {"ready": True}},
            ],
        },
        # The same pod in a second slice (slices may overlap during updates).
        {"ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.2"], "targetRef": {"name": "sm-b"}}]},
        {"ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}}]},
    ]
    eps = tuner.ready_endpoints(slices)
    assert [e.pod for e in eps] == ["fd00::5", "sm-a", "sm-b"]
    a = eps[1]
    assert a.metrics_url == "http://10.0.0.1:9090/metrics"
    # The Service has no admin port: the pod's fixed one.
    assert a.admin_url == "http://10.0.0.1:8001/v1/speculative_config"
    v6 = eps[0]
    assert v6.metrics_url == "http://[fd00::5]:8000/metrics"  # no metrics port: http's
    assert Endpoint("p", "10.0.0.9", None, None, None).admin_url is None
    named = tuner.ready_endpoints([{
        "ports": [{"name": "http", "port": 8000}, {"name": "admin", "port": 18001}],
        "endpoints": [{"addresses": ["10.0.0.3"]}],
    }])
    assert named[0].admin_url == "http://10.0.0.3:18001/v1/speculative_config"


def test_is_due():
    state = tuner.TunerStatus(last_scrape_time=NOW)
    assert tuner.is_due(None, 30, 5, NOW)
    assert not tuner.is_due(state, 30, 5, NOW + 10)
    assert tuner.is_due(state, 30, 5, NOW + 27.5)  # within half a tick
    assert tuner.is_due(state, 30, 5, NOW - 100)  # clock went back


def test_settings_follow_the_spec():
    s = tuner.tuning_settings(spec("Recommend", k=3, minSpeculativeTokens=1, minGain=0.1,
                                   interval="1m30s", cooldown="2m"))
    assert (s.mode, s.min_speculative_tokens, s.max_speculative_tokens) == ("Recommend", 1, 4)
    assert (s.interval_s, s.cooldown_s, s.min_gain) == (90.0, 120.0, 0.1)


def test_unreadable_state_starts_afresh():
    st = tuner.load_state(spec(k=3), tuner.TunerStatus(state={"version": 99}))
    assert st.num_speculative_tokens == 3 and st.decisions == 0


# --- windows and decisions -----------------------------------------------------------


def test_no_endpoints_writes_no_state():
    ev = tuner.evaluate(spec(), None, [], NOW, NOW_S)
    assert ev.decision is None and ev.problem[0] == tuner.REASON_NO_ENDPOINTS
    update = tuner.finish(ev, {}, None, 1, NOW_S)
    assert update.patch["tuner"] is None  # nothing measured, nothing to remember
    cond = get_condition(update.conditions, TUNED)
    assert (cond.status, cond.reason) == ("False", "NoEndpoints")
    assert update.events == []


def test_scrape_failure_keeps_baselines_of_unreachable_pods():
    first = tuner.evaluate(spec(), None, [reading("a", 2)], NOW, NOW_S)
    status = roundtrip(SpeculativeModelStatus(), tuner.finish(first, {}, None, 1, NOW_S))
    failed = PodReading(Endpoint("a", "10.0.0.1", 8000, 9090), error="ConnectTimeout: timed out")
    ev = tuner.evaluate(spec(), status, [failed], NOW + 10, NOW_S)
    assert ev.problem == (tuner.REASON_SCRAPE_FAILED, "a: ConnectTimeout: timed out")
    assert set(ev.tuner.baselines) == {"a"}
    assert ev.tuner.state == status.tuner.state


def test_first_window_sets_baselines_and_applies_the_spec_k_in_auto():
    # The pod started at its bound (4); the spec asks for 2.
    ev = tuner.evaluate(spec("Auto", k=2), None, [reading("a", 4, configured=4)], NOW, NOW_S)
    assert ev.decision.reason == "InsufficientData"  # no previous scrape: empty window
    assert ev.target_num_speculative_tokens == 2
    assert [e.pod for e in ev.to_apply] == ["a"]
    assert set(ev.tuner.baselines) == {"a"}
    assert ev.tuner.last_scrape_time == NOW
    update = tuner.finish(ev, {}, None, 1, NOW_S)
    cond = get_condition(update.conditions, TUNED)
    assert (cond.status, cond.reason) == ("False", "InsufficientData")
    assert update.patch["speculation"]["numSpeculativeTokens"] == 2


def _two_windows(mode, k, rate, configured=None):
    s = spec(mode, k=k, minGain=0.01)
    first = tuner.evaluate(s, None, [reading("a", k, configured=configured)], NOW, NOW_S)
    status = roundtrip(SpeculativeModelStatus(), tuner.finish(first, {}, None, 1, NOW_S))
    second = tuner.evaluate(
        s, status, [reading("a", k, scale=2.0, rate=rate, configured=configured)],
        NOW + 10, NOW_S,
    )
    return status, second


def test_window_is_the_counter_increase_since_the_baseline():
    _, ev = _two_windows("Recommend", 2, 0.6)
    d = ev.decision
    assert d.sampled_drafts == 1000  # 2000 cumulative minus the 1000 baseline
    assert d.acceptance_rate == pytest.approx((1200 - 600 + 720 - 360) / 2000)
    spec_status = ev.speculation
    assert spec_status.sampled_drafts == 1000
    assert spec_status.acceptance_rate == pytest.approx(d.acceptance_rate, abs=1e-6)
    assert spec_status.mean_acceptance_length == pytest.approx(1 + 960 / 1000, abs=1e-6)
    assert len(spec_status.per_position_acceptance_rate) == 2
    assert spec_status.last_update_time == NOW_S
    assert spec_status.schedule[0][0] == 1


def test_recommend_mode_records_without_applying():
    # Counters that make drafting deeper look worthwhile or not, the test does not
    # presume which: it checks what is recorded for whatever was decided.
    status, ev = _two_windows("Recommend", 2, 0.95)
    assert ev.target_num_speculative_tokens is None and ev.to_apply == []
    d = ev.decision
    assert not d.apply
    assert ev.speculation.num_speculative_tokens == 2  # the pods' k, unchanged
    expected = d.num_speculative_tokens if d.num_speculative_tokens is not None else 2
    assert ev.speculation.recommended_num_speculative_tokens == expected
    update = tuner.finish(ev, {}, status, 1, NOW_S)
    cond = get_condition(update.conditions, TUNED)
    if d.reason == "InsufficientData":
        assert cond.reason == "InsufficientData"
    else:
        assert (cond.status, cond.reason) == ("True", "Recommended")
        assert cond.message.startswith(d.reason)
    for entry in update.patch.get("tuningHistory") or []:
        assert entry["applied"] is False


def test_recommend_mode_takes_the_k_the_pods_report():
    # The state says 2, but the pod runs 3 (set by hand, or by an earlier Auto).
    s = spec("Recommend", k=2)
    ev = tuner.evaluate(s, None, [reading("a", 3)], NOW, NOW_S)
    assert ev.speculation.num_speculative_tokens == 3
    assert TuningState.from_dict(ev.tuner.state).num_speculative_tokens == 3


def _decision_status(reason, current, new, apply, gain=0.1):
    from specula.tuning import Decision

    state = TuningState(num_speculative_tokens=new if apply else current)
    return Decision(
        num_speculative_tokens=new, apply=apply, reason=reason, message=f"k {current}->{new}",
        current_num_speculative_tokens=current, state=state, predicted_gain=gain,
    )


def test_history_records_changes_and_keeps_the_last_ten():
    history = None
    for i in range(12):
        d = _decision_status("HigherGoodput", i % 4, (i % 4) + 1, apply=True)
        history, entry = tuner._history(history, d, f"2027-01-15T08:00:{i:02d}Z")
        assert entry is not None and entry.applied
    assert len(history) == 10
    assert history[-1].time == "2027-01-15T08:00:11Z"
    assert history[0].time == "2027-01-15T08:00:02Z"
    # Keeping k, or a repeated recommendation, adds nothing.
    keep = _decision_status("NoGain", 2, None, apply=False)
    assert tuner._history(history, keep, NOW_S) == (history, None)
    rec = _decision_status("HigherGoodput", 3, 2, apply=False)
    history, entry = tuner._history(history, rec, NOW_S)
    assert entry is not None and not entry.applied
    assert tuner._history(history, rec, NOW_S) == (history, None)
    assert history[-1].to_k8s()["from"] == 3


def _auto_evaluation(failures):
    ev = tuner.evaluate(spec("Auto", k=2), None, [reading("a", 4, configured=4),
                                                  reading("b", 2, configured=2)], NOW, NOW_S)
    assert [e.pod for e in ev.to_apply] == ["a"]
    return ev, tuner.finish(ev, failures, None, 7, NOW_S)


def test_apply_failure_is_reported_and_retried():
    ev, update = _auto_evaluation({"a": "HTTP 400 above_max: too large"})
    cond = get_condition(update.conditions, TUNED)
    assert (cond.status, cond.reason, cond.observed_generation) == ("False", "ApplyFailed", 7)
    assert "a: HTTP 400 above_max" in cond.message
    assert update.patch["tuner"]["pendingPods"] == ["a"]
    assert [(e.type, e.reason) for e in update.events] == [("Warning", "ApplyFailed")]

    status = roundtrip(SpeculativeModelStatus(), update)
    retried = tuner.after_retry(2, ["a"], {}, status, 7, NOW_S)
    cond = get_condition(retried.conditions, TUNED)
    assert (cond.status, cond.reason) == ("True", "Applied")
    # An explicit null: a merge patch that left the member out would keep ["a"].
    assert retried.patch["tuner"]["pendingPods"] is None
    assert roundtrip(status, retried).tuner.pending_pods == []
    assert [(e.type, e.reason) for e in retried.events] == [("Normal", "Applied")]


def test_applied_change_posts_an_event_and_history():
    d = _decision_status("Explore", 2, 3, apply=True)
    ev = tuner.Evaluation(
        tuner=tuner.TunerStatus(state=d.state.to_dict()),
        speculation=None, history=None, decision=d, target_num_speculative_tokens=3,
        new_history_entry=TuningHistoryEntry(
            time=NOW_S, from_=2, to=3, reason="Explore", applied=True, message="m"
        ),
    )
    update = tuner.finish(ev, {}, None, 1, NOW_S)
    cond = get_condition(update.conditions, TUNED)
    assert (cond.status, cond.reason) == ("True", "Applied")
    assert [(e.type, e.reason) for e in update.events] == [("Normal", "Explore")]
    assert update.events[0].message.startswith("k 2->3 applied")


def test_finish_keeps_other_conditions_and_transition_time():
    current = SpeculativeModelStatus.model_validate({"conditions": [
        {"type": "Ready", "status": "True", "reason": "ReplicasReady",
         "lastTransitionTime": "2027-01-01T00:00:00Z"},
    ]})
    ev = tuner.evaluate(spec(), current, [], NOW, NOW_S)
    first = tuner.finish(ev, {}, current, 1, NOW_S)
    assert [c.type for c in first.conditions] == ["Ready", "Tuned"]
    again = tuner.finish(ev, {}, roundtrip(current, first), 1, "2027-01-15T09:00:00Z")
    assert get_condition(again.conditions, TUNED).last_transition_time == NOW_S


# --- Off mode and the reconcile's view -----------------------------------------------


def test_off_mode_restores_the_spec_k_then_forgets():
    s = spec("Off", k=2)
    tuned = SpeculativeModelStatus(
        tuner=tuner.TunerStatus(state=TuningState(num_speculative_tokens=3).to_dict())
    )
    assert tuner.needs_restore(s, tuned)
    assert not tuner.needs_restore(spec("Auto"), tuned)
    failed = tuner.disabled(s, tuned, {"a": "ConnectError"}, 1, NOW_S)
    assert get_condition(failed.conditions, TUNED).reason == "ApplyFailed"
    assert failed.patch["tuner"] is not None  # retried next tick
    done = tuner.disabled(s, tuned, {}, 1, NOW_S)
    assert done.patch["tuner"] is None
    assert done.patch["speculation"]["numSpeculativeTokens"] == 2
    assert [e.reason for e in done.events] == ["Restored"]
    quiet = tuner.disabled(s, roundtrip(tuned, done), None, 1, NOW_S)
    assert get_condition(quiet.conditions, TUNED).reason == "Disabled" and quiet.events == []


@pytest.mark.parametrize(("mode", "has_state", "expected_k"), [
    ("Off", True, 2), ("Recommend", False, 2), ("Recommend", True, 3), ("Auto", True, 3),
])
def test_reconcile_keeps_the_tuners_fields(mode, has_state, expected_k):
    previous = SpeculativeModelStatus.model_validate({
        "speculation": {"numSpeculativeTokens": 3, "meanAcceptanceLength": 2.5},
        "tuningHistory": [{"time": NOW_S, "from": 2, "to": 3, "reason": "Explore",
                           "applied": True}],
        "tuner": {"state": TuningState(num_speculative_tokens=3).to_dict()} if has_state else {},
        "conditions": [{"type": "Tuned", "status": "True", "reason": "Applied"}],
    })
    status = compute_status(
        Observation(generation=1, selector="s", desired_replicas=1, num_speculative_tokens=2,
                    tuning_mode=mode),
        previous, NOW_S,
    )
    assert status.speculation.num_speculative_tokens == expected_k
    assert status.speculation.mean_acceptance_length == 2.5
    assert status.tuning_history == previous.tuning_history
    assert status.tuner == previous.tuner
    assert get_condition(status.conditions, TUNED).reason == "Applied"


def test_tuning_settings_from_env():
    from specula.operator.settings import OperatorSettings

    s = OperatorSettings.from_env({"SPECULA_TUNING_TICK_S": "1", "SPECULA_SCRAPE_TIMEOUT_S": "0.5"})
    assert (s.tuning_tick_s, s.scrape_timeout_s) == (1.0, 0.5)
    assert (OperatorSettings().tuning_tick_s, OperatorSettings().scrape_timeout_s) == (5.0, 3.0)


def test_apply_failure_warns_once_per_set_of_failing_pods():
    _, update = _auto_evaluation({"a": "ConnectError"})
    status = roundtrip(SpeculativeModelStatus(), update)
    ev = tuner.evaluate(spec("Auto", k=2), status, [reading("a", 4, configured=4)], NOW + 10, NOW_S)
    again = tuner.finish(ev, {"a": "ConnectError"}, status, 7, NOW_S)
    assert get_condition(again.conditions, TUNED).reason == "ApplyFailed"
    assert again.events == []


def test_target_config_is_the_schedule_or_the_single_k():
    single = TuningState(num_speculative_tokens=3)
    assert tuner.target_config(single) == {"num_speculative_tokens": 3}
    scheduled = TuningState(num_speculative_tokens=3, schedule=((1, 8, 4), (9, 256, 2)))
    config = tuner.target_config(scheduled)
    assert config == {"num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 256, 2]]}
    pod = reading("a", 2)
    assert pod.runs({"num_speculative_tokens": 2}) and not pod.runs(config)
    on_schedule = PodReading(pod.endpoint, pod.metrics, {
        "num_speculative_tokens": None,
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 256, 2]],
    })
    assert on_schedule.runs(config) and on_schedule.num_speculative_tokens is None
    assert not on_schedule.runs({"num_speculative_tokens": 2})


def test_unreadable_baseline_counts_as_a_new_pod():
    status = SpeculativeModelStatus(tuner=tuner.TunerStatus(baselines={"a": {"stepTimes": 7}}))
    ev = tuner.evaluate(spec("Recommend"), status, [reading("a", 2)], NOW, NOW_S)
    assert ev.decision.sampled_drafts == 0
    assert RuntimeMetrics.from_dict(ev.tuner.baselines["a"]).counters.num_drafts == 1000


def test_out_of_place_engines_get_no_pods_to_apply_to():
    """``engine: vllm``: the target k is decided, but no pod is told (a rollout is)."""
    ev = tuner.evaluate(
        spec("Auto", k=2), None, [reading("a", 4, configured=4)], NOW, NOW_S, in_place=False
    )
    assert ev.target_num_speculative_tokens == 2
    assert ev.to_apply == [] and ev.tuner.pending_pods == []


def test_window_reports_queue_and_length_of_pods_measured_throughout():
    s = spec("Recommend", k=2)
    first = tuner.evaluate(s, None, [reading("a", 2)], NOW, NOW_S)
    assert first.window_seconds is None and first.window_pods == 0
    status = roundtrip(SpeculativeModelStatus(), tuner.finish(first, {}, None, 1, NOW_S))
    queued = [
        replace(reading("a", 2, scale=2.0), queue=QueueGauges(4, 2)),
        replace(reading("b", 2, scale=2.0), queue=QueueGauges(3, 5)),  # new: no baseline
    ]
    second = tuner.evaluate(s, status, queued, NOW + 10, NOW_S)
    assert second.window_seconds == pytest.approx(10)
    assert second.window_pods == 1
    assert second.queue == QueueGauges(4, 2)
    assert second.window.counters.num_drafts == 1000


# --- per-batch-size schedules (spec.tuning.perBatchSize) ------------------------------


def on_schedule(pod: str, k: int, schedule, scale=1.0) -> PodReading:
    """A pod that drafted at ``k`` and reports running ``schedule``."""
    base = reading(pod, k, scale)
    return replace(base, speculative_config={
        "num_speculative_tokens": None,
        "num_speculative_tokens_per_batch_size": schedule,
        "max_num_speculative_tokens": 4,
    })


def test_settings_turn_schedules_on_over_the_pods_batch():
    s = tuner.tuning_settings(spec("Auto", perBatchSize=True))
    assert s.apply_schedule and s.max_batch_size == 256  # maxNumSeqs 32 is covered
    assert not tuner.tuning_settings(spec("Auto")).apply_schedule
    big = SpeculativeModelSpec.model_validate({
        **spec("Auto", perBatchSize=True).to_k8s(), "maxNumSeqs": 1024,
    })
    assert tuner.tuning_settings(big).max_batch_size == 1024


def test_per_batch_size_puts_a_schedule_and_shows_it_in_status():
    s = spec("Auto", k=2, perBatchSize=True)
    ev = tuner.evaluate(s, None, [reading("a", 4, configured=4)], NOW, NOW_S)
    # Before any decision: the spec's k as a schedule over every batch size.
    assert ev.target_config == {"num_speculative_tokens_per_batch_size": [[1, 256, 2]]}
    assert [e.pod for e in ev.to_apply] == ["a"]
    update = tuner.finish(ev, {}, None, 1, NOW_S)
    assert update.patch["speculation"]["numSpeculativeTokens"] == 2
    assert update.patch["speculation"]["numSpeculativeTokensPerBatchSize"] == [[1, 256, 2]]
    status = roundtrip(SpeculativeModelStatus(), update)
    assert status.speculation.num_speculative_tokens_per_batch_size == [[1, 256, 2]]
    assert TuningState.from_dict(status.tuner.state).schedule == ((1, 256, 2),)

    # The pod now runs it; the next decision (whatever it is) is a schedule too, sent
    # only if it differs from the one the pod runs.
    second = tuner.evaluate(s, status, [on_schedule("a", 2, [[1, 256, 2]], 2.0)], NOW + 10, NOW_S)
    target = second.target_config["num_speculative_tokens_per_batch_size"]
    assert (second.to_apply == []) == (target == [[1, 256, 2]])
    # This window (batch 4) explores k=4 on its batch sizes; larger batches get the
    # k the model prefers there, which falls with the batch size.
    assert second.decision.reason == "Explore"
    assert target[0][:1] + target[0][2:] == [1, 4] and target[-1][1] == 256
    assert all(a[1] + 1 == b[0] and a[2] > b[2] for a, b in zip(target[:-1], target[1:], strict=True))
    assert second.speculation.num_speculative_tokens_per_batch_size == (
        second.target_config["num_speculative_tokens_per_batch_size"]
    )


def test_failing_pods_are_told_the_schedule_they_refused():
    s = spec("Auto", k=2, perBatchSize=True)
    ev = tuner.evaluate(s, None, [reading("a", 2)], NOW, NOW_S)
    update = tuner.finish(ev, {"a": "HTTP 400"}, None, 1, NOW_S)
    cond = get_condition(update.conditions, TUNED)
    assert cond.reason == "ApplyFailed"
    assert "did not accept schedule [[1, 256, 2]]" in cond.message
    status = roundtrip(SpeculativeModelStatus(), update)
    retried = tuner.after_retry("schedule [[1, 256, 2]]", ["a"], {}, status, 1, NOW_S)
    assert get_condition(retried.conditions, TUNED).message.startswith(
        "schedule [[1, 256, 2]] applied to a"
    )


def test_turning_per_batch_size_off_puts_one_k_back():
    scheduled = TuningState(
        num_speculative_tokens=3, schedule=((1, 8, 3), (9, 32, 1)),
        previous_num_speculative_tokens=2, previous_schedule=((1, 256, 2),),
        pending_verification=True,
    )
    status = SpeculativeModelStatus(
        tuner=tuner.TunerStatus(state=scheduled.to_dict()),
        speculation={"numSpeculativeTokens": 3,
                     "numSpeculativeTokensPerBatchSize": [[1, 8, 3], [9, 32, 1]]},
    )
    state = tuner.load_state(spec("Auto", k=2), status.tuner)
    assert (state.schedule, state.previous_schedule, state.pending_verification) == (
        None, None, False
    )
    ev = tuner.evaluate(
        spec("Auto", k=2), status, [on_schedule("a", 3, [[1, 8, 3], [9, 32, 1]])], NOW, NOW_S
    )
    assert ev.target_config == {"num_speculative_tokens": 3}
    assert [e.pod for e in ev.to_apply] == ["a"]
    update = tuner.finish(ev, {}, status, 1, NOW_S)
    # An explicit null: a merge patch would otherwise keep the old schedule.
    assert update.patch["speculation"]["numSpeculativeTokensPerBatchSize"] is None
    after = roundtrip(status, update)
    assert after.speculation.num_speculative_tokens_per_batch_size is None
    assert after.speculation.num_speculative_tokens == 3


def test_turning_per_batch_size_on_keeps_the_revert_target_in_form():
    state = TuningState(num_speculative_tokens=3, previous_num_speculative_tokens=2)
    loaded = tuner.load_state(
        spec("Auto", k=2, perBatchSize=True), tuner.TunerStatus(state=state.to_dict())
    )
    assert loaded.schedule == ((1, 256, 3),)
    assert loaded.previous_schedule == ((1, 256, 2),)
    # Recommend mode describes what the pods run; it converts nothing.
    scheduled = replace(state, schedule=((1, 8, 3), (9, 32, 1)))
    kept = tuner.load_state(spec("Recommend"), tuner.TunerStatus(state=scheduled.to_dict()))
    assert kept.schedule == ((1, 8, 3), (9, 32, 1))


def test_recommend_mode_reports_the_schedule_the_pods_run():
    ev = tuner.evaluate(spec("Recommend"), None, [on_schedule("a", 2, [[1, 4, 3], [5, 32, 2]])],
                        NOW, NOW_S)
    assert ev.speculation.num_speculative_tokens_per_batch_size == [[1, 4, 3], [5, 32, 2]]
    mixed = [on_schedule("a", 2, [[1, 256, 2]]), reading("b", 2)]
    ev = tuner.evaluate(spec("Recommend"), None, mixed, NOW, NOW_S)
    assert ev.speculation.num_speculative_tokens_per_batch_size is None


def test_off_mode_clears_the_schedule_in_status():
    status = SpeculativeModelStatus(speculation={
        "numSpeculativeTokens": 3, "numSpeculativeTokensPerBatchSize": [[1, 32, 3]],
    })
    update = tuner.disabled(spec("Off", k=2), status, {}, 1, NOW_S)
    after = roundtrip(status, update)
    assert after.speculation.num_speculative_tokens == 2
    assert after.speculation.num_speculative_tokens_per_batch_size is None


def test_the_status_patch_removes_tuner_members_that_are_gone():
    """The tuner's status is written as a JSON merge patch, which keeps every member
    it does not name: a pod that left pendingPods, a gone pod's baseline and an expired
    blacklist entry are sent as explicit nulls, so the stored status equals the new."""
    old = {"pendingPods": ["a"], "baselines": {"a": {"drafts": 1}, "b": {"drafts": 2}},
           "state": {"blacklist": {"3": 1.0}, "decisions": 4}}
    new = {"baselines": {"b": {"drafts": 3}}, "state": {"blacklist": {}, "decisions": 5}}
    patch = tuner.replacing(old, new)
    assert patch["pendingPods"] is None and patch["baselines"]["a"] is None
    assert merge_patch(old, patch) == new


def test_a_patch_that_changes_nothing_is_not_written():
    from specula.operator.tuning import _unchanged

    status = SpeculativeModelStatus.model_validate(
        {"tuner": {"lastScrapeTime": 5.0, "baselines": {"a": {"x": 1}}}}
    )
    same = {"tuner": {"lastScrapeTime": 5.0, "pendingPods": None,
                      "baselines": {"a": {"x": 1}}}}
    assert _unchanged(same, status)
    assert not _unchanged({"tuner": {"lastScrapeTime": 6.0}}, status)
    assert not _unchanged({"tuner": {"baselines": {"a": None}}}, status)
