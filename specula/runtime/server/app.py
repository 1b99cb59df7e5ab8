"""The FastAPI apps around one engine loop (the README's HTTP API section lists their
routes and limits); the engine runs on the thread of an
:class:`~specula.runtime.server.engine_loop.EngineLoop`, handlers on the event loop.
The admin app, on a port of its own, reads and sets the speculative configuration; a
``PUT`` is answered once the engine thread applied it between two steps.
"""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from specula.runtime.engine.spec_schedule import SpeculativeConfigError
from specula.runtime.server import completions
from specula.runtime.server.engine_loop import EngineDeadError, EngineLoop, EngineState
from specula.runtime.server.limits import (
    DEFAULT_LIMITS,
    RETRY_AFTER,
    Limits,
    read_body,
    unless_disconnected,
)
from specula.runtime.server.metrics import build_registry
from specula.runtime.server.protocol import (
    ERROR_TYPE_UNAVAILABLE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    SpeculativeConfigUpdate,
    install_error_handlers,
    validation_error,
)

BodyT = TypeVar("BodyT", bound=BaseModel)


class _ServerState:
    def __init__(self, loop: EngineLoop, limits: Limits) -> None:
        self.loop, self.limits = loop, limits
        self.draining = False
        """Set on SIGTERM (:class:`~specula.runtime.server.limits.DrainingServer`)."""
        self._tokenizer: Any = None
        self._registry: CollectorRegistry | None = None
        self.exposition = CollectorRegistry(auto_describe=False)
        """What ``/metrics`` exports (API and metrics port): nothing until the engine loaded."""
        self.exposition.register(self)  # type: ignore[arg-type] - a collector by `collect`

    def ready_engine(self) -> Any:
        """The loaded engine; 503 (an ``APIError``) while loading or after it died."""
        try:
            self.loop.check_alive()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type=ERROR_TYPE_UNAVAILABLE) from exc
        return self.loop.engine

    def tokenizer(self) -> Any:
        engine = self.ready_engine()
        if self._tokenizer is None:
            # A private copy: the engine thread uses its tokenizer concurrently, and
            # a Rust-backed fast tokenizer must not be shared across threads.
            self._tokenizer = copy.deepcopy(engine.tokenizer)
        return self._tokenizer

    def serving_engine(self) -> Any:
        """:meth:`ready_engine`; 503 with ``Retry-After`` too while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type=ERROR_TYPE_UNAVAILABLE, headers=RETRY_AFTER)
        return self.ready_engine()

    def admit(self, num_prompts: int) -> None:
        """Raises:
            APIError: 503 (:meth:`serving_engine`); 429 when the engine already holds its
                batch plus ``max_queued_requests`` (a lone request is always admitted).
        """
        engine = self.serving_engine()
        held = self.loop.num_unfinished
        if held and held + num_prompts > engine.max_num_seqs + self.limits.max_queued_requests:
            raise APIError(429, f"the server is at capacity ({held} requests running or "
                           "queued); retry later", type=ERROR_TYPE_UNAVAILABLE,
                           code="rate_limit_exceeded", headers=RETRY_AFTER)

    def collect(self) -> Iterator[Metric]:
        if self._registry is None and self.loop.state is EngineState.READY:
            assert self.loop.engine is not None
            self._registry = build_registry(self.loop.snapshot, self.loop.engine.served_model_name)
        if self._registry is not None:
            yield from self._registry.collect()


async def parse_body(raw: Request, model: type[BodyT], limits: Limits = DEFAULT_LIMITS) -> BodyT:
    """Parse a JSON body whatever its content type (``curl -d`` sends a form's) and validate it.

    Raises:
        APIError: 400 for malformed JSON (lone surrogates included) or a schema
            violation; 413 or 408 (:func:`~specula.runtime.server.limits.read_body`).
    """
    try:
        data = json.loads(await read_body(raw, limits))
        # A `\ud800` escape decodes to a lone surrogate, which neither the tokenizer nor
        # a UTF-8 answer (an error naming the field) can take: refuse it here.
        json.dumps(data, ensure_ascii=False).encode()
    except (json.JSONDecodeError, UnicodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from exc


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the JSON body of a route that reads it
    with :func:`parse_body` (FastAPI documents only the bodies it parses itself); the
    model's ``$defs`` are inlined, as its ``#/$defs`` references mean nothing in OpenAPI."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        return [inline(value) for value in node] if isinstance(node, list) else node

    body = {"required": True, "content": {"application/json": {"schema": inline(schema)}}}
    return {"requestBody": body}


_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


def require_bearer(token: Callable[[], str | None], what: str) -> Any:
    """A route dependency requiring ``Authorization: Bearer <token()>`` (compared in
    constant time); ``token()`` returning ``None`` lets every request through.

    Raises:
        APIError: 401 for a missing or wrong token; 503 when ``token()`` cannot read it.
    """

    async def check(given: _Credentials) -> None:
        try:
            expected = token()
        except OSError as exc:
            raise APIError(503, f"the {what} cannot be read: {exc.strerror}",
                           type=ERROR_TYPE_UNAVAILABLE) from exc
        if expected is None:
            return
        if given is None or not expected or not secrets.compare_digest(
                given.credentials.encode(), expected.encode()):
            raise APIError(401, f"missing or wrong {what}: send `Authorization: Bearer <{what}>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return Depends(check)


def create_app(loop: EngineLoop, *, manage_loop: bool = True, api_key: str | None = None,
               limits: Limits = DEFAULT_LIMITS) -> FastAPI:
    """The model app around ``loop``.

    Args:
        loop: the engine loop; not yet started when ``manage_loop``.
        manage_loop: start the loop on app startup and stop it on shutdown.
        api_key: the bearer key ``/v1/*`` requires; ``None`` leaves them open.
        limits: body size and read time, admission limit.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="Specula runtime", lifespan=lifespan if manage_loop else None)
    install_error_handlers(app)
    state = _ServerState(loop, limits)
    app.state.specula = state

    @app.get("/health")
    async def health() -> Response:
        state.serving_engine()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.exposition), media_type=CONTENT_TYPE_LATEST)

    openai = [require_bearer(lambda: api_key, "API key")] if api_key else []

    @app.get("/v1/models", dependencies=openai)
    async def models() -> ModelList:
        engine = state.ready_engine()
        name = engine.served_model_name
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=engine.max_model_len)])

    def generation_route(path: str, body: type[GenerationRequest]) -> None:
        @app.post(path, response_model=None, dependencies=openai, openapi_extra=json_body(body))
        async def create(raw: Request) -> Response:
            request = await parse_body(raw, body, limits)
            run = completions.CompletionRun(request, loop, state.tokenizer(), limits.max_n)
            state.admit(len(run.choices))
            if not request.stream:
                return JSONResponse(await unless_disconnected(raw, run.complete()))
            await run.submit()
            # The background task aborts what is left whichever way the response ends (a
            # client gone before the first chunk never runs the stream's own `finally`).
            return StreamingResponse(run.stream(), media_type="text/event-stream",
                                     background=BackgroundTask(run.abort_unfinished))

    generation_route("/v1/completions", CompletionRequest)
    generation_route("/v1/chat/completions", ChatCompletionRequest)
    return app


def create_admin_app(app: FastAPI, token: Callable[[], str | None]) -> FastAPI:
    """The admin API of the model ``app`` (same engine loop), every route behind
    :func:`require_bearer` with ``token`` (``None`` from it: no check, local runs only)."""
    admin = FastAPI(title="Specula runtime admin",
                    dependencies=[require_bearer(token, "admin token")])
    install_error_handlers(admin)
    state: _ServerState = app.state.specula
    loop = state.loop

    @admin.get("/v1/speculative_config")
    async def speculative_config() -> JSONResponse:
        state.ready_engine()
        return JSONResponse(loop.speculative_config)

    @admin.put("/v1/speculative_config", openapi_extra=json_body(SpeculativeConfigUpdate))
    async def update_speculative_config(raw: Request) -> JSONResponse:
        update = await parse_body(raw, SpeculativeConfigUpdate)
        state.ready_engine()
        try:
            await loop.call(lambda engine: engine.set_speculative_config(**update.model_dump()))
        except SpeculativeConfigError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
        except EngineDeadError as exc:
            raise completions.engine_unavailable(exc) from exc
        return JSONResponse(loop.speculative_config)
    return admin
