"""The status page: `GET /status` (HTML, no external assets) and `GET /status.json` (what it shows).

The page embeds a first snapshot and then fetches `status.json` every 2 s (a small inline script; a meta
refresh takes over without JavaScript). Both are read-only and need no token, like /metrics: they show the
pools, each worker's role, load, KV usage and health, cache hit rates and the router's TTFT / TPOT / E2E
percentiles over its recent requests (router/recent.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from pdserve.router.registry import ROLES, Worker
from pdserve.router.status_html import render_page

REFRESH_S = 2


def build_status_router() -> APIRouter:
    api = APIRouter()

    @api.get("/status.json")
    async def status_json(request: Request) -> dict[str, Any]:
        return status_snapshot(request.app.state.router)

    @api.get("/status", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        snapshot = status_snapshot(request.app.state.router)
        return HTMLResponse(render_page(json.dumps(snapshot), REFRESH_S), headers={"Cache-Control": "no-store"})

    return api


def status_snapshot(state: Any) -> dict[str, Any]:
    registry = state.registry
    workers = [_worker_row(registry.describe(w), w) for w in registry.workers()]
    latency = state.metrics.recent.summary()
    recent = state.metrics.recent
    return {
        "model": state.config.model,
        "generated_at": time.time(),
        "uptime_s": time.time() - state.started,
        "refresh_s": REFRESH_S,
        "pools": {role: _pool(role, registry) for role in ROLES},
        "workers": workers,
        "latency": latency.to_dict(),
        "cache": {
            "hit_rate_recent": latency.cache_hit_rate,
            "hit_rate_total": (recent.total_cached_tokens / recent.total_prompt_tokens
                               if recent.total_prompt_tokens else None),
            "prompt_tokens_total": recent.total_prompt_tokens,
            "cached_tokens_total": recent.total_cached_tokens,
        },
        "policies": {"prefill": state.admin.prefill_policy, "decode": state.admin.decode_policy,
                     "cache": state.admin.cache_policy.to_dict()},
        "requests": _request_counts(state.metrics.requests),
    }


def _worker_row(described: dict[str, Any], worker: Worker) -> dict[str, Any]:
    load = described["load"]
    return {
        "worker_id": worker.worker_id, "url": worker.url, "roles": list(worker.roles), "static": worker.static,
        "health": described["health"], "silent_s": described["silent_s"], "inflight": worker.inflight,
        "queue_len": load["queue_len"], "num_running": load["num_running"], "num_waiting": load["num_waiting"],
        "kv_used": worker.load.used_blocks, "kv_total": load["total_blocks"], "kv_usage": described["kv_usage"],
        "prefix_hit_rate": load["prefix_hit_rate"],
    }


def _pool(role: str, registry: Any) -> dict[str, Any]:
    members = [w for w in registry.workers() if role in w.roles]
    used = sum(w.load.used_blocks for w in members)
    total = sum(w.load.total_blocks for w in members)
    return {"workers": len(members), "available": len(registry.candidates(role)),
            "queue_len": sum(w.load.queue_len for w in members),
            "num_running": sum(w.load.num_running for w in members),
            "inflight": sum(w.inflight for w in members),
            "kv_used": used, "kv_total": total, "kv_usage": used / total if total else None}


def _request_counts(counter: Any) -> dict[str, int]:
    """Finished HTTP requests by status code, from the Prometheus counter."""
    counts: dict[str, int] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["status"]] = int(sample.value)
    return counts
