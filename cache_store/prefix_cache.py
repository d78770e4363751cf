"""Device-tier prefix cache: chained block hashes → blocks of a `BlockPool`.

A sequence's life with the cache (P and D alike):

    hashes = block_hashes(prompt[:n - 1], ...)     # leave >= 1 token to compute: it yields the logits
    seq = cache.allocate(hashes, blocks_needed(n + 1, bs))
          # atomic: the longest cached prefix of `hashes` is acquired and the rest is allocated,
          # or nothing changes and OutOfBlocksError is raised
          #   seq.block_ids = [ hit, hit, new, new, new ]   seq.num_cached_tokens = 2 * bs
    ... compute tokens seq.num_cached_tokens .. n into seq.block_ids ...
    cache.commit(all_full_block_hashes, seq.block_ids)   # full blocks become findable
    pool.free(seq.block_ids)                             # one free for everything; committed blocks stay
                                                         # cached (EVICTABLE) until their room is needed

`allocate` is the leak-proof entry point: hits and new blocks come back as one list that one `free`
releases. `match` (acquire only) exists for callers that allocate elsewhere; its result must be freed.

`enabled=False` (`--no-enable-prefix-caching`): `commit` names nothing, so nothing is ever found and every
prompt is computed in full; the calls stay the same, so the nodes need no second code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cache_store.block_pool import BlockPool, OutOfBlocksError


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks of a hash chain found in the cache."""

    block_ids: tuple[int, ...]
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class SequenceBlocks:
    """All blocks of one sequence: the cached prefix first, then newly allocated blocks."""

    block_ids: tuple[int, ...]
    num_cached_blocks: int
    num_cached_tokens: int

    @property
    def new_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]


@dataclass
class PrefixCacheStats:
    """Counted over `match`/`allocate` calls, in blocks."""

    num_queries: int = 0
    num_hit_blocks: int = 0
    num_miss_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        looked_up = self.num_hit_blocks + self.num_miss_blocks
        return self.num_hit_blocks / looked_up if looked_up else 0.0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()

    def peek(self, hashes: Sequence[bytes]) -> PrefixMatch:
        """Longest cached prefix of `hashes`, without acquiring it or counting it."""
        block_ids: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixMatch(tuple(block_ids), len(block_ids) * self.block_size)

    def match(self, hashes: Sequence[bytes]) -> PrefixMatch:
        """Longest cached prefix, acquired (ref count +1 each): the caller must `pool.free` its block_ids."""
        found = self.peek(hashes)
        self.pool.incref(found.block_ids)
        self._count(found, len(hashes))
        return found

    def can_allocate(self, hashes: Sequence[bytes], num_blocks: int) -> bool:
        return self._blocks_to_take(self.peek(hashes[:num_blocks]), num_blocks) <= self.pool.num_free

    def allocate(self, hashes: Sequence[bytes], num_blocks: int) -> SequenceBlocks:
        """`num_blocks` blocks for a sequence whose full blocks hash to `hashes`; all or nothing.

        Only the first `num_blocks` hashes are looked up. Reviving an evictable hit takes a block off
        the free count just as a new block does, so both count against the room available.
        """
        hashes = hashes[:num_blocks]
        found = self.peek(hashes)
        needed = self._blocks_to_take(found, num_blocks)
        if needed > self.pool.num_free:
            raise OutOfBlocksError(needed, self.pool.num_free, self.pool.num_total)
        self.pool.incref(found.block_ids)
        fresh = self.pool.allocate(num_blocks - found.num_blocks)
        self._count(found, len(hashes))
        return SequenceBlocks(found.block_ids + fresh.block_ids, found.num_blocks, found.num_tokens)

    def commit(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Register full blocks: `hashes[i]` names `block_ids[i]`. Returns how many blocks were newly named.

        A hash already held by another block (two sequences computed the same prefix at once) is
        skipped: that copy stays unnamed and returns to the free list when released.
        """
        if len(hashes) > len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for only {len(block_ids)} blocks")
        if not self.enabled:
            return 0
        newly = 0
        for block_hash, block_id in zip(hashes, block_ids):
            had_hash = self.pool.block_hash(block_id) is not None
            if self.pool.cache_block(block_id, block_hash) and not had_hash:
                newly += 1
        return newly

    def _blocks_to_take(self, found: PrefixMatch, num_blocks: int) -> int:
        revived = sum(1 for b in found.block_ids if self.pool.ref_count(b) == 0)
        return num_blocks - found.num_blocks + revived

    def _count(self, found: PrefixMatch, looked_up: int) -> None:
        self.pool.note_hits(found.block_ids)
        hits = found.num_blocks
        self.stats.num_queries += 1
        self.stats.num_hit_blocks += hits
        self.stats.num_miss_blocks += looked_up - hits
