from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.cache_store.block_pool import BlockPool, OutOfBlocksError, assert_no_leak, blocks_needed
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache, PrefixCacheStats

BS = 16
FP = "test-model"


@pytest.fixture
def cache() -> Iterator[PrefixCache]:
    cache = PrefixCache(BlockPool(10), BS)
    yield cache
    assert_no_leak(cache.pool)


def run_sequence(cache: PrefixCache, tokens: list[int], extra_blocks: int = 0) -> tuple[int, ...]:
    """Allocate, 'compute', commit full blocks and keep the blocks held; returns them."""
    hashes = block_hashes(tokens, BS, FP)
    seq = cache.allocate(hashes, blocks_needed(len(tokens), BS) + extra_blocks)
    cache.commit(hashes, seq.block_ids)
    return seq.block_ids


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 33])
def test_second_request_hits_full_blocks_only(cache: PrefixCache, num_tokens: int) -> None:
    tokens = list(range(100, 100 + num_tokens))
    first = run_sequence(cache, tokens)
    assert len(first) == blocks_needed(num_tokens, BS)
    cache.pool.free(first)
    hashes = block_hashes(tokens, BS, FP)
    seq = cache.allocate(hashes, blocks_needed(num_tokens, BS))
    assert seq.num_cached_blocks == num_tokens // BS
    assert seq.num_cached_tokens == (num_tokens // BS) * BS
    assert seq.block_ids[: seq.num_cached_blocks] == first[: seq.num_cached_blocks]
    assert cache.stats.num_hit_blocks == num_tokens // BS
    cache.pool.free(seq.block_ids)


def test_match_acquires_and_shares_live_blocks(cache: PrefixCache) -> None:
    tokens = list(range(40))
    held = run_sequence(cache, tokens)
    cache.stats = PrefixCacheStats()
    found = cache.match(block_hashes(tokens + [7] * 30, BS, FP))
    assert found.block_ids == held[:2] and found.num_tokens == 32 and found.num_blocks == 2
    assert [cache.pool.ref_count(b) for b in held] == [2, 2, 1]
    assert (cache.stats.num_hit_blocks, cache.stats.num_miss_blocks) == (2, 2)
    assert cache.stats.hit_rate == 0.5
    cache.pool.free(found.block_ids)
    cache.pool.free(held)


def test_peek_takes_nothing(cache: PrefixCache) -> None:
    tokens = list(range(32))
    cache.pool.free(run_sequence(cache, tokens))
    queries = cache.stats.num_queries
    found = cache.peek(block_hashes(tokens, BS, FP))
    assert found.num_blocks == 2 and cache.pool.num_used == 0 and cache.stats.num_queries == queries


def test_lru_eviction_order(cache: PrefixCache) -> None:
    """Sequences freed first are evicted first; a hit refreshes a sequence."""
    a, b, c = ([i] * 32 for i in (1, 2, 3))
    for tokens in (a, b, c):
        cache.pool.free(run_sequence(cache, tokens))  # 6 cached blocks, 4 never used
    cache.pool.free(cache.match(block_hashes(a, BS, FP)).block_ids)  # a is now the most recent
    filler = cache.pool.allocate(6)  # 4 plain free blocks + the 2 oldest cached: b's
    assert cache.peek(block_hashes(b, BS, FP)).num_blocks == 0
    assert cache.peek(block_hashes(c, BS, FP)).num_blocks == 2
    assert cache.peek(block_hashes(a, BS, FP)).num_blocks == 2
    filler2 = cache.pool.allocate(1)  # c's tail block goes before c's head block
    assert cache.peek(block_hashes(c, BS, FP)).num_blocks == 1
    cache.pool.free(filler.block_ids + filler2.block_ids)


def test_referenced_cached_blocks_are_never_evicted(cache: PrefixCache) -> None:
    held = run_sequence(cache, [5] * 32)  # cached and still referenced
    others = cache.pool.allocate(8)
    with pytest.raises(OutOfBlocksError, match="1 KV blocks: 0 of 10"):
        cache.pool.allocate(1)
    assert cache.peek(block_hashes([5] * 32, BS, FP)).block_ids == held
    cache.pool.free(others.block_ids)
    cache.pool.free(held)


def test_allocate_counts_revived_hits_against_free_room(cache: PrefixCache) -> None:
    tokens = [9] * 64
    cache.pool.free(run_sequence(cache, tokens))  # 4 evictable blocks
    others = cache.pool.allocate(5)  # 1 plain free + 4 evictable left
    cache.stats = PrefixCacheStats()
    hashes = block_hashes(tokens, BS, FP)
    assert cache.can_allocate(hashes, 5) and not cache.can_allocate(hashes, 6)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 6 KV blocks: 5 of 10"):
        cache.allocate(hashes, 6)
    assert cache.pool.num_used == 5 and cache.stats.num_queries == 0, "a failed allocate changes nothing"
    seq = cache.allocate(hashes, 5)
    assert seq.num_cached_blocks == 4 and len(seq.new_block_ids) == 1
    cache.pool.free(others.block_ids + seq.block_ids)


def test_allocate_looks_up_at_most_num_blocks_hashes(cache: PrefixCache) -> None:
    tokens = list(range(48))
    cache.pool.free(run_sequence(cache, tokens))
    seq = cache.allocate(block_hashes(tokens, BS, FP), 2)
    assert seq.num_cached_blocks == 2 and seq.new_block_ids == ()
    cache.pool.free(seq.block_ids)


def test_concurrent_duplicate_prefix_commits_once(cache: PrefixCache) -> None:
    tokens = [4] * 32
    hashes = block_hashes(tokens, BS, FP)
    first = cache.allocate(hashes, 2)
    second = cache.allocate(hashes, 2)  # nothing committed yet: both compute the prefix
    assert cache.commit(hashes, first.block_ids) == 2
    assert cache.commit(hashes, second.block_ids) == 0
    cache.pool.free(first.block_ids + second.block_ids)
    assert cache.pool.num_cached == 2 and cache.pool.num_evictable == 2


def test_salt_separates_tenants(cache: PrefixCache) -> None:
    tokens = list(range(32))
    cache.pool.free(run_sequence(cache, tokens))
    assert cache.peek(block_hashes(tokens, BS, FP, salt="tenant-b")).num_blocks == 0
    assert cache.peek(block_hashes(tokens, BS, "other-model")).num_blocks == 0


def test_commit_needs_a_block_per_hash(cache: PrefixCache) -> None:
    alloc = cache.pool.allocate(1)
    with pytest.raises(ValueError, match="2 hashes for only 1 blocks"):
        cache.commit(block_hashes([1] * 32, BS, FP), alloc.block_ids)
    cache.pool.free(alloc.block_ids)
