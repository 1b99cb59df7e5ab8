"""Fit the tuner's step-time model to the measured T(B, k) grid and check it.

Reads the two H100 measurements ``bench/results/step_costs_h100.json`` (20 timed steps
a cell, k in ascending order) and ``bench/results/step_costs_h100_shuffled.json`` (3
sweeps of 20, fresh requests per sweep, k in shuffled order), made by
``bench/step_costs.py``: the engine's step time for B in {1, 4, 16, 32, 64, 128} and k in
0..8.  Each cell's value is the mean of the two files' per-cell medians (see "The fit"),
:class:`specula.tuning.cost.StepCostModel` is fitted to them, and it reports:

- the error of the *global* model (no per-bucket corrections, the curve the tuner starts
  from) in every cell: ``predicted / measured - 1``, median and maximum of its absolute
  value (goals: <= 5 % and <= 10 %);
- for every (B, per-position acceptance alpha in {0.2, 0.5, 0.7, 0.85}) cell, the
  measured goodput ``B * E(k) / T(B, k)`` of the k the model picks, over the best
  measured goodput (goal: >= 0.98).  ``E(k)`` is the tuner's expected acceptance length
  (:func:`specula.tuning.acceptance.expected_accepted_length`, alpha at every position)
  and the model picks with the tuner's own :func:`specula.tuning.goodput.best_k`;
- the same check once the tuner has measured the cells it visits (:func:`online_check`):
  from the model's k it measures that k and its neighbours at that batch size, refits
  with per-bucket corrections (:meth:`StepCostModel.fit`) and moves to the new best k,
  until the pick stays — what the tuner does online with its step-time histogram and
  its probes of unmeasured neighbouring k.

The fit:

- The two measurements weigh the same: their differences are larger than the spread
  within either (B = 128, k = 0: 8.54 against 10.44 ms; B = 64, k = 0: 7.37 against
  8.54 ms; within a cell the steps of one session are within ~2 % of their median), so
  the session, not the step, is the unit of replication.  Pooling all steps would weigh
  the shuffled session three to one and count its correlated steps as independent; the
  files hold per-cell statistics only, not the steps, so a pooled median cannot be
  formed anyway.  The first session also confounds k with context length (k ascends as
  the KV context grows); the shuffled session does not, and averaging halves that bias.

- Per-cell medians of the timed steps, not means: a few steps of a cell can be slowed by
  the host (the B = 4, k = 5 cell has a 19 ms step among 9 ms ones).  A whole cell can
  also sit off the trend of its row (B = 64, k = 6: all 20 steps 22.2-23.5 ms between
  15.5 ms at k = 5 and 19.6 ms at k = 7).  No cell is dropped: the fit is a Huber
  M-estimate (Huber 1964; iteratively reweighted least squares, Holland & Welsch 1977)
  on relative residuals with the usual tuning constant 1.345 and the scale from the
  median absolute deviation, so such a cell keeps a bounded influence.  Its error is
  reported with the others, and the robust weight of every cell is written out.
- The datasheet prior does not inform the fit (prior weights 1e-6).
- The knee: the model puts it at ``knee_scale`` times the roofline knee of the *prior's*
  coefficients (see :mod:`specula.tuning.cost`).  For the fitted coefficients to be a
  prior that reproduces this fit by themselves (``StepCostModel(params=p, prior=p)``),
  the fit is repeated with its own result as the prior until the knee scale it fits is 1
  and the coefficients no longer move (a fixed point).  It starts from the datasheet
  roofline that was the default before any measurement (:data:`START`).  These data
  place the knee only loosely: started from its own result, the iteration stops at a
  knee scale ~4 % lower with errors within 0.3 points.

Usage::

    python3 bench/fit_costs.py [--input FILE ...] [--write]

``--write`` stores the results under ``"cost_fit"`` in ``bench/results/tuning.json``
(other keys of that file are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specula.tuning.acceptance import expected_accepted_length  # noqa: E402 - after the path set-up
from specula.tuning.cost import (  # noqa: E402
    CostObservation,
    CostParams,
    StepCostModel,
    batch_bucket,
)
from specula.tuning.goodput import BatchDistribution, best_k  # noqa: E402

DEFAULT_INPUTS = (
    HERE / "results" / "step_costs_h100.json",
    HERE / "results" / "step_costs_h100_shuffled.json",
)
RESULTS = HERE / "results" / "tuning.json"
ALPHAS = (0.2, 0.5, 0.7, 0.85)
GOALS = {"median_error": 0.05, "max_error": 0.10, "min_cell_fraction_of_best": 0.98}
HUBER_C = 1.345
PRIOR_WEIGHT = 1e-6
START = CostParams(
    fixed_s=8.0e-3,
    per_draft_step_s=0.6e-3,
    per_sequence_s=0.08e-3,
    per_draft_token_s=0.005e-3,
    per_verified_token_s=0.04e-3,
)
"""Where the fit starts: the datasheet roofline for an ~8B bf16 target and a one-layer
EAGLE-style head on an H100-class GPU (16 GB of weights at ~2.5 TB/s plus launches;
~0.08 ms of KV reads per sequence; 16 GFLOP per token at ~400 TFLOP/s; ~0.6 ms per draft
step) that was the tuner's default before these measurements."""

Cell = tuple[int, int, float, float]
"""(batch size, k, step time in seconds, number of timed steps)."""


def load_cells(data: dict, stat: str = "median_ms") -> list[Cell]:
    """The measured grid as ``(B, k, seconds, steps)``, from ``step_ms[B][k][stat]``."""
    return [
        (int(b), int(k), v[stat] * 1e-3, float(v.get("steps", 1)))
        for b, by_k in data["step_ms"].items()
        for k, v in by_k.items()
    ]


def combine(datas: list[dict], stat: str = "median_ms") -> list[Cell]:
    """Per (B, k): the mean over measurements of their per-cell ``stat``; steps summed.

    Raises:
        ValueError: the measurements do not cover the same cells.
    """
    grids = [{(b, k): (t, n) for b, k, t, n in load_cells(d, stat)} for d in datas]
    if any(g.keys() != grids[0].keys() for g in grids):
        raise ValueError("measurements cover different (B, k) cells")
    return [
        (b, k, sum(g[b, k][0] for g in grids) / len(grids), sum(g[b, k][1] for g in grids))
        for b, k in sorted(grids[0])
    ]


def huber_weights(residuals: list[float], c: float = HUBER_C) -> list[float]:
    """IRLS weights ``min(1, c * s / |r|)`` with ``s = 1.4826 * MAD(r)`` (Huber 1964)."""
    med = statistics.median(residuals)
    scale = 1.4826 * statistics.median(abs(r - med) for r in residuals)
    if scale <= 0:
        return [1.0] * len(residuals)
    return [min(1.0, c * scale / abs(r)) if r else 1.0 for r in residuals]


def fit(
    cells: list[Cell],
    start: CostParams = START,
    robust: bool = True,
    max_iter: int = 200,
    tol: float = 1e-6,
) -> tuple[CostParams, list[float], int]:
    """Fixed point of ``StepCostModel.fit`` with its own result as the prior.

    Returns:
        The coefficients (their ``knee_scale`` included), each cell's robust weight (all 1
        with ``robust=False``) and the number of iterations.

    Raises:
        RuntimeError: no convergence within ``max_iter``.
    """
    params = start
    weights = [1.0] * len(cells)
    for it in range(1, max_iter + 1):
        obs = [
            CostObservation(batch_bucket(b), b, k, t, n * w)
            for (b, k, t, n), w in zip(cells, weights, strict=True)
        ]
        model = StepCostModel.fit(
            obs, prior=params, prior_weight=PRIOR_WEIGHT, knee_prior_weight=PRIOR_WEIGHT
        )
        new = model.params
        moved = max(
            abs(a - b) / max(abs(b), 1e-12)
            for a, b in zip(new.as_list(), params.as_list(), strict=True)
        )
        moved = max(moved, abs(math.log(new.knee_scale / params.knee_scale)))
        new_weights = weights
        if robust:
            res = [model._global(b, k) / t - 1.0 for b, k, t, _ in cells]
            new_weights = huber_weights(res)
            moved = max(moved, *(abs(a - b) for a, b in zip(new_weights, weights, strict=True)))
        params, weights = new, new_weights
        if moved < tol:
            return params, weights, it
    raise RuntimeError(f"no fixed point within {max_iter} iterations")


def cell_errors(model: StepCostModel, cells: list[Cell]) -> dict[tuple[int, int], float]:
    """``predicted / measured - 1`` of the global model (no corrections) per (B, k)."""
    return {(b, k): model._global(b, k) / t - 1.0 for b, k, t, _ in cells}


def goodput_check(model: StepCostModel, cells: list[Cell]) -> list[dict]:
    """Per (B, alpha): the model's k, the measured best k and the measured fraction."""
    by_b: dict[int, dict[int, float]] = {}
    for b, k, t, _ in cells:
        by_b.setdefault(b, {})[k] = t
    out = []
    for b, times in sorted(by_b.items()):
        ks = sorted(times)
        for a in ALPHAS:
            alphas = [a] * max(ks)
            measured = {k: b * expected_accepted_length(alphas, k) / times[k] for k in ks}
            pick = best_k(alphas, model, BatchDistribution.single(b), ks)[0]
            top = max(ks, key=lambda k: measured[k])
            out.append({
                "batch_size": b, "alpha": a, "k_model": pick, "k_best": top,
                "fraction_of_best": measured[pick] / measured[top],
            })
    return out


def online_check(params: CostParams, cells: list[Cell], probe_steps: float = 50.0) -> list[dict]:
    """Per (B, alpha): the k reached once measured step times correct the model.

    Starting from the pick of ``StepCostModel(params=params, prior=params)``, the k in
    effect and its neighbours k - 1 and k + 1 are "measured" (their cells' step times,
    ``probe_steps`` steps each), the model is refitted with ``params`` as the prior
    (:meth:`StepCostModel.fit`, default weights: per-bucket corrections), and the pick
    moves to the refitted best k; repeated until it stays (at most 9 moves).
    """
    times = {(b, k): t for b, k, t, _ in cells}
    out = []
    for b in sorted({b for b, *_ in cells}):
        ks = sorted(k for bb, k in times if bb == b)
        for a in ALPHAS:
            alphas = [a] * max(ks)
            measured = {k: b * expected_accepted_length(alphas, k) / times[b, k] for k in ks}
            top = max(ks, key=lambda k: measured[k])
            model = StepCostModel(params=params, prior=params)
            pick = best_k(alphas, model, BatchDistribution.single(b), ks)[0]
            path, seen = [pick], set()
            for _ in range(len(ks)):
                seen |= {k for k in (pick - 1, pick, pick + 1) if k in measured}
                obs = [
                    CostObservation(batch_bucket(b), b, k, times[b, k], probe_steps)
                    for k in sorted(seen)
                ]
                model = StepCostModel.fit(obs, prior=params)
                new = best_k(alphas, model, BatchDistribution.single(b), ks)[0]
                if new == pick:
                    break
                pick = new
                path.append(pick)
            out.append({
                "batch_size": b, "alpha": a, "k_path": path, "k_best": top,
                "cells_measured": len(seen),
                "fraction_of_best": measured[pick] / measured[top],
            })
    return out


def evaluate(params: CostParams, cells: list[Cell]) -> dict:
    """Errors and the goodput check of ``StepCostModel(params=params, prior=params)``."""
    model = StepCostModel(params=params, prior=params)
    errors = cell_errors(model, cells)
    abs_err = sorted(abs(e) for e in errors.values())
    check = goodput_check(model, cells)
    worst = min(check, key=lambda c: c["fraction_of_best"])
    below = [c for c in check if c["fraction_of_best"] < GOALS["min_cell_fraction_of_best"]]
    return {
        "goodput_cells_below_goal": len(below),
        "median_error": statistics.median(abs_err),
        "max_error": abs_err[-1],
        "errors": errors,
        "goodput_cells": check,
        "worst_goodput_cell": worst,
        "min_cell_fraction_of_best": worst["fraction_of_best"],
    }


def _r(x: float, n: int = 4) -> float:
    return round(x, n)


def _params(params: CostParams) -> dict[str, float]:
    return {k: float(f"{v:.6g}") for k, v in asdict(params).items()}


def _summary(ev: dict, worst: bool = True) -> dict:
    """The goal figures of an :func:`evaluate` result, rounded."""
    out = {k: _r(ev[k]) for k in ("median_error", "max_error", "min_cell_fraction_of_best")}
    if worst:
        out["worst_goodput_cell"] = {k: _r(v) for k, v in ev["worst_goodput_cell"].items()}
    out["goodput_cells_below_goal"] = ev["goodput_cells_below_goal"]
    return out


def run(datas: list[dict], names: list[str]) -> dict:
    """The ``"cost_fit"`` block for measured grids (see the module docstring)."""
    cells = combine(datas)
    params, weights, iterations = fit(cells)
    ev = evaluate(params, cells)
    over = sorted((b, k) for (b, k), e in ev["errors"].items() if abs(e) > GOALS["max_error"])
    batches = sorted({b for b, *_ in cells})
    # Sensitivity: the plain (non-robust) fixed point, the datasheet start unfitted, and
    # the fitted model judged on the cells' fastest and mean steps instead of medians.
    plain, _, _ = fit(cells, robust=False)
    sens = {"plain_least_squares": {"params": _params(plain), **_summary(evaluate(plain, cells))}}
    sens["datasheet_start_unfitted"] = _summary(evaluate(START, cells))
    for name, data in zip(names, datas, strict=True):
        sens[f"judged_on_{name}"] = _summary(evaluate(params, load_cells(data)))
        own, _, _ = fit(load_cells(data))
        sens[f"fitted_to_{name}_alone"] = {
            "params": _params(own), **_summary(evaluate(own, load_cells(data)), worst=False)
        }
    for stat in ("min_ms", "mean_ms"):
        sens[f"judged_on_{stat}"] = _summary(evaluate(params, combine(datas, stat)))
    online = online_check(params, cells)
    worst_online = min(online, key=lambda c: c["fraction_of_best"])
    return {
        "command": "python3 bench/fit_costs.py --write",
        "inputs": names,
        "gpu": sorted({d.get("gpu", "?") for d in datas}),
        "measured": [d.get("date") for d in datas],
        "statistic": "mean over the inputs of the per-cell median_ms",
        "method": "StepCostModel.fit to per-cell medians, Huber IRLS weights (c = 1.345, "
                  "MAD scale) on relative residuals, prior weights 1e-6, repeated with its "
                  "own result as the prior to a fixed point (knee scale 1)",
        "iterations": iterations,
        "params": _params(params),
        "knee_tokens": {str(b): round(params.knee_tokens(b)) for b in batches},
        "median_error": _r(ev["median_error"]),
        "max_error": _r(ev["max_error"]),
        "cells_over_max_error_goal": [[b, k] for b, k in over],
        "max_error_other_cells": _r(max(
            (abs(e) for c, e in ev["errors"].items() if c not in over), default=0.0)),
        "errors": {str(b): {str(k): _r(e) for (bb, k), e in sorted(ev["errors"].items())
                            if bb == b} for b in batches},
        "robust_weights": {str(b): {str(k): _r(w, 3) for (bb, k, *_), w
                                    in zip(cells, weights, strict=True) if bb == b}
                           for b in batches},
        "goodput_check": [{k: _r(v) for k, v in c.items()} for c in ev["goodput_cells"]],
        "worst_goodput_cell": {k: _r(v) for k, v in ev["worst_goodput_cell"].items()},
        "min_cell_fraction_of_best": _r(ev["min_cell_fraction_of_best"]),
        "goodput_cells_below_goal": ev["goodput_cells_below_goal"],
        "online_corrected": {
            "method": "from the model's k: measure it and its neighbours at that batch size "
                      "(50 steps each), refit with per-bucket corrections, move to the new "
                      "best k, until it stays",
            "min_cell_fraction_of_best": _r(worst_online["fraction_of_best"]),
            "cells_below_goal": sum(
                c["fraction_of_best"] < GOALS["min_cell_fraction_of_best"] for c in online),
            "max_cells_measured": max(c["cells_measured"] for c in online),
            "cells": [{k: (v if isinstance(v, list) else _r(v)) for k, v in c.items()}
                      for c in online],
        },
        "goals": {
            "median_error": {"goal": GOALS["median_error"],
                             "met": ev["median_error"] <= GOALS["median_error"]},
            "max_error": {"goal": GOALS["max_error"],
                          "met": ev["max_error"] <= GOALS["max_error"]},
            "min_cell_fraction_of_best": {
                "goal": GOALS["min_cell_fraction_of_best"],
                "met": ev["min_cell_fraction_of_best"] >= GOALS["min_cell_fraction_of_best"],
            },
        },
        "sensitivity": sens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, nargs="+", default=list(DEFAULT_INPUTS))
    parser.add_argument("--write", action="store_true",
                        help=f'store the results under "cost_fit" in {RESULTS.name}')
    args = parser.parse_args(argv)
    datas = [json.loads(p.read_text()) for p in args.input]
    out = run(datas, [p.name for p in args.input])
    p = out["params"]
    print("params (ms):", {k: (v if k == "knee_scale" else round(v * 1e3, 5))
                           for k, v in p.items()})
    print(f"knee (tokens) by B: {out['knee_tokens']}  ({out['iterations']} iterations)")
    print(f"median error {out['median_error']:.2%}, max {out['max_error']:.2%}; "
          f"cells over {GOALS['max_error']:.0%}: {out['cells_over_max_error_goal']}, "
          f"max of the others {out['max_error_other_cells']:.2%}")
    print("error (%) by B, k = 0..8:")
    for b, row in out["errors"].items():
        print(f"  B={b:<4}" + " ".join(f"{100 * e:+6.1f}" for e in row.values()))
    w = out["worst_goodput_cell"]
    print(f"goodput check: worst cell B={w['batch_size']} alpha={w['alpha']}: model k="
          f"{w['k_model']}, best k={w['k_best']}, {w['fraction_of_best']:.2%} of best")
    for c in out["goodput_check"]:
        if c["fraction_of_best"] < GOALS["min_cell_fraction_of_best"]:
            print(f"  below goal: {c}")
    for name, s in out["sensitivity"].items():
        print(f"sensitivity {name}: median {s['median_error']:.2%} max {s['max_error']:.2%}, "
              f"worst goodput cell {s.get('worst_goodput_cell', s['min_cell_fraction_of_best'])}, "
              f"{s['goodput_cells_below_goal']} cells below goal")
    o = out["online_corrected"]
    print(f"with online corrections: worst cell {o['min_cell_fraction_of_best']:.2%} of best, "
          f"{o['cells_below_goal']} cells below goal, at most {o['max_cells_measured']} "
          "cells measured per (B, alpha)")
    print("goals:", {k: v["met"] for k, v in out["goals"].items()})
    if args.write:
        # Load-modify-write: other keys of the results file belong to other benchmarks.
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        results["cost_fit"] = out
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote cost_fit to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
