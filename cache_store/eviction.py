"""Eviction order for a cache tier: least recently used (`lru`) or least frequently used (`lfu`).

An evictor holds the keys that may be evicted, each with a use count, and answers which one goes next:

    lru   victim = the key pushed or touched longest ago                      (an OrderedDict)
    lfu   victim = the key with the fewest uses; among equals, the oldest     (one OrderedDict per count)

    push(key, uses)   key becomes evictable (the device pool: a cached block's last reference went away)
    touch(key)        a hit on a resident key (the host tier): one more use, and it is now the most recent
    remove(key)       key is no longer evictable (a hit revived it, or it was dropped)
    pop()             take the victim

Both kinds keep every key's use count, so `convert` can switch a tier between them at run time (a policy
update) without losing what was counted. Not thread-safe: the owning tier locks.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, Literal, TypeVar

from pdserve.protocol.cache_policy import EVICTION_KINDS  # the names a CachePolicy may give

K = TypeVar("K", bound=Hashable)
EvictionKind = Literal["lru", "lfu"]


class Evictor(ABC, Generic[K]):
    kind: EvictionKind

    @abstractmethod
    def push(self, key: K, uses: int = 0) -> None: ...

    @abstractmethod
    def remove(self, key: K) -> int:
        """Forget `key`; returns its use count."""

    @abstractmethod
    def pop(self) -> K:
        """Remove and return the victim; KeyError when empty."""

    @abstractmethod
    def __iter__(self) -> Iterator[K]:
        """Keys in eviction order, victim first."""

    @abstractmethod
    def uses(self, key: K) -> int: ...

    def touch(self, key: K) -> None:
        self.push(key, self.remove(key) + 1)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class LRUEvictor(Evictor[K]):
    kind: EvictionKind = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[K, int] = OrderedDict()  # oldest first, value = uses

    def push(self, key: K, uses: int = 0) -> None:
        self._keys[key] = uses
        self._keys.move_to_end(key)

    def remove(self, key: K) -> int:
        return self._keys.pop(key)

    def pop(self) -> K:
        key, _ = self._keys.popitem(last=False)
        return key

    def uses(self, key: K) -> int:
        return self._keys[key]

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class LFUEvictor(Evictor[K]):
    """Buckets by use count; a heap of the counts that have a bucket finds the lowest in O(log #counts)."""

    kind: EvictionKind = "lfu"

    def __init__(self) -> None:
        self._uses: dict[K, int] = {}
        self._buckets: dict[int, OrderedDict[K, None]] = {}  # uses -> keys, oldest first
        self._counts: list[int] = []  # heap of bucket keys (may hold stale counts; skipped on pop)

    def push(self, key: K, uses: int = 0) -> None:
        if key in self._uses:
            self.remove(key)
        self._uses[key] = uses
        bucket = self._buckets.get(uses)
        if bucket is None:
            bucket = self._buckets[uses] = OrderedDict()
            heapq.heappush(self._counts, uses)
            if len(self._counts) > 2 * len(self._buckets) + 16:  # touches leave stale counts: compact
                self._counts = list(self._buckets)
                heapq.heapify(self._counts)
        bucket[key] = None

    def remove(self, key: K) -> int:
        uses = self._uses.pop(key)
        bucket = self._buckets[uses]
        del bucket[key]
        if not bucket:
            del self._buckets[uses]
        return uses

    def pop(self) -> K:
        while self._counts:
            bucket = self._buckets.get(self._counts[0])
            if bucket:
                key, _ = bucket.popitem(last=False)
                uses = self._uses.pop(key)
                if not bucket:
                    del self._buckets[uses]
                return key
            heapq.heappop(self._counts)  # stale: that bucket emptied
        raise KeyError("pop from an empty evictor")

    def uses(self, key: K) -> int:
        return self._uses[key]

    def __iter__(self) -> Iterator[K]:
        return iter([key for uses in sorted(self._buckets) for key in self._buckets[uses]])

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses


def make_evictor(kind: str) -> Evictor[K]:
    if kind == "lru":
        return LRUEvictor()
    if kind == "lfu":
        return LFUEvictor()
    raise ValueError(f"unknown eviction policy {kind!r}; choose one of {EVICTION_KINDS}")


def convert(evictor: Evictor[K], kind: str) -> Evictor[K]:
    """The same keys and use counts under another policy, pushed in the old eviction order."""
    if evictor.kind == kind:
        return evictor
    new: Evictor[K] = make_evictor(kind)
    for key in evictor:
        new.push(key, evictor.uses(key))
    return new
