"""The shipped step-time prior is the fit of the checked-in H100 measurements
(``bench/results/step_costs_h100.json`` and ``step_costs_h100_shuffled.json``, the mean of
their per-cell medians; ``bench/fit_costs.py``), and how well it holds.

Goals: median error of the global curve <= 5 %, maximum <= 10 %, and in every (batch,
acceptance) cell the k it picks reaches >= 98 % of the best measured goodput.  The median
goal is met.  The other two are not met by the global curve in a few cells, pinned here by
name so that any other cell falling short, or these getting worse, fails:

- B = 64, k = 6: ~5 ms above the trend of its row in both sessions (22.7 and 22.1 ms
  medians, against 15.5-16.0 ms at k = 5 and 19.3-19.6 ms at k = 7); the global curve is
  19 % below it.
- Two (B, alpha) cells where the measured optimum is flat and the curve's errors at the two
  competing k differ by 5-8 points: (64, 0.7) 96.1 % and (128, 0.7) 96.8 % of the best.

With the per-bucket corrections the tuner fits from the steps it measures (the k it runs and
its neighbours), every cell reaches its measured best k.
"""

from __future__ import annotations

import json
import statistics

import pytest

from bench.fit_costs import DEFAULT_INPUTS, GOALS, combine, evaluate, fit, online_check
from specula.tuning import DEFAULT_COST_PARAMS, StepCostModel

OFF_TREND_CELLS = {(64, 6)}
FLAT_OPTIMUM_MISSES = {(64, 0.7), (128, 0.7)}


@pytest.fixture(scope="module")
def measured():
    datas = [json.loads(p.read_text()) for p in DEFAULT_INPUTS]
    cells = combine(datas)
    params, weights, _ = fit(cells)
    return datas, cells, params, weights


def test_cells_are_the_mean_of_the_sessions_medians(measured):
    datas, cells, _, _ = measured
    assert len(cells) == 54
    got = {(b, k): t for b, k, t, _ in cells}
    a, b = (d["step_ms"]["128"]["0"]["median_ms"] for d in datas)
    assert got[128, 0] == pytest.approx((a + b) / 2 * 1e-3)
    with pytest.raises(ValueError, match="different"):
        combine([datas[0], {"step_ms": {"1": datas[0]["step_ms"]["1"]}}])


def test_default_prior_is_the_fit_of_the_measurements(measured):
    _, _, params, _ = measured
    for got, want in zip(params.as_list(), DEFAULT_COST_PARAMS.as_list(), strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    assert params.knee_scale == pytest.approx(DEFAULT_COST_PARAMS.knee_scale, rel=1e-4)
    # StepCostModel() is that curve: its own knee, no corrections.
    model = StepCostModel()
    assert model.predict(32, 4) == pytest.approx(
        StepCostModel(params=params, prior=params).predict(32, 4), rel=1e-3
    )


def test_prediction_error_goals(measured):
    _, cells, _, weights = measured
    ev = evaluate(DEFAULT_COST_PARAMS, cells)
    abs_err = {c: abs(e) for c, e in ev["errors"].items()}
    assert statistics.median(abs_err.values()) <= GOALS["median_error"]
    over = {c for c, e in abs_err.items() if e > GOALS["max_error"]}
    assert over == OFF_TREND_CELLS
    assert max(e for c, e in abs_err.items() if c not in over) <= 0.08
    assert all(e < 0.2 for e in abs_err.values())
    # The off-trend cell is kept but has little weight in the robust fit.
    w = dict(zip([(b, k) for b, k, *_ in cells], weights, strict=True))
    assert w[64, 6] < 0.2


def test_model_k_reaches_98_percent_of_measured_best(measured):
    _, cells, _, _ = measured
    ev = evaluate(DEFAULT_COST_PARAMS, cells)
    assert len(ev["goodput_cells"]) == 24
    short = {(c["batch_size"], c["alpha"]): c["fraction_of_best"] for c in ev["goodput_cells"]
             if c["fraction_of_best"] < GOALS["min_cell_fraction_of_best"]}
    assert set(short) <= FLAT_OPTIMUM_MISSES
    assert min(short.values(), default=1.0) >= 0.96


def test_online_corrections_reach_the_measured_best(measured):
    _, cells, _, _ = measured
    online = online_check(DEFAULT_COST_PARAMS, cells)
    assert len(online) == 24
    for c in online:
        assert c["k_path"][-1] == c["k_best"], c
        assert c["fraction_of_best"] == pytest.approx(1.0)
        # Found by measuring a few neighbouring k, not the whole row.
        assert c["cells_measured"] <= 4
    moved = {(c["batch_size"], c["alpha"]) for c in online if len(c["k_path"]) > 1}
    assert FLAT_OPTIMUM_MISSES <= moved
