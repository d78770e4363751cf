"""The admin API: operators watch the pools and move capacity between them. Every route needs
`Authorization: Bearer <admin token>` (401 without or wrong; 403 for all when the router has no token).

    GET  /admin/workers                  every worker: roles, load, KV usage, prefix hit rate, health
    POST /admin/workers/{id}/drain       {"exit": true}  no new work now; the worker finishes what it holds,
                                         then deregisters and exits with status 0 ({"exit": false}: it stays
                                         up, idle and drained, until POST /admin/workers/{id}/resume)
    POST /admin/workers/{id}/resume      a drained worker that did not exit takes work again
    PUT  /admin/workers/{id}/role        {"role": "prefill" | "decode" | "both"}
    GET | PUT /admin/routing-policy      {"prefill_policy", "decode_policy"} (either may be left out)
    GET | PUT /admin/cache-policy        CachePolicy fields (any subset): kept here, forwarded to every worker,
                                         and pushed to workers that register later

Order of each change, so that no client request fails (a worker refuses work it does not admit with 503,
and the relay then tries another worker):

    drain   registry: draining (no new work from now) ─▶ POST {worker}/internal/drain
    role    registry: paused ─▶ POST {worker}/internal/role (admits only the new role; in-flight work of the
            old one finishes) ─▶ registry: new roles, unpaused
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import httpx
from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict

from pdserve.protocol.cache_policy import CachePolicy
from pdserve.router.errors import APIError, bad_request
from pdserve.router.internal_routes import SECRET_HEADER
from pdserve.router.policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    make_decode_policy,
    make_prefill_policy,
)
from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)
ROLE_NAMES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}


@dataclass
class AdminState:
    """What the admin API changed at run time (the config keeps the start-up values)."""

    prefill_policy: str
    decode_policy: str
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    cache_policy_set: bool = False  # an operator set it: push it to workers that register later
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # those pushes, referenced until done

    def push_later(self, state: Any, worker: Worker) -> None:
        if self.cache_policy_set:
            task = asyncio.create_task(push_cache_policy(state, worker))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exit: bool = True


class RoleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "both"]


class RoutingPolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_policy: str | None = None
    decode_policy: str | None = None


def check_admin_token(request: Request) -> None:
    token = request.app.state.router.config.admin_token
    if token is None:
        raise APIError(403, "the admin API is off: start the router with --admin-token (or PDSERVE_ADMIN_TOKEN)",
                       type="permission_error", code="admin_disabled")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "missing or wrong admin token: send 'Authorization: Bearer <token>'",
                       code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"})


def build_admin_router() -> APIRouter:
    api = APIRouter(prefix="/admin", dependencies=[Depends(check_admin_token)])
    _add_worker_routes(api)
    _add_role_route(api)
    _add_policy_routes(api)
    return api


def _add_worker_routes(api: APIRouter) -> None:
    @api.get("/workers")
    async def workers(request: Request) -> dict[str, Any]:
        registry = request.app.state.router.registry
        return {"workers": [registry.describe(w) for w in registry.workers()]}

    @api.get("/workers/{worker_id}")
    async def worker(worker_id: str, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        registry: WorkerRegistry = state.registry
        return registry.describe(_worker(state, worker_id))

    @api.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request, body: Annotated[DrainBody | None, Body()] = None) -> dict[str, Any]:
        state = request.app.state.router
        target = _worker(state, worker_id)
        target.draining = True  # before telling the worker: nothing new is routed there from now on
        answer = await forward(state, target, "/internal/drain", {"exit": (body or DrainBody()).exit})
        log.info("draining %s (%s): %s", target.worker_id, target.url, answer)
        return {"worker": state.registry.describe(target), "worker_answer": answer}

    @api.post("/workers/{worker_id}/resume")
    async def resume(worker_id: str, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        target = _worker(state, worker_id)
        answer = await forward(state, target, "/internal/resume", {})
        target.draining = False
        target.load.draining = bool(answer.get("draining", False))  # its next heartbeat would say so too
        return {"worker": state.registry.describe(target), "worker_answer": answer}


def _add_role_route(api: APIRouter) -> None:
    @api.put("/workers/{worker_id}/role")
    async def set_role(worker_id: str, body: RoleBody, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        target = _worker(state, worker_id)
        if target.draining or target.load.draining:
            raise APIError(409, f"worker {worker_id} is draining; resume it before changing its role",
                           code="worker_draining")
        roles = ROLE_NAMES[body.role]
        target.paused = True  # while it switches: no request meets a half-switched worker
        try:
            answer = await forward(state, target, "/internal/role", {"roles": list(roles)})
            state.registry.set_roles(worker_id, roles)
            if isinstance(answer.get("roles_version"), int):
                target.roles_version = max(target.roles_version, answer["roles_version"])
        finally:
            target.paused = False
        log.info("worker %s now serves %s", worker_id, body.role)
        return {"worker": state.registry.describe(target), "worker_answer": answer}


def _add_policy_routes(api: APIRouter) -> None:
    @api.get("/routing-policy")
    async def routing_policy(request: Request) -> dict[str, Any]:
        return _routing(request.app.state.router.admin)

    @api.put("/routing-policy")
    async def set_routing_policy(body: RoutingPolicyBody, request: Request) -> dict[str, Any]:
        state = request.app.state.router
        admin: AdminState = state.admin
        prefill = body.prefill_policy or admin.prefill_policy
        decode = body.decode_policy or admin.decode_policy
        if prefill not in PREFILL_POLICIES:
            raise bad_request(f"unknown prefill policy {prefill!r}; choose one of {sorted(PREFILL_POLICIES)}",
                              param="prefill_policy")
        if decode not in DECODE_POLICIES:
            raise bad_request(f"unknown decode policy {decode!r}; choose one of {sorted(DECODE_POLICIES)}",
                              param="decode_policy")
        options = state.config.policy_options
        state.relay.set_policies(make_prefill_policy(prefill, options), make_decode_policy(decode, options))
        admin.prefill_policy, admin.decode_policy = prefill, decode
        log.info("routing policies: prefill %s, decode %s", prefill, decode)
        return _routing(admin)

    @api.get("/cache-policy")
    async def cache_policy(request: Request) -> dict[str, Any]:
        return {"policy": request.app.state.router.admin.cache_policy.to_dict()}

    @api.put("/cache-policy")
    async def set_cache_policy(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        state = request.app.state.router
        try:
            policy = state.admin.cache_policy.merged(body)
        except (TypeError, ValueError) as exc:
            raise bad_request(f"invalid cache policy: {exc}", param="cache_policy") from exc
        state.admin.cache_policy, state.admin.cache_policy_set = policy, True
        workers = state.registry.workers()
        answers = await asyncio.gather(*(_forward_or_error(state, w, "/internal/cache-policy", policy.to_dict())
                                         for w in workers))
        return {"policy": policy.to_dict(), "workers": dict(zip((w.worker_id for w in workers), answers, strict=True))}


def _routing(admin: AdminState) -> dict[str, Any]:
    return {"prefill_policy": admin.prefill_policy, "decode_policy": admin.decode_policy,
            "prefill_policies": sorted(PREFILL_POLICIES), "decode_policies": sorted(DECODE_POLICIES)}


def _worker(state: Any, worker_id: str) -> Worker:
    worker: Worker | None = state.registry.get(worker_id)
    if worker is None:
        known = sorted(w.worker_id for w in state.registry.workers())
        raise APIError(404, f"no worker {worker_id!r}; known workers: {known}", code="worker_not_found")
    return worker


async def forward(state: Any, worker: Worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a control call to a worker; its error (or silence) becomes an APIError naming the worker."""
    try:
        headers = {SECRET_HEADER: state.config.secret} if state.config.secret else {}
        response = await state.client.post(f"{worker.url}{path}", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise APIError(502, f"worker {worker.worker_id} ({worker.url}) did not answer {path}: {exc!r}",
                       type="server_error", code="worker_unreachable") from exc
    try:
        data = response.json()
    except ValueError:
        data = {"message": response.text[:200]}
    if response.status_code != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(data)[:200]
        status = response.status_code if response.status_code in (400, 409) else 502
        raise APIError(status, f"worker {worker.worker_id} refused {path} ({response.status_code}): {message}",
                       code="worker_refused")
    if not isinstance(data, dict):
        raise APIError(502, f"worker {worker.worker_id} answered {path} with a JSON {type(data).__name__}, "
                       f"not an object: {str(data)[:200]}", type="server_error", code="worker_bad_answer")
    return data


async def _forward_or_error(state: Any, worker: Worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return await forward(state, worker, path, body)
    except APIError as exc:
        return {"error": exc.message}


async def push_cache_policy(state: Any, worker: Worker) -> None:
    """A worker that registers after an operator set the cache policy gets it too (in the background)."""
    answer = await _forward_or_error(state, worker, "/internal/cache-policy", state.admin.cache_policy.to_dict())
    if "error" in answer:
        log.warning("cannot give the cache policy to %s: %s", worker.worker_id, answer["error"])
