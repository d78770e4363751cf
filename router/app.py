"""The router's FastAPI app: `create_app(config, tokenizer)`.

All state (registry, HTTP client, policies, metrics, the health task) is created in the app's lifespan and
held in `app.state.router`; nothing lives at module level, so tests can run several routers in one process.

    /v1/* behind the front door: API key, body size, in-flight limit (router/front_door.py)
    POST /v1/completions, /v1/chat/completions   plan (validate, tokenize) ─▶ relay.start_all ─▶ SSE | JSON
        (the workers are reached over their data-plane links, router/worker_link.py; a client that leaves
         before its first token is noticed and its work aborted on P and D)
    GET  /v1/models, /health, /metrics; POST /tokenize, /detokenize, GET /version (router/tokenize_routes.py)
    /internal/workers/{register,heartbeat,deregister}, GET /internal/workers   (router/internal_routes.py)
    /admin/... behind a bearer token (router/admin.py)     GET /status, /status.json (router/status_page.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.router.admin import AdminState, build_admin_router
from pdserve.router.channel import Channel, DeltaSink
from pdserve.router.config import RouterConfig
from pdserve.router.console import Console
from pdserve.router.errors import APIError, install_error_handlers
from pdserve.router.front_door import FrontDoor
from pdserve.router.health import HealthMonitor
from pdserve.router.internal_routes import SECRET_HEADER, build_internal_router
from pdserve.router.metrics import RouterMetrics
from pdserve.router.plan import GenerationPlan, plan_chat, plan_completion
from pdserve.router.policies import make_decode_policy, make_prefill_policy
from pdserve.router.prompts import TokenizerLike
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.router.registry import WorkerRegistry
from pdserve.router.relay import Relay
from pdserve.router.request_fields import FieldLog
from pdserve.router.responses import ResponseWriter
from pdserve.router.status_page import build_status_router
from pdserve.router.streaming import CLIENT_CLOSED, Relayed, SSEResponse, collect
from pdserve.router.tokenize_routes import build_tokenize_router
from pdserve.router.worker_link import WorkerLinks


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: TokenizerLike
    registry: WorkerRegistry
    metrics: RouterMetrics
    client: httpx.AsyncClient  # status polls of static workers
    links: WorkerLinks  # the data plane: one connection per worker
    relay: Relay
    health: HealthMonitor
    started: int  # unix time, the models' `created`
    admin: AdminState
    fields: FieldLog  # unknown request fields, logged once each
    console: Console  # the request and stats lines


def create_app(config: RouterConfig, tokenizer: TokenizerLike) -> FastAPI:
    """The router app. `tokenizer` needs encode / decode / apply_chat_template / vocab_size
    (engine.tokenizer.Tokenizer has them)."""
    # outside the lifespan so error handlers can count before startup finishes
    metrics = RouterMetrics(config.status_window_s, model_name=config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = _build_state(config, tokenizer, metrics)
        app.state.router = state
        await state.health.tick()  # static workers' first status, before the first request
        tasks = [asyncio.create_task(state.health.run()), asyncio.create_task(state.console.run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.links.close()
            await state.client.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    def count_api_error(status: int, path: str) -> None:
        if path.startswith("/v1/"):  # admin, internal and status calls are not client requests
            metrics.count_request(status)

    install_error_handlers(app, on_error=count_api_error)
    app.add_middleware(FrontDoor, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       max_inflight=config.max_inflight_requests, retry_after_s=max(1, config.retry_after_s),
                       on_reject=metrics.count_request)
    _add_openai_routes(app)
    _add_service_routes(app)
    app.include_router(build_internal_router())
    app.include_router(build_admin_router())
    app.include_router(build_status_router())
    app.include_router(build_tokenize_router())
    return app


def _build_state(config: RouterConfig, tokenizer: TokenizerLike, metrics: RouterMetrics) -> RouterState:
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.control_timeout_s, connect=config.connect_timeout_s),
                               limits=limits, trust_env=False)
    registry = WorkerRegistry(config.worker_timeout_s)
    metrics.attach(registry)
    for url in config.prefill_urls:
        registry.add_static(url, "prefill")
    for url in config.decode_urls:
        registry.add_static(url, "decode")
    links = WorkerLinks(registry, config.secret, f"router-{uuid.uuid4().hex[:8]}", config.connect_timeout_s,
                        stall_timeout_s=config.stream_stall_timeout_s)
    relay = Relay(links, registry, make_prefill_policy(config.prefill_policy, config.policy_options),
                  make_decode_policy(config.decode_policy, config.policy_options), config, metrics)
    headers = {SECRET_HEADER: config.secret} if config.secret else {}
    health = HealthMonitor(registry, client, config, metrics, headers, links)
    admin = AdminState(config.prefill_policy, config.decode_policy)
    return RouterState(config, tokenizer, registry, metrics, client, links, relay, health, int(time.time()), admin,
                       FieldLog(), Console(config, registry))


def _add_openai_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        state: RouterState = request.app.state.router
        state.fields.check(body)
        plan = await plan_completion(body, state.config, state.tokenizer)
        return await _serve(state, plan, request, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        state: RouterState = request.app.state.router
        state.fields.check(body)
        plan = await plan_chat(body, state.config, state.tokenizer)
        return await _serve(state, plan, request, arrival)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state: RouterState = request.app.state.router
        cards = [ModelCard(id=name, created=state.started, max_model_len=state.config.max_model_len)
                 for name in state.config.served_models]
        return ModelList(data=cards)


async def _serve(state: RouterState, plan: GenerationPlan, request: Request, arrival: float) -> Response:
    sink = DeltaSink()
    try:
        channels = await _start(state, plan, sink, request)
    except APIError as exc:
        state.console.failed(plan, exc, arrival)
        raise
    writer = ResponseWriter(plan, state.tokenizer, [c.prompt_logprobs for c in channels])  # P's, when asked
    relayed = Relayed(channels, sink, writer, state.metrics, arrival, state.console.ended)
    if plan.stream:
        return SSEResponse(relayed)
    return JSONResponse(await collect(relayed, request))


async def _start(state: RouterState, plan: GenerationPlan, sink: DeltaSink, request: Request) -> list[Channel]:
    """Start every choice; a client that hangs up meanwhile cancels the start (the channels abort on P and D)."""
    start = asyncio.create_task(state.relay.start_all(plan.subrequests, sink))
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({start, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not start.done():
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
    if start.cancelled():
        raise APIError(CLIENT_CLOSED, "client closed the request before its first token")
    return start.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when at least one prefill and one decode worker can take work, else 503 (with the counts)."""
        state: RouterState = request.app.state.router
        counts = {role: len(state.registry.candidates(role)) for role in ("prefill", "decode")}
        if all(counts.values()):
            return JSONResponse({"status": "ok", "workers": counts})
        missing = [role for role, count in counts.items() if not count]
        error = APIError(503, f"no {' and no '.join(missing)} worker available", code="no_worker_available",
                         headers={"Retry-After": str(state.config.retry_after_s)})
        body = {**error.body(), "status": "unavailable", "workers": counts}
        return JSONResponse(body, status_code=503, headers=error.headers)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: RouterState = request.app.state.router
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
