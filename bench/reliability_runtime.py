"""The runtime under faults and load, with real ``specula serve`` processes on the CPU
(issue 14, sections 3 and 4).  Each subcommand starts its servers on the runtime tier's
tiny Llama target and 1-layer draft (``draft_model``, k = 3), built into a temporary
directory:

- ``rolling``: replicas behind a tiny round-robin balancer that routes only to ready
  backends (a ``/health`` probe every 0.2 s, like a readiness probe) and sends a request
  that got 503 or a refused connection (nothing processed: what a Service/ingress
  retries) to the next one; clients send greedy completions (streamed and not) through
  it all along while every replica is replaced, one after another (a new one started and
  ready, then SIGTERM to the old one, which drains).  A request fails if its final answer
  is not 200 with all its tokens (``finish_reason`` length, streams ending in
  ``[DONE]``).  Key ``rolling_update_failed_requests``.
- ``kswitch``: ``--requests`` greedy completions answered with k = 0 first (the
  reference), then again, concurrently, while a switcher PUTs a new
  ``num_speculative_tokens`` (0..3) or per-batch-size schedule on the admin port (bearer
  token) as fast as the engine applies them (each between two steps).  An output that
  differs from its reference is corrupted.  Keys ``k_switch_corrupted_outputs``,
  ``k_switch_requests``.
- ``overload``: a burst of ``--burst`` concurrent clients against a server admitting
  ``max_num_seqs + max_queued_requests`` requests; every answer must be 200, or 429 with
  ``Retry-After`` (no timeout, no 5xx, no dropped connection), and sequential requests
  afterwards all succeed with the KV cache back to empty.
- ``soak``: ``--minutes`` of steady load (greedy and sampled, streamed and not, and a
  stream abandoned every so often); RSS of the server sampled every 5 s; growth from the
  end of the warm-up (the first fifth, at most 2 min) to the end.  Then idle: KV cache
  usage and request gauges must return to 0.  Key ``soak_rss_growth`` (a fraction).

Usage::

    .venv/bin/python bench/reliability_runtime.py rolling --rounds 2
    .venv/bin/python bench/reliability_runtime.py kswitch --requests 500
    .venv/bin/python bench/reliability_runtime.py overload
    .venv/bin/python bench/reliability_runtime.py soak --minutes 10

Each writes its keys and an evidence object into ``bench/results/reliability.json``
(``--no-write`` to skip), keeping the file's other keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "reliability.json"
MODEL = "tiny-target"
TOKEN = "bench-admin-token"
K = 3
MAX_MODEL_LEN = 256


# ---- servers ---------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class Server:
    """One ``specula serve`` process (model port, and the admin port with a token)."""

    def __init__(self, ckpt: tuple[Path, Path], workdir: Path, **config: Any) -> None:
        self.port, self.admin_port = free_ports(2)
        cfg = {
            "model": f"file://{ckpt[0]}", "served_model_name": MODEL, "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN, "host": "127.0.0.1", "port": self.port,
            "admin_port": self.admin_port, "max_num_seqs": 8,
            "speculator": {"method": "draft_model", "model": f"file://{ckpt[1]}",
                           "num_speculative_tokens": K},
            **config,
        }
        path = workdir / f"runtime-{self.port}.json"
        path.write_text(json.dumps(cfg))
        self.log = open(workdir / f"serve-{self.port}.log", "w")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECULA_ADMIN_TOKEN": TOKEN,
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specula.cli", "serve", "--config", str(path)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("server never became healthy")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def metrics(url: str) -> dict[str, float]:
    """Unlabelled-by-anything-but-model gauges and counters of ``url``'s ``/metrics``."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("specula:") and "{model_name=" in line and "," not in line.split("}")[0]:
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(url: str, timeout_s: float = 120) -> dict[str, float]:
    """Poll until no request runs or waits and the KV cache is empty; return the gauges."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        idle = {k: m.get(f"specula:{k}", -1.0) for k in
                ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if all(v == 0 for v in idle.values()) or time.monotonic() > deadline:
            return idle
        time.sleep(0.2)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 320) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def completion(client: httpx.Client, url: str, prompt: list[int], max_tokens: int,
               stream: bool, temperature: float = 0.0) -> tuple[int, str, dict]:
    """POST one completion; ``(status, text, info)``. For a stream, ``info`` has
    ``done`` ([DONE] seen) and ``finish_reason``; for a 200 whole answer, the body."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "ignore_eos": True, "stream": stream}
    if not stream:
        r = client.post(f"{url}/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, r.text, {"headers": dict(r.headers)}
        data = r.json()
        return 200, data["choices"][0]["text"], {
            "finish_reason": data["choices"][0]["finish_reason"],
            "tokens": data["usage"]["completion_tokens"]}
    text, info = [], {"done": False, "finish_reason": None}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, {"headers": dict(r.headers)}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                info["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                info["error"] = chunk["error"]
                continue
            for c in chunk["choices"]:
                text.append(c["text"])
                info["finish_reason"] = c["finish_reason"] or info["finish_reason"]
    return 200, "".join(text), info


def record(keys: dict[str, Any], write: bool) -> None:
    print(json.dumps(keys, indent=2))
    if not write:
        return
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"issue": 14}
    data.update(keys)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def evidence(command: str, result: Any, **extra: Any) -> dict[str, Any]:
    import torch

    return {"command": command, "result": result,
            "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}, "
                       f"{platform.system()}), no GPU used; python {platform.python_version()}, "
                       f"torch {torch.__version__}",
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), **extra}


@contextlib.contextmanager
def workspace() -> Iterator[tuple[tuple[Path, Path], Path]]:
    with tempfile.TemporaryDirectory(prefix="specula-reliability-") as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(HERE.parent))
        from bench.fuzz_http import build_checkpoints  # the runtime tier's tiny pair

        yield build_checkpoints(root), root


# ---- rolling update --------------------------------------------------------------------


class Balancer:
    """Round-robin over ready backends; a readiness probe thread keeps ``ready``."""

    def __init__(self) -> None:
        self.backends: list[str] = []
        self.ready: dict[str, bool] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.retries = Counter()
        threading.Thread(target=self._probe, daemon=True).start()

    def add(self, url: str) -> None:
        with self._lock:
            self.backends.append(url)
            self.ready[url] = True

    def remove(self, url: str) -> None:
        with self._lock:
            self.backends.remove(url)
            self.ready.pop(url, None)

    def _probe(self) -> None:
        while not self._stop.wait(0.2):
            for url in list(self.backends):
                try:
                    ok = httpx.get(f"{url}/health", timeout=1).status_code == 200
                except httpx.TransportError:
                    ok = False
                with self._lock:
                    if url in self.ready:
                        self.ready[url] = ok

    def pick(self) -> str | None:
        with self._lock:
            live = [u for u in self.backends if self.ready.get(u)]
            if not live:
                return None
            self._next += 1
            return live[self._next % len(live)]

    def mark_unready(self, url: str) -> None:
        with self._lock:
            if url in self.ready:
                self.ready[url] = False

    def send(self, prompt: list[int], max_tokens: int, stream: bool) -> tuple[int, str, dict]:
        """Send until a backend takes the request (30 s at most)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            url = self.pick()
            if url is None:
                time.sleep(0.05)
                continue
            try:
                # A connection per request: no kept-alive connection to a replica that
                # is going away (a Service's clients reconnect the same way).
                with httpx.Client(timeout=120) as client:
                    status, text, info = completion(client, url, prompt, max_tokens, stream)
            except httpx.ConnectError:
                self.retries["connect_refused"] += 1
                self.mark_unready(url)
                continue
            if status == 503:
                self.retries["503"] += 1
                assert "retry-after" in info["headers"], info
                self.mark_unready(url)
                continue
            return status, text, info
        return 0, "no ready backend for 30 s", {}


def cmd_rolling(args: argparse.Namespace) -> None:
    with workspace() as (ckpt, root):
        balancer = Balancer()
        servers = [Server(ckpt, root) for _ in range(args.replicas)]
        for s in servers:
            s.wait_healthy()
            balancer.add(s.url)
        stop = threading.Event()
        outcomes: Counter = Counter()
        failures: list[str] = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = [rng.randrange(1, 320) for _ in range(rng.randrange(4, 24))]
                n, stream = rng.randrange(8, 48), rng.random() < 0.5
                try:
                    status, text, info = balancer.send(prompt, n, stream)
                    ok = (status == 200 and info.get("finish_reason") == "length"
                          and (info.get("done") if stream else info.get("tokens") == n))
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    status, ok, text, info = -1, False, repr(exc), {}
                with lock:
                    outcomes["ok" if ok else "failed"] += 1
                    if not ok:
                        failures.append(f"stream={stream} status={status} {text[:200]} {info}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(3)
        exit_codes, drains, drained_in = [], [], []
        for _ in range(args.rounds):
            for i, old in enumerate(list(servers)):
                new = Server(ckpt, root)
                new.wait_healthy()
                balancer.add(new.url)
                t0 = time.monotonic()
                exit_codes.append(old.stop(signal.SIGTERM))
                drains.append(round(time.monotonic() - t0, 2))
                drained_in.extend(line.split("drained in ")[1].strip() for line in
                                  Path(old.log.name).read_text().splitlines()
                                  if "drained in " in line)
                balancer.remove(old.url)
                servers[i] = new
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join()
        for s in servers:
            s.stop()
    result = {"requests": sum(outcomes.values()), "failed": outcomes["failed"],
              "retried_elsewhere": dict(balancer.retries), "replicas": args.replicas,
              "replacements": len(exit_codes), "old_replica_exit_codes": exit_codes,
              "sigterm_to_exit_seconds": drains, "drain_log": drained_in,
              "failures": failures[:20]}
    record({"rolling_update_failed_requests": outcomes["failed"],
            "rolling_update_requests": sum(outcomes.values()),
            "rolling_update_evidence": evidence(
                f"{_cmdline()}", result,
                shows="clients run throughout; each old replica gets SIGTERM after its "
                      "replacement is ready, answers new requests and /health 503 with "
                      "Retry-After while it drains, finishes its in-flight completions, "
                      "and exits 0; the balancer sends 503s and refused connections to "
                      "another ready replica")}, args.write)


# ---- k switched under load -------------------------------------------------------------


SWITCHES = [{"num_speculative_tokens": k} for k in range(K + 1)] + [
    {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 1]]},
    {"num_speculative_tokens_per_batch_size": [[1, 3, 0], [4, 256, 2]]},
]


def run_all(url: str, work: list[tuple[list[int], int]], concurrency: int) -> list[str]:
    out: list[str | None] = [None] * len(work)
    order = list(range(len(work)))
    random.Random(len(work)).shuffle(order)
    it = iter(order)
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as c:
            while True:
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                status, text, info = completion(c, url, work[i][0], work[i][1],
                                                stream=rng.random() < 0.5)
                assert status == 200 and info.get("finish_reason") == "length", (status, text)
                out[i] = text

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def cmd_kswitch(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    work = [(p, rng.randrange(16, 64)) for p in prompts(args.requests, seed=11)]
    admin = {"Authorization": f"Bearer {TOKEN}"}
    with workspace() as (ckpt, root):
        server = Server(ckpt, root)
        try:
            server.wait_healthy()
            put = f"{server.admin_url}/v1/speculative_config"
            assert httpx.put(put, json={"num_speculative_tokens": 0}, headers=admin,
                             timeout=30).status_code == 200
            reference = run_all(server.url, work, args.concurrency)
            stop = threading.Event()
            applied = Counter()

            def switcher() -> None:
                srng = random.Random(3)
                with httpx.Client(timeout=60, headers=admin) as c:
                    while not stop.is_set():
                        body = srng.choice(SWITCHES)
                        r = c.put(put, json=body)
                        assert r.status_code == 200, r.text
                        applied[json.dumps(body)] += 1

            steps_before = _steps(server.url)
            t = threading.Thread(target=switcher)
            t.start()
            try:
                got = run_all(server.url, work, args.concurrency)
            finally:
                stop.set()
                t.join()
            steps = _steps(server.url) - steps_before
            idle = wait_idle(server.url)
        finally:
            code = server.stop()
    corrupted = [i for i, (a, b) in enumerate(zip(reference, got, strict=True)) if a != b]
    result = {"requests": len(work), "corrupted": len(corrupted), "switches_applied":
              sum(applied.values()), "engine_steps_during_switching": steps,
              "switches_by_setting": dict(applied), "idle_after": idle, "exit_code": code,
              "corrupted_indices": corrupted[:20]}
    record({"k_switch_corrupted_outputs": len(corrupted), "k_switch_requests": len(work),
            "k_switch_evidence": evidence(
                _cmdline(), result,
                shows="every greedy output (temperature 0, streamed or not, 8 concurrent "
                      "clients) equals the same prompt's output at k = 0 while k and "
                      "per-batch-size schedules were switched through the admin API "
                      "between engine steps")}, args.write)


def _steps(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specula:step_duration_seconds_count"))


# ---- overload --------------------------------------------------------------------------


def cmd_overload(args: argparse.Namespace) -> None:
    with workspace() as (ckpt, root):
        server = Server(ckpt, root, max_num_seqs=4, max_queued_requests=4)
        try:
            server.wait_healthy()
            statuses: Counter = Counter()
            problems: list[str] = []
            latencies_429: list[float] = []
            lock = threading.Lock()
            start = threading.Barrier(args.burst)

            def one(i: int) -> int:
                t0 = time.monotonic()
                try:
                    with httpx.Client(timeout=120) as c:
                        status, text, info = completion(c, server.url, [1 + i % 300, 2, 3],
                                                        96, stream=i % 2 == 0)
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    status, text, info = -1, repr(exc), {}
                with lock:
                    statuses[status] += 1
                    if status == 429:
                        latencies_429.append(time.monotonic() - t0)
                        if "retry-after" not in info["headers"]:
                            problems.append("429 without Retry-After")
                    elif status != 200:
                        problems.append(f"{status}: {text[:200]}")
                return status

            def burst(i: int) -> None:
                start.wait()
                one(i)

            threads = [threading.Thread(target=burst, args=(i,)) for i in range(args.burst)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            burst_statuses, statuses = dict(statuses), Counter()
            # Sustained: every client resends at once after a 200, after Retry-After
            # after a 429.
            stop_at = time.monotonic() + args.seconds

            def sustained(i: int) -> None:
                while time.monotonic() < stop_at:
                    if one(i) == 429:
                        time.sleep(1)

            threads = [threading.Thread(target=sustained, args=(i,))
                       for i in range(args.burst // 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after_idle = wait_idle(server.url)
            recovered = 0
            with httpx.Client(timeout=120) as c:
                for i in range(args.after):
                    status, _, info = completion(c, server.url, [5, 6, 7 + i], 32, i % 2 == 0)
                    recovered += status == 200 and info.get("finish_reason") == "length"
            idle = wait_idle(server.url)
        finally:
            code = server.stop()
    result = {"burst": args.burst, "capacity": 8,
              "burst_statuses": {str(k): v for k, v in burst_statuses.items()},
              "sustained_clients": args.burst // 2, "sustained_seconds": args.seconds,
              "sustained_statuses": {str(k): v for k, v in statuses.items()},
              "problems": problems,
              "seconds_to_429_median": round(statistics.median(latencies_429), 3),
              "seconds_to_429_max": round(max(latencies_429), 3),
              "recovered": f"{recovered}/{args.after}", "idle_after_burst": after_idle,
              "idle_at_end": idle, "exit_code": code}
    record({"overload_evidence": evidence(
        _cmdline(), result,
        shows="a burst beyond max_num_seqs + max_queued_requests (4 + 4), then clients "
              "resending for --seconds (after Retry-After on a 429): every answer is 200 "
              "or 429 with Retry-After, answered without queueing (no timeout, no 5xx, no "
              "dropped connection); afterwards the KV cache is empty and sequential "
              "requests all succeed")},
        args.write)


# ---- soak ------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cmd_soak(args: argparse.Namespace) -> None:
    total_s = args.minutes * 60
    warmup_s = min(total_s / 5, 120)
    with workspace() as (ckpt, root):
        server = Server(ckpt, root)
        try:
            server.wait_healthy()
            stop = threading.Event()
            outcomes: Counter = Counter()
            errors: list[str] = []
            lock = threading.Lock()

            def client(seed: int) -> None:
                rng = random.Random(seed)
                with httpx.Client(timeout=120) as c:
                    while not stop.is_set():
                        prompt = [rng.randrange(1, 320) for _ in range(rng.randrange(4, 64))]
                        n = rng.randrange(8, 96)
                        temp = rng.choice([0.0, 0.0, 0.8])
                        kind = rng.random()
                        try:
                            if kind < 0.1:  # abandon a stream after its first chunk
                                body = {"prompt": prompt, "max_tokens": n, "stream": True,
                                        "ignore_eos": True, "temperature": temp}
                                with c.stream("POST", f"{server.url}/v1/completions",
                                              json=body) as r:
                                    ok = r.status_code == 200
                                    next(r.iter_lines())
                                key = "abandoned"
                            else:
                                status, text, info = completion(c, server.url, prompt, n,
                                                                kind < 0.55, temp)
                                ok = status == 200 and info.get("finish_reason") == "length"
                                key = "ok" if ok else "error"
                                if not ok:
                                    errors.append(f"{status} {text[:200]} {info}")
                        except Exception as exc:  # noqa: BLE001 - every failure is counted
                            ok, key = False, "error"
                            errors.append(repr(exc))
                        with lock:
                            outcomes[key if ok else "error"] += 1

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            samples: list[tuple[float, int]] = []
            while (elapsed := time.monotonic() - t0) < total_s:
                samples.append((round(elapsed, 1), rss_bytes(server.proc.pid)))
                time.sleep(5)
            stop.set()
            for t in threads:
                t.join()
            idle = wait_idle(server.url)
            rss_idle = rss_bytes(server.proc.pid)
        finally:
            code = server.stop()
    after = [rss for t, rss in samples if t >= warmup_s]
    start_rss = statistics.median(after[:3])
    end_rss = statistics.median(after[-3:])
    growth = (end_rss - start_rss) / start_rss
    result = {"minutes": args.minutes, "clients": args.clients,
              "warmup_s": warmup_s, "requests": dict(outcomes), "errors": errors[:20],
              "rss_mib_after_warmup": round(start_rss / 2**20, 1),
              "rss_mib_end": round(end_rss / 2**20, 1),
              "rss_mib_max_after_warmup": round(max(after) / 2**20, 1),
              "rss_mib_idle": round(rss_idle / 2**20, 1),
              "rss_mib_samples_every_5s": [round(r / 2**20, 1) for _, r in samples],
              "idle_after": idle, "exit_code": code}
    record({"soak_rss_growth": round(growth, 4),
            "soak_evidence": evidence(
                _cmdline(), result,
                shows="steady load from several clients (greedy and sampled, streamed and "
                      "not, one stream in ten abandoned after its first chunk); RSS growth "
                      "from the end of the warm-up (median of 3 samples) to the end (median "
                      "of the last 3); then idle: no request running or waiting, KV cache "
                      "usage 0")}, args.write)


def _cmdline() -> str:
    return ".venv/bin/python bench/reliability_runtime.py " + " ".join(sys.argv[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", dest="write", action="store_false")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rolling")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p = sub.add_parser("kswitch")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=8)
    p = sub.add_parser("overload")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--after", type=int, default=20)
    p.add_argument("--seconds", type=float, default=30)
    p = sub.add_parser("soak")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    {"rolling": cmd_rolling, "kswitch": cmd_kswitch, "overload": cmd_overload,
     "soak": cmd_soak}[args.cmd](args)


if __name__ == "__main__":
    main()
