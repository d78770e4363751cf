"""A worker's tiered KV cache: flags and PDSERVE_* variables → settings, Prometheus families, heartbeat summaries,
the policy applier (worker/cache.py). Real caches over small pools; the served behaviour is in
tests/e2e/test_kv_cache.py."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.env_flags import apply_env_defaults
from pdserve.protocol.prefix_summary import decode_summary, summary_key
from pdserve.worker.cache import SummaryReporter, build_tiered, cache_policy_applier, tier_metrics
from pdserve.worker.flags import add_worker_arguments, worker_settings_from_args

BS = 4


@pytest.fixture
def tiered() -> Iterator[TieredKVCache]:
    pool = BlockPool(16)
    kv_caches = [torch.zeros((2, 16, BS, 1, 4))]
    cache = build_tiered(PrefixCache(pool, BS), kv_caches, "fp", TierConfig(host_capacity_gb=8 * 128 / (1 << 30)),
                         CachePolicy(), "cpu", threading.RLock(), secret="test-secret")
    yield cache
    cache.close()
    pool.evict_all_cached()
    assert_no_leak(pool)


def prefill(cache: TieredKVCache, tokens: list[int]) -> None:
    hashes = cache.sequence_hashes(tokens, None)
    seq = cache.allocate(hashes, len(hashes) + 1)
    cache.commit(hashes, seq.block_ids, seq.num_cached_blocks, None)
    cache.pool.free(seq.block_ids)


def test_cache_flags_come_from_the_environment_named_after_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="prefill")
    apply_env_defaults(parser, {"PDSERVE_REDIS_URL": "redis://redis:6379/0", "PDSERVE_HOST_CACHE_GB": "2",
                                "PDSERVE_CACHE_WRITE_POLICY": "write_back", "PDSERVE_CACHE_TIMEOUT": "0.25"})
    settings = worker_settings_from_args(parser.parse_args(["--device", "cpu", "--redis-ttl", "0"]), None, None)
    assert (settings.tiers.redis_url, settings.tiers.host_capacity_gb) == ("redis://redis:6379/0", 2.0)
    assert not settings.tiers.pin_host_memory  # pinned only for a pool on a GPU
    policy = settings.cache_policy
    assert (policy.write, policy.lookup_timeout_s, policy.redis_ttl_s) == ("write_back", 0.25, None)


def test_metrics_export_every_tier_and_the_load_histogram(tiered: TieredKVCache) -> None:
    prefill(tiered, list(range(9)))
    prefill(tiered, list(range(9)))  # 2 device hits
    registry = CollectorRegistry(auto_describe=False)
    registry.register(type("Collector", (), {"collect": lambda self: tier_metrics(tiered)})())
    text = generate_latest(registry).decode()
    assert 'pdserve_kv_cache_reused_tokens_total{tier="device"} 8.0' in text
    assert 'pdserve_kv_cache_hit_rate{tier="device"} 0.5' in text
    assert "pdserve_kv_cache_redis_errors_total 0.0" in text
    assert 'pdserve_kv_cache_load_seconds_bucket{le="+Inf"} 0.0' in text
    assert "pdserve_kv_cache_host_blocks_total 8.0" in text


def test_summary_is_sent_when_it_changed_and_again_after_registering(tiered: TieredKVCache) -> None:
    reporter = SummaryReporter(tiered)
    assert decode_summary(reporter.fields()["cached_blocks"]) == frozenset()
    assert reporter.fields() == {}
    prefill(tiered, list(range(9)))
    sent = reporter.fields()
    assert decode_summary(sent["cached_blocks"]) == {summary_key(h) for h in tiered.sequence_hashes(range(9), None)}
    assert sent["fingerprint"] == "fp" and reporter.fields() == {}
    reporter.resend()
    assert "cached_blocks" in reporter.fields() and "cached_blocks" in reporter.fields(force=True)


def test_policy_applier_applies_every_field(tiered: TieredKVCache) -> None:
    applied = cache_policy_applier(tiered)(CachePolicy(host_eviction="lfu", write="none"))
    assert applied == sorted(CachePolicy().to_dict())
    assert (tiered.policy.host_eviction, tiered.policy.write, tiered.host.eviction) == ("lfu", "none", "lfu")
