"""What the router believes one worker holds in its prefix cache (device or host RAM), for `cache_aware`.

Two sources, united:

    reported   the worker's own summary (`cached_blocks` in its heartbeats or status): exact when sent,
               at most one heartbeat interval old
    routed     the full blocks of prompts the router prefilled there since, kept `routed_ttl_s` seconds:
               a worker commits every full prompt block it computed, so the next request with the same
               prefix goes there even before the next heartbeat (and is forgotten if the worker evicted it)

Keys are cache_store.summary keys (the first 8 bytes of a chained block hash).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.cache_store.summary import DEFAULT_SUMMARY_BLOCKS, decode_summary, summary_key

ROUTED_TTL_S = 10.0


class CachedPrefixes:
    def __init__(self, routed_ttl_s: float = ROUTED_TTL_S, max_routed: int = DEFAULT_SUMMARY_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reported: frozenset[bytes] = frozenset()
        self._routed: OrderedDict[bytes, float] = OrderedDict()  # key -> when, oldest first
        self._routed_ttl_s = routed_ttl_s
        self._max_routed = max_routed
        self._clock = clock

    def __len__(self) -> int:
        return len(self.reported) + len(self._routed)

    def report(self, summary: str) -> None:
        """The worker's own summary replaces the last one (ValueError for a malformed one)."""
        self.reported = decode_summary(summary)

    def note_routed(self, hashes: Sequence[bytes]) -> None:
        now = self._clock()
        for block_hash in hashes:
            key = summary_key(block_hash)
            self._routed[key] = now
            self._routed.move_to_end(key)
        while len(self._routed) > self._max_routed:
            self._routed.popitem(last=False)

    def matched(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` this worker holds, as far as the router knows."""
        self._expire()
        count = 0
        for block_hash in hashes:
            key = summary_key(block_hash)
            if key not in self.reported and key not in self._routed:
                break
            count += 1
        return count

    def _expire(self) -> None:
        limit = self._clock() - self._routed_ttl_s
        while self._routed and next(iter(self._routed.values())) < limit:
            self._routed.popitem(last=False)
