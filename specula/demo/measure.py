"""Client side of the demo: concurrent greedy completions and the speculative-decoding counters.

The figures derived from the counters use vLLM's definitions (``vllm/v1/spec_decode/metrics.py``):

- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts (the bonus or recovered token counts);
- per-position acceptance rate i = accepted tokens at draft position i / drafts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Metric prefixes accepted: this runtime's, and vLLM's for the same counters.
PREFIXES: tuple[str, ...] = ("specula:", "vllm:")


@dataclass
class SpecCounters:
    """Counter values read from one ``/metrics`` scrape (summed over label sets)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    """Accepted draft tokens by 0-based draft position."""
    generation_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        positions = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return SpecCounters(
            num_drafts=self.num_drafts - other.num_drafts,
            num_draft_tokens=self.num_draft_tokens - other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - other.num_accepted_tokens,
            accepted_per_pos={
                p: self.accepted_per_pos.get(p, 0.0) - other.accepted_per_pos.get(p, 0.0)
                for p in sorted(positions)
            },
            generation_tokens=self.generation_tokens - other.generation_tokens,
        )

    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def per_position_acceptance(self) -> list[float]:
        if not self.num_drafts:
            return []
        return [self.accepted_per_pos[p] / self.num_drafts for p in sorted(self.accepted_per_pos)]


def _strip(name: str) -> str | None:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            return name[: -len("_total")] if name.endswith("_total") else name
    return None


def parse_counters(text: str) -> SpecCounters:
    """Parse a Prometheus text exposition into :class:`SpecCounters`.

    Counter samples may carry the ``_total`` suffix or not, and either prefix in
    :data:`PREFIXES`; other metrics are ignored. Missing counters read as 0.

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    out = SpecCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            name = _strip(sample.name)
            if name == "spec_decode_num_drafts":
                out.num_drafts += sample.value
            elif name == "spec_decode_num_draft_tokens":
                out.num_draft_tokens += sample.value
            elif name == "spec_decode_num_accepted_tokens":
                out.num_accepted_tokens += sample.value
            elif name == "spec_decode_num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + sample.value
            elif name == "generation_tokens":
                out.generation_tokens += sample.value
    return out


@dataclass
class Completion:
    prompt: str
    text: str
    completion_tokens: int
    finish_reason: str | None


@dataclass
class BatchResult:
    completions: list[Completion]
    wall_s: float
    """Wall time from sending the first request to receiving the last response, seconds."""

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


class DemoClient:
    """Synchronous client of one ``specula serve`` instance."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def model_name(self) -> str:
        """The served model name, from ``GET /v1/models``."""
        r = self._http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def speculative_config(self) -> dict:
        r = self._http.get("/v1/speculative_config")
        r.raise_for_status()
        return r.json()

    def counters(self) -> SpecCounters:
        r = self._http.get("/metrics")
        r.raise_for_status()
        return parse_counters(r.text)

    def complete(self, model: str, prompt: str, max_tokens: int) -> Completion:
        """One greedy completion (temperature 0, EOS honoured).

        Raises:
            httpx.HTTPStatusError: the server answered 4xx/5xx (the body is in the message).
        """
        r = self._http.post(
            "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        )
        if r.is_error:
            raise httpx.HTTPStatusError(
                f"POST /v1/completions -> {r.status_code}: {r.text}", request=r.request, response=r
            )
        body = r.json()
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        return Completion(prompt, choice["text"], int(usage.get("completion_tokens", 0)),
                          choice.get("finish_reason"))

    def run_batch(self, model: str, prompts: list[str], max_tokens: int) -> BatchResult:
        """Send all ``prompts`` at once (one thread each) so the server batches them."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            completions = list(pool.map(lambda p: self.complete(model, p, max_tokens), prompts))
        return BatchResult(completions, time.perf_counter() - t0)
