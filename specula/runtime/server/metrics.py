"""Step-time counting and the Prometheus export, at scrape time, of the
:class:`RuntimeSnapshot` the engine loop publishes (speculative-decoding counters by
:class:`~specula.runtime.spec_decode.metrics_prom.SpecDecodingProm`), in a private
``CollectorRegistry`` per app so that several apps (tests) in one process do not collide.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from specula.runtime.spec_decode.metrics_prom import METRIC_PREFIX, SpecDecodingProm

# One labelling shared with the tuner that reads the histogram back (re-exported here).
from specula.tuning.cost import batch_bucket as batch_bucket

STEP_DURATION_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                                              0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                                              0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the step-time histogram: about 1.5x apart from 1 ms to 1 s,
where steps live (small batches at a few ms, large GPU batches at 10-300 ms), so
quantiles of T(batch, k) are resolved to about a third; coarser beyond."""
_BUCKET_LABELS = [*map(str, STEP_DURATION_BUCKETS_S), "+Inf"]


@dataclass
class StepTimeSeries:
    """Histogram state of one (batch bucket, k) label pair."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(_BUCKET_LABELS))
    """Non-cumulative counts; the last slot is ``+Inf``."""
    sum_s: float = 0.0
    count: int = 0


@dataclass
class StepTimeStats:
    """Plain counts of engine step durations, keyed by ``(batch_bucket, k)``."""

    series: dict[tuple[str, int], StepTimeSeries] = field(default_factory=dict)

    def observe(self, batch_size: int, num_speculative_tokens: int, seconds: float) -> None:
        key = (batch_bucket(batch_size), num_speculative_tokens)
        s = self.series.setdefault(key, StepTimeSeries())
        s.bucket_counts[bisect.bisect_left(STEP_DURATION_BUCKETS_S, seconds)] += 1
        s.sum_s += seconds
        s.count += 1


@dataclass
class RuntimeSnapshot:
    """Everything exported, copied between steps so one scrape is self-consistent; each
    scalar field is the metric of that name (:data:`_SCALARS`)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    generation_tokens: int = 0
    step_times: StepTimeStats = field(default_factory=StepTimeStats)
    spec_decoding: object | None = None
    """A copy of the engine's ``SpecDecodingStats``; ``None`` before it is loaded."""
    num_speculative_tokens: int = 0
    """The k of the last decode round (0: plain decoding); before any round, a lone request's k."""
    max_num_speculative_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_usage: float = 0.0


_SCALARS: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str], ...] = (
    # (family, name after the prefix: the snapshot's field, less a "_perc" suffix, help)
    (GaugeMetricFamily, "num_requests_running", "Number of requests in the running batch."),
    (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be scheduled."),
    (CounterMetricFamily, "generation_tokens",
     "Number of generated tokens (accepted draft, bonus and recovered tokens)."),
    (GaugeMetricFamily, "num_speculative_tokens",
     "Draft tokens per request in the last speculative round (the k in effect; "
     "0 when the last step decoded without speculation)."),
    (GaugeMetricFamily, "max_num_speculative_tokens",
     "Largest num_speculative_tokens the runtime accepts (its startup value)."),
    (CounterMetricFamily, "num_preemptions",
     "Requests preempted because the KV cache ran out (recomputed when readmitted)."),
    (CounterMetricFamily, "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried prompt tokens."),
    (CounterMetricFamily, "prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached prompt tokens."),
    (GaugeMetricFamily, "kv_cache_usage_perc",
     "Fraction of the paged KV cache's blocks in use (1 = full)."),
)


class RuntimeProm(Collector):
    """Collector of request gauges, the generated-token counter and step times."""

    def __init__(self, get_snapshot: Callable[[], RuntimeSnapshot], model_name: str) -> None:
        self._get_snapshot, self._model_name = get_snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._get_snapshot()
        labels, values = ["model_name"], [self._model_name]
        for family_type, name, help_text in _SCALARS:
            family = family_type(METRIC_PREFIX + name, help_text, labels=labels)
            family.add_metric(values, getattr(snap, name.removesuffix("_perc")))
            yield family
        steps = HistogramMetricFamily(METRIC_PREFIX + "step_duration_seconds",
                                      "Wall time of one engine step (prefill of new requests plus "
                                      "one decode round), by batch-size bucket of the decode "
                                      "round and the k it drafted.",
                                      labels=[*labels, "batch_bucket", "num_speculative_tokens"])
        for (bucket, k), s in sorted(snap.step_times.series.items()):
            cumulative = zip(_BUCKET_LABELS, itertools.accumulate(s.bucket_counts), strict=True)
            steps.add_metric([*values, bucket, str(k)], list(cumulative), s.sum_s)
        yield steps


def build_registry(get_snapshot: Callable[[], RuntimeSnapshot],
                   model_name: str) -> CollectorRegistry:
    """A fresh registry exporting the runtime and speculative-decoding metrics."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RuntimeProm(get_snapshot, model_name))
    registry.register(SpecDecodingProm(lambda: get_snapshot().spec_decoding, model_name))
    return registry
