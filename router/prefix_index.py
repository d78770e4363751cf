"""What the router believes one worker holds in its prefix cache (device or host RAM), for `cache_aware`.

Two sources, united:

    reported   what the worker itself says: a replica of its block-hash event stream (a snapshot, then
               numbered events; protocol/prefix_events.py), kept in step through the heartbeats, or a plain
               summary (`cached_blocks`, static workers' status); at most one heartbeat interval old
    routed     the full blocks of prompts this router prefilled there since, kept `routed_ttl_s` seconds:
               a worker commits every full prompt block it computed, so the next request with the same
               prefix goes there even before the next heartbeat (and is forgotten if the worker evicted it)

With several routers, each one sees only its own `routed` blocks, but every router receives the same
events from every worker: their `reported` sets converge on what the worker holds.

Keys are protocol.prefix_summary keys (the first 8 bytes of a chained block hash).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.protocol.prefix_events import PrefixReplica, PrefixSnapshot, decode_events
from pdserve.protocol.prefix_summary import DEFAULT_SUMMARY_BLOCKS, decode_summary, summary_key

ROUTED_TTL_S = 10.0


class CachedPrefixes:
    def __init__(self, routed_ttl_s: float = ROUTED_TTL_S, max_routed: int = DEFAULT_SUMMARY_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replica = PrefixReplica()
        self._routed: OrderedDict[bytes, float] = OrderedDict()  # key -> when, oldest first
        self._routed_ttl_s = routed_ttl_s
        self._max_routed = max_routed
        self._clock = clock

    def __len__(self) -> int:
        return len(self.replica.keys) + len(self._routed)

    @property
    def reported(self) -> set[bytes]:
        return self.replica.keys

    def report(self, summary: str) -> None:
        """A plain summary (no event stream) replaces the last one (ValueError for a malformed one)."""
        self.replica = PrefixReplica()
        self.replica.keys = set(decode_summary(summary))

    def sync(self, snapshot: dict[str, Any] | None, events: dict[str, Any] | None) -> dict[str, Any]:
        """A heartbeat's `prefix_snapshot` and/or `prefix_events` (either may be absent); returns the answer's
        `prefix` field: the seq now held, or a request for a snapshot. ValueError for a malformed body."""
        if snapshot is not None:
            self.replica.load(PrefixSnapshot.from_dict(snapshot))
        if events is not None:
            epoch, decoded = decode_events(events)
            self.replica.apply(epoch, decoded)
        return self.replica.answer()

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
            if key not in self.replica.keys and key not in self._routed:
                break
            count += 1
        return count

    def _expire(self) -> None:
        limit = self._clock() - self._routed_ttl_s
        while self._routed and next(iter(self._routed.values())) < limit:
            self._routed.popitem(last=False)
