"""Reading Prometheus text exposition into plain sample lists keyed by metric suffix.

The runtime exports ``specula:``-prefixed series and vLLM exports the same counters
with a ``vllm:`` prefix; both are accepted.  Where a scrape holds both for one series
name (a pod running both exporters) the ``specula:`` series win, so nothing is counted
twice.  Parsing uses ``prometheus_client.parser`` (the reference parser of the text
format), never hand-written regular expressions.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

PREFIXES: tuple[str, ...] = ("specula:", "vllm:")
"""Accepted metric-name prefixes, in order of preference."""

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name without prefix (e.g. ``spec_decode_num_drafts_total``) -> (labels, value)."""


def parse_samples(text: str) -> Samples:
    """Samples of every ``specula:`` / ``vllm:`` series in a text exposition.

    Args:
        text: a ``/metrics`` response body (Prometheus text format 0.0.4).

    Returns:
        Sample name with the prefix stripped -> list of ``(labels, value)``; ``_created``
        samples (creation timestamps, not counts) are dropped.

    Raises:
        ValueError: the text is not valid Prometheus exposition.
    """
    by_prefix: dict[str, Samples] = {p: {} for p in PREFIXES}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad text
        raise ValueError(f"invalid Prometheus exposition: {exc}") from exc
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            for prefix in PREFIXES:
                if sample.name.startswith(prefix):
                    key = sample.name[len(prefix) :]
                    by_prefix[prefix].setdefault(key, []).append(
                        (dict(sample.labels), float(sample.value))
                    )
                    break
    merged: Samples = {}
    for prefix in PREFIXES:
        for key, rows in by_prefix[prefix].items():
            merged.setdefault(key, rows)
    return merged


def total(samples: Samples, name: str) -> float:
    """Sum of a series over all its label sets (e.g. several ``model_name`` values)."""
    return sum(value for _, value in samples.get(name, ()))
