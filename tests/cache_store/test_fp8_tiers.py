"""fp8 (float8_e4m3fn) KV blocks in the host RAM and Redis tiers: stored and loaded as their bytes, and keyed by
the KV compatibility key (engine/kv_cache_spec.py), so a worker with an fp8 pool never loads another dtype's
blocks, nor one with other fp8 scales. Every test ends leak-checked (the make_worker fixture)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.cache_store.policy import TierConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from tests.cache_store.kv_helpers import FP, LAYERS, PROMPT, Worker, drop_device, host_gb, prefill

FP8 = torch.float8_e4m3fn
FP8_KEY = KVCacheSpec.build("fp8", torch.float32, LAYERS).fingerprint(FP)


def test_fp8_blocks_round_trip_through_the_host_tier(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8)), dtype=FP8, fingerprint=FP8_KEY)
    assert worker.cache.layout.nbytes * 4 == make_worker(dtype=torch.float32).cache.layout.nbytes  # 1 byte a value
    cached, first = prefill(worker, PROMPT)
    assert cached == 0 and worker.cache.flush() and worker.cache.host.num_used == 6
    drop_device(worker)
    worker.kv_caches[0].view(torch.uint8).fill_(0)
    cached, second = prefill(worker, PROMPT, seed=99)
    assert cached == 24 and second.dtype == FP8
    assert torch.equal(second.view(torch.uint8), first.view(torch.uint8))


def test_fp8_blocks_round_trip_through_redis_to_another_worker(make_worker: Callable[..., Worker],
                                                               redis_url: str) -> None:
    config = TierConfig(redis_url=redis_url, redis_batch_blocks=4)
    writer, reader = (make_worker(config, dtype=FP8, fingerprint=FP8_KEY) for _ in range(2))
    _, stored = prefill(writer, PROMPT)
    assert writer.cache.flush() and writer.cache.stats.redis_written_blocks == 6
    cached, loaded = prefill(reader, PROMPT, seed=5)
    assert cached == 24 and torch.equal(loaded.view(torch.uint8), stored.view(torch.uint8))
    assert reader.cache.stats.redis_hit_blocks == 6


def test_fp8_and_fp32_blocks_never_mix_in_redis(make_worker: Callable[..., Worker], redis_url: str) -> None:
    """Same tokens, same model: the fp32 worker's blocks are misses for the fp8 one, and the blocks of an fp8
    worker with other scales too; each computes its own."""
    config = TierConfig(redis_url=redis_url, redis_batch_blocks=4)
    fp32 = make_worker(config, dtype=torch.float32, fingerprint=FP)
    prefill(fp32, PROMPT)
    assert fp32.cache.flush() and fp32.cache.stats.redis_written_blocks == 6
    fp8 = make_worker(config, dtype=FP8, fingerprint=FP8_KEY)
    cached, _ = prefill(fp8, PROMPT)
    assert cached == 0 and fp8.cache.stats.redis_hit_blocks == 0
    assert fp8.cache.flush()
    scaled = KVCacheSpec.build("fp8", torch.float32, LAYERS, ([0.5] * LAYERS, [1.0] * LAYERS)).fingerprint(FP)
    assert scaled not in (FP8_KEY, FP)
    other = make_worker(config, dtype=FP8, fingerprint=scaled)
    cached, _ = prefill(other, PROMPT)
    assert cached == 0 and other.cache.stats.redis_hit_blocks == 0
