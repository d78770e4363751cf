"""The router's front door: what every OpenAI API call passes before any route runs (pure ASGI middleware, so
streamed responses and disconnects pass through untouched).

    /v1/*  ──▶ API key (`--api-key`, as `vllm serve`): `Authorization: Bearer <key>`, else 401
           ──▶ body size: a Content-Length above `--max-body-size` gets 413 before a byte is read; a chunked
               body is counted as the route reads it and stopped at the limit (413 as well)
           ──▶ in flight: completions and chat completions being answered (streams until their last event)
               beyond `--max-inflight-requests` get 429 + Retry-After; the client backs off, the router's
               memory stays bounded (each request holds its prompt, its relay and a connection per worker)

Other paths (/health, /metrics, /status, /internal with its own secret, /admin with its own token) are left
alone. Rejections are OpenAI-style JSON and are counted in `pdserve_requests{status}` like any API error.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.errors import APIError

_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the router's limit of {limit} bytes (--max-body-size)")


def too_large(limit: int, size: int | None = None) -> APIError:
    told = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"request body{told} exceeds the router's limit of {limit} bytes (--max-body-size)",
                    type="invalid_request_error", code="request_too_large")


def unauthorized_api_key() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def at_capacity(limit: int, retry_after_s: int) -> APIError:
    return APIError(429, f"the router is answering {limit} requests already (--max-inflight-requests); retry "
                    f"after {retry_after_s} s", type="rate_limit_error", code="too_many_requests",
                    headers={"Retry-After": str(retry_after_s)})


class FrontDoor:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, max_inflight: int,
                 retry_after_s: int, on_reject: Callable[[int], None]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.on_reject = on_reject
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope, path)
        if error is not None:
            self.on_reject(error.status)
            await error.to_response()(scope, receive, send)
            return
        counted = path in _GENERATION_PATHS
        self.inflight += counted
        try:
            await self.app(scope, self._bounded(receive), send)
        finally:
            self.inflight -= counted

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        headers = dict(scope["headers"])
        if self.api_key is not None:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return unauthorized_api_key()
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(self.max_body_bytes, int(length))
        if path in _GENERATION_PATHS and self.inflight >= self.max_inflight:
            return at_capacity(self.max_inflight, self.retry_after_s)
        return None

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` that stops a body (chunked, or longer than its Content-Length said) at the limit."""
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return bounded
