"""``specula serve``: config merging, config errors, and a real server process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specula.cli import build_parser
from specula.runtime import download
from specula.runtime.server.cli import (
    ConfigError,
    admin_token_source,
    build_runtime_config,
    serve,
)

pytestmark = pytest.mark.runtime


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_flags_alone_build_config():
    cfg = build_runtime_config(
        _args("--model", "file:///m/target", "--speculator-model", "file:///m/draft",
              "--num-speculative-tokens", "5", "--dtype", "float32", "--max-model-len", "256",
              "--host", "127.0.0.1", "--port", "9001")
    )
    assert cfg.model == "file:///m/target"
    assert cfg.speculator is not None
    assert cfg.speculator.method == "draft_model"  # implied by --speculator-model
    assert cfg.speculator.model == "file:///m/draft"
    assert cfg.speculator.num_speculative_tokens == 5
    assert (cfg.dtype, cfg.max_model_len, cfg.host, cfg.port) == ("float32", 256, "127.0.0.1", 9001)


def test_flags_override_file(tmp_path: Path):
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({
        "model": "file:///m/target", "port": 8000, "max_model_len": 64,
        "speculator": {"method": "draft_model", "model": "file:///m/draft",
                       "num_speculative_tokens": 3},
    }))
    cfg = build_runtime_config(_args("--config", str(path), "--port", "8123",
                                     "--num-speculative-tokens", "2"))
    assert cfg.port == 8123
    assert cfg.max_model_len == 64  # from the file, no flag given
    assert cfg.speculator is not None
    assert (cfg.speculator.method, cfg.speculator.num_speculative_tokens) == ("draft_model", 2)
    assert cfg.speculator.model == "file:///m/draft"


def test_max_num_speculative_tokens_flag(tmp_path: Path):
    cfg = build_runtime_config(
        _args("--model", "file:///m/target", "--speculator-model", "file:///m/draft",
              "--num-speculative-tokens", "3", "--max-num-speculative-tokens", "8")
    )
    assert cfg.speculator is not None
    assert (cfg.speculator.num_speculative_tokens, cfg.speculator.max_num_speculative_tokens) == (3, 8)
    assert cfg.speculator.max_k == 8
    # The flag alone raises the bound of a speculator given in the file, keeping its start k.
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({
        "model": "file:///m/target",
        "speculator": {"method": "draft_model", "model": "file:///m/draft",
                       "num_speculative_tokens": 2},
    }))
    cfg = build_runtime_config(_args("--config", str(path), "--max-num-speculative-tokens", "6"))
    assert cfg.speculator is not None
    assert (cfg.speculator.num_speculative_tokens, cfg.speculator.max_k) == (2, 6)
    # Without the flag the bound is the start k.
    cfg = build_runtime_config(_args("--model", "file:///m/target",
                                     "--speculator-model", "file:///m/draft"))
    assert cfg.speculator is not None and cfg.speculator.max_num_speculative_tokens is None


def test_chat_template_flag_reads_the_file(tmp_path: Path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    cfg = build_runtime_config(_args("--model", "file:///m", "--chat-template", str(path)))
    assert cfg.chat_template == "{{ messages[0]['content'] }}"
    assert build_runtime_config(_args("--model", "file:///m")).chat_template is None
    with pytest.raises(ConfigError, match="cannot read --chat-template"):
        build_runtime_config(_args("--model", "file:///m", "--chat-template", str(tmp_path / "x")))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ((), "no target model"),
        (("--model", "s3://bucket/m"), "model"),
        (("--model", "file:///m", "--num-speculative-tokens", "4"), "needs a speculator"),
        (("--model", "file:///m", "--speculator-model", "file:///d",
          "--num-speculative-tokens", "0"), "num_speculative_tokens"),
        (("--model", "file:///m", "--max-model-len", "8"), "max_model_len"),
        (("--model", "file:///m", "--max-num-speculative-tokens", "8"), "--max-num-speculative-tokens needs a speculator"),
        (("--model", "file:///m", "--speculator-model", "file:///d",
          "--num-speculative-tokens", "4", "--max-num-speculative-tokens", "2"),
         "is below num_speculative_tokens"),
        (("--config", "/nonexistent/runtime.json"), "cannot read"),
    ],
)
def test_invalid_config_is_reported(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_runtime_config(_args(*argv))


def test_invalid_config_exits_2_without_loading(tmp_path: Path):
    bad = tmp_path / "runtime.json"
    bad.write_text(json.dumps({"model": "file:///m", "unknown_key": 1}))
    proc = subprocess.run(
        [sys.executable, "-m", "specula.cli", "serve", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown_key" in proc.stderr


def test_admin_port_needs_a_token(tmp_path: Path):
    args = _args("--model", "file:///m", "--admin-port", "8001")
    config = build_runtime_config(args)
    with pytest.raises(ConfigError, match="needs a token"):
        admin_token_source(config, args, {})
    assert admin_token_source(config, args, {"SPECULA_ADMIN_TOKEN": "t0"})() == "t0"
    dev = _args("--model", "file:///m", "--admin-port", "8001", "--admin-insecure-no-token")
    assert admin_token_source(build_runtime_config(dev), dev, {})() is None
    for content, fragment in [(None, "cannot read"), ("\n", "is empty")]:
        path = tmp_path / "token"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        args = _args("--model", "file:///m", "--admin-port", "8001",
                     "--admin-token-file", str(path))
        with pytest.raises(ConfigError, match=fragment):
            admin_token_source(build_runtime_config(args), args, {"SPECULA_ADMIN_TOKEN": "t0"})
    with pytest.raises(ConfigError, match="must differ"):
        build_runtime_config(_args("--model", "file:///m", "--admin-port", "8000"))


def test_admin_port_without_token_exits_2_without_loading():
    proc = subprocess.run(
        [sys.executable, "-m", "specula.cli", "serve", "--model", "file:///m",
         "--admin-port", "8001"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SPECULA_ADMIN_TOKEN"},
    )
    assert proc.returncode == 2
    assert "needs a token" in proc.stderr


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets are held open together, so the kernel
    cannot hand the same ephemeral port out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def test_serve_config_file_subprocess(tmp_path: Path, tiny_llama_target: Path, tiny_llama_draft: Path):
    """The pod's setup: model, metrics and admin ports, the admin token in a file (a
    mounted Secret), the API key in ``SPECULA_API_KEY``.  Every unauthenticated request
    is refused: ``bench/results/reliability.json``'s ``admin_api_unauthenticated_refused``."""
    port, metrics_port, admin_port = _free_ports(3)
    token_file = tmp_path / "admin-token"
    token_file.write_text("first-token\n")
    config = tmp_path / "runtime.json"
    config.write_text(json.dumps({
        "model": f"file://{tiny_llama_target}",
        "served_model_name": "tiny",
        "dtype": "float32",
        "max_model_len": 64,
        "host": "127.0.0.1",
        "port": port,
        "metrics_port": metrics_port,
        "admin_port": admin_port,
        "admin_token_file": str(token_file),
        "speculator": {"method": "draft_model", "model": f"file://{tiny_llama_draft}",
                       "num_speculative_tokens": 2},
    }))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECULA_API_KEY": "the-api-key"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specula.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"{base}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status == 200:
                break
            time.sleep(0.3)
        assert status == 200, f"server never became healthy (exit={proc.poll()})"
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        for headers in ({}, _bearer("wrong-key")):
            r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/v1/completions", json=body, headers=_bearer("the-api-key"),
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # No admin route on the model port, whatever the credentials.
        r = httpx.get(f"{base}/v1/speculative_config", headers=_bearer("first-token"), timeout=5)
        assert r.status_code == 404, r.text
        admin = f"http://127.0.0.1:{admin_port}/v1/speculative_config"
        for headers in ({}, _bearer("wrong-token"), _bearer("the-api-key")):
            for r in (httpx.get(admin, headers=headers, timeout=5),
                      httpx.put(admin, json={"num_speculative_tokens": 1}, headers=headers,
                                timeout=5)):
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(admin, headers=_bearer("first-token"), timeout=5)
        assert r.json()["num_speculative_tokens"] == 2
        # A replaced Secret (the kubelet rewrites the mounted file) takes effect at once.
        token_file.write_text("second-token")
        assert httpx.get(admin, headers=_bearer("first-token"), timeout=5).status_code == 401
        r = httpx.put(admin, json={"num_speculative_tokens": 1},
                      headers=_bearer("second-token"), timeout=5)
        assert r.status_code == 200 and r.json()["num_speculative_tokens"] == 1, r.text
        # The dedicated metrics port (the pod's container port ``metrics``) exports the
        # same counters as the API port.
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        drafts = [line for line in metrics.splitlines()
                  if line.startswith("specula:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0, metrics
        assert "specula:generation_tokens_total" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    for secret in ("the-api-key", "first-token", "second-token"):
        assert secret not in out


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_failed_load_exits_1_and_writes_the_termination_message(tmp_path: Path, monkeypatch):
    """The kubelet copies the termination-message file into the pod's status: the
    runtime's own reason, not the start of a traceback, is what the operator reports."""
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr(download, "TERMINATION_LOG", log)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(
        ["serve", "--model", f"file://{tmp_path}/no-such-checkpoint", "--host", "127.0.0.1",
         "--port", str(port)]
    )
    assert serve(args) == 1
    message = log.read_text()
    assert message.startswith("engine failed: ") and "no-such-checkpoint" in message, message


def test_prefix_caching_flag_as_vllm_spells_it():
    def parse(*flags: str):
        return build_runtime_config(build_parser().parse_args(["serve", "--model", "file:///m", *flags]))

    assert parse().enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
