"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every error, including FastAPI's own (malformed JSON, schema violations, unknown
routes), is answered as ``{"error": {"message", "type", "param", "code"}}``.  Request
validation failures are 400, not FastAPI's default 422: OpenAI answers schema errors
with 400 and vLLM does the same (its ``validation_exception_handler``), so clients
written against either see the status they expect.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specula.runtime.server.protocol import (
    ERROR_TYPE_INVALID_REQUEST,
    ERROR_TYPE_NOT_FOUND,
    ERROR_TYPE_SERVER,
    UnsupportedFieldError,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = ERROR_TYPE_INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.info = {"message": message, "type": type, "param": param, "code": code}

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error shape."""
        return {"error": self.info}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0), "
    "or a list of token-id lists",
    "stop": "a string or a list of strings",
}
"""Plain-words types of union fields, instead of one pydantic error per member."""


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's list of pydantic errors into one 400 ``APIError``.

    ``param`` is the first offending field (``prompt``, ``max_tokens``...), or
    ``None`` when the body as a whole is wrong (not JSON, not an object).
    """
    messages: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field, kind, ctx = (loc[0] if loc else None), str(err.get("type", "")), err.get("ctx") or {}
        if field in _UNION_SHAPES and (kind.endswith("_type") or kind == "int_parsing"):
            msg = f"{field} must be {_UNION_SHAPES[field]}"
        elif field == "prompt" and kind in ("greater_than_equal", "too_short"):
            msg = "token ids must be >= 0" if kind == "greater_than_equal" else "prompt is empty"
        elif isinstance(ctx.get("error"), UnsupportedFieldError):
            field, msg = ctx["error"].param, str(ctx["error"])
        elif kind == "json_invalid":
            msg = f"malformed JSON body: {ctx.get('error', err.get('msg'))}"
        elif kind in ("model_attributes_type", "model_type", "dict_type") and not loc:
            msg = "the request body must be a JSON object"
        elif kind == "extra_forbidden":
            msg = f"unknown field `{'.'.join(loc)}`"
        else:
            msg = f"{'.'.join(loc)}: {err.get('msg')}" if loc else str(err.get("msg"))
        if param is None:
            param = field
        if msg not in messages:
            messages.append(msg)
    return APIError(400, "; ".join(messages) or "invalid request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = ERROR_TYPE_NOT_FOUND if exc.status_code == 404 else ERROR_TYPE_INVALID_REQUEST
        return APIError(exc.status_code, str(exc.detail), type=type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", type=ERROR_TYPE_SERVER).response()
