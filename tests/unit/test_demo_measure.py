"""Demo figures from a scrape parsed by :class:`RuntimeMetrics`: both prefixes, label sets
summed, deltas between scrapes, vLLM definitions."""

from __future__ import annotations

import pytest

from specula.demo.measure import per_position_acceptance
from specula.tuning import RuntimeMetrics, SpecDecodeCounters

SPECULA_TEXT = """\
# HELP specula:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE specula:spec_decode_num_drafts counter
specula:spec_decode_num_drafts_total{model_name="target"} 10.0
# HELP specula:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE specula:spec_decode_num_draft_tokens counter
specula:spec_decode_num_draft_tokens_total{model_name="target"} 40.0
# HELP specula:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE specula:spec_decode_num_accepted_tokens counter
specula:spec_decode_num_accepted_tokens_total{model_name="target"} 22.0
# HELP specula:spec_decode_num_accepted_tokens_per_pos Accepted tokens per position.
# TYPE specula:spec_decode_num_accepted_tokens_per_pos counter
specula:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="0"} 9.0
specula:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="1"} 7.0
specula:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="2"} 4.0
specula:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="3"} 2.0
# HELP specula:generation_tokens Generated tokens.
# TYPE specula:generation_tokens counter
specula:generation_tokens_total{model_name="target"} 64.0
# HELP specula:step_duration_seconds Step time.
# TYPE specula:step_duration_seconds histogram
specula:step_duration_seconds_bucket{batch_bucket="1",num_speculative_tokens="4",le="+Inf"} 3.0
specula:step_duration_seconds_count{batch_bucket="1",num_speculative_tokens="4"} 3.0
specula:step_duration_seconds_sum{batch_bucket="1",num_speculative_tokens="4"} 0.3
"""


def test_parse_specula_counters_and_derived_figures() -> None:
    m = RuntimeMetrics.from_prometheus_text(SPECULA_TEXT)
    c = m.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 40, 22)
    assert c.num_accepted_tokens_per_pos == (9, 7, 4, 2)
    assert m.generation_tokens == 64
    assert m.step_times.total_count == 3
    assert c.acceptance_rate == pytest.approx(22 / 40)
    assert c.mean_acceptance_length == pytest.approx(1 + 22 / 10)
    assert per_position_acceptance(c) == pytest.approx([0.9, 0.7, 0.4, 0.2])


def test_vllm_prefix_and_label_sets_are_summed() -> None:
    text = SPECULA_TEXT.replace("specula:", "vllm:") + (
        'vllm:spec_decode_num_drafts_total{model_name="other"} 5.0\n'
    )
    c = RuntimeMetrics.from_prometheus_text(text).counters
    assert c.num_drafts == 15 and c.num_accepted_tokens == 22


def test_deltas_between_scrapes() -> None:
    before = RuntimeMetrics(SpecDecodeCounters(2, 8, 5, (2, 2, 1, 0)), generation_tokens=20)
    delta = RuntimeMetrics.from_prometheus_text(SPECULA_TEXT).delta(before)
    c = delta.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (8, 32, 17)
    assert c.num_accepted_tokens_per_pos == (7, 5, 3, 2)
    assert delta.generation_tokens == 44
    # The demo's per-position figure is taken over the window, not since process start.
    assert per_position_acceptance(c) == pytest.approx([7 / 8, 5 / 8, 3 / 8, 2 / 8])


def test_no_speculator_gives_no_figures() -> None:
    m = RuntimeMetrics.from_prometheus_text(
        "# TYPE specula:generation_tokens counter\n"
        'specula:generation_tokens_total{model_name="t"} 3.0\n'
    )
    assert m.generation_tokens == 3
    c = m.counters
    assert c.acceptance_rate is None and c.mean_acceptance_length is None
    assert per_position_acceptance(c) == []


def test_malformed_exposition_raises() -> None:
    with pytest.raises(ValueError):
        RuntimeMetrics.from_prometheus_text("specula:spec_decode_num_drafts_total{position=} nope\n")
