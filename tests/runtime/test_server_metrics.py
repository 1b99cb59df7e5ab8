"""Prometheus export of plain runtime counters (no engine: the exporters only read)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specula.runtime.server.metrics import (
    STEP_DURATION_BUCKETS_S,
    RuntimeSnapshot,
    StepTimeStats,
    batch_bucket,
    build_registry,
)
from specula.runtime.spec_decode.metrics import SpecDecodingStats

pytestmark = pytest.mark.runtime


@pytest.mark.parametrize(
    ("size", "label"),
    [(1, "1"), (2, "2"), (3, "3-4"), (4, "3-4"), (5, "5-8"), (8, "5-8"), (9, "9-16"),
     (32, "17-32"), (33, "33-64")],
)
def test_batch_bucket(size, label):
    assert batch_bucket(size) == label


def test_batch_bucket_rejects_empty_batch():
    with pytest.raises(ValueError):
        batch_bucket(0)


def _samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exposition_reads_counters_at_scrape_time():
    stats = SpecDecodingStats(num_spec_tokens=3)
    steps = StepTimeStats()
    snap = RuntimeSnapshot(step_times=steps, spec_decoding=stats)
    registry = build_registry(lambda: snap, "tiny")

    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = 4, 12, 7
    stats.num_accepted_tokens_per_pos[:] = [4, 2, 1]
    snap.num_requests_running, snap.num_requests_waiting, snap.generation_tokens = 2, 1, 11
    steps.observe(batch_size=3, num_speculative_tokens=3, seconds=0.004)
    steps.observe(batch_size=4, num_speculative_tokens=3, seconds=20.0)
    steps.observe(batch_size=1, num_speculative_tokens=2, seconds=0.0001)

    s = _samples(registry)
    m = (("model_name", "tiny"),)
    assert s[("specula:spec_decode_num_drafts_total", m)] == 4
    assert s[("specula:spec_decode_num_draft_tokens_total", m)] == 12
    assert s[("specula:spec_decode_num_accepted_tokens_total", m)] == 7
    for pos, v in enumerate([4, 2, 1]):
        key = ("specula:spec_decode_num_accepted_tokens_per_pos_total",
               (("model_name", "tiny"), ("position", str(pos))))
        assert s[key] == v
    assert s[("specula:num_requests_running", m)] == 2
    assert s[("specula:num_requests_waiting", m)] == 1
    assert s[("specula:generation_tokens_total", m)] == 11

    def hist(name, bucket, k, **extra):
        labels = {"model_name": "tiny", "batch_bucket": bucket, "num_speculative_tokens": k,
                  **extra}
        return s[(f"specula:step_duration_seconds_{name}", tuple(sorted(labels.items())))]

    assert hist("count", "3-4", "3") == 2
    assert hist("sum", "3-4", "3") == pytest.approx(20.004)
    assert hist("bucket", "3-4", "3", le="0.005") == 1
    assert hist("bucket", "3-4", "3", le=str(STEP_DURATION_BUCKETS_S[-1])) == 1
    assert hist("bucket", "3-4", "3", le="+Inf") == 2
    assert hist("bucket", "1", "2", le="0.001") == 1


def test_no_speculator_exports_no_spec_counters():
    registry = build_registry(lambda: RuntimeSnapshot(generation_tokens=5), "tiny")
    names = {name for name, _ in _samples(registry)}
    assert "specula:generation_tokens_total" in names
    assert not any(n.startswith("specula:spec_decode") for n in names)


def test_registries_are_private():
    a = build_registry(lambda: RuntimeSnapshot(generation_tokens=1), "a")
    b = build_registry(lambda: RuntimeSnapshot(generation_tokens=2), "b")
    assert _samples(a)[("specula:generation_tokens_total", (("model_name", "a"),))] == 1
    assert _samples(b)[("specula:generation_tokens_total", (("model_name", "b"),))] == 2


def test_kv_cache_usage_and_preemptions():
    snap = RuntimeSnapshot(num_preemptions=3, kv_cache_usage=0.25)
    samples = _samples(build_registry(lambda: snap, "tiny"))
    labels = (("model_name", "tiny"),)
    assert samples[("specula:num_preemptions_total", labels)] == 3
    assert samples[("specula:kv_cache_usage_perc", labels)] == 0.25
