"""Block-hash summaries: the wire form heartbeats carry (protocol/prefix_summary.py), and the recency order
they are cut from (cache_store/summary.py)."""

from __future__ import annotations

import pytest

from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.summary import RecentHashes
from pdserve.protocol.prefix_summary import KEY_BYTES, decode_summary, encode_summary, matched_blocks


def test_round_trip_and_prefix_match() -> None:
    hashes = block_hashes(list(range(64)), 16, "fp")
    keys = decode_summary(encode_summary(hashes[:3]))
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert matched_blocks(hashes, keys) == 3
    assert matched_blocks(block_hashes(list(range(64)), 16, "fp", salt="other"), keys) == 0
    assert decode_summary(encode_summary([])) == frozenset()
    with pytest.raises(ValueError, match="8-byte keys; got 3 bytes"):
        decode_summary("AAAA")


def test_recent_hashes_keeps_the_newest_within_capacity() -> None:
    recent = RecentHashes(capacity=3)
    recent.touch([b"a", b"b", b"c"])
    version = recent.version
    recent.touch([b"a", b"d"])  # a moves to the front, b (least recent) is dropped
    assert recent.newest() == [b"d", b"a", b"c"] and len(recent) == 3 and recent.version > version
    with pytest.raises(ValueError, match="capacity must be positive, got 0"):
        RecentHashes(0)


def test_tiered_cache_summarises_what_device_and_host_hold(make_worker) -> None:
    from pdserve.cache_store.policy import TierConfig
    from tests.cache_store.kv_helpers import PROMPT, host_gb, prefill

    worker = make_worker(TierConfig(host_capacity_gb=host_gb(8)))
    prefill(worker, PROMPT, salt="s")
    hashes = worker.cache.sequence_hashes(PROMPT, "s")
    assert worker.cache.flush() and sorted(worker.cache.held_hashes()) == sorted(hashes)
    assert worker.cache.drop_cached(device=True, host=False) == {"device_blocks": 6, "host_blocks": 0}
    assert sorted(worker.cache.held_hashes()) == sorted(hashes), "still in host RAM"
    assert prefill(worker, PROMPT, salt="s")[0] == 24, "loaded back from the host tier"
    assert worker.cache.drop_cached() == {"device_blocks": 6, "host_blocks": 6}
    assert worker.cache.held_hashes() == [] and worker.cache.held_hashes(limit=0) == []
