"""The KV cache tiers' run-time policy, as the router and the workers exchange it: the router's
`PUT /admin/cache-policy` validates a JSON object of these fields, keeps the result and forwards it to every
worker (`POST /internal/cache-policy`), whose `TieredKVCache.update(policy)` applies it.

cache_store/policy.py holds the rest of the cache settings (the fixed `TierConfig`, the flags and the policy
file) and describes what each field does. Torch-free, like all of protocol/: the router imports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

EVICTION_KINDS: tuple[str, ...] = ("lru", "lfu")  # cache_store/eviction.py's evictors
WritePolicy = Literal["write_through", "write_back", "none"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back", "none")
# upper bounds: past them a value is a mistake, and some break what takes them (a lookup thread's wait raised
# OverflowError for 1e300 s, accepted by PUT /admin/cache-policy; Redis refuses an expiry past ~9e15 s, and each
# GETEX then fails): an hour of lookup, ~68 years of TTL or admission hits
MAX_LOOKUP_TIMEOUT_S = 3600.0
MAX_COUNT = (1 << 31) - 1


@dataclass(frozen=True)
class CachePolicy:
    device_eviction: str = "lru"
    host_eviction: str = "lru"
    write: str = "write_through"
    redis_admission_hits: int = 0
    lookup_timeout_s: float = 0.5  # per request: host + Redis lookup gives up (misses) after this
    redis_ttl_s: int | None = 24 * 3600  # None: keys never expire (Redis's maxmemory-policy evicts)

    def __post_init__(self) -> None:
        for name in ("device_eviction", "host_eviction"):
            if getattr(self, name) not in EVICTION_KINDS:
                raise ValueError(f"{name} must be one of {EVICTION_KINDS}, got {getattr(self, name)!r}")
        if self.write not in WRITE_POLICIES:
            raise ValueError(f"write must be one of {WRITE_POLICIES}, got {self.write!r}")
        if not _integer(self.redis_admission_hits) or not 0 <= self.redis_admission_hits <= MAX_COUNT:
            raise ValueError(f"redis_admission_hits must be an integer in [0, {MAX_COUNT}], "
                             f"got {self.redis_admission_hits!r}")
        if not positive_number(self.lookup_timeout_s) or self.lookup_timeout_s > MAX_LOOKUP_TIMEOUT_S:
            raise ValueError(f"lookup_timeout_s must be a positive number <= {MAX_LOOKUP_TIMEOUT_S:g}, "
                             f"got {self.lookup_timeout_s!r}")
        if self.redis_ttl_s is not None and (not _integer(self.redis_ttl_s) or not 0 < self.redis_ttl_s <= MAX_COUNT):
            raise ValueError(f"redis_ttl_s must be an integer in [1, {MAX_COUNT}] or None, got {self.redis_ttl_s!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CachePolicy:
        return cls(**known_fields(cls, data, "cache policy"))

    def merged(self, changes: dict[str, Any]) -> CachePolicy:
        """This policy with some fields changed (a partial admin update), validated."""
        return dataclasses.replace(self, **known_fields(CachePolicy, changes, "cache policy"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def known_fields(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} fields {unknown}; known: {sorted(names)}")
    return dict(data)
