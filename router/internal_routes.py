"""/internal/* routes of the router: worker registration, heartbeats, deregistration and the worker list
(docs/internal_api.md). All of them check the shared secret when one is configured."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.errors import APIError, bad_request, unauthorized
from pdserve.router.health import load_from_dict

log = logging.getLogger(__name__)
SECRET_HEADER = "X-PDServe-Secret"  # the shared secret on every /internal/* call, router and workers alike


class WorkerRegistration(BaseModel):
    model_config = ConfigDict(extra="ignore")

    worker_id: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://")
    roles: list[str] = Field(min_length=1)
    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    transfer: dict[str, Any] = Field(default_factory=dict)
    fingerprint: str | None = None
    data_port: int | None = Field(default=None, ge=1, le=65535)
    roles_version: int = 0


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    worker_id: str
    roles: list[str] | None = None
    roles_version: int | None = None  # with roles: taken when newer than the version this router holds
    queue_len: int = 0
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    draining: bool = False
    transfer_bytes_total: int | None = None
    transfer_seconds_total: float | None = None
    prefix_hit_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    cached_blocks: str | None = None  # base64 summary of the prefix blocks it holds (protocol/prefix_summary.py)
    prefix_snapshot: dict[str, Any] | None = None  # or its block-hash events (protocol/prefix_events.py)
    prefix_events: dict[str, Any] | None = None
    requests_running: int | None = Field(default=None, ge=0)  # the console's numbers (router/console.py)
    requests_waiting: int | None = Field(default=None, ge=0)
    prompt_tokens_computed: int | None = Field(default=None, ge=0)
    generation_tokens: int | None = Field(default=None, ge=0)
    prefix_queried_tokens: int | None = Field(default=None, ge=0)
    prefix_hit_tokens: int | None = Field(default=None, ge=0)
    step_stalled_s: float = Field(default=0.0, ge=0.0)  # since its step threads last moved (router/health.py)
    # its Prometheus samples, compact (worker/metrics.py); kept as sent, decoded when /metrics is scraped
    metrics: list[Any] | None = None


class Deregistration(BaseModel):
    model_config = ConfigDict(extra="ignore")

    worker_id: str


def check_secret(request: Request) -> None:
    secret = request.app.state.router.config.secret
    if secret is None:
        return
    given = request.headers.get(SECRET_HEADER, "")
    if not hmac.compare_digest(given.encode(), secret.encode()):
        raise unauthorized()


def build_internal_router() -> APIRouter:
    api = APIRouter(prefix="/internal", dependencies=[Depends(check_secret)])

    @api.post("/workers/register")
    async def register(body: WorkerRegistration, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        config = state.config
        if body.model is not None and body.model not in config.served_models:
            raise bad_request(f"worker {body.worker_id} serves model {body.model!r}, this router serves "
                              f"{list(config.served_models)}", param="model")
        if body.block_size is not None and body.block_size != config.block_size:
            raise bad_request(f"worker {body.worker_id} has block_size {body.block_size}, the router expects "
                              f"{config.block_size}", param="block_size")
        try:
            worker = state.registry.register(
                body.worker_id, body.url, tuple(body.roles), model=body.model, max_model_len=body.max_model_len,
                block_size=body.block_size, num_blocks=body.num_blocks, transfer=body.transfer,
                fingerprint=body.fingerprint, data_port=body.data_port,
                roles_version=body.roles_version)
        except ValueError as exc:
            raise bad_request(str(exc), param="roles") from exc
        if body.num_blocks:
            worker.load.total_blocks = worker.load.free_blocks = body.num_blocks
        state.metrics.observe_worker(worker)
        state.admin.push_later(state, worker)
        return {"heartbeat_interval_s": config.heartbeat_interval_s}

    @api.post("/workers/heartbeat")
    async def heartbeat(body: Heartbeat, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        worker = state.registry.heartbeat(body.worker_id, load_from_dict(body.model_dump(exclude={"metrics"})))
        if worker is None:
            raise APIError(404, f"worker {body.worker_id} is not registered; register again",
                           code="worker_not_found")
        answer: dict[str, Any] = {}
        if body.metrics is not None:
            worker.series = body.metrics
        try:
            if body.roles and body.roles_version is not None:
                state.registry.take_roles(worker, tuple(body.roles), body.roles_version)
            if body.cached_blocks is not None:
                worker.prefixes.report(body.cached_blocks)
            if body.prefix_snapshot is not None or body.prefix_events is not None:
                answer["prefix"] = worker.prefixes.sync(body.prefix_snapshot, body.prefix_events)
        except ValueError as exc:
            raise bad_request(f"bad heartbeat from {body.worker_id}: {exc}") from exc
        state.metrics.observe_worker(worker)
        return answer

    @api.post("/workers/deregister")
    async def deregister(body: Deregistration, request: Request) -> dict[str, Any]:
        """A drained worker leaving: forgotten now rather than after the heartbeat timeout."""
        state = request.app.state.router
        worker = state.registry.deregister(body.worker_id)
        if worker is None:
            raise APIError(404, f"worker {body.worker_id} is not registered", code="worker_not_found")
        state.metrics.forget_worker(worker.worker_id)
        state.links.forget(worker.worker_id, "it deregistered (drained)")
        log.info("worker %s (%s) left", worker.worker_id, worker.url)
        return {"worker_id": worker.worker_id}

    @api.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        return {"workers": [w.to_dict() for w in request.app.state.router.registry.workers()]}

    return api
