"""Prometheus export of the speculative-decoding counters, as vLLM's ``SpecDecodingProm``
(``vllm/v1/spec_decode/metrics.py``): the collector reads a snapshot of the engine's
:class:`~specula.runtime.spec_decode.metrics.SpecDecodingStats` at scrape time.

Counters (``prometheus_client`` appends ``_total``): ``specula:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos{position}``. Ratios are left to the scraper: they cannot
be aggregated across pods or time windows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from specula.runtime.spec_decode.metrics import SpecDecodingStats

METRIC_PREFIX = "specula:"


class SpecDecodingProm(Collector):
    """Collector of the speculative-decoding counters of one engine.

    Args:
        get_stats: returns a consistent snapshot of the engine's counters (the server
            copies them between steps), or ``None`` when the engine has no speculator;
            then nothing is exported, as vLLM does without a speculative config.
        model_name: value of the ``model_name`` label (the served model name).
    """

    def __init__(self, get_stats: Callable[[], SpecDecodingStats | None], model_name: str) -> None:
        self._get_stats, self._model_name = get_stats, model_name

    def describe(self) -> Iterator[Metric]:
        # Describing lets ``registry.register`` check name clashes without calling
        # ``collect`` (which would read engine state at registration time).
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is not None:
            yield from self._families(stats)

    def _families(self, stats: SpecDecodingStats | None) -> Iterator[Metric]:
        labels, values = ["model_name"], [self._model_name]
        for attr, doc in (("num_drafts", "Number of spec decoding drafts."),
                          ("num_draft_tokens", "Number of draft tokens."),
                          ("num_accepted_tokens", "Number of accepted tokens.")):
            family = CounterMetricFamily(f"{METRIC_PREFIX}spec_decode_{attr}", doc, labels=labels)
            if stats is not None:
                family.add_metric(values, float(getattr(stats, attr)))
            yield family
        per_pos = CounterMetricFamily(METRIC_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=[*labels, "position"])
        if stats is not None:
            for position, count in enumerate(stats.num_accepted_tokens_per_pos):
                per_pos.add_metric([*values, str(position)], float(count))
        yield per_pos
