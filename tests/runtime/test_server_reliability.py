"""The runtime's HTTP side under faults and load (issue 14): oversized and slow
requests, abandoned streams and answers (their KV blocks freed), the admission limit
(429 with ``Retry-After``, then recovery), the engine loop dying (``/health`` 503), k
switched between every two engine steps (greedy output unchanged), and the drain of a
real ``specula serve`` process on SIGTERM.

No assertion depends on timing: the engine is held by a gate (it takes no step while
closed, but still applies added requests and aborts), switches are gated on steps, and
waits poll for a state with a generous safety deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from test_server_cli import _free_ports

from specula.runtime.server.app import create_admin_app, create_app
from specula.runtime.server.engine_loop import EngineLoop, EngineState
from specula.runtime.server.limits import Limits, h11_with_header_timeout

pytestmark = pytest.mark.runtime

MODEL = "tiny-target"
TOKEN = "admin-token-for-tests"
MAX_NUM_SEQS = 2
MAX_QUEUED = 2
BODY_LIMIT = 4096
SAFETY_S = 60.0
"""Upper bound of every wait; none is expected to come near it."""


def until(check: Callable[[], object], what: str, timeout_s: float = SAFETY_S) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


class _Listener:
    """A uvicorn server for ``app`` on a loopback socket, in a thread."""

    def __init__(self, app, **config) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        until(lambda: self.server.started, "uvicorn to start")
        self.host, self.port = sock.getsockname()
        self.url = f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Gate:
    """While closed, the engine loop takes no step (it still applies added requests,
    aborts and setting changes: they run between steps)."""

    def __init__(self, engine) -> None:
        self._open = threading.Event()
        self._open.set()
        inner = engine.has_unfinished_requests
        engine.has_unfinished_requests = lambda: self._open.is_set() and inner()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


class Runtime:
    """One engine loop serving two model apps: ``url`` with the test limits and ``slow_url``
    with a 0.5 s read timeout for headers and bodies, plus the admin app."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.gate = Gate(engine)
        self.loop = EngineLoop(lambda: engine)
        self.loop.start()
        assert self.loop.wait_ready(SAFETY_S)
        app = create_app(self.loop, manage_loop=False, limits=Limits(
            max_body_bytes=BODY_LIMIT, max_queued_requests=MAX_QUEUED))
        slow = create_app(self.loop, manage_loop=False, limits=Limits(read_timeout_s=0.5))
        self._listeners = [_Listener(app), _Listener(slow, http=h11_with_header_timeout(0.5)),
                           _Listener(create_admin_app(app, lambda: TOKEN))]
        self.url, self.slow_url, self.admin_url = (x.url for x in self._listeners)
        self.addr, self.slow_addr = ((x.host, x.port) for x in self._listeners[:2])

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self.loop.stop()

    def gauges(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0]
            if name.removeprefix("specula:") in ("kv_cache_usage_perc", "num_requests_running",
                                                 "num_requests_waiting", "generation_tokens_total"):
                out[name.removeprefix("specula:")] = float(line.rsplit(" ", 1)[1])
        return out

    def wait_idle(self) -> dict[str, float]:
        """Poll until no request is held and ``kv_cache_usage_perc`` is 0."""
        def idle():
            g = self.gauges()
            zero = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
            return g if self.loop.num_unfinished == 0 and all(g[k] == 0 for k in zero) else None
        return until(idle, "the KV cache to empty")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def rt(tiny_llama_target: Path, tiny_llama_draft: Path, make_engine) -> Iterator[Runtime]:
    runtime = Runtime(make_engine(tiny_llama_target, tiny_llama_draft, k=3,
                                  max_num_seqs=MAX_NUM_SEQS, served_model_name=MODEL,
                                  max_model_len=256))
    yield runtime
    runtime.close()


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "rt" in request.fixturenames:
        rt = request.getfixturevalue("rt")
        rt.gate.open()
        rt.wait_idle()


def body(max_tokens: int = 8, stream: bool = False, prompt=None) -> dict:
    return {"prompt": prompt or [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def serves(rt: Runtime) -> None:
    r = httpx.post(f"{rt.url}/v1/completions", json=body(4), timeout=SAFETY_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- bodies -----------------------------------------------------------------------------


def test_oversized_body_is_413(rt: Runtime):
    big = json.dumps({"prompt": "x" * (3 * BODY_LIMIT), "max_tokens": 1}).encode()
    with httpx.Client(timeout=SAFETY_S) as c:
        # Refused from Content-Length, before reading it ...
        err = error_of(c.post(f"{rt.url}/v1/completions", content=big,
                              headers={"content-type": "application/json"}), 413)
        assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]
        # ... and chunked (no Content-Length) once the limit is passed.
        chunks = (big[i:i + 1024] for i in range(0, len(big), 1024))
        assert error_of(c.post(f"{rt.url}/v1/completions", content=chunks), 413)["code"] \
            == "request_too_large"
        # Just below the limit is fine.
        ok = json.dumps({"prompt": "hello " * 10, "max_tokens": 2}).encode().ljust(BODY_LIMIT)
        assert c.post(f"{rt.url}/v1/completions", content=ok).status_code == 200
    rt.wait_idle()
    serves(rt)


def _raw(addr, data: bytes) -> socket.socket:
    s = socket.create_connection(addr, timeout=SAFETY_S)
    s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_slow_loris_headers_are_cut_off(rt: Runtime):
    # Headers never finished: the connection is closed, with no answer.
    s = _raw(rt.slow_addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert _read_all(s) == b""
    # A byte now and then does not keep it open either.
    s = _raw(rt.slow_addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")
    s.settimeout(0.05)
    deadline = time.monotonic() + SAFETY_S
    while True:
        assert time.monotonic() < deadline, "a byte-at-a-time client kept its connection"
        try:
            s.send(b"X")
            if s.recv(1) == b"":
                break
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            break
    s.close()
    serves(rt)
    rt.wait_idle()


def test_slow_body_is_408(rt: Runtime):
    s = _raw(rt.slow_addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
             b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"prompt\": ")
    head, _, payload = _read_all(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    serves(rt)
    rt.wait_idle()


# ---- clients that hang up ------------------------------------------------------------------


@pytest.mark.parametrize("chunks_read", [0, 1, 5])
def test_abandoned_stream_frees_its_kv_blocks(rt: Runtime, chunks_read: int):
    before = rt.gauges()["generation_tokens_total"]
    with httpx.Client(timeout=SAFETY_S) as c, c.stream(
        "POST", f"{rt.url}/v1/completions", json=body(200, stream=True)
    ) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line)
        for _ in range(chunks_read):
            assert next(events).startswith("data: {")
        rt.gate.close()  # from here the engine takes no step: only an abort ends it
    try:
        until(lambda: rt.loop.num_unfinished == 0, "the abort")
    finally:
        rt.gate.open()
    rt.wait_idle()
    assert rt.gauges()["generation_tokens_total"] - before < 200
    serves(rt)


def test_abandoned_whole_answer_is_aborted(rt: Runtime):
    rt.gate.close()
    request = json.dumps(body(200)).encode()
    s = _raw(rt.addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
    until(lambda: rt.loop.num_unfinished == 1, "the request to reach the engine")
    s.close()
    # Aborted while the engine held it: not one token generated.
    until(lambda: rt.loop.num_unfinished == 0, "the abort")
    before = rt.gauges()["generation_tokens_total"]
    rt.gate.open()
    rt.wait_idle()
    assert rt.gauges()["generation_tokens_total"] == before
    serves(rt)


# ---- admission limit --------------------------------------------------------------------


def test_overload_is_429_with_retry_after_then_recovers(rt: Runtime):
    rt.gate.close()
    capacity = MAX_NUM_SEQS + MAX_QUEUED
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(httpx.Client(timeout=SAFETY_S))
        streams = [stack.enter_context(c.stream("POST", f"{rt.url}/v1/completions",
                                                json=body(12, stream=True)))
                   for _ in range(capacity)]
        assert all(r.status_code == 200 for r in streams)
        assert rt.loop.num_unfinished == capacity
        for extra in (body(4), body(4, stream=True),
                      {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}):
            r = c.post(f"{rt.url}/v1/completions", json=extra)
            assert error_of(r, 429)["code"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
        assert rt.loop.num_unfinished == capacity  # nothing was queued beyond it
        rt.gate.open()
        for r in streams:
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    rt.wait_idle()
    # Load gone: served again, a full batch at once too.
    with ThreadPoolExecutor(capacity) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{rt.url}/v1/completions", json=body(4),
                                                   timeout=SAFETY_S).status_code,
                              range(capacity)))
    assert codes == [200] * capacity


# ---- k switched between every two steps ------------------------------------------------------


SWITCHES = [
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 0},
    {"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 1]]},
    {"num_speculative_tokens": 3},
    {"num_speculative_tokens": 2},
    {"num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 256, 2]]},
]


def _step_ks(rt: Runtime) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in httpx.get(f"{rt.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("specula:step_duration_seconds_count"):
            k = int(line.split('num_speculative_tokens="')[1].split('"')[0])
            out[k] = out.get(k, 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_k_switched_between_every_step_keeps_greedy_output(rt: Runtime):
    """16 greedy prompts (one request: two at a time in the batch, the rest queued)
    while the admin API switches k or the schedule before every engine step: each
    output equals its k = 0 output."""
    admin = httpx.Client(base_url=rt.admin_url, timeout=SAFETY_S,
                         headers={"Authorization": f"Bearer {TOKEN}"})
    prompts = [[(7 * i + j) % 300 + 1 for j in range(4 + i)] for i in range(16)]

    def run_all() -> list[str]:
        r = httpx.post(f"{rt.url}/v1/completions", timeout=SAFETY_S * 5,
                       json=body(24, prompt=prompts))
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    inner, active = rt.engine.step, threading.Event()
    try:
        assert admin.put("/v1/speculative_config", json={"num_speculative_tokens": 0}) \
            .status_code == 200
        reference = run_all()
        # Lockstep: a step runs only once a command (a switch, or an added request) is
        # queued, and the loop applies the queued command right after that step.
        active.set()

        def step():
            until(lambda: not active.is_set() or not rt.loop._commands.empty(), "a switch")
            return inner()

        rt.engine.step = step
        before = _step_ks(rt)
        with ThreadPoolExecutor(1) as pool:
            outputs = pool.submit(run_all)
            switches = 0
            while not outputs.done():
                r = admin.put("/v1/speculative_config", json=SWITCHES[switches % len(SWITCHES)])
                assert r.status_code == 200, r.text
                switches += 1
            active.clear()
            got = outputs.result()
        after = _step_ks(rt)
    finally:
        rt.engine.step = inner
        admin.put("/v1/speculative_config", json={"num_speculative_tokens": 3})
        admin.close()
    assert got == reference
    used = {k for k, n in after.items() if n > before.get(k, 0)}
    assert used == {0, 1, 2, 3}, used
    assert switches >= sum(after.values()) - sum(before.values()) - len(prompts)


# ---- the engine loop dies ---------------------------------------------------------------------


def test_engine_death_turns_health_503(tiny_llama_target: Path, make_engine):
    engine = make_engine(tiny_llama_target, max_num_seqs=2, served_model_name=MODEL)
    fatal: list[BaseException] = []
    loop = EngineLoop(lambda: engine, on_fatal=fatal.append)
    inner = engine.step
    broken = threading.Event()

    def step():
        if broken.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return inner()

    engine.step = step
    listener = _Listener(create_app(loop))
    try:
        with httpx.Client(base_url=listener.url, timeout=SAFETY_S) as c:
            until(lambda: c.get("/health").status_code == 200, "the engine to load")
            assert c.post("/v1/completions", json=body(4)).status_code == 200
            broken.set()
            with c.stream("POST", "/v1/completions", json=body(50, stream=True)) as r:
                events = [line for line in r.iter_lines() if line]
            assert "engine unavailable" in json.loads(events[0][6:])["error"]["message"]
            assert events[-1] == "data: [DONE]"
            until(lambda: loop.state is EngineState.DEAD, "the loop to die")
            err = error_of(c.get("/health"), 503)
            assert err["type"] == "service_unavailable_error" and "illegal memory" in \
                err["message"]
            assert error_of(c.post("/v1/completions", json=body(4)), 503)["message"]
            assert len(fatal) == 1 and "illegal memory" in str(fatal[0])
    finally:
        listener.close()


# ---- drain on SIGTERM, a real `specula serve` process -------------------------------------------

_GATED_SERVE = """
import os, sys, pathlib
from specula.runtime.engine.llm_engine import LLMEngine
gate, added = pathlib.Path(os.environ["GATE"]), pathlib.Path(os.environ["ADDED"])
has, add = LLMEngine.has_unfinished_requests, LLMEngine.add_request
LLMEngine.has_unfinished_requests = lambda self: not gate.exists() and has(self)
def add_and_note(self, *args, **kwargs):
    add(self, *args, **kwargs)
    with added.open("a") as f:
        f.write("added\\n")
LLMEngine.add_request = add_and_note
from specula.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_drains_in_flight_and_refuses_new(tmp_path: Path, tiny_llama_target: Path,
                                                  tiny_llama_draft: Path):
    """`specula serve` (its engine gated from outside: no step while the gate file
    exists) holds a whole and a streamed completion when SIGTERM comes; then new
    completions and /health answer 503 with Retry-After; the gate opens, both finish
    in full, and the process exits 0."""
    port, admin_port = _free_ports(2)
    gate, added = tmp_path / "gate", tmp_path / "added"
    gate.touch()
    config = tmp_path / "runtime.json"
    config.write_text(json.dumps({
        "model": f"file://{tiny_llama_target}", "served_model_name": MODEL,
        "dtype": "float32", "max_model_len": 128, "host": "127.0.0.1", "port": port,
        "admin_port": admin_port, "drain_timeout_s": 120,
        "speculator": {"method": "draft_model", "model": f"file://{tiny_llama_draft}",
                       "num_speculative_tokens": 2},
    }))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GATE": str(gate), "ADDED": str(added),
           "SPECULA_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-c", _GATED_SERVE, "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"

    def health() -> int | None:
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code
        except httpx.TransportError:
            return None

    try:
        until(lambda: health() == 200 or proc.poll() is not None, "the server", 180)
        assert health() == 200
        with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=SAFETY_S) as c:
            whole = pool.submit(httpx.post, f"{base}/v1/completions", json=body(40),
                                timeout=SAFETY_S * 2)
            with c.stream("POST", f"{base}/v1/completions", json=body(40, stream=True)) as s:
                assert s.status_code == 200
                until(lambda: added.exists() and len(added.read_text().split()) == 2,
                      "both requests in the engine")
                proc.send_signal(signal.SIGTERM)
                r = until(lambda: (h := httpx.get(f"{base}/health", timeout=5)).status_code
                          == 503 and h, "/health to turn 503")
                assert r.headers["retry-after"] == "1"  # type: ignore[union-attr]
                r = c.post(f"{base}/v1/completions", json=body(4))
                assert error_of(r, 503)["type"] == "service_unavailable_error"
                assert r.headers["retry-after"] == "1"
                assert not whole.done()
                gate.unlink()
                lines = [line for line in s.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
            done = whole.result()
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
        out, _ = proc.communicate(timeout=SAFETY_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert len(added.read_text().split()) == 2  # the refused request never reached the engine
