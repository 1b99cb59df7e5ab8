"""Counter parsing, deltas across restarts, ratio of sums, Beta posteriors and E(k)."""

from __future__ import annotations

import random

import pytest

from specula.tuning import (
    AcceptanceEstimate,
    RuntimeMetrics,
    SpecDecodeCounters,
    counter_delta,
    expected_accepted_length,
    sum_counters,
    wilson_interval,
    window_delta,
)
from specula.tuning.acceptance import beta_cdf, beta_quantile, position_observations

# As vLLM exposes them (prometheus_client text format, counters with _total/_created).
VLLM_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama"} 1000.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="llama"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama"} 3000.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama"} 1800.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="0"} 800.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="1"} 600.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="2"} 400.0
"""


def specula_text(drafts: float, per_pos: list[float], gen: float, steps: float, secs: float) -> str:
    """The runtime's exposition (see specula/runtime/server/metrics.py), two model names."""
    lines = [
        "# HELP specula:spec_decode_num_drafts Number of spec decoding drafts.",
        "# TYPE specula:spec_decode_num_drafts counter",
    ]
    for name in ("a", "b"):
        lines.append(f'specula:spec_decode_num_drafts_total{{model_name="{name}"}} {drafts / 2}')
    lines += ["# TYPE specula:spec_decode_num_draft_tokens counter",
              f'specula:spec_decode_num_draft_tokens_total{{model_name="a"}} {drafts * len(per_pos)}',
              "# TYPE specula:spec_decode_num_accepted_tokens counter",
              f'specula:spec_decode_num_accepted_tokens_total{{model_name="a"}} {sum(per_pos)}',
              "# TYPE specula:spec_decode_num_accepted_tokens_per_pos counter"]
    for j, v in enumerate(per_pos):
        lines.append(
            f'specula:spec_decode_num_accepted_tokens_per_pos_total{{model_name="a",position="{j}"}} {v}'
        )
    lines += ["# TYPE specula:generation_tokens counter",
              f'specula:generation_tokens_total{{model_name="a"}} {gen}',
              "# TYPE specula:step_duration_seconds histogram"]
    sl = 'batch_bucket="3-4",model_name="a",num_speculative_tokens="3"'
    lines += [f'specula:step_duration_seconds_bucket{{{sl},le="0.01"}} {steps}',
              f'specula:step_duration_seconds_bucket{{{sl},le="+Inf"}} {steps}',
              f"specula:step_duration_seconds_sum{{{sl}}} {secs}",
              f"specula:step_duration_seconds_count{{{sl}}} {steps}"]
    return "\n".join(lines) + "\n"


def test_parses_vllm_prefix_and_ignores_created():
    c = SpecDecodeCounters.from_prometheus_text(VLLM_TEXT)
    assert c.num_drafts == 1000 and c.num_draft_tokens == 3000 and c.num_accepted_tokens == 1800
    assert c.num_accepted_tokens_per_pos == (800, 600, 400)
    assert c.mean_acceptance_length == pytest.approx(2.8)
    assert c.acceptance_rate == pytest.approx(0.6)


def test_parses_specula_prefix_summing_label_sets():
    m = RuntimeMetrics.from_prometheus_text(specula_text(400, [300, 200, 100], 1000, 100, 0.5))
    assert m.counters.num_drafts == 400  # 200 + 200 over two model_name label sets
    assert m.counters.num_accepted_tokens_per_pos == (300, 200, 100)
    assert m.generation_tokens == 1000
    assert m.step_times.series[("3-4", 3)].count == 100
    assert m.step_times.series[("3-4", 3)].sum_s == pytest.approx(0.5)
    assert m.measured_goodput == pytest.approx(2000.0)


def test_parser_matches_the_runtime_exporter():
    prom_metrics = pytest.importorskip("specula.runtime.server.metrics")
    from prometheus_client.exposition import generate_latest

    from specula.runtime.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = 50, 150, 70
    stats.num_accepted_tokens_per_pos = [40, 20, 10]
    snap = prom_metrics.RuntimeSnapshot(generation_tokens=120, spec_decoding=stats)
    snap.step_times.observe(4, 3, 0.02)
    snap.step_times.observe(100, 3, 0.05)
    text = generate_latest(prom_metrics.build_registry(lambda: snap, "m")).decode()
    m = RuntimeMetrics.from_prometheus_text(text)
    assert m.counters == SpecDecodeCounters(50, 150, 70, (40, 20, 10))
    assert m.generation_tokens == 120
    assert {k: s.count for k, s in m.step_times.series.items()} == {("3-4", 3): 1, ("65-128", 3): 1}


def test_invalid_text_raises():
    with pytest.raises(ValueError):
        SpecDecodeCounters.from_prometheus_text('specula:spec_decode_num_drafts_total{x="1" 3\n')


def test_counter_delta_and_reset():
    prev = SpecDecodeCounters(100, 300, 150, (80, 50, 20))
    cur = SpecDecodeCounters(150, 450, 240, (120, 80, 40))
    assert counter_delta(prev, cur) == SpecDecodeCounters(50, 150, 90, (40, 30, 20))
    restarted = SpecDecodeCounters(10, 30, 12, (7, 4, 1))
    assert counter_delta(prev, restarted) == restarted  # pod restart: counts since restart
    assert counter_delta(None, cur).num_drafts == 0  # first scrape: baseline only


def test_window_delta_handles_restart_and_new_pods():
    a0 = RuntimeMetrics.from_prometheus_text(specula_text(100, [60, 30, 10], 200, 50, 0.5))
    a1 = RuntimeMetrics.from_prometheus_text(specula_text(300, [180, 90, 30], 600, 150, 1.5))
    b0 = RuntimeMetrics.from_prometheus_text(specula_text(1000, [600, 300, 100], 2000, 500, 5.0))
    b1 = RuntimeMetrics.from_prometheus_text(specula_text(40, [24, 12, 4], 80, 20, 0.2))
    c1 = RuntimeMetrics.from_prometheus_text(specula_text(10, [5, 2, 1], 20, 5, 0.05))
    w = window_delta({"a": a0, "b": b0}, {"a": a1, "b": b1, "c": c1})
    assert w.counters.num_drafts == 200 + 40  # c is new: baseline only
    assert w.generation_tokens == 400 + 80
    assert w.step_times.total_count == 100 + 20


def test_ratio_of_sums_not_average_of_ratios():
    busy = SpecDecodeCounters(num_drafts=9000, num_draft_tokens=27000, num_accepted_tokens=18000,
                              num_accepted_tokens_per_pos=(8000, 6000, 4000))
    idle = SpecDecodeCounters(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=3,
                              num_accepted_tokens_per_pos=(2, 1, 0))
    total = sum_counters([busy, idle])
    assert total.mean_acceptance_length == pytest.approx(1 + 18003 / 9010)
    averaged = (busy.mean_acceptance_length + idle.mean_acceptance_length) / 2
    assert abs(total.mean_acceptance_length - averaged) > 0.8
    obs = position_observations(total, 3)
    assert obs == [(9010, 8002), (8002, 6001), (6001, 4000)]


def test_position_observations_only_below_k():
    c = SpecDecodeCounters(100, 200, 120, (70, 50, 0, 0))
    assert position_observations(c, 2) == [(100, 70), (70, 50)]
    assert position_observations(c, 0) == []


def test_unobserved_positions_keep_the_prior():
    est = AcceptanceEstimate.from_evidence([1000, 800], [800, 560], num_positions=5)
    # Observed trend (Laplace estimates 801/1002 and 561/802) continues into position 2.
    r = (561 / 802) / (801 / 1002)
    for j in (2, 3, 4):
        post = est.positions[j]
        assert post.trials == 0
        assert post.alpha + post.beta == pytest.approx(est.prior.strength)  # prior only
        assert post.mean == pytest.approx(est.positions[j - 1].mean * r)
        assert post.mean > 0.3  # not a zero
    # Without any evidence, position 0 is the uniform prior.
    blank = AcceptanceEstimate.from_evidence([], [], num_positions=2)
    assert (blank.positions[0].alpha, blank.positions[0].beta) == (1.0, 1.0)
    assert blank.positions[1].mean == pytest.approx(0.5 * 0.95)


def test_evidence_cap_keeps_posterior_width():
    est = AcceptanceEstimate.from_evidence([1e6], [8e5], 1, max_effective_trials=1000)
    assert est.positions[0].trials == 1000
    assert est.positions[0].mean == pytest.approx(801 / 1002)
    lo, hi = est.positions[0].credible_interval(0.95)
    assert 0.02 < hi - lo < 0.06


def test_expected_accepted_length_by_hand():
    a = [0.8, 0.5, 0.25]
    assert expected_accepted_length(a, 0) == 1.0
    assert expected_accepted_length(a, 1) == pytest.approx(1.8)
    assert expected_accepted_length(a, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_accepted_length(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    with pytest.raises(ValueError):
        expected_accepted_length(a, 4)


def test_intervals():
    lo, hi = wilson_interval(80, 100)
    assert lo == pytest.approx(0.7112, abs=1e-3) and hi == pytest.approx(0.8666, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert beta_cdf(0.3, 1, 1) == pytest.approx(0.3)
    assert beta_cdf(0.5, 3, 3) == pytest.approx(0.5)
    assert beta_quantile(0.975, 2, 5) == pytest.approx(0.6412, abs=1e-3)


def test_sampling_is_seeded():
    est = AcceptanceEstimate.from_evidence([100], [70], 3)
    a = est.sample(random.Random(7))
    assert a == est.sample(random.Random(7))
    assert len(a) == 3 and len(est.sample(random.Random(7), 2)) == 2
    mean = sum(est.sample(random.Random(i))[0] for i in range(2000)) / 2000
    assert mean == pytest.approx(est.positions[0].mean, abs=0.01)
