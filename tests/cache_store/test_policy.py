from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.cache_store.policy import (
    CachePolicy,
    TierConfig,
    add_cache_arguments,
    cache_settings_from_args,
    load_cache_file,
)


@pytest.mark.parametrize(("changes", "message"), [
    ({"device_eviction": "fifo"}, "device_eviction must be one of"),
    ({"host_eviction": "mru"}, "host_eviction must be one of"),
    ({"write": "write_around"}, "write must be one of"),
    ({"redis_admission_hits": -1}, r"redis_admission_hits must be an integer in \[0, 2147483647\], got -1"),
    ({"redis_admission_hits": 1 << 70}, r"redis_admission_hits must be an integer in \[0, 2147483647\], got 1180"),
    ({"redis_admission_hits": True}, "redis_admission_hits must be an integer"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s must be a positive number <= 3600, got 0"),
    ({"lookup_timeout_s": float("inf")}, "lookup_timeout_s must be a positive number"),
    ({"lookup_timeout_s": 1e300}, "lookup_timeout_s must be a positive number <= 3600, got 1e"),
    ({"redis_ttl_s": 0}, r"redis_ttl_s must be an integer in \[1, 2147483647\] or None, got 0"),
    ({"redis_ttl_s": 1 << 70}, r"redis_ttl_s must be an integer in \[1, 2147483647\] or None, got 1180"),
])
def test_policy_validation_names_the_bad_value(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CachePolicy(**changes)


def test_merged_is_a_validated_partial_update() -> None:
    policy = CachePolicy()
    updated = policy.merged({"write": "write_back", "redis_admission_hits": 2})
    assert (updated.write, updated.redis_admission_hits, updated.host_eviction) == ("write_back", 2, "lru")
    assert policy.write == "write_through", "policies are immutable"
    with pytest.raises(ValueError, match=r"unknown cache policy fields \['colour'\]"):
        policy.merged({"colour": "red"})
    with pytest.raises(ValueError, match="write must be one of"):
        policy.merged({"write": "sometimes"})
    assert CachePolicy.from_dict(updated.to_dict()) == updated


def test_tier_config_validation() -> None:
    assert TierConfig(host_capacity_gb=1.5).host_capacity_bytes == 3 << 29
    with pytest.raises(ValueError, match="host_capacity_gb must be >= 0, got -1"):
        TierConfig(host_capacity_gb=-1)
    with pytest.raises(ValueError, match="redis_batch_blocks must be a positive integer, got 0"):
        TierConfig(redis_batch_blocks=0)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_settings_file_then_flags(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"cache{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"host_capacity_gb": 2, "write": "write_back", "redis_admission_hits": 3}))
    else:
        path.write_text('host_capacity_gb = 2\nwrite = "write_back"\nredis_admission_hits = 3\n')
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    args = parser.parse_args(["--cache-policy-file", str(path), "--redis-admission-hits", "5",
                              "--redis-url", "redis://h:1/0", "--host-eviction", "lfu", "--redis-ttl", "0"])
    config, policy = cache_settings_from_args(args, pin_host_memory=True)
    assert (config.host_capacity_gb, config.redis_url, config.pin_host_memory) == (2, "redis://h:1/0", True)
    assert (policy.write, policy.redis_admission_hits, policy.host_eviction) == ("write_back", 5, "lfu")
    assert policy.redis_ttl_s is None


def test_settings_file_rejects_unknown_names(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"write": "none", "host_cache": 1}))
    with pytest.raises(ValueError, match=r"unknown cache settings \['host_cache'\]"):
        load_cache_file(path)
