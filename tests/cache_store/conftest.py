"""Small KV pools with known contents, tiered caches that are closed and leak-checked after each test,
and the session redis-server flushed before each test that uses it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
import torch

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from tests.cache_store.kv_helpers import BS, DIM, FP, HEADS, LAYERS, NUM_BLOCKS, SECRET, Worker


@pytest.fixture
def make_worker() -> Iterator[Callable[..., Worker]]:
    """Builds workers; after the test each is closed and checked: no block referenced, host slots consistent."""
    workers: list[Worker] = []

    def make(config: TierConfig | None = None, policy: CachePolicy | None = None, num_blocks: int = NUM_BLOCKS,
             dtype: torch.dtype = torch.float32, fingerprint: str = FP, device: str = "cpu",
             secret: str | None = SECRET) -> Worker:
        pool = BlockPool(num_blocks)
        prefix_cache = PrefixCache(pool, BS)
        kv_caches = [torch.zeros((2, num_blocks, BS, HEADS, DIM), dtype=dtype, device=device) for _ in range(LAYERS)]
        cache = TieredKVCache(prefix_cache, kv_caches, fingerprint, config or TierConfig(), policy or CachePolicy(),
                              secret=secret)
        workers.append(Worker(pool, prefix_cache, kv_caches, cache))
        return workers[-1]

    yield make
    for worker in workers:
        worker.cache.close()
        assert_no_leak(worker.pool)
        worker.cache.host.check_consistent()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session redis-server, emptied for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
