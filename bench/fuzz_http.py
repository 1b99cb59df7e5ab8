"""Property-based HTTP fuzzing of the runtime's and the operator's servers (issue 14, "HTTP fuzzing").

``schemathesis`` generates requests from each server's own OpenAPI schema, in both of its
modes (valid bodies and parameters, and ones that break the schema), and ``hypothesis``
runs them derandomized, so a run is reproducible. Every request is answered in-process:
the FastAPI apps through schemathesis's ASGI transport, the operator's aiohttp app on a
loopback listener of this process.

Targets (``--cases`` each):

- ``model``: the runtime's model app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``) on a tiny random CPU Llama with a draft
  model and a chat template;
- ``model_api_key``: the same with ``--api-key``, requests carrying the key;
- ``admin``: the admin app (``GET``/``PUT /v1/speculative_config``) with the bearer token;
- ``operator``: the operator's utilization, metrics and health server.

Checks on every answer: no status >= 500; every 4xx is JSON in the server's error shape
(runtime: OpenAI's ``{"error": {"message", "type", "param", "code"}}``; operator:
``{"error": "<message>"}``); a 200 event stream carries no error event. After the runtime
targets, the model app must still answer a greedy completion equal to the engine's own.

Usage::

    .venv/bin/python bench/fuzz_http.py            # 2,000 cases per target
    .venv/bin/python bench/fuzz_http.py --cases 200 --no-write

writes ``fuzz_cases_runtime`` (the three runtime targets together),
``fuzz_cases_operator`` and ``fuzz_5xx`` into ``bench/results/reliability.json``,
keeping its other keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, Response

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "reliability.json"

ADMIN_TOKEN = "fuzz-admin-token"
API_KEY = "fuzz-api-key"
GREEDY_PROMPT = "the quick brown fox"
GREEDY_TOKENS = 12
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class FuzzReport:
    """What one target answered."""

    target: str
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    """One line per answer that broke a check: method, path, status, what broke."""

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "failures": self.failures[:20],
        }


def runtime_error_problem(body: Any) -> str | None:
    """Why ``body`` is not OpenAI's error shape, or ``None`` when it is."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not an OpenAI error body: {body!r:.200}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"message and type must be strings: {error!r:.200}"
    if any(error[k] is not None and not isinstance(error[k], str) for k in ("param", "code")):
        return f"param and code must be strings or null: {error!r:.200}"
    return None


def operator_error_problem(body: Any) -> str | None:
    """Why ``body`` is not the operator's ``{"error": "<message>"}``, or ``None``."""
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str):
        return None
    return f"not an operator error body: {body!r:.200}"


def _problem(response: Response, error_shape: Callable[[Any], str | None]) -> str | None:
    status = response.status_code
    text = response.content.decode("utf-8", "replace")
    if status >= 500:
        return f"server error: {text[:200]!r}"
    content_type = (response.headers.get("content-type") or [""])[0]
    if 400 <= status < 500:
        if not content_type.startswith("application/json"):
            return f"4xx with content type {content_type!r}: {text[:200]!r}"
        try:
            return error_shape(json.loads(text))
        except ValueError:
            return f"4xx body is not JSON: {text[:200]!r}"
    if status == 200 and content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                return f"error event in a stream: {line[:200]!r}"
    return None


def _strategy(schema: Any) -> Any:
    """Cases for every operation of ``schema``, valid and invalid alike."""
    modes = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        try:
            modes.append(schema.as_strategy(generation_mode=mode))
        except Exception:  # an operation with nothing to break has no negative cases
            continue
    return st.one_of(modes)


def fuzz(
    target: str,
    schema: Any,
    *,
    cases: int,
    send: Callable[[Any], Response],
    error_shape: Callable[[Any], str | None],
) -> FuzzReport:
    """Send ``cases`` generated requests (derandomized) with ``send`` and check each answer."""
    report = FuzzReport(target)

    @settings(
        max_examples=cases,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=_strategy(schema))
    def run(case: Any) -> None:
        response = send(case)
        report.cases += 1
        report.statuses[response.status_code] += 1
        problem = _problem(response, error_shape)
        if problem is not None:
            report.failures.append(
                f"{case.method} {case.formatted_path} -> {response.status_code}: {problem}"
            )

    run()
    return report


def fuzz_asgi(
    target: str, app: Any, *, cases: int, headers: dict[str, str] | None = None
) -> FuzzReport:
    """Fuzz a FastAPI ``app`` from its ``/openapi.json`` through the ASGI transport."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return fuzz(
        target, schema, cases=cases,
        send=lambda case: case.call(headers=headers, timeout=120),
        error_shape=runtime_error_problem,
    )


@contextmanager
def serve_aiohttp(app: Any) -> Iterator[str]:
    """Serve an aiohttp ``app`` on a loopback port from a thread of this process;
    yield its base URL."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def operator_app() -> Any:
    """The operator's app with one measured resource and a status lookup that knows
    another, as a running operator would have."""
    from specula.api.autoscaling import AutoscalingStatus
    from specula.operator.http_server import UtilizationRegistry, make_app

    registry = UtilizationRegistry()
    registry.record("default", "measured", 0.5, 1_800_000_000.0)

    def lookup(namespace: str, name: str) -> AutoscalingStatus | None:
        if (namespace, name) == ("default", "restarted"):
            return AutoscalingStatus(utilization=1.25, last_update_time="2026-05-01T10:00:00Z")
        return None

    return make_app(registry, lookup)


def fuzz_operator(cases: int) -> FuzzReport:
    """Fuzz the operator's HTTP server from the OpenAPI schema it serves."""
    with serve_aiohttp(operator_app()) as url, requests.Session() as session:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        return fuzz(
            "operator", schema, cases=cases,
            send=lambda case: case.call(base_url=url, session=session, timeout=30),
            error_shape=operator_error_problem,
        )


# ---- the runtime on a tiny CPU model -------------------------------------------------


def build_checkpoints(root: Path) -> tuple[Path, Path]:
    """Save the runtime tier's tiny Llama target and its 1-layer draft under ``root``."""
    sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))
    import conftest  # the runtime tier's checkpoint builders

    tokenizer = conftest._train_tokenizer()
    target = conftest._llama(tokenizer, num_layers=3, seed=0)
    draft = conftest.derive_draft(target, num_layers=1, noise=0.01, seed=2)
    return (conftest.save_checkpoint(target, tokenizer, root / "target"),
            conftest.save_checkpoint(draft, tokenizer, root / "draft"))


def build_engine(target: Path, draft: Path, *, max_model_len: int = 64) -> Any:
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(RuntimeConfig(
        model=f"file://{target}",
        served_model_name="tiny-target",
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=8,
        chat_template=CHAT_TEMPLATE,
        speculator=SpeculatorRuntimeConfig(
            method="draft_model", model=f"file://{draft}", num_speculative_tokens=3
        ),
    ))


def engine_greedy_text(engine: Any) -> str:
    """The engine's own greedy completion of :data:`GREEDY_PROMPT` (call before the
    engine loop owns the engine)."""
    from specula.runtime.engine.sampling_params import SamplingParams

    ids = engine.tokenizer(GREEDY_PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([ids], params)
    return engine.tokenizer.decode(out, skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)


def served_greedy_text(app: Any, headers: dict[str, str] | None = None) -> str:
    """The model ``app``'s greedy completion of :data:`GREEDY_PROMPT`.

    Raises:
        AssertionError: the app did not answer 200.
    """
    from schemathesis.python import asgi

    body = {"prompt": GREEDY_PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0,
            "ignore_eos": True}
    with asgi.get_client(app) as client:
        r = client.post("/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@dataclass
class RuntimeApps:
    model: Any
    keyed: Any
    admin: Any
    loop: Any
    expected_greedy: str


@contextmanager
def runtime_apps(engine: Any) -> Iterator[RuntimeApps]:
    """The model app, a second one with an API key, and the admin app with a token,
    all around one running engine loop."""
    from specula.runtime.server.app import create_admin_app, create_app
    from specula.runtime.server.engine_loop import EngineLoop

    expected = engine_greedy_text(engine)
    loop = EngineLoop(lambda: engine)
    loop.start()
    try:
        assert loop.wait_ready(120), loop.error
        model = create_app(loop, manage_loop=False)
        yield RuntimeApps(
            model=model,
            keyed=create_app(loop, manage_loop=False, api_key=API_KEY),
            admin=create_admin_app(model, lambda: ADMIN_TOKEN),
            loop=loop,
            expected_greedy=expected,
        )
    finally:
        loop.stop()


def fuzz_runtime(apps: RuntimeApps, cases: int) -> list[FuzzReport]:
    return [
        fuzz_asgi("model", apps.model, cases=cases),
        fuzz_asgi("model_api_key", apps.keyed, cases=cases,
                  headers={"Authorization": f"Bearer {API_KEY}"}),
        fuzz_asgi("admin", apps.admin, cases=cases,
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}),
    ]


def _write(results: dict[str, Any]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"issue": 14}
    data.update(results)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per target (2000)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    reports: list[FuzzReport] = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(*build_checkpoints(Path(tmp)))
        with runtime_apps(engine) as apps:
            reports += fuzz_runtime(apps, args.cases)
            greedy_ok = served_greedy_text(apps.model) == apps.expected_greedy
            greedy_ok &= served_greedy_text(
                apps.keyed, {"Authorization": f"Bearer {API_KEY}"}) == apps.expected_greedy
    reports.append(fuzz_operator(args.cases))
    elapsed = time.monotonic() - started

    by_target = {r.target: r for r in reports}
    fuzz_5xx = sum(r.server_errors for r in reports)
    failures = sum(len(r.failures) for r in reports)
    for r in reports:
        print(f"{r.target:14s} {r.cases:5d} cases  statuses {dict(sorted(r.statuses.items()))}"
              f"  failures {len(r.failures)}")
        for line in r.failures[:10]:
            print("   ", line)
    print(f"greedy completion after fuzzing equals the engine's: {greedy_ok}")
    print(f"{elapsed:.0f} s")
    results = {
        "fuzz_cases_runtime": sum(by_target[t].cases for t in ("model", "model_api_key", "admin")),
        "fuzz_cases_operator": by_target["operator"].cases,
        "fuzz_5xx": fuzz_5xx,
        "fuzz_evidence": {
            "command": ".venv/bin/python bench/fuzz_http.py"
                       + (f" --cases {args.cases}" if args.cases != 2000 else ""),
            "machine": f"2-core CPU development machine (shared), no GPU; {platform.python_version()}",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "schemathesis": schemathesis.__version__,
            "seconds": round(elapsed),
            "targets": {r.target: r.summary() for r in reports},
            "check_failures": failures,
            "greedy_after_fuzzing_equals_engine": greedy_ok,
        },
    }
    if not args.no_write:
        _write(results)
    return 0 if fuzz_5xx == 0 and failures == 0 and greedy_ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
