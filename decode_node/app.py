"""HTTP edge of the decode role (docs/internal_api.md): reserve, token stream, abort; status, health, metrics.

`create_router` holds the role's /internal routes (a worker mounts it, next to the prefill router when
colocated); `create_app` wraps one node into an app of its own. Bodies are validated here with pydantic and
every error is OpenAI-style JSON `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgpack
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr, ValidationError

from pdserve.decode_node.node import DecodeNode
from pdserve.decode_node.request import StreamFrame

_LENGTH = struct.Struct(">I")


class ReserveBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: StrictStr
    prompt_token_ids: list[StrictInt]
    sampling: dict[str, Any] = {}
    cache_salt: StrictStr | None = None
    arrival_time: StrictFloat | StrictInt | None = None


def error_response(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, **extra}, status_code=status)


def encode_frame(frame: StreamFrame) -> bytes:
    body = msgpack.packb(frame.to_dict(), use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def create_router(node: DecodeNode) -> APIRouter:
    router = APIRouter(prefix="/internal")

    @router.post("/reserve")
    async def reserve(request: Request) -> Response:
        try:
            body = ReserveBody.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return error_response(400, f"bad reserve body: {exc}")
        result = await node.reserve(body.request_id, body.prompt_token_ids, body.sampling, body.cache_salt,
                                    None if body.arrival_time is None else float(body.arrival_time))
        return JSONResponse(result.body, status_code=result.status)

    @router.post("/stream/{request_id}")
    async def stream(request_id: str) -> Response:
        queue = node.engine.streams.get(request_id)
        if queue is None:
            return error_response(404, f"no reservation {request_id!r} on this decode worker", "not_found")
        if request_id in node.engine.attached:
            return error_response(409, f"request {request_id!r} is already being streamed", "conflict")
        node.engine.attached.add(request_id)
        return StreamingResponse(_frames(node, request_id, queue), media_type="application/x-msgpack-frames")

    @router.post("/abort/{request_id}")
    async def abort(request_id: str) -> dict[str, Any]:
        return {"request_id": request_id, "aborted": node.abort(request_id, "aborted by the router")}

    return router


async def _frames(node: DecodeNode, request_id: str, queue: asyncio.Queue[StreamFrame]) -> AsyncIterator[bytes]:
    """Frames until the final one; if the reader goes away first, the request is aborted (blocks freed)."""
    finished = False
    try:
        while not finished:
            frame = await queue.get()
            finished = frame.finish_reason is not None
            yield encode_frame(frame)
    finally:
        node.engine.streams.pop(request_id, None)
        node.engine.attached.discard(request_id)
        if not finished:
            node.engine.abort(request_id, "the stream was closed")


class _NodeCollector:
    def __init__(self, collect: Callable[[], Any]) -> None:
        self.collect = collect


def metrics_response(*collects: Callable[[], Any]) -> PlainTextResponse:
    registry = CollectorRegistry(auto_describe=False)
    for collect in collects:
        registry.register(_NodeCollector(collect))
    return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")


def create_app(node: DecodeNode) -> FastAPI:
    """A decode-only app; `node.start()` runs in its lifespan. The worker process (pdserve/worker.py) builds
    its own app from `create_router` plus the shared-secret check and router registration."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await node.start()
        try:
            yield
        finally:
            await node.stop()

    app = FastAPI(title="pdserve decode worker", lifespan=lifespan)
    app.include_router(create_router(node))

    @app.get("/internal/status")
    async def status() -> dict[str, Any]:
        return {"roles": ["decode"], **node.status(), "draining": False}

    @app.get("/health")
    async def health() -> Response:
        if not node.engine.alive:
            return error_response(503, "decode engine is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return metrics_response(node.collect)

    return app
