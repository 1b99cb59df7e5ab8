"""Client side of the demo: concurrent greedy completions, ``/metrics`` scrapes (parsed by
:class:`specula.tuning.RuntimeMetrics`) and the admin API.

The figures derived from the counters use vLLM's definitions (``vllm/v1/spec_decode/metrics.py``):

- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts (the bonus or recovered token counts);
- per-position acceptance rate i = accepted tokens at draft position i / drafts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from specula.tuning import RuntimeMetrics, SpecDecodeCounters


def per_position_acceptance(counters: SpecDecodeCounters) -> list[float]:
    """Accepted tokens at each draft position (0-based) per draft; ``[]`` without drafts."""
    if counters.num_drafts <= 0:
        return []
    return [a / counters.num_drafts for a in counters.num_accepted_tokens_per_pos]


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


class DemoClient:
    """Synchronous client of one ``specula serve`` instance; the admin API at
    ``admin_url`` (its own port) with bearer ``admin_token``."""

    def __init__(
        self, base_url: str, timeout_s: float = 600.0, admin_url: str | None = None,
        admin_token: str | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s)
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._admin = httpx.Client(base_url=admin_url or base_url, timeout=timeout_s,
                                   headers=headers)

    def close(self) -> None:
        self._http.close()
        self._admin.close()

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
        r = self._admin.get("/v1/speculative_config")
        r.raise_for_status()
        return r.json()

    def metrics(self) -> RuntimeMetrics:
        """One ``/metrics`` scrape (``specula:`` or ``vllm:`` names).

        Raises:
            httpx.HTTPStatusError: the server answered 4xx/5xx.
            ValueError: the body is not valid Prometheus exposition.
        """
        r = self._http.get("/metrics")
        r.raise_for_status()
        return RuntimeMetrics.from_prometheus_text(r.text)

    def put_speculative_config(self, body: dict) -> int:
        """``PUT /v1/speculative_config`` with ``body``; returns the k the server reports in
        effect.

        Raises:
            httpx.HTTPStatusError: the server refused (the body is in the message).
        """
        r = self._admin.put("/v1/speculative_config", json=body)
        if r.is_error:
            raise httpx.HTTPStatusError(
                f"PUT /v1/speculative_config {body} -> {r.status_code}: {r.text}",
                request=r.request, response=r,
            )
        return int(r.json()["num_speculative_tokens"])

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
