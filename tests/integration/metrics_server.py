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

Usage: python metrics_server.py --host ADDR --port N --prefix vllm --k 3
       --alphas 0.8,0.5,0.25 --requests-log FILE
"""

from __future__ import annotations

import argparse
import json
import math
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
        self.start = time.monotonic()
        self.labels = {"model_name": "tiny", "engine": "0"} if self.prefix == "vllm" else {}

    def collect(self):
        drafts = math.floor(self.rate * (time.monotonic() - self.start))
        reach = []
        p = 1.0
        for alpha in self.alphas:
            p *= alpha
            reach.append(math.floor(drafts * p))
        accepted = sum(reach)
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, value: float):
            family = CounterMetricFamily(f"{self.prefix}:{name}", name, labels=names)
            family.add_metric(values, value)
            return family

        yield counter("spec_decode_num_drafts", drafts)
        yield counter("spec_decode_num_draft_tokens", drafts * self.k)
        yield counter("spec_decode_num_accepted_tokens", accepted)
        per_pos = CounterMetricFamily(
            f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos", "per position",
            labels=[*names, "position"],
        )
        for j, n in enumerate(reach):
            per_pos.add_metric([*values, str(j)], n)
        yield per_pos
        yield counter("generation_tokens", drafts + accepted)
        for name, value in (("num_requests_running", self.running),
                            ("num_requests_waiting", self.waiting)):
            gauge = GaugeMetricFamily(f"{self.prefix}:{name}", name, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        if self.prefix == "specula":
            steps = drafts // max(self.running, 1)
            histogram = HistogramMetricFamily(
                "specula:step_duration_seconds", "step time",
                labels=["batch_bucket", "num_speculative_tokens"],
            )
            bucket = "3-4" if 3 <= self.running <= 4 else str(max(self.running, 1))
            histogram.add_metric(
                [bucket, str(self.k)], [("+Inf", steps)], steps * self.step_seconds
            )
            yield histogram


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
    args = parser.parse_args()

    registry = CollectorRegistry()
    registry.register(GrowingCounters(args))
    log_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _log(self) -> None:
            with log_lock, open(args.requests_log, "a") as f:
                f.write(f"{self.command} {self.path}\n")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._log()
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/v1/speculative_config" and args.prefix == "specula":
                body = json.dumps({"num_speculative_tokens": args.k}).encode()
                self._send(200, body, "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def do_PUT(self) -> None:  # noqa: N802
            self._log()
            self._send(405, b'{"error": "read-only stand-in"}', "application/json")

        def log_message(self, *_: object) -> None:
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
