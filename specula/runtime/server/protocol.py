"""The OpenAI-compatible API's request bodies, model list and error bodies.

Field names and defaults follow the OpenAI Completions and Chat Completions APIs
(https://platform.openai.com/docs/api-reference/completions, ``/chat``) and vLLM's
``vllm/entrypoints/openai/protocol.py``.  Unknown fields are refused (a typo such as
``max_token`` gets 400, not silence); fields this runtime does not implement (``best_of`` other
than ``n``, penalties, ``logit_bias``, ``suffix``) are accepted only at their no-op values.

Every error, FastAPI's own included, is answered as ``{"error": {"message", "type",
"param", "code"}}``; malformed JSON and schema violations are 400, not FastAPI's 422, as
OpenAI and vLLM (its ``validation_exception_handler``) answer them.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specula.runtime.engine.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

ERROR_TYPE_INVALID_REQUEST = "invalid_request_error"
ERROR_TYPE_NOT_FOUND = "not_found_error"
ERROR_TYPE_UNAVAILABLE = "service_unavailable_error"
ERROR_TYPE_SERVER = "server_error"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _unsupported(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", message, {"param": param})


class StreamOptions(_Body):
    include_usage: bool = False


INT64_MAX = 2**63 - 1
"""Integers reach the engine as int64 tensors; a larger one would kill its step loop, so
they are refused here (vLLM bounds ``seed`` the same way)."""
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
NonEmptyTokenIds = Annotated[list[TokenId], Field(min_length=1)]


class GenerationRequest(_Body):
    """The sampling fields both routes share."""

    model: str | None = None
    """Served model name; ``None`` means the one model this server serves."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """0 samples greedily."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT64_MAX)
    """0 or -1 disables top-k (vLLM uses -1, OpenAI has no top-k)."""
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    """Samples per prompt (choices ``prompt_index * n + j``), at most the server's
    ``max_n``; with ``seed``, sample ``j`` is seeded ``seed + j``."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """Accepted and ignored."""

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if "" in ([v] if isinstance(v, str) else (v or [])):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _reject_unsupported(self) -> GenerationRequest:
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            raise _unsupported("presence_penalty", "penalties are not supported")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise _unsupported("stream_options", "stream_options needs stream=true")
        return self


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions`` body; ``prompt`` is a string, a list of strings (a batch:
    ``n`` choices per prompt), a list of token ids, or a list of token-id lists."""

    prompt: str | NonEmptyTokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[
        list[NonEmptyTokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)
    """Most tokens to generate per prompt; ``None`` means up to the context length."""
    best_of: int | None = None
    echo: bool = False
    """Return the prompt before the completion (with ``logprobs``, its tokens' too, the
    first ``None``)."""
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's bound
    suffix: str | None = None

    @model_validator(mode="after")
    def _reject_unsupported_completion(self) -> CompletionRequest:
        if self.best_of not in (None, self.n):
            raise _unsupported("best_of", "only best_of equal to n is supported")
        if self.suffix is not None:
            raise _unsupported("suffix", "suffix is not supported")
        return self


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message; ``content`` is a string or text parts (joined with newlines)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], Field(min_length=1)]
    name: str | None = None
    tool_call_id: str | None = None

    def template_input(self) -> dict[str, str]:
        """The message as chat templates read it (``role``, ``content`` a string)."""
        parts = self.content
        content = parts if isinstance(parts, str) else "\n".join(part.text for part in parts)
        return {**self.model_dump(exclude_none=True), "content": content}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions`` body: the messages are rendered by the model's chat
    template (or the server's ``--chat-template``) with the generation prompt added."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    """Deprecated by OpenAI for ``max_completion_tokens``; ``None``: up to the context."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Wins over ``max_tokens`` when both are given."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs needs logprobs=true")
        return self


class SpeculativeConfigUpdate(_Body):
    """``PUT /v1/speculative_config`` body: exactly one of a single k or a per-batch-size
    schedule, used from the next engine step on.  Only the shape is checked here; the bounds and
    the schedule's rules are the engine's (:mod:`specula.runtime.engine.spec_schedule`)."""

    num_speculative_tokens: StrictInt | None = None
    """0: speculation off (the draft stays loaded); at most the startup k. Clears any schedule."""
    num_speculative_tokens_per_batch_size: list[tuple[StrictInt, StrictInt, StrictInt]] | None = None
    """``[[start, end, k], ...]``: inclusive ranges of the number of requests in a
    step, the first starting at 1, contiguous; larger batches use the last k."""

    @model_validator(mode="after")
    def _one_setting(self) -> SpeculativeConfigUpdate:
        k, schedule = self.num_speculative_tokens, self.num_speculative_tokens_per_batch_size
        if (k is None) == (schedule is None):
            raise _unsupported("num_speculative_tokens", "give exactly one of "
                               "num_speculative_tokens and num_speculative_tokens_per_batch_size")
        return self


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specula"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class APIError(StarletteHTTPException):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, *,
        type: str = ERROR_TYPE_INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status_code, headers=self.headers)


_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0), "
    "or a list of token-id lists",
    "stop": "a string or a list of strings",
}
"""Plain-words types of union fields, instead of one pydantic error per member."""


def validation_error(errors: list[ErrorDetails]) -> APIError:
    """One 400 ``APIError`` for pydantic's errors; ``param`` is the first offending field
    (``prompt``, ``max_tokens``...), ``None`` when the body as a whole is wrong."""
    found: dict[str, str | None] = {}  # each distinct message, in order: the field it names
    for err in errors:
        loc = [str(p) for p in err["loc"]]
        field, kind, ctx = (loc[0] if loc else None), err["type"], err.get("ctx") or {}
        if field in _UNION_SHAPES and (kind.endswith("_type") or kind == "int_parsing"):
            msg = f"{field} must be {_UNION_SHAPES[field]}"
        elif field == "prompt" and kind in ("greater_than_equal", "too_short"):
            msg = "token ids must be >= 0" if kind == "greater_than_equal" else "prompt is empty"
        elif kind == "unsupported_field":
            field, msg = ctx["param"], err["msg"]
        elif kind == "model_type" and not loc:
            msg = "the request body must be a JSON object"
        elif kind == "extra_forbidden":
            msg = f"unknown field `{'.'.join(loc)}`"
        else:
            msg = f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"]
        found.setdefault(msg, field)
    param = next((f for f in found.values() if f is not None), None)
    return APIError(400, "; ".join(found) or "invalid request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if not isinstance(exc, APIError):  # FastAPI's own: unknown routes, methods
            type_ = ERROR_TYPE_NOT_FOUND if exc.status_code == 404 else ERROR_TYPE_INVALID_REQUEST
            exc = APIError(exc.status_code, str(exc.detail), type=type_)
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", type=ERROR_TYPE_SERVER).response()
