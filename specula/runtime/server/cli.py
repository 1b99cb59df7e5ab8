"""``specula serve``: build the runtime config, load the engine, run uvicorn.

The config comes from ``--config FILE`` (the JSON the operator writes), from flags (which
win), or both; an invalid one is reported on stderr with exit status 2 (argparse's for usage
errors) before anything is loaded.  Secrets (the API key, the admin token) come from flags,
environment variables or a file, never the config (a ConfigMap).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specula.api.runtime_config import RuntimeConfig
from specula.runtime import download

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The flags and file do not make a valid runtime config."""


def build_runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    """Merge ``--config FILE`` with the flags (flags win) into a ``RuntimeConfig``;
    ``--chat-template FILE`` puts the file's text in ``chat_template``, and
    ``--speculator-model`` without a method (in flags or file) means ``draft_model``.

    Raises:
        ConfigError: unreadable file (config or chat template), invalid JSON, a missing model, a
            speculator flag with no speculator method, or a value the pydantic model rejects.
    """
    data: dict[str, Any] = {}
    if vars(args).get("config"):
        path = Path(args.config)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read --config {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path} must hold a JSON object")
    flags = {key: value for key, value in vars(args).items() if value is not None}
    if "chat_template" in flags:
        try:
            flags["chat_template"] = Path(flags["chat_template"]).read_text()
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"cannot read --chat-template {args.chat_template}: {exc}") from exc
    data.update({key: flags[key] for key in RuntimeConfig.model_fields.keys() & flags.keys()})

    spec_flags = ("speculator_method", "speculator_model", "num_speculative_tokens",
                  "max_num_speculative_tokens")
    given = {key.removeprefix("speculator_"): flags[key] for key in spec_flags if key in flags}
    if given:
        spec = data.get("speculator")
        spec = {**(spec if isinstance(spec, dict) else {}), **given}
        if "model" in given:
            spec.setdefault("method", "draft_model")
        if "method" not in spec:
            flag = "--num-speculative-tokens" if "num_speculative_tokens" in given else (
                "--max-num-speculative-tokens")
            raise ConfigError(f"{flag} needs a speculator: pass --speculator-method "
                              "and/or --speculator-model (or a speculator in --config)")
        data["speculator"] = spec

    if "model" not in data:
        raise ConfigError("no target model: pass --model URI or --config FILE with `model`")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']} "
                 f"(got {err.get('input')!r})" for err in exc.errors()]
        raise ConfigError("invalid runtime config:\n" + "\n".join(lines)) from exc


ADMIN_TOKEN_ENV = "SPECULA_ADMIN_TOKEN"
API_KEY_ENV = "SPECULA_API_KEY"


def admin_token_source(config: RuntimeConfig, args: argparse.Namespace,
                       environ: Mapping[str, str]) -> Callable[[], str | None]:
    """Where admin requests' bearer token comes from: ``admin_token_file`` (read per
    request; checked readable and non-empty here), else ``$SPECULA_ADMIN_TOKEN``.

    Raises:
        ConfigError: no token and no ``--admin-insecure-no-token``, or an unreadable
            or empty token file.
    """
    path = config.admin_token_file
    if path is not None:
        try:
            if Path(path).read_text().strip():
                return lambda: Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read admin_token_file {path}: {exc.strerror}") from exc
        raise ConfigError(f"admin_token_file {path} is empty")
    token = environ.get(ADMIN_TOKEN_ENV)
    if token:
        return lambda: token
    if getattr(args, "admin_insecure_no_token", False):
        logger.warning("admin API on port %d WITHOUT a token (--admin-insecure-no-token): "
                       "anyone who reaches it can change k", config.admin_port)
        return lambda: None
    raise ConfigError(f"admin_port {config.admin_port} needs a token: --admin-token-file FILE "
                      f"or ${ADMIN_TOKEN_ENV} (or --admin-insecure-no-token for a local "
                      "development run)")


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; return 0 after a clean shutdown, 1 if the
    engine failed to load or died, 2 for an invalid config."""
    try:
        config = build_runtime_config(args)
        admin_token = (admin_token_source(config, args, os.environ)
                       if config.admin_port is not None else None)
    except ConfigError as exc:
        print(f"specula serve: {exc}", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here so that a config error is reported without importing torch.
    import uvicorn
    from prometheus_client import start_http_server

    from specula.runtime.engine.llm_engine import create_engine
    from specula.runtime.server.app import create_admin_app, create_app
    from specula.runtime.server.engine_loop import EngineLoop, EngineState
    from specula.runtime.server.limits import DrainingServer, Limits, h11_with_header_timeout

    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        # Exit rather than linger unhealthy: only a restart recovers a failed load or step.
        if server is not None:
            server.should_exit = True

    loop = EngineLoop(lambda: create_engine(config), on_fatal=on_fatal)
    app = create_app(loop, api_key=getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV),
                     limits=Limits.of(config))
    if config.metrics_port is not None and config.metrics_port != config.port:
        # prometheus-client's WSGI server on a daemon thread; empty until the engine loaded.
        start_http_server(config.metrics_port, addr=config.host,
                          registry=app.state.specula.exposition)
        logger.info("serving /metrics on %s:%d", config.host, config.metrics_port)
    if admin_token is not None:
        # A daemon thread with its own event loop (the engine loop accepts calls from
        # any loop). The socket is bound here, so a port in use fails the start.
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.create_server((config.host, config.admin_port), family=family)
        admin = uvicorn.Config(create_admin_app(app, admin_token), log_level="warning",
                               http=h11_with_header_timeout(config.http_read_timeout_s))
        threading.Thread(target=uvicorn.Server(admin).run, kwargs={"sockets": [sock]},
                         daemon=True, name="admin-api").start()
        logger.info("serving the admin API on %s:%d", config.host, config.admin_port)
    server = DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                       http=h11_with_header_timeout(config.http_read_timeout_s),
                       timeout_graceful_shutdown=5),
        app.state.specula, config.drain_timeout_s)
    logger.info("serving %s on %s:%d", config.model, config.host, config.port)
    # On SIGTERM/SIGINT the server drains, then shuts down gracefully; uvicorn then
    # re-raises a second signal with the handler it found: a no-op one exits with 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if loop.state is EngineState.DEAD:
        logger.error("engine failed: %r", loop.error)
        # The runtime's own reason reaches the pod's status (and the resource's Degraded).
        message = f"engine failed: {type(loop.error).__name__}: {loop.error}"
        download.write_termination_message(message)
        return 1
    return 0 if server.started else 1
