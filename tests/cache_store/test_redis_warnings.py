"""The console hears of Redis once per change: unreachable at start, gone, back; never once per call. A real
redis-server, stopped and started again on its port."""

from __future__ import annotations

import logging
import time

import pytest

from pdserve.cache_store.redis_tier import redacted_url
from tests.cache_store.kv_helpers import random_blocks
from tests.cache_store.test_redis_tier import HASHES, fetch, make_tier

LOGGER = "pdserve.cache_store.redis_tier"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_unreachable_at_start_then_back(redis_server_factory, caplog: pytest.LogCaptureFixture) -> None:
    server = redis_server_factory()
    server.stop()
    tier = make_tier(server.url)
    tier.name = f"Redis {server.url}"
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert not tier.probe()
    for _ in range(3):  # more failures: no more lines
        time.sleep(0.12)  # past the retry interval, so each call really tries
        assert fetch(tier, HASHES[:2]).shape[0] == 0
    [down] = _warnings(caplog)
    assert f"Redis {server.url} cannot be reached at start" in down and "ConnectionError" in down
    assert "retried every 0.1 s" in down

    server.start()
    time.sleep(0.12)
    assert tier.store(HASHES[:2], [None, None], random_blocks(2), ttl_s=60) == 2
    assert fetch(tier, HASHES[:2]).shape[0] == 2
    assert _warnings(caplog)[1:] == [f"Redis {server.url} is back: the Redis tier is used again"]

    server.stop()
    time.sleep(0.12)
    assert fetch(tier, HASHES[:2]).shape[0] == 0
    assert fetch(tier, HASHES[:2]).shape[0] == 0
    assert _warnings(caplog)[2].startswith(f"Redis {server.url} cannot be reached any more")
    assert len(_warnings(caplog)) == 3
    tier.close()


def test_reachable_at_start_is_one_info_line(redis_server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = make_tier(redis_server.url)
    assert tier.probe()
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.INFO]
    tier.close()


def test_a_password_never_reaches_the_log() -> None:
    assert redacted_url("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted_url("rediss://user:hunter2@cache:6380") == "rediss://user:***@cache:6380"
    assert redacted_url("redis://cache:6379/0") == "redis://cache:6379/0"
