"""The worker's HTTP app and its process: what `pdserve prefill` / `pdserve decode` run (pdserve/commands/).

    run_worker(settings)   logging, torch threads and seed ─▶ bind the HTTP port ─▶ Worker (engine, roles, tiers:
      worker/assembly.py) ─▶ create_app(worker) ─▶ uvicorn (DrainOnSigterm with --drain-on-sigterm); exit status
      PORT_TAKEN_EXIT when its HTTP or transfer port is bound by another process (the launcher then picks others)
    create_app(worker)     lifespan: worker.start(), the router links' registration task; worker.stop() at exit
      GET /internal/status, /health (503 until the engines run and a router took the registration), /metrics;
      the control routes (worker/control.py), the cache routes (worker/cache.py);
      /internal/* behind `X-PDServe-Secret` when a secret is configured (InternalSecret)
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.gc_tuning import quiet_garbage_collector
from pdserve.listeners import ListenError, bind_socket
from pdserve.settings import WorkerSettings
from pdserve.supervision import PORT_TAKEN_EXIT
from pdserve.worker.assembly import Worker
from pdserve.worker.cache import build_cache_router
from pdserve.worker.control import DrainOnSigterm, build_control_router

logger = logging.getLogger("pdserve.worker")


class InternalSecret:
    """ASGI middleware: /internal/* needs `X-PDServe-Secret` when a secret is configured (401 otherwise).
    Pure ASGI (not BaseHTTPMiddleware) so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, secret: str | None) -> None:
        self.app = app
        self.secret = secret.encode() if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.secret is not None and scope["type"] == "http" and scope["path"].startswith("/internal/"):
            given = dict(scope["headers"]).get(b"x-pdserve-secret", b"")
            if not hmac.compare_digest(given, self.secret):
                body = {"error": {"message": "missing or wrong X-PDServe-Secret", "type": "authentication_error",
                                  "code": 401}}
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(worker: Worker) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await worker.start()
        except OSError as exc:  # uvicorn logs it and ends; run_worker turns it into the exit status
            app.state.port_taken = exc.errno == errno.EADDRINUSE
            raise
        registration = asyncio.create_task(worker.links.run())
        try:
            yield
        finally:
            registration.cancel()
            await worker.stop()

    app = FastAPI(title=f"pdserve worker ({worker.settings.role_name})", lifespan=lifespan)

    @app.get("/internal/status")
    async def status() -> dict[str, Any]:
        return worker.status() | worker.summary.fields(force=True)

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive or not worker.registered:
            return JSONResponse({"error": {"message": "worker not ready (engine starting or not registered)",
                                           "type": "service_unavailable", "code": 503}}, status_code=503)
        return JSONResponse({"status": "ok", "worker_id": worker.worker_id, **worker.control.status_fields()})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(worker.metrics.render().decode(), media_type="text/plain; version=0.0.4")

    app.include_router(build_control_router(worker.control))
    app.include_router(build_cache_router(worker.tiered))
    app.add_middleware(InternalSecret, secret=worker.settings.server.secret)
    return app


def run_worker(settings: WorkerSettings) -> int:
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    if settings.model.torch_threads is not None:
        torch.set_num_threads(settings.model.torch_threads)
    torch.manual_seed(settings.model.seed)  # requests without a `seed` of their own sample from this generator
    try:  # before the model loads: a port taken meanwhile is told in milliseconds, not after the load
        sock = bind_socket(settings.server.host, settings.server.port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:  # not this host's address (EADDRNOTAVAIL), or no address (gaierror)
            raise ListenError(f"cannot listen on --host {settings.server.host} --port {settings.server.port}: "
                              f"{exc}") from None
        logger.error("port %d on %s is taken by another process: %s", settings.server.port, settings.server.host,
                     exc)
        return PORT_TAKEN_EXIT
    worker = Worker(settings)
    port = sock.getsockname()[1]
    worker.url = f"http://{worker.advertised(settings.server.host)}:{port}"
    app = create_app(worker)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, access_log=False)
    logger.info("%s (%s) on %s: %s, %d KV blocks of %d tokens, %s on %s", worker.worker_id,
                settings.role_name, worker.url, worker.model_name, worker.cache_config.num_blocks,
                worker.cache_config.block_size, worker.dtype, worker.device)
    server = DrainOnSigterm(config, worker.control) if settings.server.drain_on_sigterm else uvicorn.Server(config)
    worker.control.request_exit = lambda: setattr(server, "should_exit", True)  # a drain with exit ends here
    quiet_garbage_collector()
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit when the lifespan failed (it logged why): its status 3, or ours
        if getattr(app.state, "port_taken", False):
            return PORT_TAKEN_EXIT
        raise
    return 0
