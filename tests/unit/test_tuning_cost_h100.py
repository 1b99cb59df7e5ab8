"""The shipped step-time prior is the fit of the checked-in H100 measurements
(``bench/results/step_costs_h100.json``, ``bench/fit_costs.py``), and how well it holds.

Goals: median error of the global curve <= 5 %, maximum <= 10 %, and in every (batch,
acceptance) cell the k it picks reaches >= 98 % of the best measured goodput.  The median
goal is met.  The other two are not met in a few cells, pinned here by name so that any
other cell falling short, or these getting worse, fails:

- B = 64, k = 6: all 20 steps (22.2-23.5 ms) lie ~5 ms above the trend of the row
  (15.5 ms at k = 5, 19.6 ms at k = 7); the global curve is 22 % below it.
- Four (B, alpha) cells where the measured optimum is flat and the curve's errors at the
  two competing k differ by 4-6 points: 95.7-97.6 % of the best (worst: B = 4,
  alpha = 0.7, k = 5 picked, k = 4 best).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.fit_costs import GOALS, evaluate, fit, load_cells
from specula.tuning import DEFAULT_COST_PARAMS, StepCostModel

DATA = Path(__file__).resolve().parents[2] / "bench" / "results" / "step_costs_h100.json"
OFF_TREND_CELLS = {(64, 6)}
FLAT_OPTIMUM_MISSES = {(4, 0.7), (16, 0.7), (64, 0.5), (64, 0.85)}


@pytest.fixture(scope="module")
def measured():
    data = json.loads(DATA.read_text())
    cells = load_cells(data)
    params, weights, _ = fit(cells)
    return data, cells, params, weights


def test_default_prior_is_the_fit_of_the_measurements(measured):
    data, _, params, _ = measured
    for got, want in zip(params.as_list(), DEFAULT_COST_PARAMS.as_list(), strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    assert params.knee_scale == pytest.approx(DEFAULT_COST_PARAMS.knee_scale, rel=1e-4)
    assert data["fit"]["params"]["fixed_s"] == pytest.approx(params.fixed_s, rel=1e-4)
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
    assert max(e for c, e in abs_err.items() if c not in over) <= 0.075
    assert all(e < 0.25 for e in abs_err.values())
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
    assert min(short.values(), default=1.0) >= 0.955
