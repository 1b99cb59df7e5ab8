"""What the HTTP side refuses (bodies too large or too slow, headers too slow, clients
that hang up), with limits from :class:`~specula.api.runtime_config.RuntimeConfig`
fields, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from specula.api.runtime_config import RuntimeConfig
from specula.runtime.server.protocol import APIError

logger = logging.getLogger(__name__)

RETRY_AFTER = {"Retry-After": "1"}
_DEFAULTS = RuntimeConfig.model_fields


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = _DEFAULTS["max_request_body_bytes"].default
    read_timeout_s: float = _DEFAULTS["http_read_timeout_s"].default
    max_queued_requests: int = _DEFAULTS["max_queued_requests"].default
    max_n: int = _DEFAULTS["max_n"].default

    @classmethod
    def of(cls, config: RuntimeConfig) -> Limits:
        return cls(config.max_request_body_bytes, config.http_read_timeout_s,
                   config.max_queued_requests, config.max_n)


DEFAULT_LIMITS = Limits()


async def read_body(raw: Request, limits: Limits) -> bytes:
    """The body, at most ``max_body_bytes`` read within ``read_timeout_s``.

    Raises:
        APIError: 413 for a larger body, 408 for a slower one (both close the connection).
    """
    close = {"Connection": "close"}
    too_large = APIError(413, f"the request body exceeds {limits.max_body_bytes} bytes",
                         code="request_too_large", headers=close)
    length = raw.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_body_bytes:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            async for chunk in raw.stream():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {limits.read_timeout_s:g} s",
                       code="request_timeout", headers=close) from None
    return bytes(body)


async def unless_disconnected(raw: Request, work: Any) -> Any:
    """Await the coroutine ``work``, cancelling it if the client hangs up first (else a
    non-streamed answer keeps its batch slot and KV blocks)."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(raw.receive())  # after the body: http.disconnect
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "the client closed the connection")
    return task.result()


def h11_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's headers, counted from the
    connection (or the first byte after a response): uvicorn has none, so a client
    sending a byte at a time would hold its connection forever."""

    class Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _expired(self) -> None:
            self._deadline = None
            if self._between_requests():
                self.timeout_keep_alive_handler()  # closes the connection

        def _track(self, armed: bool) -> None:
            if armed and self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._expired)
            elif not armed and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._track(armed=True)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track(armed=self._between_requests())

        def connection_lost(self, exc: Exception | None) -> None:
            self._track(armed=False)
            super().connection_lost(exc)
    return Protocol


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM/SIGINT: ``state.draining`` is set (503
    with ``Retry-After``, so the readiness probe takes the pod out of its Service) and
    the listener stays open until the engine has no request left or ``drain_timeout_s``
    passed; then uvicorn's graceful shutdown runs. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._state, self._drain_timeout_s = state, drain_timeout_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._state.draining:
            super().handle_exit(sig, frame)
            return
        self._state.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        start = time.monotonic()
        logger.info("draining: %d requests in the engine", self._state.loop.num_unfinished)
        while self._state.loop.num_unfinished and time.monotonic() < start + self._drain_timeout_s:
            time.sleep(0.05)
        logger.info("drained in %.1f s, %d requests left", time.monotonic() - start,
                    self._state.loop.num_unfinished)
        self.should_exit = True
