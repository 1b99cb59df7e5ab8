"""HTTP calls from the operator to runtime pods: ``/metrics`` and the admin API.

Admin requests carry the resource's admin token (``Authorization: Bearer``); the
token is never logged, nor put into an error text.

Failures never raise: they come back as text in the result, so one unreachable pod
cannot stop the tuning of the others.  Pods are contacted concurrently, each request
with a timeout, so a round takes about one timeout at worst.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx

from specula.operator.tuner import Endpoint, PodReading
from specula.tuning import QueueGauges, RuntimeMetrics, parse_samples

T = TypeVar("T")

MAX_PARALLEL = 16
"""Pods contacted at once."""


def _error_text(response: httpx.Response) -> str:
    """``<status>: <message>`` from an OpenAI-style error body, else the raw text."""
    try:
        err = response.json().get("error") or {}
        detail = f"{err.get('code') or err.get('type')}: {err.get('message')}"
    except (ValueError, AttributeError):
        detail = response.text[:200]
    return f"HTTP {response.status_code} {detail}"


class RuntimeClient:
    """One ``httpx.Client`` shared by the operator's tuning rounds (connection reuse).

    ``admin_token`` is the token of admin requests whose call names none.
    """

    def __init__(self, timeout_s: float, admin_token: str | None = None) -> None:
        self._client = httpx.Client(timeout=timeout_s)
        self._admin_token = admin_token

    def _auth(self, token: str | None) -> dict[str, str]:
        token = token or self._admin_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self._client.close()

    def _parallel(self, fn: Callable[[Endpoint], T], endpoints: Iterable[Endpoint]) -> list[T]:
        endpoints = list(endpoints)
        if len(endpoints) <= 1:
            return [fn(e) for e in endpoints]
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(endpoints))) as pool:
            return list(pool.map(fn, endpoints))

    def read(
        self, endpoint: Endpoint, admin_api: bool = True, token: str | None = None
    ) -> PodReading:
        """The pod's ``/metrics`` (parsed) and, with ``admin_api``, ``GET
        /v1/speculative_config`` with ``token`` (vLLM pods have no admin API)."""
        if endpoint.metrics_url is None or (admin_api and endpoint.admin_url is None):
            return PodReading(endpoint, error="the Service has no port named http or metrics")
        try:
            response = self._client.get(endpoint.metrics_url)
            if response.status_code != 200:
                return PodReading(endpoint, error=f"/metrics: {_error_text(response)}")
            samples = parse_samples(response.text)
            metrics = RuntimeMetrics.from_samples(samples)
            queue = QueueGauges.from_samples(samples)
            if not admin_api:
                return PodReading(endpoint, metrics=metrics, queue=queue)
            response = self._client.get(endpoint.admin_url, headers=self._auth(token))
            if response.status_code != 200:
                return PodReading(
                    endpoint, metrics=metrics, queue=queue,
                    error=f"speculative_config: {_error_text(response)}",
                )
            return PodReading(
                endpoint, metrics=metrics, queue=queue, speculative_config=response.json()
            )
        except (httpx.HTTPError, ValueError) as e:
            return PodReading(endpoint, error=f"{type(e).__name__}: {e}")

    def read_all(
        self, endpoints: Iterable[Endpoint], admin_api: bool = True, token: str | None = None
    ) -> list[PodReading]:
        return self._parallel(lambda e: self.read(e, admin_api, token), endpoints)

    def put_config(
        self, endpoint: Endpoint, config: dict[str, Any], token: str | None = None
    ) -> str | None:
        """``PUT /v1/speculative_config`` with ``config`` (``{"num_speculative_tokens": k}``
        or ``{"num_speculative_tokens_per_batch_size": [[start, end, k], ...]}``) and
        ``token``; ``None`` on success, else why it failed."""
        if endpoint.admin_url is None:
            return "the pod has no admin port"
        try:
            response = self._client.put(endpoint.admin_url, json=config, headers=self._auth(token))
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if response.status_code != 200:
            return _error_text(response)
        return None

    def put_all(
        self, endpoints: Iterable[Endpoint], config: dict[str, Any], token: str | None = None
    ) -> dict[str, str]:
        """:meth:`put_config` on every endpoint; pod -> error for those that failed."""
        endpoints = list(endpoints)
        results = self._parallel(lambda e: self.put_config(e, config, token), endpoints)
        return {e.pod: err for e, err in zip(endpoints, results, strict=True) if err is not None}
