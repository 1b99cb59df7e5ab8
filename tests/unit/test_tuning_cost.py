"""Step-time histogram, cost fit, goodput optimiser and schedules."""

from __future__ import annotations

import pytest

from specula.tuning import (
    DEFAULT_COST_PARAMS,
    BatchDistribution,
    CostObservation,
    CostParams,
    StepCostModel,
    StepTimeHistogram,
    best_k,
    goodput,
    optimal_schedule,
)
from specula.tuning.cost import batch_bucket, bucket_range
from specula.tuning.goodput import bucket_representatives, build_schedule, schedule_k

TRUE = CostParams(
    fixed_s=6e-3, per_draft_step_s=0.9e-3, per_sequence_s=0.05e-3,
    per_draft_token_s=0.01e-3, per_verified_token_s=0.03e-3,
)


def truth(b: float, k: int) -> float:
    x = DEFAULT_COST_PARAMS.features(b, k)  # knee from the prior, as the model does
    return sum(c * f for c, f in zip(TRUE.as_list(), x, strict=True))


def test_batch_bucket_labels():
    # The runtime labels its step-time histogram with this same function.
    expected = {1: "1", 2: "2", 3: "3-4", 4: "3-4", 5: "5-8", 8: "5-8", 9: "9-16",
                128: "65-128", 129: "129-256"}
    assert {b: batch_bucket(b) for b in expected} == expected
    with pytest.raises(ValueError):
        batch_bucket(0)
    for b in range(1, 300):
        lo, hi = bucket_range(batch_bucket(b))
        assert lo <= b <= hi
    with pytest.raises(ValueError):
        bucket_range("x-y")


def test_histogram_delta_and_reset():
    a = StepTimeHistogram.from_dict([["1", 3, 10, 0.1], ["5-8", 3, 5, 0.2]])
    b = StepTimeHistogram.from_dict([["1", 3, 30, 0.3], ["5-8", 3, 5, 0.2], ["5-8", 4, 2, 0.1]])
    d = b.delta(a)
    assert {k: (s.count, round(s.sum_s, 9)) for k, s in d.series.items()} == {
        ("1", 3): (20, 0.2), ("5-8", 4): (2, 0.1)
    }
    restarted = StepTimeHistogram.from_dict([["1", 3, 4, 0.04]])
    assert restarted.delta(a) == restarted
    assert StepTimeHistogram.from_dict(b.to_dict()) == b


def test_default_model_before_data():
    m = StepCostModel.fit([])
    assert m.params == DEFAULT_COST_PARAMS
    d = DEFAULT_COST_PARAMS
    assert m.predict(1, 0) == pytest.approx(d.fixed_s + d.per_sequence_s)
    assert m.predict(1, 3) > m.predict(1, 0)


def test_fit_recovers_known_parameters():
    obs = [
        CostObservation(batch_bucket(b), b, k, truth(b, k), 500)
        for b in (1, 2, 4, 8, 16, 32, 64, 128) for k in range(0, 7)
    ]
    m = StepCostModel.fit(obs, prior_weight=1e-6)
    for got, want in zip(m.params.as_list(), TRUE.as_list(), strict=True):
        assert got == pytest.approx(want, rel=0.02)
    for b, k in [(3, 2), (100, 5), (50, 1)]:
        assert m.predict(b, k) == pytest.approx(truth(b, k), rel=0.02)


def test_bucket_correction_tracks_measurements():
    # One bucket measured 20 % slower than any bilinear fit would say.
    obs = [CostObservation("5-8", 8, 3, 1.2 * truth(8, 3), 1000)]
    m = StepCostModel.fit(obs)
    assert m.predict(8, 3) == pytest.approx(1.2 * truth(8, 3), rel=0.01)
    assert m.predict(8, 2) / m.predict(8, 3) == pytest.approx(
        m._global(8, 2) / m._global(8, 3)
    )


def test_optimiser_picks_k0_when_speculation_does_not_pay():
    slow_draft = StepCostModel(
        params=CostParams(8e-3, 6e-3, 0.08e-3, 0.02e-3, 0.04e-3)
    )
    batches = BatchDistribution.single(64)
    assert best_k([0.2] * 8, slow_draft, batches, range(0, 9))[0] == 0
    assert best_k([0.9] * 8, StepCostModel(), BatchDistribution.single(1), range(0, 9))[0] >= 5
    # Excluding 0 gives the least bad k > 0.
    assert best_k([0.2] * 8, slow_draft, batches, range(1, 9))[0] == 1


def test_goodput_formula():
    cost = StepCostModel()
    alphas = [0.8, 0.7]
    g = goodput(2, alphas, cost, BatchDistribution.single(4))
    assert g == pytest.approx(4 * (1 + 0.8 + 0.56) / cost.predict(4, 2))
    # Equal busy time at batch 1 and 32: the mean of the two batch sizes' goodputs.
    mixed = BatchDistribution(((1.0, 1.0), (32.0, 1.0)))
    want = (1 * 1.8 / cost.predict(1, 1) + 32 * 1.8 / cost.predict(32, 1)) / 2
    assert goodput(1, alphas, cost, mixed) == pytest.approx(want)


def test_window_goodput_holds_the_time_at_each_batch_size():
    # A workload that keeps 15 s at batch 8 and 15 s at batch 128 of every 30 s runs, at
    # each k, 15 / T(b, k) steps at b: goodput is those steps' tokens over the 30 s.
    cost = StepCostModel()
    alphas = [0.85] * 8
    mix = BatchDistribution(((8.0, 15.0), (128.0, 15.0)))
    for k in range(9):
        e = 1 + sum(0.85 ** (j + 1) for j in range(k))
        tokens = sum(15.0 / cost.predict(b, k) * b * e for b in (8, 128))
        assert goodput(k, alphas, cost, mix) == pytest.approx(tokens / 30.0)
    # Holding the step counts seen at one k fixed instead favours a larger k: slower
    # steps at batch 128 would buy more of them.
    steps = {b: 15.0 / cost.predict(b, 3) for b in (8, 128)}
    by_steps = {
        k: sum(steps[b] * b for b in steps) * (1 + sum(0.85 ** (j + 1) for j in range(k)))
        / sum(steps[b] * cost.predict(b, k) for b in steps)
        for k in range(9)
    }
    k_time = best_k(alphas, cost, mix, range(9))[0]
    assert max(by_steps, key=by_steps.get) > k_time


def test_window_distribution_weights_buckets_by_seconds():
    mix = BatchDistribution.from_buckets({"5-8": 2000, "65-128": 500}, {"5-8": 15.0, "65-128": 15.0})
    assert [w for _, w in mix.points] == [15.0, 15.0]


def test_bucket_representatives_match_mean_batch():
    reps = bucket_representatives({"65-128": 100}, mean_batch_size=128)
    assert reps == {"65-128": 128}
    reps = bucket_representatives({"1": 10, "5-8": 10})
    assert reps == {"1": 1, "5-8": 6.5}


def test_schedule_is_valid_and_matches_per_batch_best():
    alphas = [0.85] * 8
    cost = StepCostModel()
    sched = optimal_schedule(alphas, cost, range(0, 9), 256)
    assert sched[0][0] == 1 and sched[-1][1] == 256
    for (s0, e0, k0), (s1, _, k1) in zip(sched, sched[1:], strict=False):
        assert s0 <= e0 and s1 == e0 + 1 and k0 != k1
    for b in (1, 2, 7, 31, 64, 100, 200, 256):
        assert schedule_k(sched, b) == best_k(alphas, cost, BatchDistribution.single(b), range(9))[0]
    assert [r[2] for r in sched] == sorted((r[2] for r in sched), reverse=True)


def test_build_schedule_merges_equal_neighbours():
    assert build_schedule(lambda b: 4 if b <= 8 else 2, 20) == [[1, 8, 4], [9, 20, 2]]
    assert build_schedule(lambda b: 3, 1) == [[1, 1, 3]]
    with pytest.raises(ValueError):
        build_schedule(lambda b: 3, 0)
