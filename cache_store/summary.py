"""The recency order that a worker's prefix summary is cut from (the summary's wire form, its keys and their
matching are protocol/prefix_summary.py's: the router reads them too).

    RecentHashes.touch(hashes)   on each commit or hit, under the tiered cache's lock
    RecentHashes.newest()        most recent first: the worker keeps those still held and encodes them
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pdserve.protocol.prefix_summary import DEFAULT_SUMMARY_BLOCKS


class RecentHashes:
    """Block hashes in order of last use (commit or hit), at most `capacity`; not thread-safe (the tiered
    cache touches it under its lock)."""

    def __init__(self, capacity: int = 2 * DEFAULT_SUMMARY_BLOCKS) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.version = 0  # changes whenever the content or the order does
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, hashes: Iterable[bytes]) -> None:
        for block_hash in hashes:
            self._order[block_hash] = None
            self._order.move_to_end(block_hash)
            self.version += 1
        while len(self._order) > self.capacity:
            self._order.popitem(last=False)

    def newest(self) -> list[bytes]:
        """Most recently used first."""
        return list(reversed(self._order))
