"""The tiered cache end to end on real pools: lookups that fill a BlockPool from host RAM and Redis, write and
admission policies, multi-turn commits, salts, run-time policy updates. Every test ends leak-checked."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import torch

from pdserve.cache_store.policy import CachePolicy, TierConfig
from tests.cache_store.kv_helpers import PROMPT, Worker, drop_device, host_gb, prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_hits_fill_the_pool_with_the_stored_kv(make_worker: Callable[..., Worker], dtype: torch.dtype) -> None:
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8) * 2), dtype=dtype)  # bf16/fp16 blocks are smaller
    cached, first = prefill(worker, PROMPT)
    assert cached == 0 and worker.cache.flush()
    assert worker.cache.host.num_used == 6
    drop_device(worker)
    worker.kv_caches[0].fill_(0)
    cached, second = prefill(worker, PROMPT, seed=99)
    assert cached == 24, "6 blocks from the host tier; the last token is always computed"
    assert torch.equal(second.view(torch.uint8), first.view(torch.uint8))
    stats = worker.cache.stats
    assert stats.host_hit_blocks == 6 and stats.host_reused_tokens == 24 and stats.hit_rate("host") == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_redis_hits_on_another_worker_give_the_same_kv(make_worker: Callable[..., Worker], redis_url: str,
                                                       dtype: torch.dtype) -> None:
    config = TierConfig(redis_url=redis_url, redis_batch_blocks=4)
    writer, reader = make_worker(config, dtype=dtype), make_worker(config, dtype=dtype)
    _, stored = prefill(writer, PROMPT)
    assert writer.cache.flush() and writer.cache.stats.redis_written_blocks == 6
    cached, loaded = prefill(reader, PROMPT, seed=5)
    assert cached == 24 and torch.equal(loaded.view(torch.uint8), stored.view(torch.uint8))
    assert reader.cache.stats.redis_hit_blocks == 6 and reader.cache.stats.redis_reused_tokens == 24
    cached, _ = prefill(reader, PROMPT)
    assert cached == 24 and reader.cache.stats.device_hit_blocks == 6, "the loaded blocks are device hits now"


def test_lookup_walks_device_then_host_then_redis(make_worker: Callable[..., Worker], redis_url: str,
                                                  redis_client: redis.Redis) -> None:
    config = TierConfig(host_capacity_gb=host_gb(2), redis_url=redis_url)
    worker = make_worker(config)
    _, stored = prefill(worker, PROMPT)  # write_through: all 6 to Redis, the host keeps the last 2 (lru)
    assert worker.cache.flush()
    hashes = worker.cache.sequence_hashes(PROMPT, None)
    redis_client.delete(worker.cache.redis.key(hashes[5], None))
    drop_device(worker)
    seq = worker.cache.allocate(hashes[:2], 2)  # blocks 0-1 on the device again
    worker.write(seq.block_ids, seed=0)
    worker.cache.commit(hashes[:2], seq.block_ids, 0, None)
    worker.pool.free(seq.block_ids)
    assert worker.cache.flush()
    worker.cache.host.clear()
    worker.cache.host.put(hashes[2:4], [None] * 2, stored[2:4])
    fetched = worker.cache.fetch(hashes[:6], None)
    assert (fetched.start_block, fetched.num_host_blocks, fetched.num_blocks) == (2, 2, 3), "block 5 is missing"
    seq = worker.cache.allocate(hashes[:6], 7, fetched)
    assert seq.num_cached_blocks == 5
    assert torch.equal(worker.read(seq.block_ids[2:5]), stored[2:5])
    worker.pool.free(seq.block_ids)


def test_fetched_blocks_already_on_the_device_are_not_loaded(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8)))
    prefill(worker, PROMPT)
    worker.cache.flush()
    drop_device(worker)
    hashes = worker.cache.sequence_hashes(PROMPT, None)[:6]
    fetched = worker.cache.fetch(hashes, None)
    prefill(worker, PROMPT)  # another request loads them meanwhile
    seq = worker.cache.allocate(hashes, 7, fetched)
    assert seq.num_cached_blocks == 6 and worker.cache.stats.fetched_unused_blocks == 6
    worker.pool.free(seq.block_ids)


def test_write_through(make_worker: Callable[..., Worker], redis_url: str) -> None:
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8), redis_url=redis_url))
    prefill(worker, PROMPT)
    assert worker.cache.flush()
    assert worker.cache.host.num_used == 6 and worker.cache.stats.redis_written_blocks == 6


def test_write_back_moves_blocks_down_on_eviction_only(make_worker: Callable[..., Worker], redis_url: str) -> None:
    policy = CachePolicy(write="write_back")
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(4), redis_url=redis_url), policy, num_blocks=8)
    _, stored = prefill(worker, PROMPT)
    assert worker.cache.flush() and worker.cache.host.num_used == 0 and worker.cache.stats.redis_written_blocks == 0
    filler = worker.pool.allocate(8)  # evicts all 6 cached blocks: device → host (4 fit) → Redis (2 spill)
    worker.pool.free(filler.block_ids)
    assert worker.cache.flush()
    assert worker.cache.host.num_used == 4 and worker.cache.stats.redis_written_blocks == 2
    cached, loaded = prefill(worker, PROMPT)
    assert cached == 24 and torch.equal(loaded, stored)
    assert (worker.cache.stats.host_hit_blocks, worker.cache.stats.redis_hit_blocks) == (4, 2)
    assert worker.cache.flush()  # promoting 4-5 to the full host evicted 0-1 (lru) on to Redis
    assert worker.cache.stats.redis_written_blocks == 4
    other = make_worker(TierConfig(redis_url=redis_url), policy, num_blocks=8)
    cached, _ = prefill(other, PROMPT)
    assert cached == 8, "Redis holds blocks 0, 1, 4, 5: the chain misses at block 2"


def test_write_none_leaves_lower_tiers_alone(make_worker: Callable[..., Worker], redis_url: str) -> None:
    policy = CachePolicy(write="none")
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8), redis_url=redis_url), policy, num_blocks=8)
    prefill(worker, PROMPT)
    worker.pool.free(worker.pool.allocate(8).block_ids)
    assert worker.cache.flush()
    assert worker.cache.host.num_used == 0 and worker.cache.stats.redis_written_blocks == 0
    assert worker.cache.stats.device_to_host_bytes == 0


def test_redis_admission_after_n_hits(make_worker: Callable[..., Worker], redis_url: str) -> None:
    policy = CachePolicy(redis_admission_hits=2)
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8), redis_url=redis_url), policy)
    prefill(worker, PROMPT)
    assert worker.cache.flush() and worker.cache.host.num_used == 6 and worker.cache.stats.redis_written_blocks == 0
    prefill(worker, PROMPT)  # hit 1 (device)
    assert worker.cache.flush() and worker.cache.stats.redis_written_blocks == 0
    prefill(worker, PROMPT)  # hit 2: admitted, copied to Redis
    assert worker.cache.flush() and worker.cache.stats.redis_written_blocks == 6
    prefill(worker, PROMPT)
    assert worker.cache.flush() and worker.cache.stats.redis_written_blocks == 6, "admitted once"
