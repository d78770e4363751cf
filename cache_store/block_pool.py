"""Paged KV block pool: block ids, reference counts, a free list and the evictable cached blocks.

Every block is in exactly one of three states:

    state        ref count  prefix hash  where it sits
    FREE         0          none         `_free` (FIFO)            ─┐ both count as free:
    EVICTABLE    0          yes          `_evictable` (LRU order)  ─┘ allocate() can hand them out
    IN USE       >= 1       maybe        held by one or more sequences

    allocate ──▶ IN USE ──free (last ref)──▶ FREE        (no hash)
                   ▲                    └──▶ EVICTABLE   (hash committed: kept for prefix hits)
                   └──── incref (prefix hit) ◀── EVICTABLE
    allocate takes FREE blocks first, then evicts EVICTABLE ones: by default the least recently freed
    (`lru`); with `set_eviction("lfu")` the one with the fewest prefix hits (`note_hits`), oldest first.

`on_evict`, when set, sees every batch of evicted (block id, hash) pairs inside `allocate`, before the
blocks are handed out: their KV is still intact, so a write-back cache tier can copy it out first.

The pool knows nothing about tokens or models: `PrefixCache` (prefix_cache.py) maps chained block hashes
to these blocks. Not thread-safe: one scheduler thread owns a pool.
"""

from __future__ import annotations

import operator
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.cache_store.eviction import Evictor, convert, make_evictor

EvictHook = Callable[[list[tuple[int, bytes]]], None]


class OutOfBlocksError(RuntimeError):
    """Raised by `allocate` when fewer blocks are free (or evictable) than asked for."""

    def __init__(self, requested: int, num_free: int, num_total: int) -> None:
        super().__init__(f"cannot allocate {requested} KV blocks: {num_free} of {num_total} are free")
        self.requested = requested
        self.num_free = num_free
        self.num_total = num_total


@dataclass(frozen=True)
class Allocation:
    """Blocks handed out by one `allocate` call, each with ref count 1."""

    block_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockPool:
    """`num_blocks` KV blocks with ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, eviction: str = "lru") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._hits = [0] * num_blocks  # prefix hits on the block's current hash (lfu order)
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: Evictor[int] = make_evictor(eviction)
        self._hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0
        self.on_evict: EvictHook | None = None

    @property
    def eviction(self) -> str:
        return self._evictable.kind

    def set_eviction(self, kind: str) -> None:
        """Switch between `lru` and `lfu` at run time; evictable blocks keep their hit counts."""
        self._evictable = convert(self._evictable, kind)

    def note_hits(self, block_ids: Iterable[int]) -> None:
        """Count a prefix hit on each block (the `lfu` order)."""
        for block_id in block_ids:
            self._hits[self._checked(block_id)] += 1

    # ---- counters -------------------------------------------------------------------------------

    @property
    def num_total(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: never-used or released ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with ref count >= 1."""
        return self.num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a committed prefix hash, referenced or not."""
        return len(self._hash_to_block)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody references: counted in `num_free`, evicted LRU first."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return self.num_used / self.num_total

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._checked(block_id)]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[self._checked(block_id)]

    # ---- allocate / free ------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> Allocation:
        """Take `num_blocks` blocks (ref count 1 each); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(num_blocks, self.num_free, self.num_total)
        evicted: list[tuple[int, bytes]] = []
        block_ids = tuple(self._take_one(evicted) for _ in range(num_blocks))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return Allocation(block_ids)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become FREE or EVICTABLE.

        Blocks are released last to first, so a sequence's tail blocks are evicted before its head:
        a chain is only useful from its start, and head blocks are the ones other prompts share.
        """
        block_ids = [self._checked(b) for b in block_ids]
        for block_id, times in Counter(block_ids).items():
            if self._ref_counts[block_id] < times:
                raise ValueError(
                    f"double free: block {block_id} freed {times}x with ref count {self._ref_counts[block_id]}"
                )
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._release(block_id)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks in use or evictable (a prefix hit revives an evictable block)."""
        block_ids = [self._checked(b) for b in block_ids]
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0 and block_id not in self._evictable:
                raise ValueError(f"incref of free block {block_id}: allocate it first")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                self._evictable.remove(block_id)
            self._ref_counts[block_id] += 1

    # ---- prefix hashes (used by PrefixCache) ----------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """Block holding `block_hash`, or None."""
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Name an in-use block by its prefix hash; False when another block already holds that hash."""
        block_id = self._checked(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot cache block {block_id}: it is not in use")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already holds hash {current.hex()}, not {block_hash.hex()}")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def evict_all_cached(self) -> int:
        """Forget every evictable cached block (e.g. after a weight reload); returns how many."""
        count = len(self._evictable)
        while self._evictable:
            block_id = self._evictable.pop()
            self._forget_hash(block_id)
            self._free.append(block_id)
        return count

    # ---- internals ------------------------------------------------------------------------------

    def _take_one(self, evicted: list[tuple[int, bytes]]) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id = self._evictable.pop()
            block_hash = self._hashes[block_id]
            assert block_hash is not None, f"evictable block {block_id} has no hash"
            evicted.append((block_id, block_hash))
            self._forget_hash(block_id)
            self.num_evictions += 1
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        if self._hashes[block_id] is None:
            self._free.append(block_id)
        else:
            self._evictable.push(block_id, self._hits[block_id])

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._hashes[block_id] = None
        self._hits[block_id] = 0

    def _checked(self, block_id: int) -> int:
        try:
            index = operator.index(block_id)
        except TypeError:
            raise TypeError(f"block id must be an integer, got {block_id!r}") from None
        if not 0 <= index < self.num_total:
            raise ValueError(f"block id {index} out of range [0, {self.num_total})")
        return index


def assert_no_leak(pool: BlockPool) -> None:
    """Raise AssertionError unless every block is free with ref count 0 and each state set is consistent."""
    held = {b: n for b, n in enumerate(pool._ref_counts) if n != 0}
    if held:
        raise AssertionError(f"{len(held)} blocks still referenced (block: refs): {dict(list(held.items())[:10])}")
    if pool.num_free != pool.num_total:
        raise AssertionError(f"free count {pool.num_free} != total {pool.num_total}")
    ids = list(pool._free) + list(pool._evictable)
    if sorted(ids) != list(range(pool.num_total)):
        raise AssertionError(f"free list and evictable set overlap or miss blocks: {len(set(ids))} distinct")
    for block_id in pool._evictable:
        if pool._hashes[block_id] is None:
            raise AssertionError(f"evictable block {block_id} has no hash")
