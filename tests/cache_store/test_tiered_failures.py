"""A Redis that dies, comes back, or stalls never holds a request longer than the cache timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from pdserve.cache_store.policy import CachePolicy, TierConfig
from tests.cache_store.kv_helpers import PROMPT, Worker, drop_device, prefill

TIMEOUT_S = 0.3
RETRY_S = 0.2


def config(url: str) -> TierConfig:
    return TierConfig(redis_url=url, redis_retry_interval_s=RETRY_S, redis_socket_timeout_s=1.0)


def timed_prefill(worker: Worker) -> tuple[int, float]:
    started = time.monotonic()
    cached, _ = prefill(worker, PROMPT, timeout_s=TIMEOUT_S)
    return cached, time.monotonic() - started


def test_redis_killed_then_restarted(make_worker: Callable[..., Worker], redis_server_factory) -> None:
    server = redis_server_factory()
    worker = make_worker(config(server.url), CachePolicy(lookup_timeout_s=TIMEOUT_S))
    prefill(worker, PROMPT)
    assert worker.cache.flush() and worker.cache.stats.redis_written_blocks == 6
    server.stop()
    for _ in range(3):  # the first lookup fails on the dead server, the next ones are skipped while backing off
        drop_device(worker)
        cached, seconds = timed_prefill(worker)
        assert cached == 0 and seconds < TIMEOUT_S + 0.2
    assert worker.cache.flush(timeout_s=5), "writes to a dead Redis end too"
    stats = worker.cache.stats
    assert stats.redis_errors >= 1 and stats.redis_errors + stats.redis_skipped >= 6
    assert stats.redis_written_blocks == 6

    server.start()  # same port, empty (no persistence)
    time.sleep(RETRY_S)
    drop_device(worker)
    assert timed_prefill(worker)[0] == 0  # reconnects; computes and writes the blocks again
    assert worker.cache.flush() and worker.cache.stats.redis_written_blocks == 12
    drop_device(worker)
    cached, seconds = timed_prefill(worker)
    assert cached == 24 and worker.cache.stats.redis_hit_blocks == 6, "Redis is used again"


def test_slow_redis_lookups_give_up_at_the_timeout(make_worker: Callable[..., Worker], redis_server_factory) -> None:
    server = redis_server_factory()
    worker = make_worker(config(server.url), CachePolicy(lookup_timeout_s=TIMEOUT_S))
    prefill(worker, PROMPT)
    assert worker.cache.flush()
    drop_device(worker)
    blocker = redis.Redis(port=server.port)
    sleeper = threading.Thread(target=blocker.execute_command, args=("DEBUG", "SLEEP", 2))
    sleeper.start()
    time.sleep(0.1)  # the server is now asleep for ~2 s
    cached, seconds = timed_prefill(worker)
    assert cached == 0 and TIMEOUT_S - 0.05 < seconds < TIMEOUT_S + 0.3
    assert worker.cache.stats.redis_timeouts >= 1 and worker.cache.stats.redis_errors >= 1
    sleeper.join()
    blocker.close()
