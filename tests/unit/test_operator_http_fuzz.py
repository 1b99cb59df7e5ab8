"""The operator's HTTP server against its own OpenAPI document: the document matches the
routes, and a few hundred derandomized schema-driven cases get no 5xx and only JSON
errors (``bench/fuzz_http.py`` runs 2,000)."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from bench.fuzz_http import fuzz_operator
from specula.operator.http_server import OPENAPI, UtilizationRegistry, make_app


def test_openapi_documents_exactly_the_routes():
    app = make_app(UtilizationRegistry())
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD"}
    documented = {(m, path) for path, ops in OPENAPI["paths"].items() for m in ops}
    assert routes == documented


def test_serves_its_openapi_and_answers_unknown_routes_in_json():
    async def go():
        async with TestClient(TestServer(make_app(UtilizationRegistry()))) as client:
            doc = await client.get("/openapi.json")
            missing = await client.get("/nope")
            wrong_method = await client.post("/healthz")
            return (doc.status, await doc.json(), missing.status, await missing.json(),
                    wrong_method.status, await wrong_method.json(), wrong_method.headers)

    status, doc, missing, missing_body, wrong, wrong_body, headers = asyncio.run(go())
    assert status == 200 and doc == OPENAPI
    assert missing == 404 and missing_body == {"error": "Not Found"}
    assert wrong == 405 and wrong_body == {"error": "Method Not Allowed"}
    assert "GET" in headers["Allow"]


def test_fuzzed_operator_server_answers_no_5xx():
    report = fuzz_operator(300)
    assert report.cases >= 150, report.summary()
    assert report.server_errors == 0 and report.failures == [], report.summary()
