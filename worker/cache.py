"""A worker's tiered KV cache (device → host RAM → Redis, cache_store/tiered.py): built from its settings, shown
as Prometheus metrics, summarised for the router's cache-aware prefill policy, controlled over HTTP.

    GET  /internal/cache                  policy, tier occupancy and every counter (TieredKVCache.status)
    POST /internal/cache/clear            {"device": true, "host": true}: forget cached blocks (Redis, shared by
                                          every worker, is left alone); benchmarks and operators use it
    GET /internal/status                  `cached_blocks`: base64 keys of the prefix blocks held on the device or
                                          in host RAM (protocol/prefix_summary.py)
    heartbeats                            the same keys as numbered events (prefix_publisher,
                                          protocol/prefix_events.py): to each router the events after the
                                          last it acknowledged, or a snapshot when it holds none of them

The router's `PUT /admin/cache-policy` reaches `WorkerControl.set_cache_policy`, which applies it through
`cache_policy_applier` (every field: eviction orders at once, the rest from the next request).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tier_stats import LOAD_BUCKETS_S, TIERS
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.protocol.prefix_events import PrefixPublisher
from pdserve.protocol.prefix_summary import DEFAULT_SUMMARY_BLOCKS, encode_summary, summary_key


def build_tiered(prefix_cache: PrefixCache, kv_caches: list[torch.Tensor], fingerprint: str, tiers: TierConfig,
                 policy: CachePolicy, device: str, lock: threading.RLock, secret: str | None) -> TieredKVCache:
    """The worker's cache over its pool; host RAM is pinned when the pool is on a GPU (DMA, no bounce). `secret`:
    the deployment's shared secret (ServerSettings.secret), which names and seals what goes to Redis."""
    if torch.device(device).type == "cuda" and not tiers.pin_host_memory:
        tiers = dataclasses.replace(tiers, pin_host_memory=True)
    return TieredKVCache(prefix_cache, kv_caches, fingerprint, tiers, policy, lock=lock, secret=secret)


def cache_policy_applier(tiered: TieredKVCache) -> Callable[[CachePolicy], list[str]]:
    def apply(policy: CachePolicy) -> list[str]:
        tiered.update(policy)
        return sorted(policy.to_dict())

    return apply


class SummaryReporter:
    """`cached_blocks` for heartbeats: sent when the held hashes changed, or when the router needs it anew."""

    def __init__(self, tiered: TieredKVCache, limit: int = DEFAULT_SUMMARY_BLOCKS) -> None:
        self.tiered = tiered
        self.limit = limit
        self._sent_version = -1

    def fields(self, force: bool = False) -> dict[str, str]:
        version = self.tiered.recent.version
        if not force and version == self._sent_version:
            return {}
        self._sent_version = version
        return {"cached_blocks": encode_summary(self.tiered.held_hashes(self.limit)),
                "fingerprint": self.tiered.layout.model_fingerprint}

    def resend(self) -> None:
        """The router forgot this worker (it registers again): the next heartbeat carries the summary."""
        self._sent_version = -1


def prefix_publisher(tiered: TieredKVCache, limit: int = DEFAULT_SUMMARY_BLOCKS) -> PrefixPublisher:
    """The heartbeats' prefix events over the keys of what this worker holds without Redis (device, host)."""
    return PrefixPublisher(lambda: (summary_key(h) for h in tiered.held_hashes(limit)))


def tier_metrics(tiered: TieredKVCache) -> Iterator[Metric]:
    """Prometheus families of the tiers' counters (read at scrape time)."""
    stats = tiered.stats.snapshot()
    hit_rate = GaugeMetricFamily("pdserve_kv_cache_hit_rate", "blocks found / asked, per tier", labels=["tier"])
    queried = CounterMetricFamily("pdserve_kv_cache_queried_blocks", "blocks looked up, per tier", labels=["tier"])
    hits = CounterMetricFamily("pdserve_kv_cache_hit_blocks", "blocks found, per tier", labels=["tier"])
    reused = CounterMetricFamily("pdserve_kv_cache_reused_tokens", "prompt tokens not computed: their KV came "
                                 "from this tier", labels=["tier"])
    for tier in TIERS:
        hit_rate.add_metric([tier], _number(stats, f"{tier}_hit_rate"))
        queried.add_metric([tier], _number(stats, f"{tier}_queried_blocks"))
        hits.add_metric([tier], _number(stats, f"{tier}_hit_blocks"))
        reused.add_metric([tier], _number(stats, f"{tier}_reused_tokens"))
    yield from (hit_rate, queried, hits, reused)
    moved = CounterMetricFamily("pdserve_kv_cache_bytes", "KV bytes moved between tiers", labels=["path"])
    for path in ("device_to_host", "host_to_device", "redis_read", "redis_written"):
        moved.add_metric([path], _number(stats, f"{path}_bytes"))
    yield moved
    for name, text in [("lookups", "host/Redis lookups (one per prompt)"),
                       ("redis_errors", "failed or timed-out Redis calls (each a miss or an unwritten block)"),
                       ("redis_timeouts", "Redis lookups that reached the request's deadline"),
                       ("redis_skipped", "Redis calls not tried while it was backing off after an error"),
                       ("redis_corrupt_values", "Redis values that failed validation (deleted, missed)"),
                       ("redis_auth_failures", "Redis values whose HMAC seal failed (deleted, missed)"),
                       ("redis_written_blocks", "blocks written to Redis"),
                       ("host_written_blocks", "blocks written to host RAM"),
                       ("writes_dropped_blocks", "copies to host/Redis dropped: the writer queue was full"),
                       ("fetched_unused_blocks", "blocks fetched from host/Redis but not used")]:
        yield CounterMetricFamily(f"pdserve_kv_cache_{name}", text, _number(stats, name))
    yield _load_histogram(stats)
    status = tiered.status()
    yield GaugeMetricFamily("pdserve_kv_cache_host_blocks_used", "host tier blocks in use",
                            _number(status, "host_blocks_used"))
    yield GaugeMetricFamily("pdserve_kv_cache_host_blocks_total", "host tier capacity",
                            _number(status, "host_blocks_total"))
    yield GaugeMetricFamily("pdserve_kv_cache_redis_backing_off", "1 while Redis is skipped after an error",
                            float(bool(status["redis_backing_off"])))


def _number(values: Mapping[str, object], key: str) -> float:
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"KV cache stat {key} is {value!r}, not a number")
    return value


def _load_histogram(stats: dict[str, Any]) -> HistogramMetricFamily:
    buckets = [(str(bound), count) for bound, count in zip(LOAD_BUCKETS_S, stats["load_seconds_buckets"], strict=True)]
    buckets.append(("+Inf", stats["load_seconds_count"]))
    return HistogramMetricFamily("pdserve_kv_cache_load_seconds", "host + Redis lookup time per prompt",
                                 buckets=buckets, sum_value=stats["load_seconds_sum"])


def build_cache_router(tiered: TieredKVCache) -> APIRouter:
    api = APIRouter(prefix="/internal")

    @api.get("/cache")
    async def cache() -> dict[str, Any]:
        return tiered.status()

    @api.post("/cache/clear")
    async def clear(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            body = await request.json() if raw else {}
        except ValueError as exc:
            return _bad(f"bad cache clear body: {exc}")
        if not isinstance(body, dict) or not all(isinstance(body.get(k, True), bool) for k in ("device", "host")):
            return _bad(f"expected {{'device': bool, 'host': bool}}, got {body!r}")
        dropped = tiered.drop_cached(device=body.get("device", True), host=body.get("host", True))
        return JSONResponse({"dropped": dropped})

    return api


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 400}},
                        status_code=400)
