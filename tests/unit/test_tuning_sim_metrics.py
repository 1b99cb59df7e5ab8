"""The tuning simulator's figures are computed as open issue 13 defines them
(``bench/tuning/metrics.py``): checked on hand-made tables whose values are worked out
by hand, and on a short simulation whose outcome is fixed by the tuner's bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.tuning import metrics as M
from bench.tuning.model import TableCost, flat_profile
from bench.tuning.traces import Phase, Trace
from bench.tuning_sim import evaluate, shipped_settings, summarise

# Two k (0 and 1), four intervals in two phases of two.
G = [[10.0, 12.0], [10.0, 12.0], [10.0, 8.0], [10.0, 8.0]]
GOT = [10.0, 12.0, 10.0, 10.0]


def test_best_fixed_and_headroom():
    # Both columns average 10: the tie goes to the smaller k.
    assert M.column_means(G) == [10.0, 10.0]
    assert M.best_fixed_k(G) == 0
    # Oracle (12 + 12 + 10 + 10) / 4 = 11 over 10.
    assert M.oracle_mean(G) == pytest.approx(11.0)
    assert M.headroom(G) == pytest.approx(0.1)
    assert M.fraction_of_best_fixed(GOT, G) == pytest.approx(1.05)


def test_headroom_captured_both_ways():
    # Throughput-weighted: (10.5 - 10) / (11 - 10).
    assert M.captured_throughput(GOT, G) == pytest.approx(0.5)
    # Per interval: f(got) = (10/12 + 1 + 1 + 1) / 4 = 23/24; the best static is k = 0
    # with (10/12 + 10/12 + 1 + 1) / 4 = 11/12 (k = 1: (1 + 1 + 0.8 + 0.8) / 4 = 0.9);
    # (23/24 - 22/24) / (1 - 22/24) = 0.5.
    assert M.per_interval_fraction(GOT, G) == pytest.approx(23 / 24)
    assert M.best_static_per_interval(G) == (0, pytest.approx(11 / 12))
    assert M.captured_per_interval(GOT, G) == pytest.approx(0.5)
    # No headroom: nothing to capture.
    flat = [[10.0, 9.0]] * 3
    assert M.captured_throughput([10.0] * 3, flat) is None
    assert M.captured_per_interval([10.0] * 3, flat) is None


def test_convergence_per_phase():
    conv = M.convergence(GOT, G, [2, 2])
    # Phase 0: best fixed k = 1 (12); interval 0 has 10 < 0.95 * 12, interval 1 has 12.
    assert conv[0] == {"best_k": 1, "intervals_to_converge": 1, "near_optimal_after": None}
    # Phase 1: best fixed k = 0; near-optimal from its first interval, and the one after.
    assert conv[1] == {"best_k": 0, "intervals_to_converge": 0, "near_optimal_after": 1.0}
    # Never near-optimal: the phase's length.
    assert M.convergence([5.0, 5.0], G[:2], [2])[0]["intervals_to_converge"] == 2
    # After converging, one interval in two near-optimal.
    got = [12.0, 12.0, 10.0]
    rows = [[10.0, 12.0]] * 3
    assert M.convergence(got, rows, [3])[0]["near_optimal_after"] == pytest.approx(0.5)


def test_flaps_probes_and_k0_loss():
    changes = [
        M.Change(1, "0", "1", "Explore"),
        M.Change(2, "1", "0", "Revert"),          # 0 -> 1 -> 0 in 1 interval: a flap
        M.Change(20, "0", "1", "HigherGoodput"),  # 1 -> 0 -> 1 in 18: too far apart
        M.Change(31, "1", "0", "HigherGoodput"),  # 0 -> 1 -> 0 in 11: too far apart
        M.Change(35, "0", "2", "HigherGoodput"),
        M.Change(36, "2", "3", "HigherGoodput"),  # 0 -> 2 -> 3: not back to A
    ]
    assert M.count_flaps(changes) == 1
    assert M.count_flaps(changes, window=11) == 2
    assert M.probes(changes) == 1
    # 1 - 10.5 / 10.
    assert M.loss_against_k0(GOT, G) == pytest.approx(-0.05)


def test_short_simulation_with_k_pinned_by_bounds():
    # Every step takes 10 ms whatever B and k; acceptance 0.5 at every position, no
    # jitter; k pinned to 3 by the bounds.  Per interval the busy time is 25/50/25 % at
    # batch 3/4/5, so goodput = 4 * E(k) / 0.01 s with E(k) = 2 - 0.5^k.
    cost = TableCost({(b, k): 10.0 for b in (1, 8) for k in range(9)})
    trace = Trace("flat", "stationary", (Phase("half", 4, 6),), cost=cost, jitter_sd=0.0,
                  profiles={"half": flat_profile(0.5)})
    settings, k0 = shipped_settings()
    assert k0 == 3 and settings.cooldown_s == 120.0 and settings.interval_s == 30.0
    pinned = replace(settings, min_speculative_tokens=3, max_speculative_tokens=3)
    r = evaluate(trace, pinned, 3)
    assert r["k_trajectory"] == [3] * 6 and r["changes"] == []
    g = r["goodput_tokens_per_s"]
    assert g["tuner"] == pytest.approx(750.0)            # 400 * 1.875
    assert g["best_fixed"] == pytest.approx(798.4, abs=0.05)  # 400 * (2 - 1/256)
    assert g["no_speculation"] == pytest.approx(400.0)
    assert r["best_fixed_k"] == 8
    assert r["fraction_of_best_fixed"] == pytest.approx(1.875 / 1.99609375, abs=1e-4)
    assert r["headroom"] == 0.0 and r["headroom_captured"] is None
    assert r["loss_against_k0"] == pytest.approx(1 - 750 / 400)
    # 750 < 0.95 * 798.4: never near-optimal.
    assert r["convergence"][0]["intervals_to_converge"] == 6
    assert r["flaps"] == 0 and r["probes"] == 0
    s = summarise([r, {**r, "kind": "k0"}])
    assert s["stationary_fraction_of_best_fixed"] == r["fraction_of_best_fixed"]
    assert s["flaps_per_100"] == 0.0 and s["k0_case_loss"] == r["loss_against_k0"]
    assert s["min_headroom_captured"] is None
