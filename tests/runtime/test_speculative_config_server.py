"""``PUT /v1/speculative_config`` on a live server (the admin API on its own listener,
with its token, as ``specula serve --admin-port`` runs it): switching k and per-batch-size
schedules while requests are in flight keeps greedy output exact, the new setting shows
in the step-time histogram and the gauges, and refusals are 400 with the server still
serving."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from specula.runtime.engine.spec_schedule import BatchSizeSchedule
from specula.runtime.server.app import create_admin_app, create_app
from specula.runtime.server.engine_loop import EngineLoop
from specula.runtime.server.metrics import batch_bucket

pytestmark = pytest.mark.runtime

K = 3
MODEL = "tiny-target"
PATH = "/v1/speculative_config"
TOKEN = "admin-token-for-tests"


class Urls(str):
    """The model port's base URL, carrying the admin listener's as ``admin``."""

    admin: str


class Client(httpx.Client):
    """A client of the model port that sends :data:`PATH` to the admin listener with
    the token, as the operator does."""

    def __init__(self, base_url: Urls, **kwargs) -> None:
        super().__init__(base_url=base_url, **kwargs)
        self._admin = httpx.Client(
            base_url=base_url.admin, headers={"Authorization": f"Bearer {TOKEN}"}, **kwargs
        )

    def request(self, method, url, **kwargs):
        if url == PATH:
            return self._admin.request(method, url, **kwargs)
        return super().request(method, url, **kwargs)

    def close(self) -> None:
        self._admin.close()
        super().close()


@pytest.fixture(scope="module")
def serve():
    """``serve(engine)`` -> base URL of a uvicorn server around ``engine``, stopped at
    module teardown."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def listen(app) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        host, port = sock.getsockname()
        return f"http://{host}:{port}"

    def start(engine) -> Urls:
        loop = EngineLoop(lambda: engine)
        start.loops.append(loop)
        app = create_app(loop)
        urls = Urls(listen(app))
        urls.admin = listen(create_admin_app(app, lambda: TOKEN))
        assert loop.wait_ready(60)
        return urls

    start.loops = []
    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(serve, tiny_llama_target: Path, tiny_llama_draft: Path, make_engine) -> Urls:
    return serve(
        make_engine(
            tiny_llama_target, tiny_llama_draft, k=K, max_num_seqs=8, served_model_name=MODEL
        )
    )


@pytest.fixture(scope="module")
def client(server: Urls) -> Iterator[httpx.Client]:
    with Client(server, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _restore_k(request):
    yield
    if "client" in request.fixturenames:
        r = request.getfixturevalue("client").put(PATH, json={"num_speculative_tokens": K})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_target: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_target)


def complete(client: httpx.Client, prompt, max_tokens: int) -> list[str]:
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def metrics(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def step_counts(samples) -> dict[tuple[str, int], float]:
    """``{(batch_bucket, k): steps}`` from the step-time histogram."""
    out = {}
    for (name, labels), v in samples.items():
        if name == "specula:step_duration_seconds_count":
            d = dict(labels)
            out[(d["batch_bucket"], int(d["num_speculative_tokens"]))] = v
    return out


def delta(after: dict, before: dict) -> dict:
    return {
        key: v - before.get(key, 0.0) for key, v in after.items() if v - before.get(key, 0.0) > 0
    }


def counter(samples, name: str) -> float:
    return samples[(f"specula:{name}", (("model_name", MODEL),))]


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (5 + 4 * i,), generator=gen).tolist() for i in range(n)]


# ---- switching while requests are in flight ------------------------------------------


class _LockstepGate:
    """Makes a server's engine take a step only once a command (an added request or a
    setting change) is waiting in its loop's queue, while ``active``.

    The loop thread drains its queue between steps, so with the gate each setting
    change is applied between two steps, and each change gets exactly one step before
    the next: the interleaving of switches and steps is fixed, whatever the speed of
    the machine or the order in which threads run."""

    def __init__(self, engine, loop: EngineLoop) -> None:
        self.active = threading.Event()
        self.active.set()
        inner = engine.step

        def step():
            while self.active.is_set() and loop._commands.empty():
                time.sleep(0.001)
            return inner()

        engine.step = step

    def open(self) -> None:
        self.active.clear()


def test_switches_in_flight_keep_greedy_output(
    serve, hf_model, hf_greedy, tiny_llama_target, tiny_llama_draft, tokenizer, make_engine
):
    hf = hf_model(tiny_llama_target)
    batch = prompts(4, seed=31)
    max_tokens = [40, 48, 56, 64]
    # Decoded as the server decodes.
    expected = [
        tokenizer.decode(
            hf_greedy(hf, p, n), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        for p, n in zip(batch, max_tokens, strict=True)
    ]
    updates = [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 1]]},
        {"num_speculative_tokens": K + 1},  # refused mid-flight: must disturb nothing
        {"num_speculative_tokens": K},
        {"num_speculative_tokens_per_batch_size": [[1, 3, 0], [4, 8, 2]]},
        {"num_speculative_tokens": 2},
    ]
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=K, max_num_seqs=8,
                         served_model_name=MODEL)
    url = serve(engine)
    gate = _LockstepGate(engine, serve.loops[-1])

    def one(i: int) -> str:
        with httpx.Client(base_url=url, timeout=120) as c:
            return complete(c, batch[i], max_tokens[i])[0]

    with ThreadPoolExecutor(4) as pool, Client(url, timeout=120) as c:
        before = metrics(c)
        try:
            futures = [pool.submit(one, i) for i in range(len(batch))]
            # Each added request lets one step run; then the engine waits for switches.
            while engine.scheduler_stats()["num_requests_running"] + \
                    engine.scheduler_stats()["num_requests_waiting"] < len(batch):
                assert not any(f.done() for f in futures), "a request ended before switching"
                time.sleep(0.01)
            for body in updates:
                r = c.put(PATH, json=body)
                expect = 400 if body.get("num_speculative_tokens", 0) > K else 200
                assert r.status_code == expect, r.text
                # One step per switch: at most 7 * (K + 1) tokens, below every max_tokens.
                assert not any(f.done() for f in futures)
        finally:
            gate.open()
        got = [f.result() for f in futures]
        after = metrics(c)
    assert got == expected
    # Every setting ran at least one step, k = 0 included; batch 4 takes k = 1 from the
    # first schedule and k = 2 from the second.
    used_k = {k for _, k in delta(step_counts(after), step_counts(before))}
    assert used_k == {0, 1, 2, K}, used_k


# ---- the new setting takes effect ----------------------------------------------------


@pytest.mark.parametrize("k", [2, 0, K])
def test_single_k_takes_effect(client, k):
    r = client.put(PATH, json={"num_speculative_tokens": k})
    assert r.status_code == 200, r.text
    assert r.json()["num_speculative_tokens"] == k
    before = metrics(client)
    complete(client, prompts(1, seed=32)[0], 12)
    after = metrics(client)
    drafts = counter(after, "spec_decode_num_drafts_total") - counter(
        before, "spec_decode_num_drafts_total"
    )
    draft_tokens = counter(after, "spec_decode_num_draft_tokens_total") - counter(
        before, "spec_decode_num_draft_tokens_total"
    )
    assert draft_tokens == k * drafts
    assert (drafts > 0) == (k > 0)
    assert set(delta(step_counts(after), step_counts(before))) == {("1", k)}
    assert counter(after, "num_speculative_tokens") == k
    assert counter(after, "max_num_speculative_tokens") == K


def test_schedule_picks_k_by_batch_size(client):
    schedule = [[1, 1, 3], [2, 256, 1]]
    r = client.put(PATH, json={"num_speculative_tokens_per_batch_size": schedule})
    assert r.status_code == 200, r.text
    lookup = BatchSizeSchedule.parse(schedule, K)

    before = metrics(client)
    complete(client, prompts(1, seed=33)[0], 12)
    alone = delta(step_counts(metrics(client)), step_counts(before))
    assert set(alone) == {("1", 3)}

    before = metrics(client)
    complete(client, prompts(5, seed=34), 16)  # one request of five prompts: one batch
    after = metrics(client)
    batched = delta(step_counts(after), step_counts(before))
    assert any(bucket != "1" for bucket, _ in batched), batched
    for bucket, k in batched:
        # A step verifies the k of its batch size, or, right after the batch shrank, the
        # k of the larger batch its drafts were proposed for, whichever is smaller.
        sizes = [b for b in range(1, 9) if batch_bucket(b) == bucket]
        allowed = {min(lookup.k_for(b), lookup.k_for(c)) for b in sizes for c in range(b, 9)}
        assert k in allowed, (bucket, k)
    assert counter(after, "num_speculative_tokens") in (1, 3)


# ---- GET, refusals -------------------------------------------------------------------


def test_get_reflects_put(client):
    schedule = [[1, 8, 3], [9, 32, 2], [33, 256, 0]]
    put = client.put(PATH, json={"num_speculative_tokens_per_batch_size": schedule})
    assert put.status_code == 200, put.text
    got = client.get(PATH).json()
    assert got == put.json()
    assert got["num_speculative_tokens_per_batch_size"] == schedule
    assert got["num_speculative_tokens"] is None
    assert (got["method"], got["max_num_speculative_tokens"]) == ("draft_model", K)

    put = client.put(PATH, json={"num_speculative_tokens": 1})
    assert client.get(PATH).json() == put.json()
    assert (
        put.json()["num_speculative_tokens"],
        put.json()["num_speculative_tokens_per_batch_size"],
    ) == (1, None)


@pytest.mark.parametrize(
    ("body", "param", "code", "message"),
    [
        (
            {"num_speculative_tokens": K + 1},
            "num_speculative_tokens",
            "above_max",
            f"max_num_speculative_tokens={K}",
        ),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens", "invalid_value", "outside"),
        (
            {"num_speculative_tokens_per_batch_size": [[1, 4, 2], [6, 8, 1]]},
            "num_speculative_tokens_per_batch_size",
            "invalid_schedule",
            "range 1 [6, 8, 1]",
        ),
        (
            {"num_speculative_tokens_per_batch_size": [[1, 4, 2], [3, 8, 1]]},
            "num_speculative_tokens_per_batch_size",
            "invalid_schedule",
            "overlaps",
        ),
        (
            {"num_speculative_tokens_per_batch_size": [[2, 8, 1]]},
            "num_speculative_tokens_per_batch_size",
            "invalid_schedule",
            "start at batch size 1",
        ),
        (
            {"num_speculative_tokens_per_batch_size": [[1, 8, K + 1]]},
            "num_speculative_tokens_per_batch_size",
            "above_max",
            f"={K}",
        ),
        (
            {"num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 8, 1]]},
            "num_speculative_tokens",
            None,
            "exactly one",
        ),
        ({}, "num_speculative_tokens", None, "exactly one"),
        ({"num_speculative_tokens": 1, "method": "eagle3"}, "method", None, "unknown field"),
        ({"num_speculative_tokens": "2"}, "num_speculative_tokens", None, ""),
    ],
    ids=[
        "above-max",
        "negative",
        "gap",
        "overlap",
        "not-from-1",
        "schedule-above-max",
        "both",
        "neither",
        "extra-field",
        "string-k",
    ],
)
def test_refused_with_400_and_server_keeps_serving(client, body, param, code, message):
    before = client.get(PATH).json()
    r = client.put(PATH, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert message in error["message"]
    assert client.get(PATH).json() == before
    assert len(complete(client, [5, 6, 7], 4)[0]) > 0


def test_no_speculator_is_400(serve, tiny_llama_target: Path, make_engine):
    base = serve(make_engine(tiny_llama_target, served_model_name=MODEL))
    with Client(base, timeout=60) as c:
        r = c.put(PATH, json={"num_speculative_tokens": 0})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "no_speculator"
        assert "no speculator" in r.json()["error"]["message"]
        assert c.get(PATH).json()["method"] is None
        samples = metrics(c)
        assert counter(samples, "max_num_speculative_tokens") == 0
        assert counter(samples, "num_speculative_tokens") == 0
