"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every error a client can see goes through `APIError`, including FastAPI's own validation errors (OpenAI
answers 400 where FastAPI would say 422) and unknown routes. An unexpected exception is a 500 answered by
`AnswerUnexpected`, which does not raise it on: Starlette's own handler for it re-raises, and uvicorn then
closes the connection, so the client's next keep-alive request failed too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.protocol import INVALID_TEXT

log = logging.getLogger(__name__)

_TYPES_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                    405: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
                          "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        """The error as one server-sent event, for failures after a stream has started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def _printable(text: str | None) -> str | None:
    """Client text quoted in an error (a model name, a field path) with anything UTF-8 cannot carry escaped:
    the error must be answerable whatever the request held."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def context_length_exceeded(max_model_len: int, prompt_tokens: int, completion_tokens: int, chat: bool) -> APIError:
    where = "messages" if chat else "prompt"
    total = prompt_tokens + completion_tokens
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} tokens "
        f"({prompt_tokens} in the {where}, {completion_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.",
        param=where, code="context_length_exceeded",
    )


def service_unavailable(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, code="no_worker_available", headers={"Retry-After": str(retry_after_s)})


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong X-PDServe-Secret header", code="invalid_secret")


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's error list as one readable sentence; `param` names the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == INVALID_TEXT:
        path = first["ctx"]["path"]
        return bad_request(f"Invalid value for '{path}': {first['msg']}.", param=path, code="invalid_text")
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(f"We could not parse the JSON body of your request ({detail}). The body must be valid "
                           "JSON with Content-Type: application/json.", code="invalid_json")
    parts = [_describe(error) for error in errors[:3]]
    param = _field_path(first.get("loc", ()))
    return bad_request("; ".join(parts), param=param or None, code="invalid_value")


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def _describe(error: dict[str, Any]) -> str:
    path = _field_path(error.get("loc", ()))
    if error.get("type") == "missing":
        return f"Missing required parameter: '{path}'." if path else "The request body must be a JSON object."
    if not path:
        return f"The request body must be a JSON object: {error.get('msg')}."
    return f"Invalid value for '{path}': {error.get('msg')} (got {error.get('input')!r})."


class AnswerUnexpected:
    """ASGI middleware: an exception out of a route becomes a 500 OpenAI-style error, and the connection stays
    open for the client's next request. Nothing is added per message sent (the token streams pass untouched):
    when the response had started already, sending the 500 raises, and the exception goes on to the server,
    which closes the connection (the only way left to tell the client)."""

    def __init__(self, app: ASGIApp, on_error: Callable[[int, str], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            try:
                await internal_error(exc).to_response()(scope, receive, send)
            except Exception:  # noqa: BLE001 (the response had started: let the server close the connection)
                raise exc from None
            log.exception("unhandled error in the router", exc_info=exc)
            if self.on_error is not None:
                self.on_error(500, scope.get("path", ""))


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal router error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI, on_error: Callable[[int, str], None] | None = None) -> None:
    """Answer every error as OpenAI-style JSON; `on_error(status, path)` is told about each (for metrics)."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status, request.url.path)
        return error.to_response()

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return answer(request, exc)

    async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return answer(request, validation_error(exc))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        return answer(request, APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # raised outside AnswerUnexpected
        log.exception("unhandled error in the router", exc_info=exc)
        return answer(request, internal_error(exc))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_middleware(AnswerUnexpected, on_error=on_error)
