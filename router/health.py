"""HealthMonitor: the router's one background task. Every tick it drops registered workers whose heartbeats
stopped, polls the static workers' /internal/status, finds stalled workers, and refreshes the worker gauges.

A stalled worker answers heartbeats and PINGs (its event loop runs) but its step threads have not moved for
--stream-stall-timeout: a forward that never ends (engine/step_liveness.py). Its report's `step_stalled_s`, plus
the time since the report (at most one heartbeat interval: a late heartbeat alone is not a stall), less the time
the report came late by (a process frozen by SIGSTOP, thawed, reports steps that could not move: not a stall),
tells it.
Then its data-plane link is closed with the reason, so its streams end with an error event and the prompts it
had not prefilled are retried on another P (router/relay.py); it is `stalled`, out of `candidates`, until a
report shows its step threads moving again."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import ROLES, Worker, WorkerLoad, WorkerRegistry
from pdserve.router.worker_link import WorkerLinks

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, config: RouterConfig,
                 metrics: RouterMetrics, headers: dict[str, str], links: WorkerLinks | None = None) -> None:
        self._registry = registry
        self._links = links
        self._client = client
        self._config = config
        self._metrics = metrics
        self._headers = headers
        # a third of the timeout: a silent worker is dropped at most ~1.33 timeouts after its last heartbeat; a
        # quarter of the stall timeout: a stalled one is found at most 1.25 stall timeouts after its last step
        self.tick_s = min(config.poll_interval_s, config.worker_timeout_s / 3, config.stream_stall_timeout_s / 4)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:  # a bad tick must not stop monitoring
                log.exception("health check failed")

    async def tick(self) -> None:
        for worker in self._registry.expire():
            log.warning("dropping worker %s (%s): no heartbeat for %.1f s", worker.worker_id, worker.url,
                        self._config.worker_timeout_s)
            self._metrics.forget_worker(worker.worker_id)
            if self._links is not None:
                self._links.forget(worker.worker_id, f"dropped: no heartbeat for "
                                                     f"{self._config.worker_timeout_s:g} s (--heartbeat-timeout)")
        await asyncio.gather(*(self._poll(w) for w in self._registry.static_workers()))
        for worker in self._registry.workers():
            self._check_steps(worker)
        for role in ROLES:
            self._metrics.workers.labels(role).set(len(self._registry.candidates(role)))

    def _check_steps(self, worker: Worker) -> None:
        """Mark a worker whose step threads stopped as stalled and close its link; clear it once they move."""
        interval = self._config.heartbeat_interval_s
        since_report = min(max(0.0, self._registry.clock() - worker.last_seen), interval)
        # a report that came late by more than an interval follows a spell in which the whole process may not have
        # run (frozen, starved): its step threads could not move either, so that spell does not count
        frozen_s = max(0.0, worker.report_gap_s - interval)
        reported_s = max(0.0, worker.load.step_stalled_s - frozen_s)
        stalled_s = reported_s + since_report if reported_s > 0 else 0.0
        limit_s = self._config.stream_stall_timeout_s
        if worker.stalled and stalled_s <= limit_s:
            log.warning("worker %s: its step threads move again; it takes new work", worker.worker_id)
            worker.stalled = False
        elif not worker.stalled and stalled_s > limit_s:
            reason = (f"stalled: its model steps made no progress for {stalled_s:.1f} s while it answered "
                      f"heartbeats (--stream-stall-timeout {limit_s:g})")
            log.warning("worker %s (%s) %s; its requests end, and it takes no new work until its steps move",
                        worker.worker_id, worker.url, reason)
            worker.stalled = True
            self._metrics.stalled_workers.inc()
            if self._links is not None:
                self._links.forget(worker.worker_id, reason)

    async def _poll(self, worker: Worker) -> None:
        timeout = httpx.Timeout(self._config.control_timeout_s, connect=self._config.connect_timeout_s)
        try:
            response = await self._client.get(f"{worker.url}/internal/status", headers=self._headers, timeout=timeout)
            response.raise_for_status()
            data = response.json()
            load = load_from_dict(data)
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            if worker.reachable:
                log.warning("static worker %s does not answer its status: %r", worker.url, exc)
            self._registry.mark_unreachable(worker.worker_id)
            return
        self._registry.heartbeat(worker.worker_id, load)
        _take_cache_summary(worker, data)
        if isinstance(data.get("metrics"), list):
            worker.series = data["metrics"]
        self._metrics.observe_worker(worker)


def _take_cache_summary(worker: Worker, data: dict[str, Any]) -> None:
    """Static workers do not register: their status gives the fingerprint and the cached-block summary."""
    if worker.fingerprint is None and isinstance(data.get("fingerprint"), str):
        worker.fingerprint = data["fingerprint"]
    port = data.get("data_port")
    if type(port) is int and 0 < port < 65536:
        worker.data_port = port
    summary = data.get("cached_blocks")
    if isinstance(summary, str):
        try:
            worker.prefixes.report(summary)
        except ValueError as exc:
            log.warning("static worker %s sent a bad cached_blocks summary: %s", worker.url, exc)


def load_from_dict(data: dict[str, Any]) -> WorkerLoad:
    """A heartbeat or status body as a WorkerLoad (unknown fields ignored)."""
    return WorkerLoad(
        queue_len=int(data.get("queue_len", 0)),
        num_running=int(data.get("num_running", 0)),
        num_waiting=int(data.get("num_waiting", 0)),
        free_blocks=int(data.get("free_blocks", 0)),
        total_blocks=int(data.get("total_blocks", 0)),
        draining=bool(data.get("draining", False)),
        transfer_bytes_total=data.get("transfer_bytes_total"),
        transfer_seconds_total=data.get("transfer_seconds_total"),
        prefix_hit_rate=data.get("prefix_hit_rate"),
        step_stalled_s=float(data.get("step_stalled_s", 0.0)),
        **{name: _optional_int(data.get(name)) for name in _COUNTS},
    )


_COUNTS = ("requests_running", "requests_waiting", "prompt_tokens_computed", "generation_tokens",
           "prefix_queried_tokens", "prefix_hit_tokens")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
