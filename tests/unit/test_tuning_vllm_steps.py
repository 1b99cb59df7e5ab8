"""Step times of vLLM pods, from ``vllm:iteration_tokens_total`` and
``vllm:inter_token_latency_seconds`` (vLLM exports no step-time histogram)."""

from __future__ import annotations

import pytest

from specula.tuning import RuntimeMetrics, TuningSettings, TuningState, decide, window_delta
from specula.tuning.vllm_steps import EngineStepCounters

LABELS = 'engine="0",model_name="qwen"'


def vllm_text(*, steps, itl_count, itl_sum, drafts, k, accepted, generated) -> str:
    """``/metrics`` of a vLLM pod (only the series the tuner reads)."""
    per_pos = [accepted * 0.5, accepted * 0.3, accepted * 0.2][:k]
    return "\n".join([
        "# TYPE vllm:iteration_tokens_total histogram",
        f'vllm:iteration_tokens_total_bucket{{{LABELS},le="+Inf"}} {steps}',
        f"vllm:iteration_tokens_total_count{{{LABELS}}} {steps}",
        f"vllm:iteration_tokens_total_sum{{{LABELS}}} {generated * 2}",
        "# TYPE vllm:inter_token_latency_seconds histogram",
        f'vllm:inter_token_latency_seconds_bucket{{{LABELS},le="+Inf"}} {itl_count}',
        f"vllm:inter_token_latency_seconds_count{{{LABELS}}} {itl_count}",
        f"vllm:inter_token_latency_seconds_sum{{{LABELS}}} {itl_sum}",
        "# TYPE vllm:spec_decode_num_drafts counter",
        f"vllm:spec_decode_num_drafts_total{{{LABELS}}} {drafts}",
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}} {drafts * k}",
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}} {accepted}",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        *(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABELS},position="{j}"}} {n}'
            for j, n in enumerate(per_pos)
        ),
        "# TYPE vllm:generation_tokens counter",
        f"vllm:generation_tokens_total{{{LABELS}}} {generated}",
    ]) + "\n"


def scrape(scale: float, k: int = 3) -> RuntimeMetrics:
    return RuntimeMetrics.from_prometheus_text(vllm_text(
        steps=300 * scale, itl_count=1200 * scale, itl_sum=12.0 * scale,
        drafts=1200 * scale, k=k, accepted=1000 * scale, generated=2200 * scale,
    ))


def test_a_window_gets_the_mean_step_at_the_mean_batch_and_k():
    window = scrape(3).delta(scrape(2))
    ((bucket, k), series), = window.step_times.series.items()
    # 1200 request-steps in 300 steps: batch 4; 12 s over 1200: 10 ms per step.
    assert (bucket, k) == ("3-4", 3)
    assert series.count == 300
    assert series.mean_s == pytest.approx(0.010)
    assert window.measured_goodput == pytest.approx(2200 / 3.0)
    # Batch from the tokens: (generated - accepted) / steps.
    assert window.mean_batch_size == pytest.approx(4.0)


def test_cumulative_scrapes_hold_no_histogram_and_round_trip():
    first = scrape(1)
    assert first.step_times.series == {}
    assert first.engine_steps == EngineStepCounters(300, 1200, 12.0)
    assert RuntimeMetrics.from_dict(first.to_dict()) == first
    # Baselines stored before this field existed read as zeros.
    legacy = {k: v for k, v in first.to_dict().items() if k != "engineSteps"}
    assert RuntimeMetrics.from_dict(legacy).engine_steps == EngineStepCounters()


def test_restart_takes_the_whole_scrape_as_the_window():
    window = scrape(1).delta(scrape(5))
    ((_, _), series), = window.step_times.series.items()
    assert series.count == 300


def test_specula_histograms_are_not_replaced():
    text = vllm_text(steps=10, itl_count=40, itl_sum=0.4, drafts=40, k=2, accepted=30,
                     generated=70).replace("vllm:", "specula:") + (
        "# TYPE specula:step_duration_seconds histogram\n"
        'specula:step_duration_seconds_bucket{batch_bucket="2",num_speculative_tokens="2",'
        'le="+Inf"} 20\n'
        'specula:step_duration_seconds_count{batch_bucket="2",num_speculative_tokens="2"} 20\n'
        'specula:step_duration_seconds_sum{batch_bucket="2",num_speculative_tokens="2"} 0.5\n'
    )
    window = RuntimeMetrics.from_prometheus_text(text).delta(RuntimeMetrics())
    assert set(window.step_times.series) == {("2", 2)}


def test_no_drafts_is_k_zero_and_no_outputs_no_steps():
    plain = vllm_text(steps=100, itl_count=100, itl_sum=1.0, drafts=0, k=3, accepted=0,
                      generated=100)
    window = RuntimeMetrics.from_prometheus_text(plain).delta(RuntimeMetrics())
    assert list(window.step_times.series) == [("1", 0)]
    idle = scrape(2).delta(scrape(2))
    assert idle.step_times.series == {}


def test_the_tuner_decides_on_vllm_windows():
    """With step times the policy has data: no longer InsufficientData."""
    settings = TuningSettings(mode="Recommend", max_speculative_tokens=4)
    state = TuningState.initial(3, settings)
    window = window_delta({"pod": scrape(1)}, {"pod": scrape(2)})
    decision = decide(state, window, settings, now=1000.0)
    assert decision.reason != "InsufficientData", decision.message
    # 2200 tokens over 300 steps of 10 ms.
    assert decision.goodput_tokens_per_second == pytest.approx(2200 / (300 * 0.010))
