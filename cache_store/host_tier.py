"""The host tier: KV blocks in (pinned, when the pool is on CUDA) host RAM, keyed by chained block hash.

    slots   one preallocated tensor [num_slots, layers, 2, block_size, Hkv, D]; slot i holds one block
    index   block hash → (slot, cache salt)    the salt names the block's Redis key on a write-back
    order   an `Evictor` over the resident hashes: lru or lfu, switchable at run time

`read_prefix` copies the leading resident blocks of a hash chain out (a hit counts as a use);
`put` copies blocks in, evicting by policy when full, and hands the evicted blocks back (copied) so a
write-back cache can send them on to Redis. Thread-safe: lookups run on I/O threads while the step thread
and the writer thread insert.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.cache_store.eviction import Evictor, convert, make_evictor
from pdserve.cache_store.kv_codec import BlockLayout


@dataclass(frozen=True)
class HostBlocks:
    """Blocks copied out of (or evicted from) the host tier, in chain order."""

    hashes: tuple[bytes, ...]
    salts: tuple[str | None, ...]
    blocks: torch.Tensor  # [n, layers, 2, block_size, Hkv, D]

    def __len__(self) -> int:
        return len(self.hashes)


class HostTier:
    def __init__(self, layout: BlockLayout, capacity_bytes: int, eviction: str = "lru",
                 pin_memory: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.layout = layout
        self.num_slots = capacity_bytes // layout.nbytes
        self.pin_memory = pin_memory
        self._slots = layout.empty(self.num_slots, pin_memory=pin_memory and self.num_slots > 0)
        self._index: dict[bytes, tuple[int, str | None]] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._order: Evictor[bytes] = make_evictor(eviction)
        self._lock = threading.Lock()
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        return len(self._index)

    @property
    def eviction(self) -> str:
        return self._order.kind

    def set_eviction(self, kind: str) -> None:
        with self._lock:
            self._order = convert(self._order, kind)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def read_prefix(self, hashes: Sequence[bytes], pin_memory: bool = False) -> torch.Tensor:
        """Copies of the resident blocks at the start of `hashes`, up to the first miss: [k, ...]."""
        with self._lock:
            slots: list[int] = []
            for block_hash in hashes:
                entry = self._index.get(block_hash)
                if entry is None:
                    break
                slots.append(entry[0])
                self._order.touch(block_hash)
            out = self.layout.empty(len(slots), pin_memory=pin_memory and bool(slots))
            if slots:
                torch.index_select(self._slots, 0, torch.tensor(slots), out=out)
            return out

    def put(self, hashes: Sequence[bytes], salts: Sequence[str | None], blocks: torch.Tensor) -> HostBlocks:
        """Insert blocks not resident yet; returns what was evicted to make room (or did not fit at all)."""
        if len(hashes) != len(salts) or len(hashes) != blocks.shape[0]:
            raise ValueError(f"{len(hashes)} hashes, {len(salts)} salts and {blocks.shape[0]} blocks differ")
        spilled: list[tuple[bytes, str | None, torch.Tensor]] = []
        with self._lock:
            for i, (block_hash, salt) in enumerate(zip(hashes, salts)):
                if block_hash in self._index:
                    continue
                if self.num_slots == 0:
                    spilled.append((block_hash, salt, blocks[i]))
                    continue
                if not self._free:
                    victim, victim_salt, slot = self._evict_one()
                    spilled.append((victim, victim_salt, self._slots[slot].clone()))
                    self._free.append(slot)
                slot = self._free.pop()
                self._slots[slot].copy_(blocks[i])
                self._index[block_hash] = (slot, salt)
                self._order.push(block_hash)
        if not spilled:
            return HostBlocks((), (), self.layout.empty(0))
        return HostBlocks(tuple(h for h, _, _ in spilled), tuple(s for _, s, _ in spilled),
                          torch.stack([b for _, _, b in spilled]))

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            self._order = make_evictor(self._order.kind)

    def check_consistent(self) -> None:
        """AssertionError unless every slot is either free or indexed exactly once (the tier's leak check)."""
        with self._lock:
            used = sorted(slot for slot, _ in self._index.values())
            if sorted(used + self._free) != list(range(self.num_slots)):
                raise AssertionError(f"host slots leaked or doubled: {len(used)} used + {len(self._free)} free "
                                     f"!= {self.num_slots}")
            if len(self._order) != len(self._index):
                raise AssertionError(f"eviction order holds {len(self._order)} keys, index {len(self._index)}")

    def _evict_one(self) -> tuple[bytes, str | None, int]:
        victim = self._order.pop()
        assert isinstance(victim, bytes)
        slot, salt = self._index.pop(victim)
        self.num_evictions += 1
        return victim, salt, slot
