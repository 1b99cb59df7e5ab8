"""The bridge between the synchronous engine and asyncio request handlers (vLLM's
``AsyncLLMEngine`` background loop, reduced to one process).

One background thread owns the single-threaded ``LLMEngine``: it loads it and runs ``engine.step()``
while there is work. Handlers send commands (add, abort, settings calls) through a thread-safe queue
and receive each step's ``RequestOutput`` on their own ``asyncio.Queue``. After each step and
setting change the thread publishes a :class:`~specula.runtime.server.metrics.RuntimeSnapshot`, so a
scrape never sees the engine's counters half-updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from specula.runtime.server.metrics import RuntimeSnapshot, StepTimeStats

if TYPE_CHECKING:
    from specula.runtime.engine.llm_engine import LLMEngine, RequestOutput
    from specula.runtime.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle loop waits for a command before re-checking stop


class EngineState(Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineDeadError(RuntimeError):
    """The engine failed to load or a step raised; no request can be served."""


@dataclass
class _Command:
    """``fn(engine)``, run on the loop thread between two steps."""

    fn: Callable[[LLMEngine], Any]
    done: Future | None = None
    """Receives ``fn``'s result or exception; ``None``: nobody waits (an abort)."""
    is_add: bool = False
    """Counted in ``_pending_adds`` until the loop thread takes it."""


class EngineLoop:
    """Owns an ``LLMEngine`` on one background thread.

    Args:
        load: builds the engine; called on the loop thread, so a slow load leaves
            the HTTP server up and ``/health`` answering 503 meanwhile.
        on_fatal: called (on the loop thread) when loading or a step fails; ``specula
            serve`` uses it to stop the HTTP server so the process exits non-zero.
    """

    def __init__(self, load: Callable[[], LLMEngine],
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self._load, self._on_fatal = load, on_fatal
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        """Per request, where its outputs go (the handler's queue, on its event loop)."""
        self._thread: threading.Thread | None = None
        self._stop, self._ready = threading.Event(), threading.Event()
        self.state = EngineState.LOADING
        """Written by the loop thread only."""
        self.error: BaseException | None = None
        """Why the loop died (``state`` ``DEAD``)."""
        self._lock = threading.Lock()
        self._snapshot = RuntimeSnapshot()
        self._step_times = StepTimeStats()
        self._pending_adds = 0
        self._last_round_k: int | None = None
        self.engine: LLMEngine | None = None
        """Set once loaded; other threads may read its attributes (``tokenizer``,
        ``max_model_len``...), not call its methods."""
        self.speculative_config: dict[str, Any] = {}
        """``engine.get_speculative_config()``, refreshed by the loop thread at load and
        after every :meth:`call` (the only way settings change)."""

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="specula-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the current step; unfinished requests get an error."""
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(30.0)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until loaded (True) or failed/timed out (False)."""
        self._ready.wait(timeout_s)
        return self.state is EngineState.READY

    @property
    def num_unfinished(self) -> int:
        """Engine requests submitted and not yet finished or aborted (read from any thread)."""
        return len(self._sinks) + self._pending_adds

    def snapshot(self) -> RuntimeSnapshot:
        return self._snapshot  # replaced whole by the loop thread, never mutated

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, out: asyncio.Queue) -> None:
        """Submit a request; its ``RequestOutput`` objects will arrive on ``out`` (an
        :class:`EngineDeadError` instead if the loop dies later).

        Raises:
            ValueError: the engine refused the request (``engine.add_request``).
            EngineDeadError: the engine is not running.
        """
        handler_loop = asyncio.get_running_loop()
        ids = list(prompt_token_ids)

        def sink(item: RequestOutput | BaseException) -> None:
            # A closed event loop (the server shutting down) has nobody waiting.
            with contextlib.suppress(RuntimeError):
                handler_loop.call_soon_threadsafe(out.put_nowait, item)

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, ids, params)
            self._sinks[request_id] = sink
        await self._submit(_Command(add, is_add=True))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread between two steps (settings change this
        way without racing a step); return its result.

        Raises:
            Exception: whatever ``fn`` raises.
            EngineDeadError: the engine is not running.
        """

        def apply(engine: LLMEngine) -> Any:
            try:
                return fn(engine)
            finally:
                # Before answering: the caller reads it as soon as its future resolves.
                self.speculative_config = dict(engine.get_speculative_config())
                self._publish_snapshot()
        return await self._submit(_Command(apply))

    async def _submit(self, cmd: _Command) -> Any:
        self.check_alive()
        cmd.done = Future()
        if cmd.is_add:
            with self._lock:
                self._pending_adds += 1
        self._commands.put(cmd)
        # A loop that stopped or died before the put never reads the command; one that
        # stops or dies later fails it (`_fail_all`, after the state changes).
        self.check_alive()
        return await asyncio.wrap_future(cmd.done)  # cancelled, it cancels the command

    def abort_request(self, request_id: str) -> None:
        """Abort a request (client went away); no-op if it already finished."""
        def abort(engine: LLMEngine) -> None:
            if self._sinks.pop(request_id, None) is not None:
                engine.abort_request(request_id)
        self._commands.put(_Command(abort))

    def check_alive(self) -> None:
        """Raises:
            EngineDeadError: the engine is loading, stopped or dead (the message says).
        """
        if self.state is EngineState.LOADING:
            raise EngineDeadError("the model is still loading")
        if self.state is not EngineState.READY:
            raise EngineDeadError(f"the engine is not running ({self.state.value}): {self.error!r}")

    def _run(self) -> None:
        failed = "loading the engine failed"
        try:
            self.engine = self._load()
            self.speculative_config = dict(self.engine.get_speculative_config())
            self._publish_snapshot()
            self.state = EngineState.READY
            self._ready.set()
            logger.info("engine ready: %s", self.engine.served_model_name)
            failed = "engine step failed"
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if not self._stop.is_set() and self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - a failed load or step leaves no engine
            logger.exception(failed)
            self.error, self.state = exc, EngineState.DEAD
            self._ready.set()
            self._fail_all(EngineDeadError(f"engine failed: {exc!r}"))
            if self._on_fatal is not None:
                self._on_fatal(exc)
        else:
            self.state = EngineState.STOPPED
            self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self, block: bool) -> None:
        with contextlib.suppress(queue.Empty):
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            while cmd is not None:
                self._apply(cmd)
                cmd = self._commands.get_nowait()

    def _apply(self, cmd: _Command) -> None:
        assert self.engine is not None
        if cmd.is_add:
            with self._lock:
                self._pending_adds -= 1
        if cmd.done is None:
            cmd.fn(self.engine)
        elif cmd.done.set_running_or_notify_cancel():  # else the caller gave up waiting
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                cmd.done.set_exception(exc)

    def _step(self) -> None:
        assert self.engine is not None
        t0 = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - t0
        batch = self.engine.last_step_num_reqs
        # A step without a decode round (every admitted request finished at prefill, or
        # it only reported aborts) is no sample of T(batch, k): leave it out.
        if batch > 0:
            self._last_round_k = self.engine.last_step_num_speculative_tokens
            self._step_times.observe(batch, self._last_round_k, elapsed)
        # Publish before delivering: a client that has its last token and then scrapes
        # must find the step's tokens already counted.
        self._publish_snapshot()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its client meanwhile
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def _publish_snapshot(self) -> None:
        engine = self.engine
        assert engine is not None
        sched = engine.scheduler_stats()
        k = self._last_round_k
        if k is None:  # no decode round yet: what a lone request would use
            k = engine.num_speculative_tokens_for(1)
        self._snapshot = copy.deepcopy(RuntimeSnapshot(
            num_requests_running=sched["num_requests_running"],
            num_requests_waiting=sched["num_requests_waiting"] + self._pending_adds,
            generation_tokens=engine.generation_tokens_total, step_times=self._step_times,
            spec_decoding=engine.spec_decoding_stats, num_speculative_tokens=k,
            max_num_speculative_tokens=engine.max_num_speculative_tokens,
            num_preemptions=sched["num_preemptions"], prefix_cache_hits=sched["prefix_cache_hits"],
            prefix_cache_queries=sched["prefix_cache_queries"],
            kv_cache_usage=1.0 - sched["num_free_gpu_blocks"] / sched["num_gpu_blocks"]))

    def _fail_all(self, exc: EngineDeadError) -> None:
        for sink in self._sinks.values():
            sink(exc)
        self._sinks.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                cmd = self._commands.get_nowait()
                if cmd and cmd.done and cmd.done.set_running_or_notify_cancel():
                    cmd.done.set_exception(exc)
