"""The Redis tier against a real redis-server: pipelined round trips, keys, TTL, corrupt values, URL forms, and
what the shared secret does: names that hide the fingerprint and salt, a seal (HMAC) on every value that a
forged, moved or foreign value fails (a miss, counted, deleted)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import redis
import torch

from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.kv_codec import BlockLayout, encode_block
from pdserve.cache_store.redis_tier import PrefixSink, RedisTier, connect_redis
from pdserve.cache_store.tier_stats import TieredCacheStats
from tests.cache_store.kv_helpers import BS, CORRUPTIONS, FP, SECRET, corrupt_value, layout, random_blocks

HASHES = block_hashes(list(range(40)), BS, FP)  # 10 chained block hashes
KEY = re.compile(r"pdserve:[0-9a-f]{16}:[0-9a-f]{32}")


def make_tier(url: str, lay: BlockLayout | None = None, batch_blocks: int = 2, secret: str | None = SECRET) -> RedisTier:
    client = connect_redis(url, socket_timeout_s=1.0)
    return RedisTier(client, lay or layout(), TieredCacheStats(), secret, retry_interval_s=0.1,
                     batch_blocks=batch_blocks)


def count_pipelines(tier: RedisTier) -> list[int]:
    """Counts round trips: every pipelined batch is one `pipeline()` call."""
    calls: list[int] = []
    original = tier.client.pipeline

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    tier.client.pipeline = counted
    return calls


def fetch(tier: RedisTier, hashes: list[bytes], salt: str | None = None, ttl_s: int | None = 60) -> torch.Tensor:
    sink = PrefixSink()
    tier.fetch_prefix(hashes, salt, sink, time.monotonic() + 5, ttl_s)
    chunks = [blocks for _, blocks in sink.close()]
    return torch.cat(chunks) if chunks else tier.layout.empty(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_round_trip_in_pipelined_batches(redis_url: str, redis_client: redis.Redis, dtype: torch.dtype) -> None:
    tier = make_tier(redis_url, layout(dtype))
    trips = count_pipelines(tier)
    blocks = random_blocks(5, dtype)
    assert tier.store(HASHES[:5], [None] * 5, blocks, ttl_s=60) == 5
    assert len(trips) == 3, "5 blocks in batches of 2: 3 round trips"
    got = fetch(tier, HASHES[:5])
    assert len(trips) == 6 and torch.equal(got.view(torch.uint8), blocks.view(torch.uint8))
    key = tier.key(HASHES[0], None)
    assert KEY.fullmatch(key) and key.startswith(f"pdserve:{tier.auth.namespace}:"), key
    assert 0 < redis_client.ttl(key) <= 60
    assert tier.stats.redis_written_blocks == 5 and tier.stats.redis_read_bytes > 5 * tier.layout.nbytes


def test_fetch_stops_at_the_first_missing_block(redis_url: str) -> None:
    tier = make_tier(redis_url)
    blocks = random_blocks(4)
    tier.store([HASHES[i] for i in (0, 1, 3)], [None] * 3, blocks[[0, 1, 3]], ttl_s=None)
    assert torch.equal(fetch(tier, HASHES[:4], ttl_s=None), blocks[:2])
    assert fetch(tier, HASHES[2:4]).shape[0] == 0


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_values_are_misses_and_deleted(redis_url: str, redis_client: redis.Redis, kind: str) -> None:
    tier = make_tier(redis_url)
    blocks = random_blocks(3)
    tier.store(HASHES[:3], [None] * 3, blocks, ttl_s=60)
    key = tier.key(HASHES[1], None)
    damaged = corrupt_value(tier.layout, blocks[1], HASHES[1], kind)
    redis_client.set(key, damaged + tier.auth.seal(key, damaged))  # sealed: what fails is kv_codec's check
    got = fetch(tier, HASHES[:3])
    assert torch.equal(got, blocks[:1]), "the prefix ends before the corrupt block; nothing wrong is returned"
    assert tier.stats.redis_corrupt_values == 1 and tier.stats.redis_auth_failures == 0
    assert redis_client.exists(tier.key(HASHES[1], None)) == 0, "a corrupt value is deleted"
    assert redis_client.exists(tier.key(HASHES[2], None)) == 1


def test_only_missing_skips_blocks_redis_has(redis_url: str) -> None:
    tier = make_tier(redis_url)
    first, second = random_blocks(2, seed=1), random_blocks(2, seed=2)
    tier.store(HASHES[:1], [None], first[:1], ttl_s=60)
    assert tier.store(HASHES[:2], [None] * 2, second, ttl_s=60, only_missing=True) == 1
    got = fetch(tier, HASHES[:2])
    assert torch.equal(got[0], first[0]) and torch.equal(got[1], second[1])


def test_keys_hide_the_salt_and_fingerprint_and_another_salt_misses(redis_url: str) -> None:
    tier = make_tier(redis_url, layout(fingerprint="m:1*"))
    key = tier.key(HASHES[0], "tenant:a*")
    assert KEY.fullmatch(key) and "tenant" not in key and "m%3A1" not in key and HASHES[0].hex() not in key
    assert tier.key(HASHES[0], "tenant-b") != key and tier.key(HASHES[0], None) != key
    assert make_tier(redis_url, layout(fingerprint="m:2")).key(HASHES[0], "tenant:a*") != key
    assert make_tier(redis_url, layout(fingerprint="m:1*")).key(HASHES[0], "tenant:a*") == key  # every worker agrees
    tier.store(HASHES[:1], ["tenant:a*"], random_blocks(1), ttl_s=60)
    assert fetch(tier, HASHES[:1], salt="tenant-b").shape[0] == 0
    assert fetch(tier, HASHES[:1], salt="tenant:a*").shape[0] == 1


def test_a_forged_value_with_a_right_checksum_is_a_counted_miss_and_deleted(redis_url: str,
                                                                            redis_client: redis.Redis) -> None:
    tier = make_tier(redis_url)
    blocks, forged = random_blocks(3, seed=1), random_blocks(1, seed=2)[0]
    tier.store(HASHES[:3], [None] * 3, blocks, ttl_s=60)
    key = tier.key(HASHES[1], None)
    valid = encode_block(tier.layout, HASHES[1], forged)  # header, fingerprint, hash and CRC-32 all right
    for value in (valid, valid + b"\x00" * 32, valid + make_tier(redis_url, secret="another-secret").auth.seal(
            key, valid)):
        redis_client.set(key, value)
        assert torch.equal(fetch(tier, HASHES[:3]), blocks[:1]), "the forged block is never used"
        assert redis_client.exists(key) == 0, "a value that fails its seal is deleted"
    assert tier.stats.redis_auth_failures == 3 and tier.stats.redis_corrupt_values == 0


def test_a_valid_value_moved_to_another_key_fails_its_seal(redis_url: str, redis_client: redis.Redis) -> None:
    tier = make_tier(redis_url)
    blocks = random_blocks(2)
    tier.store(HASHES[:2], [None] * 2, blocks, ttl_s=60)
    source, target = tier.key(HASHES[0], None), tier.key(HASHES[0], "tenant-b")
    redis_client.set(target, redis_client.get(source))  # another tenant's sealed value, copied under its key
    assert fetch(tier, HASHES[:1], salt="tenant-b").shape[0] == 0
    assert tier.stats.redis_auth_failures == 1
    assert torch.equal(fetch(tier, HASHES[:2]), blocks), "the original key still reads"


def test_values_written_under_another_secret_are_misses(redis_url: str, redis_client: redis.Redis) -> None:
    ours, theirs = make_tier(redis_url), make_tier(redis_url, secret="another-deployment")
    theirs.store(HASHES[:2], [None] * 2, random_blocks(2), ttl_s=60)
    assert ours.key(HASHES[0], None) != theirs.key(HASHES[0], None)  # another name: never even read
    assert fetch(ours, HASHES[:2]).shape[0] == 0
    assert ours.stats.redis_auth_failures == 0 and len(redis_client.keys("pdserve:*")) == 2
    unkeyed = make_tier(redis_url, secret=None)  # no secret: damage is still detected, and nothing is shared
    assert not unkeyed.auth.authenticated and unkeyed.key(HASHES[0], None) != ours.key(HASHES[0], None)


def test_cluster_url(redis_server_factory, tmp_path: Path) -> None:
    server = redis_server_factory("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"))
    admin = redis.Redis(port=server.port)
    admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "single-node cluster did not become ok"
        time.sleep(0.05)
    tier = make_tier(f"redis+cluster://127.0.0.1:{server.port}")
    blocks = random_blocks(4)
    assert tier.store(HASHES[:4], [None] * 4, blocks, ttl_s=60) == 4, "keys in many slots, one pipeline"
    assert torch.equal(fetch(tier, HASHES[:4]), blocks)
    tier.close()


def test_sentinel_url(redis_server, redis_server_factory, tmp_path: Path) -> None:
    config = tmp_path / "sentinel.conf"
    config.write_text(f"sentinel monitor pdserve-kv 127.0.0.1 {redis_server.port} 1\n")
    sentinel = redis_server_factory(str(config), "--sentinel")
    tier = make_tier(f"redis+sentinel://127.0.0.1:{sentinel.port}/pdserve-kv/0")
    blocks = random_blocks(2)
    assert tier.store(HASHES[5:7], [None] * 2, blocks, ttl_s=60) == 2
    assert torch.equal(fetch(tier, HASHES[5:7]), blocks)
    direct = redis.Redis(port=redis_server.port)
    assert direct.exists(tier.key(HASHES[5], None)) == 1, "written to the master the sentinel names"
    direct.delete(*[tier.key(h, None) for h in HASHES[5:7]])
    tier.close()


@pytest.mark.parametrize(("url", "message"), [
    ("localhost:6379", "has no scheme"),
    ("http://localhost", "unsupported Redis URL scheme 'http'"),
    ("redis+sentinel://127.0.0.1:1", "needs a service name"),
])
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect_redis(url, 1.0)
