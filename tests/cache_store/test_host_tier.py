from __future__ import annotations

import pytest
import torch

from pdserve.cache_store.host_tier import HostTier
from tests.cache_store.kv_helpers import layout, random_blocks

H = [bytes([i]) * 16 for i in range(8)]


def tier(slots: int, eviction: str = "lru") -> HostTier:
    return HostTier(layout(), slots * layout().nbytes, eviction)


def test_put_then_read_prefix_stops_at_the_first_miss() -> None:
    host = tier(4)
    blocks = random_blocks(3)
    assert len(host.put(H[:3], [None] * 3, blocks)) == 0
    assert torch.equal(host.read_prefix(H[:3]), blocks)
    assert torch.equal(host.read_prefix([H[0], H[1], H[5], H[2]]), blocks[:2])
    assert host.read_prefix([H[5], H[0]]).shape[0] == 0
    assert host.num_used == 3
    host.check_consistent()


def test_capacity_comes_from_bytes() -> None:
    assert HostTier(layout(), 3 * layout().nbytes + 1).num_slots == 3
    with pytest.raises(ValueError, match="capacity must be >= 0 bytes, got -1"):
        HostTier(layout(), -1)


@pytest.mark.parametrize(("eviction", "victim"), [("lru", 1), ("lfu", 2)])
def test_eviction_at_capacity(eviction: str, victim: int) -> None:
    host = tier(3, eviction)
    blocks = random_blocks(4)
    host.put(H[:3], ["t"] * 3, blocks[:3])
    host.read_prefix([H[1]])
    host.read_prefix([H[1]])
    host.read_prefix([H[2]])
    host.read_prefix([H[0]])  # lru: order 1, 2, 0 → 1 goes; lfu: uses 0:1 1:2 2:1 → 2 (hit before 0) goes
    evicted = host.put([H[3]], ["t"], blocks[3:])
    assert evicted.hashes == (H[victim],) and evicted.salts == ("t",)
    assert torch.equal(evicted.blocks[0], blocks[victim]), "evicted blocks come back with their data"
    assert H[victim] not in host and H[3] in host and host.num_evictions == 1
    host.check_consistent()


def test_a_big_put_evicts_its_own_first_blocks_and_reports_them() -> None:
    host = tier(2)
    blocks = random_blocks(3)
    evicted = host.put(H[:3], [None] * 3, blocks)
    assert evicted.hashes == (H[0],) and torch.equal(evicted.blocks[0], blocks[0])
    assert torch.equal(host.read_prefix(H[1:3]), blocks[1:3])


def test_resident_blocks_are_not_copied_twice() -> None:
    host = tier(2)
    host.put([H[0]], [None], random_blocks(1, seed=1))
    host.put([H[0]], [None], random_blocks(1, seed=2))
    assert torch.equal(host.read_prefix([H[0]])[0], random_blocks(1, seed=1)[0])


def test_eviction_switches_at_run_time_keeping_counts() -> None:
    host = tier(2)
    host.put(H[:2], [None] * 2, random_blocks(2))
    for _ in range(3):
        host.read_prefix([H[0]])
    host.read_prefix([H[1]])  # most recent: lru would keep it
    host.set_eviction("lfu")
    assert host.eviction == "lfu"
    assert host.put([H[2]], [None], random_blocks(1)).hashes == (H[1],)


def test_zero_capacity_passes_everything_through() -> None:
    host = tier(0)
    blocks = random_blocks(2)
    evicted = host.put(H[:2], ["a", None], blocks)
    assert evicted.hashes == tuple(H[:2]) and evicted.salts == ("a", None) and torch.equal(evicted.blocks, blocks)
    assert host.read_prefix(H[:2]).shape[0] == 0
    host.clear()
    host.check_consistent()
