"""The OpenAI-compatible server on the real engine and tiny checkpoints.

The server runs in-process under uvicorn on a loopback socket, so the tests speak real
HTTP (streaming, client disconnects) through ``httpx``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine
from specula.runtime.server.app import create_admin_app, create_app
from specula.runtime.server.engine_loop import EngineLoop

pytestmark = pytest.mark.runtime

K = 3
MAX_MODEL_LEN = 128
MODEL_NAME = "tiny-target"
ADMIN_TOKEN = "admin-token-for-tests"
API_KEY = "api-key-for-tests"


class _Server:
    def __init__(self, app, sock: socket.socket) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        host, port = sock.getsockname()
        self.url = f"http://{host}:{port}"

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _serve(loop_or_app) -> _Server:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(loop_or_app) if isinstance(loop_or_app, EngineLoop) else loop_or_app
    return _Server(app, sock)


@pytest.fixture(scope="module")
def config(tiny_llama_target: Path, tiny_llama_draft: Path) -> RuntimeConfig:
    return RuntimeConfig(
        model=f"file://{tiny_llama_target}",
        served_model_name=MODEL_NAME,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        speculator=SpeculatorRuntimeConfig(
            method="draft_model", model=f"file://{tiny_llama_draft}", num_speculative_tokens=K
        ),
    )


@pytest.fixture(scope="module")
def engine(config: RuntimeConfig) -> LLMEngine:
    return LLMEngine.from_config(config)


@pytest.fixture(scope="module")
def served(engine: LLMEngine) -> Iterator[tuple[str, EngineLoop, object]]:
    """``(url, loop, app)`` of the model app around the shared engine."""
    loop = EngineLoop(lambda: engine)
    app = create_app(loop)
    with _serve(app) as srv:
        assert loop.wait_ready(60)
        yield srv.url, loop, app


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def admin_url(served) -> Iterator[str]:
    """The admin app of the shared server on a listener of its own, as ``specula serve
    --admin-port`` runs it."""
    with _serve(create_admin_app(served[2], lambda: ADMIN_TOKEN)) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def admin(admin_url: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=admin_url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def keyed_url(served) -> Iterator[str]:
    """A second model app around the same (running) loop, with an API key."""
    with _serve(create_app(served[1], manage_loop=False, api_key=API_KEY)) as srv:
        yield srv.url


@pytest.fixture
def target_hf(hf_model, tiny_llama_target: Path):
    return hf_model(tiny_llama_target)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_target: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_target)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def complete(client: httpx.Client, **body) -> dict:
    body.setdefault("temperature", 0)
    body.setdefault("ignore_eos", True)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(client: httpx.Client, **body) -> list[dict]:
    body.setdefault("temperature", 0)
    body.setdefault("ignore_eos", True)
    chunks, done = [], False
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            assert not done, "data after [DONE]"
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    assert done
    return chunks


def metrics(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- completions ---------------------------------------------------------------------


def test_greedy_completion_equals_transformers(client, target_hf, hf_tokenizer, hf_greedy):
    prompt = "the quick brown fox"
    ids = hf_tokenizer(prompt)["input_ids"]
    ref = hf_greedy(target_hf, ids, 12)
    body = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=12)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL_NAME
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": decode(hf_tokenizer, ref), "finish_reason": "length",
                      "logprobs": None}
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                             "total_tokens": len(ids) + 12}


def test_batch_of_prompts_and_token_ids(client, target_hf, hf_tokenizer, hf_greedy):
    prompts = ["a", "hello world, this is a longer prompt", "x y z"]
    refs = [decode(hf_tokenizer, hf_greedy(target_hf, hf_tokenizer(p)["input_ids"], 9))
            for p in prompts]
    body = complete(client, prompt=prompts, max_tokens=9)  # `model` may be omitted
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == refs
    assert body["usage"]["completion_tokens"] == 27

    token_prompts = [hf_tokenizer(p)["input_ids"] for p in prompts]
    by_ids = complete(client, prompt=token_prompts, max_tokens=9)
    assert [c["text"] for c in by_ids["choices"]] == refs
    single = complete(client, prompt=token_prompts[1], max_tokens=9)
    assert single["choices"][0]["text"] == refs[1]


def test_stream_concatenates_to_whole_text(client):
    prompts = ["stream me", "and me too, please"]
    whole = complete(client, prompt=prompts, max_tokens=20)
    chunks = stream_chunks(client, prompt=prompts, max_tokens=20)
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert len(mine) > 1  # really incremental


def test_stream_usage_chunk(client):
    chunks = stream_chunks(client, prompt="usage please", max_tokens=5,
                           stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_string_is_trimmed(client):
    base = complete(client, prompt="stop strings", max_tokens=24)["choices"][0]["text"]
    # A stop string that first occurs strictly inside the greedy text.
    stop = next(base[i:i + 2] for i in range(3, len(base) - 2)
                if base[i:i + 2].strip() and "\ufffd" not in base[i:i + 2]
                and base.find(base[i:i + 2]) == i)
    expected = base[: base.find(stop)]
    body = complete(client, prompt="stop strings", max_tokens=24, stop=[stop, "\x00never"])
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = stream_chunks(client, prompt="stop strings", max_tokens=24, stop=stop)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_batch_and_match_sequential(server, client):
    prompts = [f"request number {i} " + "x " * i for i in range(6)]
    sequential = [complete(client, prompt=p, max_tokens=15)["choices"][0]["text"] for p in prompts]

    def one(i: int) -> str:
        with httpx.Client(base_url=server, timeout=60) as c:
            if i % 2:
                chunks = stream_chunks(c, prompt=prompts[i], max_tokens=15)
                return "".join(ch["choices"][0]["text"] for ch in chunks)
            return complete(c, prompt=prompts[i], max_tokens=15)["choices"][0]["text"]

    before = metrics(client)
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(one, range(len(prompts))))
    assert concurrent == sequential
    after = metrics(client)
    batched = sum(v - before.get((name, labels), 0.0) for (name, labels), v in after.items()
                  if name == "specula:step_duration_seconds_count"
                  and dict(labels)["batch_bucket"] != "1")
    assert batched > 0  # some steps really ran several requests together


def test_seeded_sampling_is_reproducible(client):
    body = dict(prompt="sample", max_tokens=10, temperature=0.9, top_p=0.95, top_k=20, seed=7)
    a = complete(client, **body)["choices"][0]["text"]
    b = complete(client, **body)["choices"][0]["text"]
    assert a == b


# ---- other routes --------------------------------------------------------------------


def test_models_health_and_speculative_config(client, admin, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").status_code == 200
    spec = admin.get("/v1/speculative_config").json()
    assert spec == engine.get_speculative_config()
    assert spec["method"] == "draft_model"
    assert spec["num_speculative_tokens"] == K


def test_put_speculative_config_between_steps(
    client, admin, target_hf, hf_tokenizer, hf_greedy
):
    prompt = "change k at run time"
    ref = decode(hf_tokenizer, hf_greedy(target_hf, hf_tokenizer(prompt)["input_ids"], 10))
    try:
        for k in (1, 0, K):
            r = admin.put("/v1/speculative_config", json={"num_speculative_tokens": k})
            assert r.status_code == 200, r.text
            assert r.json()["num_speculative_tokens"] == k
            assert admin.get("/v1/speculative_config").json()["num_speculative_tokens"] == k
            # Greedy output does not depend on k.
            assert complete(client, prompt=prompt, max_tokens=10)["choices"][0]["text"] == ref
        steps = metrics(client)
        for k in (1, 0):
            assert steps[("specula:step_duration_seconds_count",
                          (("batch_bucket", "1"), ("model_name", MODEL_NAME),
                           ("num_speculative_tokens", str(k))))] > 0
        for bad, param in [({"num_speculative_tokens": K + 1}, "num_speculative_tokens"),
                           ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
                           ({"num_speculative_tokens_per_batch_size": [[2, 4, 2]]},
                            "num_speculative_tokens_per_batch_size"),
                           ({"k": 2}, "k")]:
            r = admin.put("/v1/speculative_config", json=bad)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        assert admin.get("/v1/speculative_config").json()["num_speculative_tokens"] == K
    finally:
        admin.put("/v1/speculative_config", json={"num_speculative_tokens": K})


def test_body_without_json_content_type(client):
    # `curl -d` sends application/x-www-form-urlencoded; the body is still JSON.
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_prefix_cache_metrics_count_a_repeated_prompt(client):
    """vLLM's semantics: ``prefix_cache_queries`` counts prompt tokens looked up,
    ``prefix_cache_hits`` those reused; the same long prompt twice reuses every full
    block of it but the one holding its last token, and the answer is unchanged."""
    m = (("model_name", MODEL_NAME),)
    prompt = "the same system prompt, long enough to fill several KV blocks"
    before = metrics(client)
    first = complete(client, prompt=prompt, max_tokens=8, temperature=0)
    middle = metrics(client)
    second = complete(client, prompt=prompt, max_tokens=8, temperature=0)
    after = metrics(client)
    n = first["usage"]["prompt_tokens"]
    queries = after[("specula:prefix_cache_queries_total", m)]
    hits = after[("specula:prefix_cache_hits_total", m)]
    assert queries - middle[("specula:prefix_cache_queries_total", m)] == n
    assert middle[("specula:prefix_cache_queries_total", m)] - before.get(
        ("specula:prefix_cache_queries_total", m), 0) == n
    assert hits - middle[("specula:prefix_cache_hits_total", m)] == (n - 1) // 16 * 16 > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_metrics_follow_requests(client):
    m = (("model_name", MODEL_NAME),)
    before = metrics(client)
    body = complete(client, prompt="count my tokens", max_tokens=20)
    after = metrics(client)

    def delta(name, labels=m):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("specula:generation_tokens_total") == body["usage"]["completion_tokens"]
    drafts = delta("specula:spec_decode_num_drafts_total")
    draft_tokens = delta("specula:spec_decode_num_draft_tokens_total")
    accepted = delta("specula:spec_decode_num_accepted_tokens_total")
    assert drafts > 0
    assert drafts <= draft_tokens <= K * drafts
    assert 0 <= accepted <= draft_tokens
    # Each draft round yields its accepted tokens plus one bonus or recovered token.
    assert 20 <= accepted + drafts + 1

    per_pos = [after[("specula:spec_decode_num_accepted_tokens_per_pos_total",
                      (("model_name", MODEL_NAME), ("position", str(p))))] for p in range(K)]
    assert per_pos == sorted(per_pos, reverse=True)  # non-increasing in position
    assert sum(per_pos) == after[("specula:spec_decode_num_accepted_tokens_total", m)]
    assert per_pos[0] <= after[("specula:spec_decode_num_drafts_total", m)]

    assert after[("specula:num_requests_running", m)] == 0
    assert after[("specula:num_requests_waiting", m)] == 0
    steps = [v for (name, labels), v in after.items()
             if name == "specula:step_duration_seconds_count"
             and dict(labels)["num_speculative_tokens"] == str(K)]
    assert sum(steps) > 0
    assert ("specula:step_duration_seconds_bucket",
            (("batch_bucket", "1"), ("le", "+Inf"), ("model_name", MODEL_NAME),
             ("num_speculative_tokens", str(K)))) in after


def test_stream_disconnect_aborts_request(server, client):
    m = (("model_name", MODEL_NAME),)
    before = metrics(client)[("specula:generation_tokens_total", m)]
    max_tokens = MAX_MODEL_LEN - 8
    with httpx.Client(base_url=server, timeout=60) as c, c.stream(
        "POST", "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk arrived; now hang up
    deadline = time.monotonic() + 30
    while metrics(client)[("specula:num_requests_running", m)] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    generated = metrics(client)[("specula:generation_tokens_total", m)] - before
    assert 0 < generated <= max_tokens
    complete(client, prompt="still serving", max_tokens=3)


# ---- bad requests --------------------------------------------------------------------

LONG = list(range(1, MAX_MODEL_LEN + 5))

BAD_REQUESTS = [
    # (name, raw body or json, status, param)
    ("malformed_json", b'{"prompt": "x", ', 400, None),
    ("not_an_object", b'["prompt"]', 400, None),
    ("unknown_field", {"prompt": "x", "max_token": 3}, 400, "max_token"),
    ("prompt_too_long", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("prompt_plus_max_tokens_too_long", {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN},
     400, "max_tokens"),
    ("max_tokens_zero", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_negative", {"prompt": "x", "max_tokens": -4}, 400, "max_tokens"),
    ("unknown_model", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("wrong_type_max_tokens", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("wrong_type_prompt", {"prompt": 42}, 400, "prompt"),
    ("wrong_type_temperature", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("missing_prompt", {"max_tokens": 3}, 400, "prompt"),
    ("empty_prompt_list", {"prompt": []}, 400, "prompt"),
    ("token_out_of_vocab", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("negative_token", {"prompt": [1, -1]}, 400, "prompt"),
    ("n_above_max", {"prompt": "x", "n": 10**4}, 400, "n"),
    ("logprobs_above_5", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("best_of", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("temperature_out_of_range", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("empty_stop", {"prompt": "x", "stop": [""]}, 400, "stop"),
]


@pytest.mark.parametrize(("body", "status", "param"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_json_error_and_server_keeps_serving(client, body, status, param):
    for stream in (False, True):
        if isinstance(body, bytes):
            r = client.post("/v1/completions", content=body,
                            headers={"content-type": "application/json"})
        else:
            r = client.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"]
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert err["param"] == param
    body = complete(client, prompt="after a bad request", max_tokens=4)
    assert body["usage"]["completion_tokens"] == 4


def test_wrong_prompt_type_message_is_readable(client):
    err = client.post("/v1/completions", json={"prompt": 42}).json()["error"]
    assert err["message"].startswith("prompt must be a string, a list of strings")


def test_context_error_names_both_lengths(client):
    err = client.post("/v1/completions", json={"prompt": LONG}).json()["error"]
    assert str(len(LONG)) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_chat_without_a_template_is_refused(server):
    """The tiny checkpoint has no chat template: a chat completion gets a 400 that says
    so (``tests/runtime/test_server_openai.py`` serves one with ``--chat-template``)."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "no_chat_template"
    assert "no chat template" in info.value.message and "--chat-template" in info.value.message


def test_unknown_route_is_json_404(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


# ---- authentication ------------------------------------------------------------------


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_model_port_has_no_admin_route(client, method):
    body = {"num_speculative_tokens": 1} if method == "PUT" else None
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = client.request(method, "/v1/speculative_config", json=body, headers=headers)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": f"Basic {ADMIN_TOKEN}"},
    {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
], ids=["none", "wrong", "not-bearer", "longer"])
def test_admin_refuses_without_the_token(admin_url, admin, headers):
    before = admin.get("/v1/speculative_config").json()
    with httpx.Client(base_url=admin_url, headers=headers, timeout=30) as c:
        _refused(c.get("/v1/speculative_config"))
        _refused(c.put("/v1/speculative_config", json={"num_speculative_tokens": 0}))
    assert admin.get("/v1/speculative_config").json() == before


def test_api_key_guards_openai_routes_only(keyed_url):
    with httpx.Client(base_url=keyed_url, timeout=60) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        _refused(c.post("/v1/completions", json=body))
        _refused(c.post("/v1/completions", json=body,
                        headers={"Authorization": "Bearer not-the-key"}))
        _refused(c.get("/v1/models"))
        keyed = {"Authorization": f"Bearer {API_KEY}"}
        assert c.post("/v1/completions", json=body, headers=keyed).status_code == 200
        assert c.get("/v1/models", headers=keyed).status_code == 200
        # Probes and scrapers carry no key.
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


# ---- lifecycle: each test loads its own engine, never stepping the shared one -----------


def test_health_is_503_until_loaded(config):
    release = threading.Event()

    def slow_load() -> LLMEngine:
        release.wait(30)
        return LLMEngine.from_config(config)

    loop = EngineLoop(slow_load)
    with _serve(loop) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        release.set()
        assert loop.wait_ready(30)
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_health_is_503_when_load_fails(tmp_path: Path):
    config = RuntimeConfig(model=f"file://{tmp_path / 'missing'}", dtype="float32")
    fatal: list[BaseException] = []
    loop = EngineLoop(lambda: LLMEngine.from_config(config), on_fatal=fatal.append)
    with _serve(loop) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert not loop.wait_ready(30)
        assert len(fatal) == 1 and isinstance(fatal[0], FileNotFoundError)
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503
        assert r.json()["error"]["message"]
