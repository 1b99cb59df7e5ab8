"""Pure helpers of the demo's tuning phase: phase schedule, settings, table rows, phase summary."""

from __future__ import annotations

import pytest

from specula.demo.tuning import (
    HEADER,
    IntervalRecord,
    demo_settings,
    format_interval,
    format_phase,
    phase_schedule,
    summarize_phases,
)


def _rec(i, workload, k0, k1, reason="NoGain", drafts=100.0, draft_tokens=400.0, accepted=200.0,
         acc=0.5, length=3.0, goodput=600.0):
    return IntervalRecord(
        interval=i, workload=workload, k_before=k0, k_after=k1, applied=k0 != k1, reason=reason,
        message="", acceptance_rate=acc, mean_acceptance_length=length,
        goodput_tokens_per_second=goodput, predicted_gain=None, wall_s=1.0, num_drafts=drafts,
        num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
    )


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (3, ["code", "prose", "code"]),
        (7, ["code"] * 3 + ["prose"] * 2 + ["code"] * 2),
        (8, ["code"] * 3 + ["prose"] * 3 + ["code"] * 2),
    ],
)
def test_phase_schedule_three_phases(n, expected):
    assert phase_schedule(n) == expected


def test_phase_schedule_18_is_six_each():
    s = phase_schedule(18)
    assert s == ["code"] * 6 + ["prose"] * 6 + ["code"] * 6


def test_phase_schedule_rejects_fewer_than_three():
    with pytest.raises(ValueError, match="at least 3"):
        phase_schedule(2)


def test_demo_settings_are_in_interval_units():
    s = demo_settings(interval_s=2.0, max_k=8)
    assert s.mode == "Auto"
    assert (s.min_speculative_tokens, s.max_speculative_tokens) == (0, 8)
    assert s.cooldown_s == s.interval_s == 2.0
    assert s.min_gain == pytest.approx(0.03)
    # Every duration scales with the interval, so halving it halves them all.
    half = demo_settings(interval_s=1.0)
    for name in ("cooldown_s", "acceptance_half_life_s", "unobserved_half_life_s",
                 "blacklist_s", "cost_half_life_s"):
        assert getattr(half, name) * 2 == getattr(s, name)


def test_format_interval_shows_change_and_missing_values():
    changed = format_interval(_rec(4, "prose", 7, 5, reason="HigherGoodput", acc=0.4123,
                                   length=3.891, goodput=476.4))
    assert changed.split() == ["4", "prose", "0.412", "3.89", "476", "7", "->", "5",
                               "HigherGoodput"]
    kept = format_interval(_rec(12, "code", 5, 5, acc=None, length=None, goodput=None))
    assert kept.split() == ["12", "code", "n/a", "n/a", "n/a", "5", "NoGain"]
    # Rows line up under the header.
    assert len(changed) >= HEADER.index("reason")
    assert changed.index("HigherGoodput") == HEADER.index("reason")


def test_summarize_phases_groups_runs_and_pools_counters():
    records = [
        _rec(1, "code", 3, 6, drafts=100, draft_tokens=300, accepted=240),
        _rec(2, "code", 6, 6, drafts=50, draft_tokens=300, accepted=150),
        _rec(3, "prose", 6, 4, drafts=100, draft_tokens=600, accepted=150),
        _rec(4, "prose", 4, 4, drafts=100, draft_tokens=400, accepted=100),
        _rec(5, "code", 4, 5, drafts=0, draft_tokens=0, accepted=0),
        _rec(6, "code", 5, 4),
    ]
    phases = summarize_phases(records)
    assert [p["workload"] for p in phases] == ["code", "prose", "code"]
    assert [p["intervals"] for p in phases] == [[1, 2], [3, 4], [5, 6]]
    assert [(p["k_start"], p["k_end"]) for p in phases] == [(3, 6), (6, 4), (4, 4)]
    assert [p["k_visited"] for p in phases] == [[3, 6], [6, 4], [4, 5, 4]]
    assert [p["changes"] for p in phases] == [1, 1, 2]
    # Ratio of sums, not a mean of the per-interval ratios (which would be 0.65).
    assert phases[0]["acceptance_rate"] == pytest.approx(390 / 600)
    assert phases[0]["mean_acceptance_length"] == pytest.approx(1 + 390 / 150)
    assert phases[1]["acceptance_rate"] == pytest.approx(250 / 1000)
    line = format_phase(phases[2])
    assert "phase 3 (code, intervals 5-6)" in line
    assert "k 4 -> 5 -> 4 (ends at 4)" in line


def test_summarize_phases_empty_window_has_no_rates():
    (p,) = summarize_phases([_rec(1, "prose", 3, 3, drafts=0, draft_tokens=0, accepted=0)])
    assert p["acceptance_rate"] is None and p["mean_acceptance_length"] is None
    assert "acceptance n/a" in format_phase(p)
