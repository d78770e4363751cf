"""Every Prometheus family of one worker, for its own `/metrics` and, compact, for its heartbeats (the router's
`/metrics` carries them all, labelled by worker and role: router/worker_series.py).

    the nodes' own          pdserve_prefill_*, pdserve_decode_* (prefill_node/node.py, decode_node/node.py)
    the cache tiers         pdserve_kv_cache_* (worker/cache.py's tier_metrics): hits per tier, Redis
                            errors / timeouts, bytes moved between tiers
    autoscaling             pdserve_prefill_queued_prompt_tokens   prompt tokens accepted and not yet computed
                                                                   (queued + being prefilled): P's backlog
                            pdserve_decode_kv_usage                share of the KV pool's blocks held by requests
                            (deploy/k8s: HorizontalPodAutoscalers through the Prometheus adapter,
                            deploy/k8s/prometheus-adapter/rules.yaml; pdserve_decode_num_running is D's other one)
    vLLM's names            vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc,
                            vllm:prefix_cache_queries / _hits (tokens), vllm:num_preemptions {model_name}

The compact form, one list per family: [name, type, help, samples], a sample being [suffix, value] or
[suffix, value, labels] (suffix: what the sample's name adds to the family's, e.g. "_total", "_bucket").
Everything is read at call time under the worker's state lock, as the nodes' collectors do. `compact()` takes
~0.5 ms and ~7 KB of JSON for the default model's worker on the 2-core CPU test machine (57 families, 84
samples; timed over 200 calls on a `Worker` built in-process): at a heartbeat a second, 0.05 % of a core.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.node import DecodeNode
from pdserve.prefill_node.node import PrefillNode
from pdserve.worker.cache import tier_metrics


class WorkerMetrics:
    def __init__(self, model_name: str, prefill: PrefillNode | None, decode: DecodeNode | None, pool: BlockPool,
                 tiered: TieredKVCache, state_lock: threading.RLock) -> None:
        self.model_name = model_name
        self.prefill = prefill
        self.decode = decode
        self.pool = pool
        self.tiered = tiered
        self.state_lock = state_lock

    def collect(self) -> Iterator[Metric]:
        for node in (self.prefill, self.decode):
            if node is not None:
                yield from node.collect()
        yield from tier_metrics(self.tiered)
        yield from self._scaling()
        yield from self._vllm()

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # a collector is anything with collect()
        return generate_latest(registry)

    def compact(self) -> list[list[Any]]:
        """Every family in the heartbeat's compact form (see the module docstring)."""
        out = []
        for family in self.collect():
            cut = len(family.name)
            samples = [[s.name[cut:], s.value, s.labels] if s.labels else [s.name[cut:], s.value]
                       for s in family.samples]
            out.append([family.name, family.type, family.documentation, samples])
        return out

    def console_counts(self) -> dict[str, int]:
        """The heartbeat's numbers for the router's stats lines: vLLM's running / waiting, and cumulative token
        counters (prompt tokens computed, P's and D's recomputes; tokens D generated; prompt tokens looked up in,
        and found in, the prefix cache)."""
        statuses = [node.status() for node in (self.prefill, self.decode) if node is not None]
        counts = {"requests_running": sum(s["num_running"] for s in statuses),
                  "requests_waiting": sum(s["num_waiting"] for s in statuses),
                  "prompt_tokens_computed": 0, "generation_tokens": 0, "prefix_queried_tokens": 0,
                  "prefix_hit_tokens": 0}
        if self.prefill is not None:
            stats = self.prefill.engine.stats
            counts["prompt_tokens_computed"] += stats.num_computed_tokens
            counts["prefix_queried_tokens"] = stats.num_prompt_tokens
            counts["prefix_hit_tokens"] = stats.num_cached_tokens
        if self.decode is not None:
            decoded = self.decode.engine.stats
            counts["prompt_tokens_computed"] += decoded.num_recomputed_tokens
            counts["generation_tokens"] = decoded.num_generated_tokens
        return counts

    def _scaling(self) -> Iterator[Metric]:
        with self.state_lock:
            if self.prefill is not None:
                batcher = self.prefill.batcher
                queued = sum(r.remaining for r in batcher.queue) + sum(r.remaining for r in batcher.prefilling)
                yield GaugeMetricFamily("pdserve_prefill_queued_prompt_tokens",
                                        "prompt tokens accepted and not yet computed (queued or being prefilled)",
                                        queued)
            if self.decode is not None:
                yield GaugeMetricFamily("pdserve_decode_kv_usage", "share of KV blocks held by requests",
                                        self.decode.scheduler.pool.usage)

    def _vllm(self) -> Iterator[Metric]:
        """vLLM's names where ours mean the same, so that vLLM's dashboards read a pdserve deployment."""
        with self.state_lock:
            usage = self.pool.usage
        preemptions = self.decode.scheduler.num_preemptions if self.decode is not None else 0
        values: dict[str, float] = {**self.console_counts(), "kv_usage": usage, "preemptions": preemptions}
        for name, kind, text, key in _VLLM_FAMILIES:
            family = kind(name, text, labels=["model_name"])
            family.add_metric([self.model_name], values[key])
            yield family


_VLLM_FAMILIES: list[tuple[str, type[GaugeMetricFamily | CounterMetricFamily], str, str]] = [
    ("vllm:num_requests_running", GaugeMetricFamily,
     "requests in a running batch (being prefilled on P, decoding on D)", "requests_running"),
    ("vllm:num_requests_waiting", GaugeMetricFamily,
     "requests waiting: P's queue; D's queue, preempted ones and reservations waiting for their KV",
     "requests_waiting"),
    ("vllm:kv_cache_usage_perc", GaugeMetricFamily,
     "fraction of KV blocks held by requests (0-1; cached blocks nobody holds count as free)", "kv_usage"),
    ("vllm:prefix_cache_queries", CounterMetricFamily, "prompt tokens looked up in the prefix cache",
     "prefix_queried_tokens"),
    ("vllm:prefix_cache_hits", CounterMetricFamily,
     "prompt tokens found in the prefix cache (device, host RAM or Redis)", "prefix_hit_tokens"),
    ("vllm:num_preemptions", CounterMetricFamily, "requests preempted on D", "preemptions"),
]
