"""Demo figures from Prometheus text: both prefixes, ``_total`` suffixes, vLLM definitions."""

from __future__ import annotations

import pytest

from specula.demo.measure import SpecCounters, parse_counters

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
specula:step_duration_seconds_bucket{batch_bucket="1",k="4",le="+Inf"} 3.0
specula:step_duration_seconds_count{batch_bucket="1",k="4"} 3.0
specula:step_duration_seconds_sum{batch_bucket="1",k="4"} 0.3
"""


def test_parse_specula_counters_and_derived_figures() -> None:
    c = parse_counters(SPECULA_TEXT)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 40, 22)
    assert c.accepted_per_pos == {0: 9, 1: 7, 2: 4, 3: 2}
    assert c.generation_tokens == 64
    assert c.acceptance_rate() == pytest.approx(22 / 40)
    assert c.mean_acceptance_length() == pytest.approx(1 + 22 / 10)
    assert c.per_position_acceptance() == pytest.approx([0.9, 0.7, 0.4, 0.2])


def test_vllm_prefix_and_label_sets_are_summed() -> None:
    text = SPECULA_TEXT.replace("specula:", "vllm:") + (
        'vllm:spec_decode_num_drafts_total{model_name="other"} 5.0\n'
    )
    c = parse_counters(text)
    assert c.num_drafts == 15 and c.num_accepted_tokens == 22


def test_deltas_between_scrapes() -> None:
    before = SpecCounters(2, 8, 5, {0: 2, 1: 2, 2: 1, 3: 0}, 20)
    delta = parse_counters(SPECULA_TEXT) - before
    assert (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens) == (8, 32, 17)
    assert delta.accepted_per_pos == {0: 7, 1: 5, 2: 3, 3: 2}
    assert delta.generation_tokens == 44


def test_no_speculator_gives_no_figures() -> None:
    c = parse_counters(
        "# TYPE specula:generation_tokens counter\n"
        'specula:generation_tokens_total{model_name="t"} 3.0\n'
    )
    assert c.generation_tokens == 3
    assert c.acceptance_rate() is None and c.mean_acceptance_length() is None
    assert c.per_position_acceptance() == []


def test_malformed_exposition_raises() -> None:
    with pytest.raises(ValueError):
        parse_counters("specula:spec_decode_num_drafts_total{position=} nope\n")
