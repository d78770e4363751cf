"""Run-time control of a worker: the roles it admits, draining, the KV cache policy (the router's admin API
forwards to these; docs/internal_api.md).

    POST /internal/role {"roles": [...]}   admit only these roles from now on; in-flight work of a role
                                          dropped finishes first (its node keeps running, it just gets no new work)
    POST /internal/drain {"exit": true}   admit nothing; once idle, deregister from the router, then exit with
                                          status 0 (exit false: stay up, idle, until POST /internal/resume)
    POST /internal/resume                 admit the roles again after a drain that did not exit
    POST /internal/cache-policy {...}     CachePolicy fields: kept, and what this worker has tiers for applied
    GET  /internal/control                the state above

Why a role switch is cheap: a worker holds both nodes over ONE engine (weights, block pool, runner), with the
`tcp` transfer backend, so "role" only says which new work the data plane admits (worker/data_plane.py). The exception is a
`--role both` worker on the `local` backend (the colocated baseline): its halves only talk to each other, so
its role is fixed (409).

A drain's life:  draining ─(no request in either node, no open work call)─▶ drained ─exit?─▶ deregistered
(from every router: `leave`, worker/router_links.py) ─▶ the server is asked to stop (uvicorn's graceful
shutdown). In-flight work meanwhile runs to its end.

`roles_version` counts role switches; heartbeats carry it with the roles, so every router (not only the one
whose admin API asked) takes a switch up, and a report sent before the switch cannot undo it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.policy import CachePolicy
from pdserve.decode_node.node import DecodeNode
from pdserve.prefill_node.node import PrefillNode
from pdserve.settings import ROLES

logger = logging.getLogger("pdserve.worker")
_IDLE_CHECKS = 3  # consecutive idle observations (at `poll_s`) before a drain counts as done
RETRY_AFTER_S = 1


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _stay() -> None:
    """`leave` of a worker registered nowhere (static)."""


@dataclass
class WorkerControl:
    roles: tuple[str, ...]
    switchable: bool  # False for a colocated worker on the local transfer backend
    is_idle: Callable[[], bool]  # no request in either node (call on the event loop)
    leave: Callable[[], Awaitable[None]] = _stay  # deregister from every router (worker/router_links.py)
    apply_cache_policy: Callable[[CachePolicy], list[str]] = lambda policy: []  # -> fields applied
    request_exit: Callable[[], None] | None = None  # set by the process that runs the server
    draining: bool = False
    roles_version: int = 0  # one more per role switch (see the module docstring)
    exit_when_drained: bool = True
    drained: bool = False
    left: bool = False  # deregistered: the heartbeat loop stops
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    _watcher: asyncio.Task[None] | None = None

    def admits(self, role: str) -> bool:
        return role in self.roles and not self.draining

    def set_roles(self, roles: tuple[str, ...]) -> None:
        if not roles or any(role not in ROLES for role in roles):
            raise ControlError(400, f"roles must be a non-empty subset of {list(ROLES)}, got {list(roles)}")
        if self.draining:
            raise ControlError(409, "the worker is draining; resume it before changing its role")
        if not self.switchable and set(roles) != set(self.roles):
            raise ControlError(409, f"this worker serves {list(self.roles)} over the local transfer backend, "
                               "which cannot serve one role alone; start it with --transfer-backend tcp to "
                               "make its role switchable")
        self.roles = tuple(role for role in ROLES if role in roles)
        self.roles_version += 1
        logger.info("now admitting %s", list(self.roles))

    def drain(self, exit_when_drained: bool) -> None:
        self.draining, self.exit_when_drained = True, exit_when_drained
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._finish_drain())
        logger.info("draining (exit when drained: %s)", exit_when_drained)

    def resume(self) -> None:
        if self.left:
            raise ControlError(409, "the worker already left the router; start a new one")
        self.draining = self.drained = False
        if self._watcher is not None:
            self._watcher.cancel()
        logger.info("resumed, admitting %s", list(self.roles))

    def set_cache_policy(self, changes: dict[str, Any]) -> dict[str, Any]:
        try:
            policy = self.cache_policy.merged(changes)
        except (TypeError, ValueError) as exc:
            raise ControlError(400, f"invalid cache policy: {exc}") from exc
        applied = self.apply_cache_policy(policy)
        self.cache_policy = policy
        stored = sorted(set(policy.to_dict()) - set(applied))
        return {"policy": policy.to_dict(), "applied": applied, "stored_only": stored}

    def status_fields(self) -> dict[str, Any]:
        """What heartbeats and /internal/status report about control."""
        return {"roles": list(self.roles), "roles_version": self.roles_version, "draining": self.draining}

    def to_dict(self) -> dict[str, Any]:
        return {**self.status_fields(), "switchable": self.switchable, "drained": self.drained,
                "exit_when_drained": self.exit_when_drained,
                "cache_policy": self.cache_policy.to_dict()}

    def idle(self) -> bool:
        return self.is_idle()

    async def _finish_drain(self, poll_s: float = 0.1) -> None:
        quiet = 0
        while quiet < _IDLE_CHECKS:
            await asyncio.sleep(poll_s)
            quiet = quiet + 1 if self.idle() else 0
        self.drained = True
        logger.info("drained: no request left")
        if not self.exit_when_drained:
            return
        self.left = True
        await self.leave()
        if self.request_exit is None:
            logger.warning("drained, but nothing can stop this server: staying up, idle")
            return
        logger.info("leaving")
        self.request_exit()


def nodes_idle(prefill: PrefillNode | None, decode: DecodeNode | None, state_lock: threading.RLock,
               open_requests: Callable[[], int] = lambda: 0) -> bool:
    """No request queued or running in either node, none a router still waits on (event loop thread)."""
    with state_lock:
        if prefill is not None and prefill.batcher.requests:
            return False
        if decode is not None and decode.scheduler.queues.requests:
            return False
    return open_requests() == 0


def pool_policy_applier(pool: BlockPool, state_lock: threading.RLock) -> Callable[[CachePolicy], list[str]]:
    """Without host / Redis tiers only the device pool's eviction order can change."""

    def apply(policy: CachePolicy) -> list[str]:
        with state_lock:
            pool.set_eviction(policy.device_eviction)
        return ["device_eviction"]

    return apply


class DrainOnSigterm(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM drains (finish the requests held, deregister, exit 0)
    instead of stopping within the 3 s graceful shutdown; a second SIGTERM, or SIGINT, stops at once. What
    `docker compose stop` / `--scale` down needs to lose no request (compose.yaml's stop_grace_period)."""

    def __init__(self, config: uvicorn.Config, control: WorkerControl) -> None:
        super().__init__(config)
        self.control = control

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.control.draining:
            logger.info("SIGTERM: draining before leaving (SIGTERM again to stop now)")
            asyncio.get_running_loop().call_soon_threadsafe(self.control.drain, True)
            return
        super().handle_exit(sig, frame)


def _error(status: int, message: str) -> JSONResponse:
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_control_router(control: WorkerControl) -> APIRouter:
    api = APIRouter(prefix="/internal")

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        data = await request.json()
        if not isinstance(data, dict):
            raise ControlError(400, f"expected a JSON object, got {type(data).__name__}")
        return data

    async def run(request: Request, action: Callable[[dict[str, Any]], Any]) -> JSONResponse:
        try:
            result = action(await body_of(request))
        except ControlError as exc:
            return _error(exc.status, str(exc))
        except ValueError as exc:  # a body that is not JSON
            return _error(400, f"bad control body: {exc}")
        return JSONResponse(result if isinstance(result, dict) else control.to_dict())

    @api.get("/control")
    async def state() -> dict[str, Any]:
        return control.to_dict()

    @api.post("/role")
    async def role(request: Request) -> JSONResponse:
        return await run(request, lambda body: control.set_roles(tuple(_roles(body))))

    @api.post("/drain")
    async def drain(request: Request) -> JSONResponse:
        return await run(request, lambda body: control.drain(bool(body.get("exit", True))))

    @api.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        return await run(request, lambda body: control.resume())

    @api.post("/cache-policy")
    async def cache_policy(request: Request) -> JSONResponse:
        return await run(request, control.set_cache_policy)

    return api


def _roles(body: dict[str, Any]) -> list[str]:
    roles = body.get("roles")
    if isinstance(roles, str):
        roles = list(ROLES) if roles == "both" else [roles]
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise ControlError(400, f"'roles' must be a list of role names, got {roles!r}")
    return roles
