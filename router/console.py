"""The router's console at INFO, as vLLM's (lines formatted by router/request_log.py):

    a line per finished request    when its response ends (router/streaming.py's Relayed.end: the SSE stream's
                                   last event, the collected JSON body, or the error that ended either), or when
                                   it fails before its first token (no worker, a worker refused it, the client
                                   left); off with --disable-log-requests. Requests refused before they are
                                   planned (a bad body, 401, 413, 429) get no line: pdserve_requests_total counts
                                   them.
    a stats line per pool          every --log-stats-interval (10 s) while any pool has work, from the
                                   workers' last heartbeats: their running and waiting requests and KV usage, and what
                                   their token counters moved since the last lines; off with --disable-log-stats.

A request line costs ~18 µs (formatting, and one write to stderr; 5,000 lines logged to a file on the 2-core CPU
test machine): at the 200 requests a second of 256-token streams that make the relay's ~50k tokens/s
(benchmarks/router_relay.py), 0.4 % of the router's core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.plan import GenerationPlan
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.request_log import FinishedRequest, StatsLines, WorkerSnapshot, request_line
from pdserve.router.streaming import Relayed

log = logging.getLogger("pdserve.router")


class Console:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log_requests = config.log_requests
        self.stats = StatsLines(config.log_stats_interval_s) if config.log_stats else None
        self._registry = registry
        self._clock = clock

    def ended(self, relayed: Relayed, status: int, error: str | None) -> None:
        """Relayed's `on_end`: the response is over."""
        if not self.log_requests:
            return
        usage = relayed.writer.usage()
        firsts = [t.first for t in relayed.timers if t.first is not None]
        reasons = dict.fromkeys(c.finish_reason for c in relayed.writer.choices if c.finish_reason is not None)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
        log.info(request_line(FinishedRequest(
            relayed.writer.plan.id, status, usage.prompt_tokens, usage.completion_tokens, cached,
            ttft_s=min(firsts) - relayed.arrival if firsts else None, e2e_s=time.perf_counter() - relayed.arrival,
            finish_reason=",".join(r for r in reasons if r is not None) or None, error=error)))

    def failed(self, plan: GenerationPlan, error: APIError, arrival: float) -> None:
        """The request ended before its first token (no relay was started)."""
        if self.log_requests:
            log.info(request_line(FinishedRequest(plan.id, error.status, sum(plan.prompt_lengths), 0,
                                                  e2e_s=time.perf_counter() - arrival, error=error.message)))

    async def run(self) -> None:
        """The stats lines, until cancelled (the app's lifespan)."""
        if self.stats is None:
            return
        self.stats.lines(self._clock(), self.snapshots())  # opens the first interval
        while True:
            await asyncio.sleep(self.stats.interval_s)
            try:
                for line in self.stats.lines(self._clock(), self.snapshots()):
                    log.info(line)
            except Exception:  # a bad report must not end the stats lines for good
                log.exception("stats lines failed")

    def snapshots(self) -> list[WorkerSnapshot]:
        return [_snapshot(w) for w in self._registry.workers()]


def _snapshot(worker: Worker) -> WorkerSnapshot:
    load = worker.load
    running = load.requests_running if load.requests_running is not None else load.num_running
    waiting = load.requests_waiting if load.requests_waiting is not None else load.num_waiting
    return WorkerSnapshot(worker.worker_id, worker.pool, running, waiting, load.used_blocks, load.total_blocks,
                          load.prompt_tokens_computed or 0, load.generation_tokens or 0,
                          load.prefix_queried_tokens or 0, load.prefix_hit_tokens or 0)
