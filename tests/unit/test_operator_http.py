"""The operator's HTTP server: utilization JSON for KEDA, the gauge for Prometheus."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from specula.api.autoscaling import AutoscalingStatus
from specula.operator.autoscaling import utilization_path
from specula.operator.http_server import UtilizationRegistry, make_app


def run(coro):
    return asyncio.run(coro)


async def _get(app, path: str) -> tuple[int, object]:
    async with TestClient(TestServer(app)) as client:
        response = await client.get(path)
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def gauges(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["namespace"], s.labels["name"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specula_operator_utilization"
    }


def test_recorded_utilization_is_served_and_exported():
    registry = UtilizationRegistry()
    registry.record("llm", "qwen", 0.83, 1_800_000_000.0)
    app = make_app(registry)
    status, body = run(_get(app, utilization_path("llm", "qwen")))
    assert status == 200
    assert body == {"utilization": 0.83, "lastUpdateTime": "2027-01-15T08:00:00Z"}
    status, text = run(_get(make_app(registry), "/metrics"))
    assert status == 200 and gauges(text) == {("llm", "qwen"): 0.83}

    registry.discard("llm", "qwen")
    registry.discard("llm", "qwen")  # twice is fine
    status, body = run(_get(make_app(registry), utilization_path("llm", "qwen")))
    assert status == 404 and "no utilization" in body["error"]
    assert gauges(run(_get(make_app(registry), "/metrics"))[1]) == {}


def test_status_answers_for_resources_not_measured_by_this_process():
    seen = []

    def lookup(namespace: str, name: str) -> AutoscalingStatus | None:
        seen.append((namespace, name))
        if name == "qwen":
            return AutoscalingStatus(utilization=1.25, last_update_time="2026-05-01T10:00:00Z")
        return None

    app = make_app(UtilizationRegistry(), lookup)
    status, body = run(_get(app, utilization_path("llm", "qwen")))
    assert (status, body) == (200, {"utilization": 1.25, "lastUpdateTime": "2026-05-01T10:00:00Z"})
    status, _ = run(_get(make_app(UtilizationRegistry(), lookup), utilization_path("llm", "other")))
    assert status == 404
    assert seen == [("llm", "qwen"), ("llm", "other")]


def test_lookup_failure_is_a_503():
    def lookup(namespace: str, name: str) -> AutoscalingStatus | None:
        raise ConnectionError("API server unreachable")

    status, body = run(_get(make_app(UtilizationRegistry(), lookup), utilization_path("a", "b")))
    assert status == 503 and "unreachable" in body["error"]


def test_healthz():
    assert run(_get(make_app(UtilizationRegistry()), "/healthz")) == (200, "ok")
