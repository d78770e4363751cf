from __future__ import annotations

import pytest

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.eviction import LFUEvictor, LRUEvictor, convert, make_evictor
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache


def test_lru_evicts_the_oldest_and_touch_refreshes() -> None:
    order = LRUEvictor()
    for key in "abc":
        order.push(key)
    order.touch("a")
    assert [order.pop(), order.pop(), order.pop()] == ["b", "c", "a"]
    with pytest.raises(KeyError):
        order.pop()


def test_lfu_evicts_the_least_used_then_the_oldest() -> None:
    order = LFUEvictor()
    order.push("a", 3)
    order.push("b", 1)
    order.push("c", 1)
    order.touch("b")  # b: 2 uses
    assert list(order) == ["c", "b", "a"]
    assert order.remove("a") == 3 and "a" not in order
    assert [order.pop(), order.pop()] == ["c", "b"] and len(order) == 0


def test_lfu_heap_stays_bounded_under_many_touches() -> None:
    order = LFUEvictor()
    order.push("a")
    order.push("b")
    for _ in range(1000):
        order.touch("a")
    assert len(order._counts) <= 2 * len(order._buckets) + 17
    assert order.pop() == "b" and order.uses("a") == 1000


def test_convert_keeps_keys_and_counts() -> None:
    lru = make_evictor("lru")
    for key, uses in (("x", 5), ("y", 0), ("z", 2)):
        lru.push(key, uses)
    lfu = convert(lru, "lfu")
    assert lfu.kind == "lfu" and [lfu.uses(k) for k in "xyz"] == [5, 0, 2]
    assert list(lfu) == ["y", "z", "x"]
    assert convert(lfu, "lfu") is lfu
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_evictor("fifo")


def _cached_chain(cache: PrefixCache, tokens: list[int]) -> list[bytes]:
    hashes = block_hashes(tokens, 4, "fp")
    seq = cache.allocate(hashes, len(hashes))
    cache.commit(hashes, seq.block_ids)
    cache.pool.free(seq.block_ids)
    return hashes


@pytest.mark.parametrize(("eviction", "survivor"), [("lru", "cold"), ("lfu", "hot")])
def test_pool_eviction_policy_picks_the_victim(eviction: str, survivor: str) -> None:
    pool = BlockPool(4, eviction=eviction)
    cache = PrefixCache(pool, 4)
    chains = {"hot": _cached_chain(cache, [1] * 8)}
    for _ in range(3):
        pool.free(cache.match(chains["hot"]).block_ids)
    chains["cold"] = _cached_chain(cache, [2] * 8)  # freed last: the most recent, never hit
    filler = pool.allocate(2)
    assert {name: cache.peek(h).num_blocks for name, h in chains.items()}[survivor] == 2
    assert pool.num_evictions == 2
    pool.free(filler.block_ids)
    assert_no_leak(pool)


def test_pool_switches_eviction_at_run_time_and_reports_evictions() -> None:
    pool = BlockPool(4)
    cache = PrefixCache(pool, 4)
    hot = _cached_chain(cache, [1] * 8)
    for _ in range(2):
        pool.free(cache.match(hot).block_ids)
    cold = _cached_chain(cache, [2] * 8)  # most recently freed: lru would keep it
    pool.set_eviction("lfu")
    assert pool.eviction == "lfu"
    seen: list[list[tuple[int, bytes]]] = []
    pool.on_evict = seen.append
    filler = pool.allocate(2)
    assert [h for _, h in seen[0]] == [cold[1], cold[0]], "one call per allocate, the chain's tail first"
    assert {b for b, _ in seen[0]} == set(filler.block_ids)
    assert cache.peek(hot).num_blocks == 2
    pool.free(filler.block_ids)
    assert_no_leak(pool)
