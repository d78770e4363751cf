from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.cache_store.block_pool import BlockPool, OutOfBlocksError, assert_no_leak, blocks_needed


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    pool = BlockPool(8)
    yield pool
    assert_no_leak(pool)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 1), (15, 1), (16, 1), (17, 2), (33, 3)])
def test_blocks_needed_per_length(pool: BlockPool, num_tokens: int, blocks: int) -> None:
    assert blocks_needed(num_tokens, 16) == blocks
    alloc = pool.allocate(blocks_needed(num_tokens, 16))
    assert len(alloc) == blocks
    assert pool.num_used == blocks and pool.num_free == 8 - blocks
    pool.free(alloc.block_ids)


def test_allocate_free_counters(pool: BlockPool) -> None:
    assert (pool.num_total, pool.num_free, pool.num_used, pool.usage) == (8, 8, 0, 0.0)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a.block_ids + b.block_ids) == list(range(8))
    assert all(pool.ref_count(x) == 1 for x in a.block_ids + b.block_ids)
    assert pool.usage == 1.0 and not pool.can_allocate(1) and pool.can_allocate(0)
    pool.free(a.block_ids)
    assert pool.num_free == 3 and pool.can_allocate(3)
    pool.free(b.block_ids)


def test_out_of_blocks_names_the_numbers(pool: BlockPool) -> None:
    held = pool.allocate(6)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 3 KV blocks: 2 of 8 are free") as info:
        pool.allocate(3)
    assert (info.value.requested, info.value.num_free, info.value.num_total) == (3, 2, 8)
    assert pool.num_free == 2, "a failed allocate must not take anything"
    pool.free(held.block_ids)


def test_ref_counts(pool: BlockPool) -> None:
    alloc = pool.allocate(2)
    pool.incref(alloc.block_ids)
    pool.incref(alloc.block_ids[:1])
    assert [pool.ref_count(b) for b in alloc.block_ids] == [3, 2]
    pool.free(alloc.block_ids)
    pool.free(alloc.block_ids)
    assert pool.num_used == 1
    pool.free(alloc.block_ids[:1])


def test_double_free_and_bad_ids_are_errors(pool: BlockPool) -> None:
    alloc = pool.allocate(1)
    (block,) = alloc.block_ids
    with pytest.raises(ValueError, match=f"double free: block {block} freed 2x with ref count 1"):
        pool.free([block, block])
    assert pool.ref_count(block) == 1, "a rejected free changes nothing"
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])
    with pytest.raises(ValueError, match="incref of free block"):
        pool.incref([block])
    with pytest.raises(ValueError, match=r"block id 8 out of range \[0, 8\)"):
        pool.free([8])
    with pytest.raises(TypeError, match="integer"):
        pool.free(["1"])  # type: ignore[list-item]


def test_cached_blocks_count_as_free_but_are_reported(pool: BlockPool) -> None:
    alloc = pool.allocate(2)
    assert pool.cache_block(alloc.block_ids[0], b"h" * 16)
    assert pool.num_cached == 1 and pool.num_evictable == 0
    pool.free(alloc.block_ids)
    assert pool.num_free == 8 and pool.num_cached == 1 and pool.num_evictable == 1
    assert pool.lookup(b"h" * 16) == alloc.block_ids[0]
    assert pool.evict_all_cached() == 1
    assert pool.lookup(b"h" * 16) is None and pool.num_cached == 0


def test_free_blocks_are_used_before_evicting(pool: BlockPool) -> None:
    cached = pool.allocate(2)
    pool.cache_block(cached.block_ids[0], b"a" * 16)
    pool.cache_block(cached.block_ids[1], b"b" * 16)
    pool.free(cached.block_ids)
    plain = pool.allocate(6)
    assert set(plain.block_ids).isdisjoint(cached.block_ids) and pool.num_evictions == 0
    extra = pool.allocate(1)
    assert pool.num_evictions == 1
    assert extra.block_ids[0] == cached.block_ids[1], "the tail block of a freed chain goes first"
    assert pool.lookup(b"b" * 16) is None and pool.lookup(b"a" * 16) == cached.block_ids[0]
    pool.free(plain.block_ids + extra.block_ids)


def test_duplicate_hash_is_not_cached_twice(pool: BlockPool) -> None:
    a, b = pool.allocate(2).block_ids
    assert pool.cache_block(a, b"x" * 16)
    assert not pool.cache_block(b, b"x" * 16)
    assert pool.cache_block(a, b"x" * 16), "re-committing the same hash is a no-op"
    with pytest.raises(ValueError, match="already holds hash"):
        pool.cache_block(a, b"y" * 16)
    pool.free([a, b])
    assert pool.num_evictable == 1
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(b, b"z" * 16)


def test_assert_no_leak_catches_a_held_block() -> None:
    pool = BlockPool(4)
    alloc = pool.allocate(1)
    with pytest.raises(AssertionError, match="1 blocks still referenced"):
        assert_no_leak(pool)
    pool.free(alloc.block_ids)
    assert_no_leak(pool)


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockPool(0)
