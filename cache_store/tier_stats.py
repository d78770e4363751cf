"""Counters of the tiered KV cache, held by the cache and exported as Prometheus metrics by the nodes.

Every field only grows (Prometheus counters), except the histogram buckets, which are cumulative counts
of lookups that took at most `LOAD_BUCKETS_S[i]` seconds. Incremented from the step thread, lookup threads
and the writer thread, so every change goes through `count` (one lock).

Per tier, a lookup walks the chain of a prompt's block hashes and stops at the first miss:

    hashes   h0 h1 h2 h3 h4 h5 h6 h7
    device   ✓  ✓  ✗                    device: queried 8, hit 2
    host           ✓  ✓  ✗              host:   queried 6, hit 2
    redis                ✓  ✗           redis:  queried 4, hit 1    → 5 blocks reused, 3 computed
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

LOAD_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIERS: tuple[str, ...] = ("device", "host", "redis")


@dataclass
class TieredCacheStats:
    lookups: int = 0
    device_queried_blocks: int = 0
    device_hit_blocks: int = 0
    host_queried_blocks: int = 0
    host_hit_blocks: int = 0
    redis_queried_blocks: int = 0
    redis_hit_blocks: int = 0
    device_reused_tokens: int = 0  # tokens not computed because their KV came from this tier
    host_reused_tokens: int = 0
    redis_reused_tokens: int = 0
    fetched_unused_blocks: int = 0  # fetched from host/Redis, then already on the device (or a gap) at allocate
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    redis_read_bytes: int = 0
    redis_written_bytes: int = 0
    redis_written_blocks: int = 0
    host_written_blocks: int = 0
    redis_errors: int = 0  # failed or timed-out Redis calls (connection refused, socket timeout, deadline)
    redis_timeouts: int = 0  # the subset that hit a lookup's deadline
    redis_skipped: int = 0  # calls not tried while Redis was backing off after an error
    redis_corrupt_values: int = 0  # detected, treated as misses and deleted
    redis_auth_failures: int = 0  # values whose seal (HMAC) failed: forged, or moved; misses, deleted
    writes_dropped_blocks: int = 0  # write-through/back copies dropped: the writer queue was full
    load_seconds_sum: float = 0.0
    load_seconds_count: int = 0
    load_seconds_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS_S))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, **increments: float) -> None:
        with self._lock:
            for name, amount in increments.items():
                setattr(self, name, getattr(self, name) + amount)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self.load_seconds_sum += seconds
            self.load_seconds_count += 1
            for i, bound in enumerate(LOAD_BUCKETS_S):
                if seconds <= bound:
                    self.load_seconds_buckets[i] += 1

    def hit_rate(self, tier: str) -> float:
        """Blocks found in `tier` / blocks asked of it (each tier is asked what the tiers above missed)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")
        queried = getattr(self, f"{tier}_queried_blocks")
        return getattr(self, f"{tier}_hit_blocks") / queried if queried else 0.0

    @property
    def reused_tokens(self) -> int:
        return self.device_reused_tokens + self.host_reused_tokens + self.redis_reused_tokens

    def snapshot(self) -> dict[str, float | int | list[int]]:
        """A consistent copy of every counter (plus hit rates), for /metrics and /internal/status."""
        with self._lock:
            values: dict[str, float | int | list[int]] = {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }
            values["load_seconds_buckets"] = list(self.load_seconds_buckets)
        for tier in TIERS:
            values[f"{tier}_hit_rate"] = self.hit_rate(tier)
        return values
