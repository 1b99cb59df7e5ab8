"""``specula serve``: build the runtime config, load the engine, run uvicorn.

The config comes from ``--config FILE`` (the JSON the operator writes), from flags,
or both; a flag overrides the file's value.  An invalid config is reported on stderr
with exit status 2 (argparse's status for usage errors) before anything is loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specula.api.runtime_config import RuntimeConfig

logger = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2

_TOP_LEVEL_FLAGS = {
    "model": "model",
    "served_model_name": "served_model_name",
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "host": "host",
    "port": "port",
}
"""argparse dest -> RuntimeConfig field, for flags that map one to one."""


class ConfigError(ValueError):
    """The flags and file do not make a valid runtime config."""


def build_runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    """Merge ``--config FILE`` with the flags (flags win) into a ``RuntimeConfig``.

    ``--speculator-model`` without a method (in flags or file) means ``draft_model``.

    Raises:
        ConfigError: unreadable file, invalid JSON, a missing model, a speculator flag
            with no speculator method, or a value the pydantic model rejects.
    """
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read --config {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path} must hold a JSON object")
    for dest, key in _TOP_LEVEL_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            data[key] = value

    method = getattr(args, "speculator_method", None)
    draft = getattr(args, "speculator_model", None)
    k = getattr(args, "num_speculative_tokens", None)
    max_k = getattr(args, "max_num_speculative_tokens", None)
    if method is not None or draft is not None or k is not None or max_k is not None:
        spec = data.get("speculator")
        spec = dict(spec) if isinstance(spec, dict) else {}
        if method is not None:
            spec["method"] = method
        if draft is not None:
            spec["model"] = draft
            spec.setdefault("method", "draft_model")
        if k is not None:
            spec["num_speculative_tokens"] = k
        if max_k is not None:
            spec["max_num_speculative_tokens"] = max_k
        if "method" not in spec:
            flag = "--num-speculative-tokens" if k is not None else "--max-num-speculative-tokens"
            raise ConfigError(
                f"{flag} needs a speculator: pass --speculator-method "
                "and/or --speculator-model (or a speculator in --config)"
            )
        data["speculator"] = spec

    if "model" not in data:
        raise ConfigError("no target model: pass --model URI or --config FILE with `model`")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid runtime config:\n" + "\n".join(lines)) from exc


def start_metrics_listener(app: Any, host: str, port: int) -> None:
    """Serve the app's ``/metrics`` exposition on a port of its own, from a daemon
    thread (prometheus-client's WSGI server).  Until the engine has loaded, the
    exposition is empty, as on the API port.

    Raises:
        OSError: the port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.registry import Collector

    state = app.state.specula

    class _EngineMetrics(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            registry = state.registry()
            if registry is not None:
                yield from registry.collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineMetrics())
    start_http_server(port, addr=host, registry=registry)
    logger.info("serving /metrics on %s:%d", host, port)


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted.

    Returns:
        0 after a clean shutdown, 1 if the engine failed to load or died,
        2 for an invalid config.
    """
    try:
        config = build_runtime_config(args)
    except ConfigError as exc:
        print(f"specula serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported here so that a config error is reported without importing torch.
    import uvicorn

    from specula.runtime.engine.llm_engine import create_engine
    from specula.runtime.server.app import create_app
    from specula.runtime.server.engine_loop import EngineLoop, EngineState

    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        # Exit rather than linger unhealthy: a restart (by the user, or the pod's
        # liveness probe) is the only way back from a failed load or step.
        if server is not None:
            server.should_exit = True

    loop = EngineLoop(lambda: create_engine(config), on_fatal=on_fatal)
    app = create_app(loop)
    if config.metrics_port is not None and config.metrics_port != config.port:
        start_metrics_listener(app, config.host, config.metrics_port)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="info")
    )
    logger.info("serving %s on %s:%d", config.model, config.host, config.port)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal
    # with the handler it found; a no-op handler lets a requested stop exit with 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if loop.state is EngineState.DEAD:
        logger.error("engine failed: %r", loop.error)
        return 1
    return 0 if server.started else 1
