"""Schema-driven HTTP fuzzing of the runtime's model and admin apps (a few hundred
derandomized cases; ``bench/fuzz_http.py`` runs 2,000 per target), and the defects it
found, each as a regression test.

Every answer is below 500, every 4xx has the OpenAI error shape, and afterwards the
model app still answers a greedy completion equal to the engine's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from schemathesis.python import asgi

from bench.fuzz_http import (
    API_KEY,
    RuntimeApps,
    build_engine,
    fuzz_runtime,
    runtime_apps,
    served_greedy_text,
)
from specula.runtime.server.engine_loop import EngineState

pytestmark = pytest.mark.runtime

CASES = 120
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def apps(tiny_llama_target: Path, tiny_llama_draft: Path) -> Iterator[RuntimeApps]:
    with runtime_apps(build_engine(tiny_llama_target, tiny_llama_draft)) as apps:
        yield apps


def post(app, body: dict | str) -> tuple[int, dict]:
    with asgi.get_client(app) as client:
        if isinstance(body, str):
            r = client.post("/v1/completions", data=body, timeout=60)
        else:
            r = client.post("/v1/completions", json=body, timeout=60)
    return r.status_code, r.json()


def test_fuzzed_runtime_answers_no_5xx_and_still_serves_greedy(apps: RuntimeApps):
    reports = fuzz_runtime(apps, CASES)
    assert served_greedy_text(apps.model) == apps.expected_greedy
    keyed = served_greedy_text(apps.keyed, {"Authorization": f"Bearer {API_KEY}"})
    assert keyed == apps.expected_greedy
    for report in reports:
        assert report.cases >= CASES // 2, report.summary()
        assert report.server_errors == 0, report.summary()
        assert report.failures == [], report.summary()
        # The fuzzer got past the bearer checks to the handlers.
        assert report.statuses[200] > 0 and report.statuses[400] > 0, report.summary()


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", INT64_MAX + 1), ("seed", -INT64_MAX - 2), ("top_k", INT64_MAX + 1),
     ("stop_token_ids", [INT64_MAX + 1])],
)
def test_integers_beyond_int64_are_refused_and_the_engine_lives(apps, field, value):
    # Found by the fuzzer: such a value reached the engine's int64 tensors and its
    # step raised, which killed the engine loop (every later request 503).
    status, body = post(apps.model, {"prompt": "hi", "max_tokens": 2, field: value})
    assert status == 400 and body["error"]["param"] == field
    assert apps.loop.state is EngineState.READY
    status, _ = post(apps.model, {"prompt": "hi", "max_tokens": 2, "seed": INT64_MAX,
                                  "top_k": INT64_MAX, "stop_token_ids": [INT64_MAX]})
    assert status == 200
    assert served_greedy_text(apps.model) == apps.expected_greedy


@pytest.mark.parametrize(
    "raw",
    ['{"prompt": "\\ud800"}', '{"prompt": "a", "\\udfff": 1}',
     '{"prompt": "a", "model": "x\\ud800"}', '{"prompt": ["a", "\\ud800"]}'],
)
def test_lone_surrogates_are_refused(apps, raw):
    # Found by the fuzzer: a `\ud800` escape is valid JSON but decodes to a lone
    # surrogate; the tokenizer raised on it, and an error naming it could not be
    # encoded as UTF-8: 500 either way.
    status, body = post(apps.model, raw)
    assert status == 400 and "surrogates not allowed" in body["error"]["message"]
    status, body = post(apps.model, '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200, body  # a proper surrogate pair is one character
