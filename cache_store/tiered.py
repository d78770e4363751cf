"""The tiered KV cache: device blocks (the pool's prefix cache) → host RAM → Redis, for one worker.

A prompt's life with it on a prefill worker (`hashes` = its full blocks' chained hashes, salt included):

    event loop / any thread          fetched = await cache.fetch_async(lookup, salt)
      device peek, then host copy, then Redis (I/O thread, per-request deadline): blocks staged in host RAM
      (the reading: cache_store/tier_reader.py); then hits counted for admission, Redis hits promoted to host
    step thread (pool lock)          seq = cache.allocate(lookup, num_blocks, fetched)
      device hits acquired, new blocks allocated; the fetched blocks that continue the device prefix are
      copied into the first new blocks and named, so seq.num_cached_tokens covers device + host + Redis
    ... compute tokens seq.num_cached_tokens .. n ...
    step thread (pool lock)          cache.commit(hashes, seq.block_ids, seq.num_cached_blocks, salt)
      names the full blocks; write_through copies the newly computed ones to host and Redis (writer thread)
    pool.free(seq.block_ids)

    hashes:   h0  h1  h2  h3  h4  h5  h6 | h7 (last full block: not looked up, >= 1 token is computed)
    device    ✓   ✓   ✗
    host              ✓   ✓   ✗                   fetched.start_block = 2, fetched.hashes = h2 h3 h4
    redis                     ✓   ✗               allocate: blocks 0-1 shared, 2-4 loaded, 5-7 computed

A decode worker commits a finished sequence (prompt + generated tokens) with `commit_sequence` before
freeing its blocks, so the next turn of the conversation finds the whole history (on any prefill worker,
through Redis). `update(policy)` changes eviction, write and admission policies and the timeouts at run time.

Threads: `fetch` runs anywhere except the step thread (it waits for Redis up to the deadline);
`allocate`, `commit`, `commit_sequence` run on the step thread and take `lock` (pass the worker's pool
lock). Redis I/O never runs on the step thread (lookups: the reader's I/O threads, cache_store/tier_reader.py);
copies to host and Redis go through the writer thread (cache_store/tier_writer.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.cache_store.admission import HitCounter
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.host_tier import HostTier
from pdserve.cache_store.kv_codec import BlockLayout, gather_to_host, scatter_from_host
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache, SequenceBlocks
from pdserve.cache_store.summary import RecentHashes
from pdserve.cache_store.tier_reader import FetchedPrefix, TierReader
from pdserve.cache_store.tier_stats import TieredCacheStats
from pdserve.cache_store.tier_writer import RedisTarget, TierWriter, WriteJob
from pdserve.protocol.prefix_summary import DEFAULT_SUMMARY_BLOCKS

if TYPE_CHECKING:  # redis-py (~0.25 s of a worker's start) loads only where a Redis tier is configured
    from pdserve.cache_store.redis_tier import RedisTier


class TieredKVCache:
    def __init__(self, prefix_cache: PrefixCache, kv_caches: list[torch.Tensor], model_fingerprint: str,
                 config: TierConfig, policy: CachePolicy, lock: threading.RLock | None = None,
                 secret: str | None = None) -> None:
        """`secret`: the deployment's shared secret, which names and seals Redis values (cache_store/redis_auth.py)."""
        self.prefix_cache = prefix_cache
        self.pool = prefix_cache.pool
        self.kv_caches = kv_caches
        self.config = config
        self.layout = BlockLayout.of_pool(kv_caches, model_fingerprint)
        if self.layout.block_size != prefix_cache.block_size:
            raise ValueError(f"KV pool blocks hold {self.layout.block_size} tokens, the prefix cache "
                             f"{prefix_cache.block_size}")
        self.lock = lock or threading.RLock()
        self.stats = TieredCacheStats()
        self._policy = policy
        self.host = HostTier(self.layout, config.host_capacity_bytes, policy.host_eviction, config.pin_host_memory)
        self.redis = self._connect(config, secret)
        self._reader = TierReader(self.host, self.redis, config, self.stats)
        self._writer = TierWriter(self._process, self.stats, config.max_pending_write_bytes)
        self._hits = HitCounter(4 * (self.pool.num_total + self.host.num_slots) + 1024)
        self._salts: OrderedDict[bytes, str | None] = OrderedDict()  # device blocks' salts, for write-back keys
        self.recent = RecentHashes()  # committed or hit lately: the router's cache-aware summary (held_hashes)
        with self.lock:
            self.pool.set_eviction(policy.device_eviction)
            self.pool.on_evict = self._on_device_evict

    def _connect(self, config: TierConfig, secret: str | None) -> RedisTier | None:
        if config.redis_url is None:
            return None
        from pdserve.cache_store.redis_tier import RedisTier, connect_redis, redacted_url

        client = connect_redis(config.redis_url, config.redis_socket_timeout_s, 4 * config.redis_io_threads)
        tier = RedisTier(client, self.layout, self.stats, secret, config.redis_retry_interval_s,
                         config.redis_batch_blocks, config.pin_host_memory, name=f"Redis {redacted_url(config.redis_url)}")
        tier.probe()  # the console says at start whether the tier works (a refused connection answers at once)
        return tier

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def has_lower_tiers(self) -> bool:
        return self.host.num_slots > 0 or self.redis is not None

    def update(self, policy: CachePolicy) -> None:
        """Apply a new policy now: eviction orders are converted in place, the rest applies to later calls."""
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"expected a CachePolicy, got {type(policy).__name__}")
        with self.lock:
            self.pool.set_eviction(policy.device_eviction)
        self.host.set_eviction(policy.host_eviction)
        self._policy = policy

    def sequence_hashes(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, self.layout.model_fingerprint, salt)

    # ---- lookup: any thread but the step thread ------------------------------------------------------

    def fetch(self, hashes: Sequence[bytes], salt: str | None, timeout_s: float | None = None) -> FetchedPrefix:
        """The blocks after the device prefix of `hashes` found in host RAM, then Redis, until the first miss.

        Returns within `timeout_s` (default: the policy's lookup timeout) plus the host copy: Redis batches
        still in flight then are given up (misses). Redis hits are promoted to the host tier.
        """
        started = time.monotonic()
        deadline = started + (timeout_s if timeout_s is not None else self._policy.lookup_timeout_s)
        with self.lock:
            start = self.prefix_cache.peek(hashes).num_blocks
        fetched = self._reader.read(hashes, start, salt, started, deadline, self._policy.redis_ttl_s)
        self._promote(fetched)
        return fetched

    async def fetch_async(self, hashes: Sequence[bytes], salt: str | None,
                          timeout_s: float | None = None) -> FetchedPrefix:
        return await asyncio.to_thread(self.fetch, hashes, salt, timeout_s)

    def _promote(self, fetched: FetchedPrefix) -> None:
        """Admission by hits (host hits that crossed it go on to Redis), and Redis hits up to the host tier."""
        num_host, num_redis = fetched.num_host_blocks, fetched.num_blocks - fetched.num_host_blocks
        crossed = set(self._hits.hit(fetched.hashes, self._policy.redis_admission_hits))
        host_crossed = [i for i in range(num_host) if fetched.hashes[i] in crossed]
        if host_crossed and self._policy.write == "write_through" and self.redis is not None:
            blocks = torch.stack([fetched.blocks(i, i + 1)[0] for i in host_crossed])
            self._submit([fetched.hashes[i] for i in host_crossed], [fetched.salt] * len(host_crossed), blocks,
                         to_host=False, redis="all", only_missing=True)
        if num_redis and self.host.num_slots:
            self._submit(fetched.hashes[num_host:], [fetched.salt] * num_redis,
                         fetched.blocks(num_host, fetched.num_blocks), to_host=True, redis="none")

    # ---- step thread ---------------------------------------------------------------------------------

    def can_allocate(self, hashes: Sequence[bytes], num_blocks: int) -> bool:
        with self.lock:
            return self.prefix_cache.can_allocate(hashes, num_blocks)

    def allocate(self, hashes: Sequence[bytes], num_blocks: int, fetched: FetchedPrefix | None = None) -> SequenceBlocks:
        """Device hits + new blocks (all or nothing, as PrefixCache.allocate), with `fetched` blocks loaded.

        Only the first `num_blocks` hashes are used. The fetched blocks that continue the device prefix as it
        is now are copied into the first new blocks and named; the rest of `fetched` is dropped (counted).
        """
        with self.lock:
            hashes = list(hashes[:num_blocks])
            seq = self.prefix_cache.allocate(hashes, num_blocks)
            on_device = seq.num_cached_blocks
            try:
                loaded = self._load(seq, hashes, fetched) if fetched is not None else 0
            except BaseException:
                self.pool.free(seq.block_ids)  # all or nothing, as PrefixCache.allocate
                raise
            self.stats.count(device_queried_blocks=len(hashes), device_hit_blocks=on_device,
                             device_reused_tokens=on_device * self.block_size)
            self._admit_device_hits(hashes[:on_device], seq.block_ids[:on_device])
            self.recent.touch(hashes[:on_device + loaded])
        cached = on_device + loaded
        return SequenceBlocks(seq.block_ids, cached, cached * self.block_size)

    def _load(self, seq: SequenceBlocks, hashes: list[bytes], fetched: FetchedPrefix) -> int:
        on_device = seq.num_cached_blocks
        lo = on_device - fetched.start_block
        count = min(fetched.num_blocks - lo, len(hashes) - on_device) if lo >= 0 else 0
        if count <= 0 or fetched.hashes[lo] != hashes[on_device]:
            self.stats.count(fetched_unused_blocks=fetched.num_blocks)
            return 0
        targets = list(seq.block_ids[on_device:on_device + count])
        done = 0
        for piece in fetched.pieces(lo, lo + count):  # pinned chunks go straight to the device, uncopied
            scatter_from_host(self.kv_caches, targets[done:done + piece.shape[0]], piece)
            done += piece.shape[0]
        self.prefix_cache.commit(hashes[on_device:on_device + count], targets)
        self._remember_salts(hashes[on_device:on_device + count], fetched.salt)
        from_host = max(min(fetched.num_host_blocks - lo, count), 0)
        self.stats.count(host_to_device_bytes=count * self.layout.nbytes,
                         host_reused_tokens=from_host * self.block_size,
                         redis_reused_tokens=(count - from_host) * self.block_size,
                         fetched_unused_blocks=fetched.num_blocks - count)
        return count

    def _admit_device_hits(self, hashes: list[bytes], block_ids: Sequence[int]) -> None:
        crossed = set(self._hits.hit(hashes, self._policy.redis_admission_hits))
        if not crossed or self._policy.write != "write_through" or self.redis is None:
            return
        picked = [(h, b) for h, b in zip(hashes, block_ids) if h in crossed]
        self._copy_down([h for h, _ in picked], [b for _, b in picked], to_host=False, redis="all", only_missing=True)

    def commit(self, hashes: Sequence[bytes], block_ids: Sequence[int], num_cached_blocks: int,
               salt: str | None) -> int:
        """Name a prompt's full blocks (device tier); with write_through, copy the computed ones down.

        Blocks before `num_cached_blocks` came from a tier and are not written again. Returns how many
        blocks were newly named on the device.
        """
        with self.lock:
            newly = self.prefix_cache.commit(hashes, block_ids)
            self._remember_salts(hashes, salt)
            self.recent.touch(hashes)
            computed = slice(num_cached_blocks, min(len(hashes), len(block_ids)))
            if self._policy.write == "write_through" and hashes[computed]:
                self._copy_down(list(hashes[computed]), list(block_ids[computed]), to_host=True, redis="admitted")
        return newly

    def commit_sequence(self, token_ids: Sequence[int], num_kv_tokens: int, block_ids: Sequence[int],
                        salt: str | None) -> int:
        """A decode worker's finished sequence: name its full blocks and send them to host and Redis now.

        `num_kv_tokens` tokens have KV in `block_ids` (the last sampled token has none). Unless the write
        policy is `none`, the blocks go down at once, admission aside: a finished sequence's blocks are what
        the conversation's next turn needs, from any prefill worker. Blocks Redis has already (the prompt's,
        written by the prefill worker) are skipped. Returns the number of full blocks committed.
        """
        hashes = self.sequence_hashes(token_ids[:num_kv_tokens], salt)
        if len(hashes) > len(block_ids):
            raise ValueError(f"{num_kv_tokens} tokens fill {len(hashes)} blocks; the sequence holds {len(block_ids)}")
        with self.lock:
            self.prefix_cache.commit(hashes, block_ids)
            self._remember_salts(hashes, salt)
            self.recent.touch(hashes)
            if self._policy.write != "none" and hashes:
                self._copy_down(hashes, list(block_ids[:len(hashes)]), to_host=True, redis="all", only_missing=True)
        return len(hashes)

    def _on_device_evict(self, victims: list[tuple[int, bytes]]) -> None:
        """Pool hook (inside allocate, pool lock held): write-back copies evicted blocks before reuse."""
        known = [(b, h) for b, h in victims if h in self._salts]  # unknown salt: committed around this cache
        salts = [self._salts.pop(h) for _, h in known]
        if known and self._policy.write == "write_back":
            self._copy_down([h for _, h in known], [b for b, _ in known], to_host=True, redis="none", salts=salts)

    def _copy_down(self, hashes: list[bytes], block_ids: list[int], to_host: bool, redis: RedisTarget,
                   only_missing: bool = False, salts: list[str | None] | None = None) -> None:
        """Copy pool blocks to host staging (queued on the stream) and hand them to the writer thread."""
        spills_to_redis = to_host and self._policy.write == "write_back"
        useful_for_redis = self.redis is not None and (redis != "none" or spills_to_redis)
        if not (to_host and self.host.num_slots) and not useful_for_redis:
            return
        staging = self.layout.empty(len(hashes), pin_memory=self.config.pin_host_memory)
        ready = gather_to_host(self.kv_caches, block_ids, staging)
        self.stats.count(device_to_host_bytes=staging.numel() * staging.element_size())
        if salts is None:
            salts = [self._salts.get(h) for h in hashes]
        self._submit(hashes, salts, staging, to_host, redis, only_missing, ready)

    def _submit(self, hashes: Sequence[bytes], salts: Sequence[str | None], blocks: torch.Tensor, to_host: bool,
                redis: RedisTarget, only_missing: bool = False, ready: torch.cuda.Event | None = None) -> None:
        self._writer.submit(WriteJob(tuple(hashes), tuple(salts), blocks, to_host, redis, only_missing, ready))

    def _remember_salts(self, hashes: Sequence[bytes], salt: str | None) -> None:
        for block_hash in hashes:
            self._salts[block_hash] = salt
            self._salts.move_to_end(block_hash)
        while len(self._salts) > 2 * self.pool.num_total:
            self._salts.popitem(last=False)

    # ---- writer thread -------------------------------------------------------------------------------

    def _process(self, job: WriteJob) -> None:
        policy = self._policy
        spilled_hashes, spilled_salts, spilled = job.hashes, job.salts, job.blocks
        if job.to_host and self.host.num_slots:
            out = self.host.put(job.hashes, job.salts, job.blocks)
            self.stats.count(host_written_blocks=len(job.hashes))
            spilled_hashes, spilled_salts, spilled = out.hashes, out.salts, out.blocks
        if self.redis is None:
            return
        if job.redis != "none":
            keep = [i for i, h in enumerate(job.hashes)
                    if job.redis == "all" or self._hits.admitted(h, policy.redis_admission_hits)]
            self._store(job.hashes, job.salts, job.blocks, keep, job.only_missing)
        elif policy.write == "write_back" and job.to_host:
            keep = [i for i, h in enumerate(spilled_hashes) if self._hits.admitted(h, policy.redis_admission_hits)]
            self._store(spilled_hashes, spilled_salts, spilled, keep, only_missing=True)

    def _store(self, hashes: Sequence[bytes], salts: Sequence[str | None], blocks: torch.Tensor, keep: list[int],
               only_missing: bool) -> None:
        if keep and self.redis is not None:
            self.redis.store([hashes[i] for i in keep], [salts[i] for i in keep], blocks[keep],
                             self._policy.redis_ttl_s, only_missing)

    # ---- control ---------------------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """Policy, tier occupancy and counters, JSON-ready (for /internal/status and the admin API)."""
        return {"policy": self._policy.to_dict(), "host_blocks_used": self.host.num_used,
                "host_blocks_total": self.host.num_slots, "redis": self.redis is not None,
                "redis_backing_off": self.redis is not None and self.redis.backing_off,
                "redis_namespace": self.redis.auth.namespace if self.redis is not None else None,
                "stats": self.stats.snapshot()}

    def held_hashes(self, limit: int = DEFAULT_SUMMARY_BLOCKS) -> list[bytes]:
        """Up to `limit` hashes this worker serves without Redis (device or host), most recently used first."""
        with self.lock:
            recent = self.recent.newest()
            held = [h for h in recent if self.pool.lookup(h) is not None or h in self.host]
        return held[:limit]

    def drop_cached(self, device: bool = True, host: bool = True) -> dict[str, int]:
        """Forget the device's evictable cached blocks and/or the host tier (Redis is shared: never here)."""
        dropped = {"device_blocks": 0, "host_blocks": 0}
        if device:
            with self.lock:
                dropped["device_blocks"] = self.pool.evict_all_cached()
        if host:
            dropped["host_blocks"] = self.host.num_used
            self.host.clear()
        return dropped

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued host/Redis writes (tests, shutdown); False on timeout."""
        return self._writer.flush(timeout_s)

    def close(self) -> None:
        with self.lock:
            self.pool.on_evict = None
        self._writer.close()
        self._reader.close()
        if self.redis is not None:
            self.redis.close()
