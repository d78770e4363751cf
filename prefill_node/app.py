"""HTTP edge of the prefill role (docs/internal_api.md): `/internal/prefill`, `/internal/abort`; status,
health, metrics. Bodies are validated here with pydantic; every error is OpenAI-style JSON."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from pdserve.prefill_node.node import PrefillNode


class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: StrictStr
    prompt_token_ids: list[StrictInt]
    sampling: dict[str, Any] = {}
    cache_salt: StrictStr | None = None
    transfer: dict[str, Any]


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_router(node: PrefillNode) -> APIRouter:
    router = APIRouter(prefix="/internal")

    @router.post("/prefill")
    async def prefill(request: Request) -> Response:
        try:
            body = PrefillBody.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return error_response(400, f"bad prefill body: {exc}")
        answer = await node.prefill(body.request_id, body.prompt_token_ids, body.sampling, body.cache_salt,
                                    body.transfer)
        return JSONResponse(answer.body, status_code=answer.status)

    @router.post("/abort/{request_id}")
    async def abort(request_id: str) -> dict[str, Any]:
        return {"request_id": request_id, "aborted": node.abort(request_id, "aborted by the router")}

    return router


class _Collector:
    def __init__(self, collect: Callable[[], Any]) -> None:
        self.collect = collect


def create_app(node: PrefillNode) -> FastAPI:
    """A prefill-only app; `node.start()` runs in its lifespan. The worker process (pdserve/worker.py) builds
    its own app from `create_router` plus the shared-secret check and router registration."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await node.start()
        try:
            yield
        finally:
            await node.stop()

    app = FastAPI(title="pdserve prefill worker", lifespan=lifespan)
    app.include_router(create_router(node))

    @app.get("/internal/status")
    async def status() -> dict[str, Any]:
        return {"roles": ["prefill"], **node.status(), "draining": False}

    @app.get("/health")
    async def health() -> Response:
        if not node.engine.alive:
            return error_response(503, "prefill engine is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(node.collect))
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app
