"""Reading a prompt's blocks from the tiers below the device: host RAM, then Redis, staged in host memory.

    TieredKVCache.fetch(hashes, salt)       any thread but the step thread
      start = the device prefix's length    (peeked by the cache under the pool lock)
      TierReader.read(hashes, start, ...)
        host RAM  the resident blocks that continue the device prefix (one copy out, pinned on CUDA)
        Redis     the blocks after those, on the "kv-redis-io" threads, until the first miss or the deadline;
                  batches still in flight then are given up (misses; Redis is marked failed for a while)
      ─▶ FetchedPrefix(start, hashes found, staged chunks): holds no pool block, so dropping it leaks nothing

The reader counts what it queried and found (`TieredCacheStats`); what goes on to Redis (admission by hits)
or up to the host tier (Redis hits) is the cache's decision (cache_store/tiered.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.cache_store.host_tier import HostTier
from pdserve.cache_store.policy import TierConfig
from pdserve.cache_store.tier_stats import TieredCacheStats

if TYPE_CHECKING:  # redis-py loads only where a Redis tier is configured (tiered.py `_connect`)
    from pdserve.cache_store.redis_tier import RedisTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedPrefix:
    """Blocks found in host RAM and Redis, staged in host memory; they continue the device prefix.

    hashes[i] names block start_block + i of the prompt; the first `num_host_blocks` came from the host
    tier, the rest from Redis. Holds no pool blocks: dropping it unused leaks nothing.
    """

    start_block: int
    hashes: tuple[bytes, ...]
    chunks: tuple[torch.Tensor, ...]  # concatenated: [len(hashes), layers, 2, block_size, Hkv, D]
    num_host_blocks: int
    salt: str | None
    seconds: float

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def pieces(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Blocks lo..hi (indices into `hashes`) as views of the staged chunks, in order (no copy)."""
        parts, offset = [], 0
        for chunk in self.chunks:
            a, b = max(lo - offset, 0), min(hi - offset, chunk.shape[0])
            if a < b:
                parts.append(chunk[a:b])
            offset += chunk.shape[0]
        return parts

    def blocks(self, lo: int, hi: int) -> torch.Tensor:
        """Blocks lo..hi as one tensor (a copy when they span chunks)."""
        parts = self.pieces(lo, hi)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class TierReader:
    def __init__(self, host: HostTier, redis: RedisTier | None, config: TierConfig, stats: TieredCacheStats) -> None:
        self.host = host
        self.redis = redis  # None: no Redis tier
        self.config = config
        self.stats = stats
        self._io = ThreadPoolExecutor(config.redis_io_threads, thread_name_prefix="kv-redis-io")

    def read(self, hashes: Sequence[bytes], start: int, salt: str | None, started: float, deadline: float,
             redis_ttl_s: int | None) -> FetchedPrefix:
        """Up to `config.max_fetch_blocks` blocks of `hashes` from block `start` on: host RAM, then Redis, until
        the first miss. `started`, `deadline`: time.monotonic() values (the lookup's start, when Redis is given up)."""
        rest = list(hashes[start:start + self.config.max_fetch_blocks])
        host_blocks = self.host.read_prefix(rest, self.config.pin_host_memory) if rest else self.host.layout.empty(0)
        num_host = host_blocks.shape[0]
        redis_chunks = [blocks for _, blocks in self._read_redis(rest[num_host:], salt, deadline, redis_ttl_s)]
        num_redis = sum(blocks.shape[0] for blocks in redis_chunks)
        chunks = ([host_blocks] if num_host else []) + redis_chunks
        found = rest[:num_host + num_redis]
        fetched = FetchedPrefix(start, tuple(found), tuple(chunks), num_host, salt, time.monotonic() - started)
        self._count(len(rest), fetched)
        return fetched

    def _read_redis(self, hashes: list[bytes], salt: str | None, deadline: float,
                    redis_ttl_s: int | None) -> list[tuple[tuple[bytes, ...], torch.Tensor]]:
        if self.redis is None or not hashes:
            return []
        if self.redis.backing_off:  # skip the thread hop while Redis is known to be down
            self.stats.count(redis_skipped=1)
            return []
        from pdserve.cache_store.redis_tier import PrefixSink  # loaded with the tier itself

        sink = PrefixSink()
        try:
            future = self._io.submit(self.redis.fetch_prefix, hashes, salt, sink, deadline, redis_ttl_s)
        except RuntimeError:  # closed
            return []
        try:
            future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            self.redis.mark_failed(timed_out=True)
        except Exception as exc:  # a cache bug must cost a miss, not the request
            logger.exception("Redis lookup of %d blocks failed", len(hashes))
            self.redis.mark_failed(error=exc)
        return sink.close()

    def _count(self, num_queried: int, fetched: FetchedPrefix) -> None:
        num_host, num_redis = fetched.num_host_blocks, fetched.num_blocks - fetched.num_host_blocks
        redis_queried = num_queried - num_host if self.redis is not None else 0
        self.stats.count(lookups=1, host_queried_blocks=num_queried if self.host.num_slots else 0,
                         host_hit_blocks=num_host, redis_queried_blocks=redis_queried, redis_hit_blocks=num_redis)
        self.stats.observe_load(fetched.seconds)

    def close(self) -> None:
        """Redis lookups queued or running are given up (their callers see misses)."""
        self._io.shutdown(wait=False, cancel_futures=True)
