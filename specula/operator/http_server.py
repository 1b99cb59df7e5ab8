"""The operator's HTTP server: utilization for KEDA, Prometheus metrics for an HPA.

Runs on kopf's asyncio loop (aiohttp, which kopf itself depends on), on
``OperatorSettings.http_port``:

- ``GET /apis/specula.dev/v1alpha1/namespaces/<ns>/speculativemodels/<name>/utilization``
  -> ``{"utilization": 0.83, "lastUpdateTime": "..."}``, what KEDA's ``metrics-api``
  scaler polls (``valueLocation: utilization``); 404 while a resource has no
  measurement;
- ``GET /metrics`` -> the gauge ``specula_operator_utilization{namespace,name}`` in the
  Prometheus text format, for an HPA through a Prometheus adapter;
- ``GET /healthz`` -> ``ok``;
- ``GET /openapi.json`` -> :data:`OPENAPI`, the OpenAPI 3.1 document of these routes.

Every error is JSON, ``{"error": "<message>"}``, aiohttp's own (unknown route, wrong
method) included.

Values come from the tuner's windows (:class:`UtilizationRegistry`, fed by
:func:`specula.operator.tuning.tune`); after an operator restart, until the first
window, the endpoint answers from the resource's ``status.autoscaling``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from specula.api.autoscaling import AutoscalingStatus
from specula.operator.autoscaling import UTILIZATION_METRIC, utilization_path

log = logging.getLogger(__name__)

StatusLookup = Callable[[str, str], AutoscalingStatus | None]
"""``(namespace, name) -> status.autoscaling`` read from the API server (blocking)."""


class UtilizationRegistry:
    """The latest utilization per resource, and its Prometheus gauge.  Thread-safe:
    tuning ticks run in kopf's worker threads, requests on the event loop."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], tuple[float, float]] = {}
        self._guard = threading.Lock()
        self.prometheus = CollectorRegistry()
        self._gauge = Gauge(
            UTILIZATION_METRIC,
            "Demand over predicted capacity of a SpeculativeModel (fraction; the "
            "autoscaling target is spec.autoscaling.targetUtilization)",
            ["namespace", "name"],
            registry=self.prometheus,
        )

    def record(self, namespace: str, name: str, utilization: float, time: float) -> None:
        """Store ``utilization`` measured at Unix ``time`` and set the gauge."""
        with self._guard:
            self._values[(namespace, name)] = (utilization, time)
            self._gauge.labels(namespace=namespace, name=name).set(utilization)

    def discard(self, namespace: str, name: str) -> None:
        """Forget a resource (deleted, or autoscaling turned off) and drop its series."""
        with self._guard:
            if self._values.pop((namespace, name), None) is not None:
                self._gauge.remove(namespace, name)

    def get(self, namespace: str, name: str) -> tuple[float, float] | None:
        """``(utilization, Unix time)``, or ``None`` if not measured by this process."""
        with self._guard:
            return self._values.get((namespace, name))


_ERROR = {
    "description": "Error",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}},
    }}},
}
_NAME = {"type": "string", "minLength": 1}

OPENAPI: dict = {
    "openapi": "3.1.0",
    "info": {"title": "Specula operator", "version": "v1alpha1"},
    "paths": {
        utilization_path("{namespace}", "{name}"): {"get": {
            "summary": "Utilization of a SpeculativeModel, for KEDA's metrics-api scaler",
            "parameters": [
                {"name": p, "in": "path", "required": True, "schema": _NAME}
                for p in ("namespace", "name")
            ],
            "responses": {
                "200": {"description": "The latest measurement", "content": {
                    "application/json": {"schema": {
                        "type": "object",
                        "required": ["utilization", "lastUpdateTime"],
                        "properties": {"utilization": {"type": "number"},
                                       "lastUpdateTime": {"type": ["string", "null"]}},
                    }},
                }},
                "404": {**_ERROR, "description": "No measurement for this resource yet"},
                "503": {**_ERROR, "description": "The resource's status cannot be read"},
            },
        }},
        "/metrics": {"get": {
            "summary": "The utilization gauge, Prometheus text format",
            "responses": {"200": {"description": "Metrics",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
        "/healthz": {"get": {
            "summary": "Liveness",
            "responses": {"200": {"description": "ok",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
        "/openapi.json": {"get": {
            "summary": "This document",
            "responses": {"200": {"description": "OpenAPI 3.1",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
    },
}
"""The OpenAPI document of :func:`make_app`'s routes, served at ``/openapi.json``."""


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer aiohttp's own errors (404 for an unknown route, 405...) as JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": exc.reason}, status=exc.status,
                                 headers={k: v for k, v in exc.headers.items()
                                          if k.lower() == "allow"})


def _rfc3339(time: float) -> str:
    return datetime.fromtimestamp(time, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_app(registry: UtilizationRegistry, lookup: StatusLookup | None = None) -> web.Application:
    """The aiohttp application (routes in the module docstring).

    ``lookup`` answers for resources this process has not measured yet; it blocks, so
    it runs in the loop's default executor.
    """

    async def utilization(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        found = registry.get(namespace, name)
        if found is not None:
            value, time = found
            return web.json_response({"utilization": value, "lastUpdateTime": _rfc3339(time)})
        status = None
        if lookup is not None:
            try:
                loop = asyncio.get_running_loop()
                status = await loop.run_in_executor(None, lookup, namespace, name)
            except Exception as e:  # the client raises many types; answer, never crash
                log.warning("cannot read %s/%s: %s", namespace, name, e)
                return web.json_response(
                    {"error": f"cannot read {namespace}/{name}: {e}"}, status=503
                )
        if status is None or status.utilization is None:
            return web.json_response(
                {"error": f"no utilization measured for {namespace}/{name} yet"}, status=404
            )
        return web.json_response(
            {"utilization": status.utilization, "lastUpdateTime": status.last_update_time}
        )

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry.prometheus)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    app = web.Application(middlewares=[json_errors])
    app.router.add_get(utilization_path("{namespace}", "{name}"), utilization)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi)
    return app


class HttpServer:
    """:func:`make_app` served on one address, started and stopped on a running loop."""

    def __init__(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``.

        Raises:
            OSError: the address cannot be bound.
        """
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        log.info("utilization and metrics on http://%s:%d", host, port)

    async def stop(self) -> None:
        await self._runner.cleanup()
