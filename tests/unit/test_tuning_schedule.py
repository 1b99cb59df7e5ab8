"""Per-batch-size schedules: decisions, execution-aware acceptance, and the knee fit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specula.tuning import (
    DEFAULT_COST_PARAMS,
    CostObservation,
    CostParams,
    RuntimeMetrics,
    SpecDecodeCounters,
    StepCostModel,
    StepTimeHistogram,
    TuningSettings,
    TuningState,
    decide,
)
from specula.tuning.acceptance import position_observations, position_observations_by_k
from specula.tuning.cost import StepTimeSeries, batch_bucket
from specula.tuning.goodput import schedule_k

T0 = 1_700_000_000.0
SCHED = TuningSettings(mode="Auto", apply_schedule=True)


def mixed_window(parts: list[tuple[int, int, int]], alphas: list[float]) -> RuntimeMetrics:
    """A window of ``(batch, k, steps)`` parts, each drafting its own k: expected
    acceptance counts, step times from the default cost curve."""
    drafts = tokens = accepted = 0.0
    draft_tokens = 0.0
    per_pos = [0.0] * 8
    series = {}
    model = StepCostModel()
    for batch, k, steps in parts:
        d = steps * batch if k > 0 else 0
        reached = float(d)
        for j in range(k):
            reached = round(reached * alphas[j])
            per_pos[j] += reached
            accepted += reached
        drafts += d
        draft_tokens += d * k
        tokens += steps * batch
        key = (batch_bucket(batch), k)
        prev = series.get(key, StepTimeSeries())
        series[key] = StepTimeSeries(prev.count + steps, prev.sum_s + steps * model.predict(batch, k))
    return RuntimeMetrics(
        counters=SpecDecodeCounters(drafts, draft_tokens, accepted, tuple(per_pos)),
        generation_tokens=tokens + accepted,
        step_times=StepTimeHistogram(series),
    )


def test_trials_corrected_for_drafts_that_stopped_early():
    # Half the drafts at k=2 (batch 4), half at k=4 (batch 4): positions 2, 3 are
    # reached only by the k=4 half.
    alphas = [0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5]
    w = mixed_window([(4, 2, 5000), (4, 4, 5000)], alphas)
    obs = position_observations_by_k(w.counters, w.drafts_by_k())
    assert len(obs) == 4
    for j, (n, a) in enumerate(obs):
        assert a / n == pytest.approx(alphas[j], rel=0.01)
    # The uncorrected chain would halve the rates of positions 2 and 3.
    naive = position_observations(w.counters, 4)
    assert naive[2][1] / naive[2][0] == pytest.approx(alphas[2] / 2, rel=0.02)
    # One k: identical to the exact single-k observations.
    single = mixed_window([(4, 3, 1000)], alphas)
    assert position_observations_by_k(single.counters, single.drafts_by_k()) == (
        position_observations(single.counters, 3)
    )


def test_mean_batch_size_holds_with_undrafted_steps():
    w = mixed_window([(2, 4, 1000), (64, 0, 1000)], [0.8] * 8)
    assert w.mean_batch_size == pytest.approx(33.0)


def test_schedule_decision_is_applied_as_a_schedule():
    # Low acceptance at batch 64 with k=6 everywhere: the tuner moves to a schedule.
    state = TuningState.initial(6, SCHED)
    d = decide(state, mixed_window([(64, 6, 2000)], [0.3] * 8), SCHED, T0)
    assert d.reason == "HigherGoodput" and d.apply
    sched = d.num_speculative_tokens_per_batch_size
    assert sched is not None and sched[0][0] == 1
    for (_, e0, _), (s1, _, _) in zip(sched, sched[1:], strict=False):
        assert s1 == e0 + 1
    assert schedule_k(sched, 64) == d.num_speculative_tokens < 6
    assert d.state.schedule == tuple(tuple(r) for r in sched)
    assert d.state.previous_schedule is None and d.state.previous_num_speculative_tokens == 6
    assert d.current_num_speculative_tokens_per_batch_size is None
    # JSON round trip keeps the schedule.
    again = TuningState.from_dict(json.loads(json.dumps(d.state.to_dict())))
    assert again == d.state


def test_schedule_is_reverted_to_the_previous_configuration():
    state = TuningState.initial(6, SCHED)
    d0 = decide(state, mixed_window([(64, 6, 2000)], [0.3] * 8), SCHED, T0)
    k_new = schedule_k(d0.num_speculative_tokens_per_batch_size, 64)
    slow = mixed_window([(64, k_new, 2000)], [0.3] * 8)
    # Steps so much slower than predicted that the change loses: reverted to k = 6.
    f = (1.0 + d0.predicted_gain) / 0.85
    slow = replace(slow, step_times=StepTimeHistogram(
        {key: StepTimeSeries(v.count, v.sum_s * f) for key, v in slow.step_times.series.items()}
    ))
    d1 = decide(d0.state, slow, SCHED, T0 + 30)
    assert d1.reason == "Revert" and d1.apply
    assert d1.num_speculative_tokens == 6 and d1.num_speculative_tokens_per_batch_size is None
    assert d1.state.schedule is None


def test_recommend_mode_recommends_a_schedule_without_applying():
    rec = replace(SCHED, mode="Recommend")
    d = decide(TuningState.initial(6, rec), mixed_window([(64, 6, 2000)], [0.3] * 8), rec, T0)
    assert not d.apply and d.state.schedule is None and d.schedule[0][0] == 1


TRUE = CostParams(
    fixed_s=6e-3, per_draft_step_s=0.9e-3, per_sequence_s=0.05e-3,
    per_draft_token_s=0.01e-3, per_verified_token_s=0.03e-3,
)


def test_knee_fit_recovers_a_known_knee():
    # Data generated by the model's own form with a knee at 0.6 x the prior's.
    truth = StepCostModel(params=TRUE, prior=DEFAULT_COST_PARAMS, knee_scale=0.6)
    obs = [
        CostObservation(batch_bucket(b), b, k, truth.predict(b, k), 500)
        for b in (1, 4, 16, 32, 64, 96, 128) for k in (0, 1, 2, 3, 5, 7)
    ]
    m = StepCostModel.fit(obs, prior_weight=1e-6, knee_prior_weight=1e-6)
    assert m.knee_scale == pytest.approx(0.6, rel=0.05)
    for got, want in zip(m.params.as_list(), TRUE.as_list(), strict=True):
        assert got == pytest.approx(want, rel=0.05)
    fixed_knee = StepCostModel.fit(obs, prior_weight=1e-6, fit_knee=False)
    # Without the knee fit, an unmeasured k at high batch is mispredicted.
    unmeasured = [(100, 4), (48, 6)]
    err = max(abs(m._global(b, k) / truth.predict(b, k) - 1) for b, k in unmeasured)
    err_fixed = max(abs(fixed_knee._global(b, k) / truth.predict(b, k) - 1) for b, k in unmeasured)
    assert err < 0.02 < err_fixed


def test_knee_stays_at_the_prior_without_informative_data():
    # Only small batches: every step is far below any knee on the grid.
    obs = [CostObservation("1", 1, k, StepCostModel().predict(1, k), 1000) for k in range(4)]
    assert StepCostModel.fit(obs).knee_scale == pytest.approx(1.0)
