"""Redis slowed (DEBUG SLEEP) or killed under a prefill worker started with --redis-url: every request still
succeeds, by recompute, with the same greedy output, and no lookup waits longer than --cache-timeout. Values
forged in Redis (another block's bytes with a right CRC-32, their seal kept or not) are never used: the output
stays the same and the worker counts them.

The session's prefill workers are drained (admin API, exit false) for the test, so every prompt goes through
the Redis-backed prefill worker; they are resumed after it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import zlib

import httpx
import msgpack
import redis

from tests.reliability.cluster import AUTH, INTERNAL, MODEL, WORKER_FLAGS, Cluster, Proc, metric

CACHE_TIMEOUT_S = 0.5
SLACK_S = 1.5  # scheduling noise of five model processes on two busy cores
PROMPTS = [[(7919 * (i + 1) + 31 * j) % 30000 + 200 for j in range(48)] for i in range(6)]  # 3 blocks each


def complete(cluster: Cluster, prompts: list[list[int]]) -> tuple[list[str], list[float]]:
    def one(prompt: list[int]) -> tuple[str, float]:
        started = time.monotonic()
        reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"], time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts, seconds = zip(*pool.map(one, prompts), strict=True)
    return list(texts), list(seconds)


def clear_device(proc: Proc) -> None:
    """Forget the device's (and host's) cached blocks, so the next lookups go to Redis."""
    httpx.post(f"{proc.url}/internal/cache/clear", json={"device": True, "host": True}, headers=INTERNAL,
               timeout=10).raise_for_status()


def slow_lookups(proc: Proc) -> int:
    """Lookups that took longer than 1 s (the histogram's bucket above the 0.5 s timeout)."""
    return int(metric(proc, "pdserve_kv_cache_load_seconds_count")
               - metric(proc, 'pdserve_kv_cache_load_seconds_bucket{le="1.0"}'))


def test_redis_slowed_or_killed_costs_at_most_the_cache_timeout(healthy: Cluster, redis_server_factory) -> None:
    cluster = healthy
    server = redis_server_factory()
    others = cluster.live("prefill")
    cached = cluster.start_worker("prefill", "prefill-redis", *WORKER_FLAGS, "--redis-url", server.url,
                                  "--cache-timeout", str(CACHE_TIMEOUT_S))
    cluster.wait_ready(cached)
    for proc in others:
        cluster.admin("POST", f"/workers/{proc.name}/drain", json={"exit": False}).raise_for_status()
    try:
        figures = run_phases(cluster, cached, server)
    finally:
        for proc in others:
            cluster.admin("POST", f"/workers/{proc.name}/resume").raise_for_status()
        cluster.retire(cached)
    cluster.wait_idle()
    print("\nRELIABILITY redis: " + "; ".join(f"{phase}: slowest {worst:.2f} s" for phase, worst in figures.items())
          + f" (cache timeout {CACHE_TIMEOUT_S} s)")


def run_phases(cluster: Cluster, cached: Proc, server) -> dict[str, float]:
    reference, baseline = complete(cluster, PROMPTS)  # computed, then written through to Redis
    wait_for_writes(cached, 6 * 3)
    clear_device(cached)
    hits_before = metric(cached, 'pdserve_kv_cache_hit_blocks_total{tier="redis"}')
    texts, warm = complete(cluster, PROMPTS)
    assert texts == reference
    assert metric(cached, 'pdserve_kv_cache_hit_blocks_total{tier="redis"}') > hits_before  # Redis was used

    forged = forge_every_value(server)
    clear_device(cached)
    texts, forged_s = complete(cluster, PROMPTS)
    assert texts == reference
    assert metric(cached, "pdserve_kv_cache_redis_auth_failures_total") >= len(PROMPTS)  # each prompt's first block
    assert metric(cached, "pdserve_kv_cache_redis_corrupt_values_total") == 0
    wait_for_writes(cached, 6 * 3 + metric(cached, "pdserve_kv_cache_redis_auth_failures_total"))

    clear_device(cached)
    sleeper = threading.Thread(target=lambda: redis.Redis(port=server.port).execute_command("DEBUG", "SLEEP", 4))
    sleeper.start()
    time.sleep(0.2)
    texts, slowed = complete(cluster, PROMPTS)
    sleeper.join()
    assert texts == reference
    assert metric(cached, "pdserve_kv_cache_redis_timeouts_total") >= 1

    server.stop()
    clear_device(cached)
    texts, killed = complete(cluster, PROMPTS)
    assert texts == reference
    assert metric(cached, "pdserve_kv_cache_redis_errors_total") >= 1
    server.start()

    bound = max(baseline) + CACHE_TIMEOUT_S + SLACK_S
    for phase, seconds in (("slowed", slowed), ("killed", killed)):
        assert max(seconds) < bound, f"{phase}: {max(seconds):.2f} s > {bound:.2f} s"
    assert slow_lookups(cached) == 0
    return {"baseline": max(baseline), "redis hits": max(warm), f"{forged} values forged (each missed)": max(forged_s),
            "DEBUG SLEEP 4": max(slowed), "redis-server killed": max(killed)}


def forge_every_value(server) -> int:
    """Replace every block in Redis with a valid-looking one: the KV bytes changed, the CRC-32 recomputed, so
    only the seal (HMAC with the deployment's secret) can tell; half keep the old seal, half carry none."""
    client = redis.Redis(port=server.port)
    keys = client.keys("pdserve:*")
    for index, key in enumerate(keys):
        value = client.get(key)
        body, seal = value[:-32], value[-32:]
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(body)
        header = unpacker.unpack()
        raw = bytearray(body[unpacker.tell():])
        raw[:64] = bytes(64)  # the first 16 floats of layer 0's keys: zeros
        header["checksum"] = zlib.crc32(raw)
        client.set(key, msgpack.packb(header, use_bin_type=True) + bytes(raw) + (seal if index % 2 else b""))
    client.close()
    return len(keys)


def wait_for_writes(proc: Proc, blocks: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(proc, "pdserve_kv_cache_redis_written_blocks_total") < blocks:
        assert time.monotonic() < deadline, "write-through to Redis did not finish"
        time.sleep(0.1)
