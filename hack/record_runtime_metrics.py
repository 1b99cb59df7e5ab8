"""Record ``/metrics`` snapshots of a real ``specula serve`` under load, as test fixtures.

Serves the runtime tier's tiny Llama target (``tests/runtime/conftest.py``) with two
drafts of different quality, one after the other, each under the same closed-loop
load (more concurrent requests than ``max_num_seqs``, so requests queue), and scrapes
``/metrics`` twice per run, ``WINDOW_S`` apart.  Writes, per run, ``scrape_0.prom``,
``scrape_1.prom`` and ``window.json`` (window length, engine settings, how it was
made) under ``tests/unit/data/specula_serve/<run>/``.

Usage (from the repository root; a few minutes on two CPU cores):

    .venv/bin/python hack/record_runtime_metrics.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "unit" / "data" / "specula_serve"
MAX_NUM_SEQS = 4
CONCURRENCY = 6
NUM_SPECULATIVE_TOKENS = 3
WARMUP_S = 8.0
WINDOW_S = 10.0
RUNS = {"draft_close": 0.01, "draft_far": 0.08}
"""Run name -> std of the noise added to the draft's weights (more noise, less acceptance)."""

PROMPTS = [
    "def speculative_decoding(target, draft, k):",
    "The quick brown fox jumps over the lazy dog",
    "Kubernetes reconciles a SpeculativeModel into pods",
    "import torch\nfrom transformers import AutoTokenizer",
]


def _fixtures():
    spec = importlib.util.spec_from_file_location(
        "_runtime_fixtures", REPO / "tests" / "runtime" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traffic(base_url: str, stop: threading.Event, index: int) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        n = index
        while not stop.is_set():
            client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 48,
                "temperature": 0.0, "ignore_eos": True,
            })
            n += 1


def record(name: str, target: Path, draft: Path, workdir: Path) -> None:
    port = _free_port()
    config = {
        "model": f"file://{target}", "served_model_name": "tiny", "dtype": "float32",
        "max_model_len": 128, "max_num_seqs": MAX_NUM_SEQS, "host": "127.0.0.1", "port": port,
        "speculator": {"method": "draft_model", "model": f"file://{draft}",
                       "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
    }
    config_path = workdir / f"{name}.json"
    config_path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specula.cli", "serve", "--config", str(config_path)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("specula serve did not become healthy")
            time.sleep(0.5)
        stop = threading.Event()
        threads = [
            threading.Thread(target=_traffic, args=(base, stop, i), daemon=True)
            for i in range(CONCURRENCY)
        ]
        for t in threads:
            t.start()
        time.sleep(WARMUP_S)
        t0 = time.monotonic()
        first = httpx.get(f"{base}/metrics", timeout=10).text
        time.sleep(WINDOW_S)
        t1 = time.monotonic()
        second = httpx.get(f"{base}/metrics", timeout=10).text
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        proc.terminate()
        proc.wait(60)
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "scrape_0.prom").write_text(first)
    (out / "scrape_1.prom").write_text(second)
    (out / "window.json").write_text(json.dumps({
        "window_seconds": round(t1 - t0, 3),
        "max_num_seqs": MAX_NUM_SEQS,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "concurrent_requests": CONCURRENCY,
        "draft_noise_std": RUNS[name],
        "recorded_with": "hack/record_runtime_metrics.py",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.system()}, CPU torch",
    }, indent=2) + "\n")
    print(f"{name}: window {t1 - t0:.1f}s -> {out.relative_to(REPO)}")


def main() -> None:
    fixtures = _fixtures()
    tokenizer = fixtures._train_tokenizer()
    target_model = fixtures._llama(tokenizer, num_layers=3, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = fixtures.save_checkpoint(target_model, tokenizer, root / "target")
        for name, noise in RUNS.items():
            draft_model = fixtures.derive_draft(target_model, num_layers=1, noise=noise, seed=2)
            draft = fixtures.save_checkpoint(draft_model, tokenizer, root / name)
            record(name, target, draft, root)


if __name__ == "__main__":
    main()
