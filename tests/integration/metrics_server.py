"""A stand-in serving pod for the tuning and autoscaling tests, run as a script.

Serves ``/metrics`` in the Prometheus text format with the counters a serving pod
exports (``specula:`` or, with ``--prefix vllm``, ``vllm:`` names and vLLM's
``model_name``/``engine`` labels), growing with wall-clock time at a fixed draft rate
and fixed per-position acceptance, so the acceptance the operator reports is known in
advance; gauges of running and waiting requests are constant.  ``/health`` answers
200; ``GET /v1/speculative_config`` answers like the Specula runtime's admin API for
``--prefix specula`` and 404 for ``vllm`` (which has none).  Every request is
appended to ``--requests-log`` as ``METHOD PATH``, so a test can check that nothing
was ``PUT``.

With ``--admin-token-file`` (``specula`` only) the admin API is writable, as the
runtime's: ``GET`` and ``PUT /v1/speculative_config`` need ``Authorization: Bearer``
with the file's token (read per request; 401 otherwise), and a ``PUT`` of
``{"num_speculative_tokens": k}`` changes the k the counters grow at from then on
(counters stay monotonic); with ``--pause-file``, ``GET /metrics`` is answered only
once that file is gone (a test holds the operator's tuning window there).  Its log line is ``PUT /v1/speculative_config k=<k>`` once
applied, or ``... <status>`` when refused.

Usage: python metrics_server.py --host ADDR --port N --prefix vllm --k 3
       --alphas 0.8,0.5,0.25 --requests-log FILE [--admin-token-file FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class GrowingCounters:
    """Counters of a pod drafting ``drafts_per_second`` rounds of ``k`` tokens, position
    j accepted with conditional probability ``alphas[j]``, in steps of ``batch``
    sequences taking ``step_seconds`` each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.prefix = args.prefix
        self.k = args.k
        self.alphas = [float(a) for a in args.alphas.split(",")][: args.k]
        self.rate = args.drafts_per_second
        self.running = args.running
        self.waiting = args.waiting
        self.step_seconds = args.step_seconds
        self.all_alphas = [float(a) for a in args.alphas.split(",")]
        self.start = time.monotonic()
        self.labels = {"model_name": "tiny", "engine": "0"} if self.prefix == "vllm" else {}
        # Totals so far, advanced at the k in effect (a k set through PUT changes the
        # rate of growth, never a total).
        self.lock = threading.Lock()
        self.last = self.start
        self.total_seconds = {self.k: 0.0}
        self.draft_tokens = 0.0
        self.reach_f = [0.0] * len(self.all_alphas)

    def set_k(self, k: int) -> None:
        with self.lock:
            self._advance()
            self.k = k
            self.alphas = self.all_alphas[:k]
            self.total_seconds.setdefault(k, 0.0)

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self.last = now - self.last, now
        self.total_seconds[self.k] = self.total_seconds.get(self.k, 0.0) + elapsed
        drafts = self.rate * elapsed
        self.draft_tokens += drafts * self.k
        p = 1.0
        for j, alpha in enumerate(self.alphas):
            p *= alpha
            self.reach_f[j] += drafts * p

    def collect(self):
        with self.lock:
            self._advance()
            seconds = dict(self.total_seconds)
            drafts = math.floor(self.rate * sum(seconds.values()))
            draft_tokens = math.floor(self.draft_tokens)
            reach = [math.floor(r) for r in self.reach_f[: self.k]]
            reach_all = [math.floor(r) for r in self.reach_f]
        accepted = sum(reach_all)
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, value: float):
            family = CounterMetricFamily(f"{self.prefix}:{name}", name, labels=names)
            family.add_metric(values, value)
            return family

        yield counter("spec_decode_num_drafts", drafts)
        yield counter("spec_decode_num_draft_tokens", draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", accepted)
        per_pos = CounterMetricFamily(
            f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos", "per position",
            labels=[*names, "position"],
        )
        for j, n in enumerate(reach_all if len(seconds) > 1 else reach):
            per_pos.add_metric([*values, str(j)], n)
        yield per_pos
        yield counter("generation_tokens", drafts + accepted)
        for name, value in (("num_requests_running", self.running),
                            ("num_requests_waiting", self.waiting)):
            gauge = GaugeMetricFamily(f"{self.prefix}:{name}", name, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        if self.prefix == "specula":
            histogram = HistogramMetricFamily(
                "specula:step_duration_seconds", "step time",
                labels=["batch_bucket", "num_speculative_tokens"],
            )
            bucket = "3-4" if 3 <= self.running <= 4 else str(max(self.running, 1))
            for k, secs in sorted(seconds.items()):
                steps = math.floor(self.rate * secs) // max(self.running, 1)
                histogram.add_metric(
                    [bucket, str(k)], [("+Inf", steps)], steps * self.step_seconds
                )
            yield histogram


_UNAUTHORIZED = b'{"error": {"code": "invalid_api_key", "message": "admin token required"}}'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefix", choices=("specula", "vllm"), required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--alphas", default="0.8,0.5,0.25")
    parser.add_argument("--drafts-per-second", type=float, default=400.0)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--waiting", type=int, default=2)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--requests-log", required=True)
    parser.add_argument("--admin-token-file", default=None)
    parser.add_argument("--pause-file", default=None)
    args = parser.parse_args()

    registry = CollectorRegistry()
    counters = GrowingCounters(args)
    registry.register(counters)
    log_lock = threading.Lock()
    writable = args.admin_token_file is not None and args.prefix == "specula"

    def authorized(header: str | None) -> bool:
        try:
            with open(args.admin_token_file) as f:
                token = f.read().strip()
        except OSError:
            return False
        return bool(token) and header == f"Bearer {token}"

    class Handler(BaseHTTPRequestHandler):
        def _log(self, suffix: str = "") -> None:
            with log_lock, open(args.requests_log, "a") as f:
                f.write(f"{self.command} {self.path}{suffix}\n")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._log()
            if self.path == "/metrics" and args.pause_file:
                # Held while the file exists (at most 30 s): a test acts meanwhile.
                deadline = time.monotonic() + 30
                while os.path.exists(args.pause_file) and time.monotonic() < deadline:
                    time.sleep(0.005)
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/v1/speculative_config" and args.prefix == "specula":
                if writable and not authorized(self.headers.get("Authorization")):
                    self._send(401, _UNAUTHORIZED, "application/json")
                    return
                body = json.dumps({"num_speculative_tokens": counters.k}).encode()
                self._send(200, body, "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def do_PUT(self) -> None:  # noqa: N802
            if not (writable and self.path == "/v1/speculative_config"):
                self._log()
                self._send(405, b'{"error": "read-only stand-in"}', "application/json")
                return
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if not authorized(self.headers.get("Authorization")):
                self._log(" 401")
                self._send(401, _UNAUTHORIZED, "application/json")
                return
            try:
                k = json.loads(raw)["num_speculative_tokens"]
                if not isinstance(k, int) or not 0 <= k <= len(counters.all_alphas):
                    raise ValueError(k)
            except (ValueError, KeyError, TypeError):
                self._log(" 400")
                self._send(400, b'{"error": {"message": "bad k"}}', "application/json")
                return
            counters.set_k(k)
            self._log(f" k={k}")
            self._send(200, json.dumps({"num_speculative_tokens": k}).encode(),
                       "application/json")

        def log_message(self, *_: object) -> None:
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
