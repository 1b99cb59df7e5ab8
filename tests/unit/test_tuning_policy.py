"""Decision policy: data sufficiency, cooldown, hysteresis, steps, exploration, revert,
and state that survives an operator restart (JSON round trip)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specula.tuning import (
    RuntimeMetrics,
    SpecDecodeCounters,
    StepCostModel,
    StepTimeHistogram,
    TuningPolicy,
    TuningSettings,
    TuningState,
    decide,
)
from specula.tuning.cost import StepTimeSeries, batch_bucket

T0 = 1_700_000_000.0
AUTO = TuningSettings(mode="Auto")


def window(k: int, alphas: list[float], batch: int = 8, steps: int = 2000,
           slowdown: float = 1.0) -> RuntimeMetrics:
    """A window of ``steps`` steps at ``batch`` drafting k, expected acceptance counts,
    step times from the default cost curve (times ``slowdown``)."""
    drafts = steps * batch if k > 0 else 0
    per_pos, reached = [], float(drafts)
    for j in range(k):
        reached = round(reached * alphas[j])
        per_pos.append(float(reached))
    per_pos += [0.0] * (8 - len(per_pos))
    step_s = StepCostModel().predict(batch, k) * slowdown
    return RuntimeMetrics(
        counters=SpecDecodeCounters(drafts, drafts * k, sum(per_pos), tuple(per_pos)),
        generation_tokens=steps * batch + sum(per_pos),
        step_times=StepTimeHistogram(
            {(batch_bucket(batch), k): StepTimeSeries(steps, steps * step_s)}
        ),
    )


def run(state: TuningState, alphas: list[float], n: int, settings=AUTO, batch: int = 8,
        start: float = T0):
    decisions = []
    for i in range(n):
        d = decide(state, window(state.num_speculative_tokens, alphas, batch), settings,
                   start + (i + 1) * settings.interval_s)
        decisions.append(d)
        state = d.state
    return decisions, state


def test_insufficient_data():
    state = TuningState.initial(3, AUTO)
    d = decide(state, window(3, [0.9] * 8, steps=10), AUTO, T0)
    assert d.reason == "InsufficientData" and d.num_speculative_tokens is None and not d.apply
    d = decide(state, RuntimeMetrics(), AUTO, T0)
    assert d.reason == "InsufficientData"


def test_off_mode_decides_nothing():
    d = decide(TuningState.initial(3, AUTO), window(3, [0.2] * 8), replace(AUTO, mode="Off"), T0)
    assert d.reason == "Disabled" and d.num_speculative_tokens is None


def test_cooldown_blocks_changes():
    state = replace(TuningState.initial(3, AUTO), last_change_time=T0 - 30)
    d = decide(state, window(3, [0.1] * 8), AUTO, T0)
    assert d.reason == "Cooldown" and not d.apply
    assert d.state.num_speculative_tokens == 3


def test_no_action_when_gain_is_improbable():
    # At the model's own optimum nothing beats the current k by 5 %.
    state = replace(TuningState.initial(4, AUTO), explore_tokens=0.0)
    decisions, state = run(state, [0.62, 0.6, 0.59, 0.58, 0.57, 0.56, 0.55, 0.54], 6)
    assert {d.reason for d in decisions} == {"NoGain"}
    assert state.num_speculative_tokens == 4
    assert all(d.probability is None for d in decisions)
    assert decisions[-1].schedule[0][0] == 1


def test_moves_one_step_unless_gain_is_big():
    low = [0.3] * 8
    never_jump = replace(AUTO, big_gain=100.0)
    d = decide(TuningState.initial(6, AUTO), window(6, low, batch=64), never_jump, T0)
    assert d.reason == "HigherGoodput" and d.num_speculative_tokens == 5 and d.apply
    assert d.probability >= 0.95 and d.predicted_gain > 0.05
    d = decide(TuningState.initial(6, AUTO), window(6, low, batch=64), AUTO, T0)
    assert d.reason == "HigherGoodput" and d.num_speculative_tokens < 5
    assert d.predicted_gain >= AUTO.big_gain
    assert d.state.pending_verification and d.state.last_change_time == T0
    assert d.state.previous_num_speculative_tokens == 6


def test_one_step_move_skips_a_blacklisted_neighbour():
    # k = 5 was reverted recently: a small gain towards 3 goes to the nearest probable
    # winner past it, never into the blacklist (and never raises).
    low = [0.3] * 8
    never_jump = replace(AUTO, big_gain=100.0)
    state = replace(TuningState.initial(6, AUTO), blacklist={5: T0 + 600})
    d = decide(state, window(6, low, batch=64), never_jump, T0)
    assert d.reason == "HigherGoodput" and d.apply
    assert d.num_speculative_tokens == 4
    assert d.probability >= 0.95 and d.predicted_gain > 0.05


def test_recommend_mode_does_not_apply():
    rec = replace(AUTO, mode="Recommend")
    d = decide(TuningState.initial(6, rec), window(6, [0.3] * 8, batch=64), rec, T0)
    assert d.reason == "HigherGoodput" and d.num_speculative_tokens is not None
    assert not d.apply and d.state.num_speculative_tokens == 6
    assert not d.state.pending_verification


def test_explores_unobserved_depth_within_budget():
    high = [0.9] * 8
    state = TuningState.initial(2, AUTO)
    decisions, state = run(state, high, 12, batch=1)
    reasons = [d.reason for d in decisions if d.apply]
    assert reasons and set(reasons) <= {"Explore", "HigherGoodput"}
    assert state.num_speculative_tokens >= 6
    ks = [2] + [d.num_speculative_tokens for d in decisions if d.apply]
    # Upwards into undrafted positions the step doubles k, never more.
    assert all(b <= max(a + 1, 2 * a) for a, b in zip(ks, ks[1:], strict=False))
    # Without budget there is no exploration.
    broke = replace(TuningState.initial(2, AUTO), explore_tokens=0.0)
    no_budget = replace(AUTO, explore_budget=0.0)
    decisions, state = run(broke, high, 5, settings=no_budget, batch=1)
    assert all(d.reason != "Explore" for d in decisions)


def test_exploration_doubles_k_then_stops_at_the_model_best():
    d0 = decide(TuningState.initial(3, AUTO), window(3, [0.9] * 8, batch=1), AUTO, T0)
    assert d0.reason == "Explore" and d0.num_speculative_tokens == 6
    # Confirmed by the next window: no cooldown, the token is given back, next step.
    d1 = decide(d0.state, window(6, [0.9] * 8, batch=1), AUTO, T0 + 30)
    assert d1.apply and d1.num_speculative_tokens == 8
    assert d1.state.explore_tokens >= d0.state.explore_tokens


def test_reverts_when_measured_goodput_is_worse():
    state = TuningState.initial(3, AUTO)
    d0 = decide(state, window(3, [0.9] * 8, batch=1), AUTO, T0)
    assert d0.reason == "Explore" and d0.num_speculative_tokens == 6
    # The new k turns out so much slower than the model believed that it loses.
    slowdown = (1.0 + d0.predicted_gain) / 0.9
    d1 = decide(d0.state, window(6, [0.9] * 8, batch=1, slowdown=slowdown), AUTO, T0 + 30)
    assert d1.reason == "Revert" and d1.num_speculative_tokens == 3 and d1.apply
    assert 6 in d1.state.blacklist and not d1.state.pending_verification
    assert d1.state.probe_failures == 1
    # Blacklisted k is not explored again while the entry lasts.
    decisions, _ = run(d1.state, [0.9] * 8, 6, batch=1, start=T0 + 30)
    assert all(d.num_speculative_tokens != 6 for d in decisions)


def test_change_is_kept_when_verified():
    d0 = decide(TuningState.initial(3, AUTO), window(3, [0.9] * 8, batch=1), AUTO, T0)
    d1 = decide(d0.state, window(6, [0.9] * 8, batch=1), AUTO, T0 + 30)
    # Verified (kept), and confirmed as better than k=3: the tuner may move on at once.
    assert d1.reason not in ("Revert", "Cooldown")
    assert d1.state.num_speculative_tokens >= 6


def test_unconfirmed_change_keeps_the_cooldown():
    # Slightly worse than the old k would have been (within the revert tolerance):
    # kept, but the cooldown holds.
    d0 = decide(TuningState.initial(3, AUTO), window(3, [0.9] * 8, batch=1), AUTO, T0)
    assert d0.reason == "Explore"
    slowdown = (1.0 + d0.predicted_gain) / (1.0 - AUTO.explore_revert_tolerance / 2)
    d1 = decide(d0.state, window(6, [0.9] * 8, batch=1, slowdown=slowdown), AUTO, T0 + 30)
    assert d1.reason == "Cooldown" and not d1.apply and not d1.state.pending_verification


def test_state_round_trips_through_json():
    _, state = run(TuningState.initial(3, AUTO), [0.85] * 8, 5, batch=4)
    data = json.loads(json.dumps(state.to_dict()))
    assert TuningState.from_dict(data) == state
    assert data["numSpeculativeTokens"] == state.num_speculative_tokens
    with pytest.raises(ValueError):
        TuningState.from_dict({"version": 99, "numSpeculativeTokens": 3})


def test_version_1_state_is_migrated():
    _, state = run(TuningState.initial(3, AUTO), [0.85] * 8, 3, batch=4)
    old = state.to_dict()
    for key in ("schedule", "previousSchedule", "probeFailures"):
        del old[key]
    old["version"] = 1
    migrated = TuningState.from_dict(json.loads(json.dumps(old)))
    assert migrated == replace(state, schedule=None, previous_schedule=None, probe_failures=0)
    assert migrated.to_dict()["version"] == 2


def test_restart_continues_identically():
    alphas = [0.88, 0.86, 0.85, 0.84, 0.83, 0.82, 0.81, 0.8]
    continuous = TuningPolicy(AUTO)
    state_a = state_b = TuningState.initial(3, AUTO)
    for i in range(15):
        now = T0 + (i + 1) * 30
        batch = 2 if i < 8 else 64
        da = continuous.decide(state_a, window(state_a.num_speculative_tokens, alphas, batch), now)
        # A fresh policy and a state that only survived as JSON on the resource.
        restored = TuningState.from_dict(json.loads(json.dumps(state_b.to_dict())))
        db = TuningPolicy(AUTO).decide(restored, window(restored.num_speculative_tokens, alphas, batch), now)
        assert (da.reason, da.num_speculative_tokens, da.probability) == (
            db.reason, db.num_speculative_tokens, db.probability)
        state_a, state_b = da.state, db.state
    assert state_a == state_b


def test_settings_validation():
    with pytest.raises(ValueError):
        TuningSettings(mode="Sometimes")
    with pytest.raises(ValueError):
        TuningSettings(min_speculative_tokens=5, max_speculative_tokens=2)


def test_out_of_bounds_k_is_clamped():
    d = decide(TuningState.initial(12, AUTO), window(12, [0.9] * 16), AUTO, T0)
    assert d.reason == "Bounds" and d.num_speculative_tokens == AUTO.max_speculative_tokens


def test_failed_probes_in_a_row_lengthen_the_blacklist():
    d0 = decide(TuningState.initial(3, AUTO), window(3, [0.9] * 8, batch=1), AUTO, T0)
    assert d0.reason == "Explore" and d0.num_speculative_tokens == 6
    slowdown = (1.0 + d0.predicted_gain) / 0.9
    for failures, factor in ((0, 1), (1, 2), (2, 4), (7, 2**AUTO.max_probe_backoff)):
        state = replace(d0.state, probe_failures=failures)
        d1 = decide(state, window(6, [0.9] * 8, batch=1, slowdown=slowdown), AUTO, T0 + 30)
        assert d1.reason == "Revert"
        assert d1.state.blacklist[6] == pytest.approx(T0 + 30 + AUTO.blacklist_s * factor)
        assert d1.state.probe_failures == failures + 1


def test_no_probe_straight_back_to_the_k_a_confirmed_move_left():
    # k=1 after a model-driven move from k=2; position 1 has no evidence (undrafted), so
    # the prior's acceptance makes deeper k look better and a probe to k=2 is due...
    alphas = [0.7] * 8
    base = replace(
        TuningState.initial(1, AUTO),
        previous_num_speculative_tokens=2,
        last_change_time=T0 - 30,
        last_decision_time=T0 - 30,
        last_reason="HigherGoodput",
    )
    plain = decide(base, window(1, alphas), AUTO, T0 + 120)
    assert plain.reason == "Explore" and plain.num_speculative_tokens == 2
    # ... unless the window has just confirmed the move (measured at least what k=2
    # would have given): then k=2 is not probed straight back.
    pending = replace(
        base, pending_verification=True, pre_change_goodput=1.0, pre_change_model_goodput=1e9
    )
    d = decide(pending, window(1, alphas), AUTO, T0)
    assert not (d.reason == "Explore" and d.num_speculative_tokens == 2)
