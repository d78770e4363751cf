"""Hit counts per block hash, for admission to Redis after N hits (bounded: the least recently hit go first)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class HitCounter:
    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def hit(self, hashes: Iterable[bytes], threshold: int) -> list[bytes]:
        """Count one hit on each hash; returns those whose count just reached `threshold` (none if 0)."""
        crossed = []
        with self._lock:
            for block_hash in hashes:
                count = self._counts.pop(block_hash, 0) + 1
                self._counts[block_hash] = count
                if count == threshold:
                    crossed.append(block_hash)
            while len(self._counts) > self.max_entries:
                self._counts.popitem(last=False)
        return crossed

    def admitted(self, block_hash: bytes, threshold: int) -> bool:
        if threshold == 0:
            return True
        with self._lock:
            return self._counts.get(block_hash, 0) >= threshold
