"""Prometheus export of the speculative-decoding counters.

Counting and exporting are separate (as vLLM's ``SpecDecodingStats`` and
``SpecDecodingProm``, ``vllm/v1/spec_decode/metrics.py``): the engine updates a
:class:`~specula.runtime.spec_decode.metrics.SpecDecodingStats` every step and the
collector reads a snapshot of it at scrape time, so the exported values equal the
engine's, with no per-step export cost.

Exported counters (``prometheus_client`` appends ``_total``, as in vLLM's
``vllm:spec_decode_num_drafts_total``): ``specula:spec_decode_num_drafts`` (draft rounds,
one per request per step that proposed tokens), ``..._num_draft_tokens`` (proposed),
``..._num_accepted_tokens`` (accepted by the target) and
``..._num_accepted_tokens_per_pos{position}`` (accepted, by position ``0 .. k_max - 1``).
Ratios (acceptance rate ``accepted / draft_tokens``, mean acceptance length ``1 +
accepted / drafts``) are left to the scraper: they cannot be aggregated across pods or
time windows.
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

    def __init__(
        self, get_stats: Callable[[], SpecDecodingStats | None], model_name: str
    ) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        # Describing lets ``registry.register`` check name clashes without calling
        # ``collect`` (which would read engine state at registration time).
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        yield from self._families(stats)

    def _families(self, stats: SpecDecodingStats | None) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self._model_name]
        for attr, doc in (
            ("num_drafts", "Number of spec decoding drafts."),
            ("num_draft_tokens", "Number of draft tokens."),
            ("num_accepted_tokens", "Number of accepted tokens."),
        ):
            family = CounterMetricFamily(f"{METRIC_PREFIX}spec_decode_{attr}", doc, labels=labels)
            if stats is not None:
                family.add_metric(values, float(getattr(stats, attr)))
            yield family
        per_pos = CounterMetricFamily(
            METRIC_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        if stats is not None:
            for position, count in enumerate(stats.num_accepted_tokens_per_pos):
                per_pos.add_metric([*values, str(position)], float(count))
        yield per_pos
