"""Multi-turn reuse through a decode worker's commit, tenant salts, and run-time policy updates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import torch

from pdserve.cache_store.block_pool import blocks_needed
from pdserve.cache_store.policy import CachePolicy, TierConfig
from tests.cache_store.kv_helpers import BS, PROMPT, Worker, drop_device, host_gb, prefill


def decode(worker: Worker, prompt: list[int], generated: list[int], salt: str | None) -> torch.Tensor:
    """What a decode node does at the end of a sequence: its blocks hold the KV of every token but the last
    sampled one; commit them, then free. Returns the KV of the committed full blocks."""
    num_kv_tokens = len(prompt) + len(generated) - 1
    blocks = worker.pool.allocate(blocks_needed(num_kv_tokens + 1, BS))
    worker.write(blocks.block_ids, seed=7)
    committed = worker.cache.commit_sequence(prompt + generated, num_kv_tokens, blocks.block_ids, salt)
    kv = worker.read(blocks.block_ids[:committed])
    worker.pool.free(blocks.block_ids)
    return kv


def test_next_turn_reuses_the_whole_history_through_redis(make_worker: Callable[..., Worker], redis_url: str,
                                                           redis_client: redis.Redis) -> None:
    config = TierConfig(redis_url=redis_url)
    decoder, prefiller = make_worker(config), make_worker(config)
    generated = list(range(500, 514))  # 25 + 14 tokens, 38 with KV: 9 full blocks
    history = decode(decoder, PROMPT, generated, salt="chat-1")
    assert decoder.cache.flush() and decoder.cache.stats.redis_written_blocks == 9
    follow_up = PROMPT + generated + [7, 8, 9, 10, 11]
    cached, kv = prefill(prefiller, follow_up, salt="chat-1")
    assert cached == 9 * BS and torch.equal(kv[:9], history)
    again = decoder.pool.allocate(10)
    decoder.cache.commit_sequence(PROMPT + generated, 38, again.block_ids, "chat-1")
    decoder.pool.free(again.block_ids)
    assert decoder.cache.flush() and decoder.cache.stats.redis_written_blocks == 9, "present blocks are skipped"


def test_commit_sequence_honours_write_none(make_worker: Callable[..., Worker], redis_url: str) -> None:
    decoder = make_worker(TierConfig(host_capacity_gb=host_gb(8), redis_url=redis_url), CachePolicy(write="none"))
    decode(decoder, PROMPT, [1, 2, 3], salt=None)
    assert decoder.cache.flush() and decoder.cache.stats.redis_written_blocks == 0
    assert decoder.cache.host.num_used == 0 and decoder.pool.num_cached == 6


def test_commit_sequence_needs_enough_blocks(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker()
    blocks = worker.pool.allocate(2)
    with pytest.raises(ValueError, match="12 tokens fill 3 blocks; the sequence holds 2"):
        worker.cache.commit_sequence(list(range(20)), 12, blocks.block_ids, None)
    worker.pool.free(blocks.block_ids)


def test_different_salts_share_no_blocks_in_any_tier(make_worker: Callable[..., Worker], redis_url: str,
                                                     redis_client: redis.Redis) -> None:
    config = TierConfig(host_capacity_gb=host_gb(16), redis_url=redis_url)
    worker = make_worker(config)
    prefill(worker, PROMPT, salt="tenant-a")
    assert worker.cache.flush()
    cached, _ = prefill(worker, PROMPT, salt="tenant-b")
    assert cached == 0, "same tokens, other tenant: no device, host or Redis hit"
    stats = worker.cache.stats
    assert stats.device_hit_blocks == stats.host_hit_blocks == stats.redis_hit_blocks == 0
    assert worker.cache.flush()
    keys = {k.decode() for k in redis_client.keys("pdserve:*")}
    redis = worker.cache.redis
    hashes = {salt: worker.cache.sequence_hashes(PROMPT, salt) for salt in ("tenant-a", "tenant-b")}
    assert keys == {redis.key(h, salt) for salt, chain in hashes.items() for h in chain}  # 6 + 6, none shared
    assert len(keys) == 12 and not any("tenant" in k for k in keys)  # names hash the salt
    other = make_worker(config)
    assert prefill(other, PROMPT, salt="tenant-b")[0] == 24 and prefill(other, PROMPT)[0] == 0


def test_update_changes_policies_at_run_time(make_worker: Callable[..., Worker], redis_url: str) -> None:
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8), redis_url=redis_url), CachePolicy(write="none"))
    prefill(worker, PROMPT)
    assert worker.cache.flush() and worker.cache.host.num_used == 0
    new = worker.cache.policy.merged({"write": "write_through", "device_eviction": "lfu", "host_eviction": "lfu"})
    worker.cache.update(new)
    assert worker.cache.policy is new and worker.pool.eviction == "lfu" and worker.cache.host.eviction == "lfu"
    drop_device(worker)
    prefill(worker, PROMPT)  # computed again, now written through
    assert worker.cache.flush() and worker.cache.host.num_used == 6 and worker.cache.stats.redis_written_blocks == 6
    status = worker.cache.status()
    assert status["policy"]["write"] == "write_through" and status["host_blocks_used"] == 6
    assert status["stats"]["redis_written_blocks"] == 6 and status["redis_backing_off"] is False
    with pytest.raises(TypeError, match="expected a CachePolicy, got dict"):
        worker.cache.update({"write": "none"})  # type: ignore[arg-type]
