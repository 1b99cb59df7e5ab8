"""The tuner's closed loop on the real engine (``bench/tuning_closed_loop.py``) on a tiny
CPU model, in logical time: every engine step lasts a fixed cost ``T(k)`` on a clock
the engine loop times steps with, so the tuner's decisions do not depend on the
machine.  The operator's tuning tick moves k up while every draft is accepted and down
to 0 once none is, through ``/metrics`` and the admin API over HTTP; the metrics are
computed as the issue defines them."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest

from bench.engine_e2e import TINY, TINY_DRAFT, make_engine, write_checkpoints
from bench.tuning_closed_loop import (
    ClosedLoopEngine,
    LoopConfig,
    Phase,
    closed_loop_metrics,
    compare,
    start,
    static_phase_goodput,
)
from specula.operator.tuner import ready_endpoints
from specula.runtime.server import engine_loop

pytestmark = pytest.mark.runtime

BATCH = 8
STEP_S, DRAFT_S = 6e-3, 0.5e-3


def step_cost(batch: int, k: int) -> float:
    """Logical seconds of one step: a fixed part and a part per drafted position."""
    return STEP_S + DRAFT_S * k


class LogicalClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def iv(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "engine_s": seconds, "steps": 1, "k_steps": {}}


def test_metrics_as_defined():
    # Two phases of 3 intervals of 1 s.  k=0 wins phase 2, k=3 phase 1.
    tuned = [[iv(100, 1), iv(300, 1), iv(300, 1)], [iv(200, 1), iv(180, 1), iv(200, 1)]]
    static = {
        0: [[iv(100, 1), iv(150, 1)], [iv(190, 1), iv(200, 1)]],
        3: [[iv(120, 1), iv(300, 1)], [iv(90, 1), iv(100, 1)]],
    }
    m = closed_loop_metrics(tuned, static, k0_phase=1, settle_intervals=2)
    # Static phases extrapolated to 3 s: first interval, then the later rate.
    g0 = [(100 + 150 * 2) / 3, (190 + 200 * 2) / 3]
    g3 = [(120 + 300 * 2) / 3, (90 + 100 * 2) / 3]
    assert static_phase_goodput(static[0][0], 3.0) == pytest.approx(g0[0])
    tuned_overall = (700 + 580) / 6
    s0, s3 = sum(g0) / 2, sum(g3) / 2
    best = max(s0, s3)
    oracle = (max(g0[0], g3[0]) + max(g0[1], g3[1])) / 2
    assert m["best_static_k"] == (0 if s0 > s3 else 3)
    assert m["phase_best_static_k"] == [3, 0]
    assert m["gain_over_best_static"] == pytest.approx(tuned_overall / best - 1, abs=1e-4)
    assert m["oracle_headroom_captured"] == pytest.approx(
        (tuned_overall - best) / (oracle - best), abs=1e-4)
    assert m["k0_phase_loss"] == pytest.approx(1 - (580 / 3) / g0[1], abs=1e-4)
    # After 2 settling intervals: 300 against 300 (k=3), 200 against 200 (k=0).
    assert m["phase_fraction_after_3"] == [1.0, 1.0]
    assert m["worst_phase_fraction_after_3"] == 1.0
    assert m["checks"] == {"above_best_static": True, "headroom_captured_ge_0.5": True,
                           "phases_ge_0.97_after_3": True, "k0_phase_loss_le_0.02": True}
    assert m["verdict"] == "pass"

    # At the best static k's level (k=3 in phase 2 from the start): refuted.
    weak = [tuned[0], [iv(90, 1), iv(100, 1), iv(100, 1)]]
    m = closed_loop_metrics(weak, static, k0_phase=1, settle_intervals=2)
    assert m["gain_over_best_static"] <= 0 and m["verdict"] == "refuted"
    assert not m["checks"]["k0_phase_loss_le_0.02"]
    with pytest.raises(ValueError):
        closed_loop_metrics(tuned, {}, k0_phase=1)
    with pytest.raises(ValueError):
        closed_loop_metrics(tuned, {0: static[0][:1]}, k0_phase=1)


@pytest.fixture
def harness(tmp_path: Path, monkeypatch):
    clock = LogicalClock()
    # The engine loop times each step with this clock: a step lasts step_cost(...).
    monkeypatch.setattr(engine_loop, "time", types.SimpleNamespace(perf_counter=clock.now))
    cfg = LoopConfig(
        # 8 requests give enough drafts per interval for the acceptance estimate to
        # follow the collapse within the phase.
        phases=(Phase(BATCH, 1.0, intervals=3), Phase(BATCH, 0.0, intervals=9)),
        interval_engine_s=None,
        interval_steps=60,
        static_ks=(0, 2),
        static_intervals=2,
        start_k=1,
        max_k=4,
        prompt_len=8,
        max_tokens=(24, 40),
        k0_phase=1,
    )
    dirs = write_checkpoints(tmp_path, TINY, TINY_DRAFT)
    engine = make_engine(dirs, "eagle3", cfg.max_k, (BATCH,), "cpu", 1.0)
    gate = ClosedLoopEngine(engine, clock=clock.now, step_cost=step_cost, advance=clock.advance)
    h = start(engine, cfg, gate, log=lambda _: None)
    yield h
    h.loop.stop()
    h.served.close()


def test_closed_loop_moves_k_and_measures(harness):
    result = compare(harness)
    tuned = result["tuned"]
    cfg = harness.cfg

    # Lockstep: every interval is exactly interval_steps steps of logical cost.
    for rec in (r for phase in tuned for r in phase):
        assert rec["steps"] == cfg.interval_steps
        expected = sum(n * step_cost(BATCH, int(k)) for k, n in rec["k_steps"].items())
        prefill_only = rec["steps"] - sum(rec["k_steps"].values())
        assert rec["engine_s"] == pytest.approx(expected + prefill_only * STEP_S)

    up, down = tuned
    ks_up = [cfg.start_k] + [r["tuner"]["k"] for r in up]
    ks_down = [r["tuner"]["k"] for r in down]
    # Every draft accepted: the tuner raises k, and never lowers it.
    assert ks_up[-1] > cfg.start_k
    assert all(b >= a for a, b in zip(ks_up, ks_up[1:], strict=False))
    # No draft accepted: it never raises k, comes down to 0 and stays there; the engine
    # ran the k the tuner put through the admin API.
    assert all(b <= a for a, b in zip([ks_up[-1], *ks_down], ks_down, strict=False))
    assert ks_down[-1] == ks_down[-2] == 0
    assert down[-1]["k_steps"] == {"0": cfg.interval_steps}

    # The scrape measures what the engine did: the tuner's window goodput is the
    # interval's tokens over its engine time.  (Status keeps the last window that
    # drafted, and steps that decoded nothing are not in the step-time histogram.)
    for rec in (r for phase in tuned for r in phase):
        if sum(rec["k_steps"].values()) == rec["steps"] and "0" not in rec["k_steps"]:
            assert rec["tuner"]["measured_goodput"] == pytest.approx(
                rec["tokens"] / rec["engine_s"], rel=1e-4)

    # Metrics as defined, from the records.
    m = result["metrics"]
    assert m == closed_loop_metrics(tuned, {int(k): v for k, v in result["static"].items()},
                                    k0_phase=1)
    total_tokens = sum(r["tokens"] for phase in tuned for r in phase)
    total_s = sum(r["engine_s"] for phase in tuned for r in phase)
    assert m["overall_goodput"]["tuned"] == pytest.approx(total_tokens / total_s, abs=0.01)
    k0_phase = [r["tokens"] for r in result["static"]["0"][1]]
    k0_s = [r["engine_s"] for r in result["static"]["0"][1]]
    d = sum(r["engine_s"] for r in down)
    k0_rate = (k0_phase[0] + k0_phase[1] / k0_s[1] * (d - k0_s[0])) / d
    down_rate = sum(r["tokens"] for r in down) / d
    assert m["k0_phase_loss"] == pytest.approx(1 - down_rate / k0_rate, abs=1e-4)
    assert m["phase_best_static_k"] == [2, 0]
    assert math.isfinite(m["gain_over_best_static"])


def test_schedule_run_follows_batch_size(tmp_path: Path, monkeypatch):
    """``run_tuned(schedules=True)`` on a bursty phase (2 <-> 8 clients every 10 steps):
    the tuner PUTs per-batch-size schedules, and in every interval the engine drafts, at
    each batch size, the k the schedule in effect gives it."""
    from specula.tuning.goodput import schedule_k

    clock = LogicalClock()
    monkeypatch.setattr(engine_loop, "time", types.SimpleNamespace(perf_counter=clock.now))
    cfg = LoopConfig(
        phases=(Phase(BATCH, 1.0, intervals=4, low_batch=2, burst_steps=10),),
        interval_engine_s=None,
        interval_steps=60,
        start_k=1,
        max_k=4,
        prompt_len=8,
        max_tokens=(24, 40),
        k0_phase=None,
    )
    dirs = write_checkpoints(tmp_path, TINY, TINY_DRAFT)
    engine = make_engine(dirs, "eagle3", cfg.max_k, (2, BATCH), "cpu", 1.0)
    gate = ClosedLoopEngine(engine, clock=clock.now, step_cost=step_cost, advance=clock.advance)
    h = start(engine, cfg, gate, log=lambda _: None)
    try:
        (phase,) = h.run_tuned(schedules=True)
        (reading,) = h.served.client.read_all(ready_endpoints(h.served.kube.slices))
        config = reading.speculative_config
    finally:
        h.loop.stop()
        h.served.close()
    assert h.schedules_through is not None
    schedules = [rec["tuner"]["schedule"] for rec in phase]
    assert all(s for s in schedules)
    # The pod runs the last schedule the tuner decided.
    assert config["num_speculative_tokens_per_batch_size"] == schedules[-1]
    # Both batch sizes ran, and each ran the k of the schedule in effect (the one
    # decided after the interval before; a step in flight at the PUT may keep the old k).
    for before, rec in zip(schedules, phase[1:], strict=False):
        by_batch = rec["k_steps_by_batch"]
        assert {"2", str(BATCH)} <= set(by_batch)
        for batch, ks in by_batch.items():
            main_k = max(ks, key=ks.__getitem__)
            assert int(main_k) == schedule_k(before, int(batch)), (batch, ks, before)
    # Every draft accepted: the tuner raised k.
    assert max(k for s in schedules for _, _, k in s) > cfg.start_k
