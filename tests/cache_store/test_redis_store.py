"""The Redis transfer store's inbox listener against a real redis-server: records come out in push order, and
closing wakes the blocked BLPOP at once (not within its 1 s timeout) and leaves no inbox behind."""

from __future__ import annotations

import asyncio
import time

import redis

from pdserve.cache_store.redis_store import RedisStore

INBOX = "pdserve:xfer:test:inbox:listener"


async def test_records_arrive_in_order_and_close_wakes_the_listener_at_once(redis_server) -> None:
    store = RedisStore(redis_server.url)
    got: list[bytes] = []
    arrived = asyncio.Event()

    def deliver(record: bytes, source: object) -> None:
        got.append(record)
        arrived.set()

    listening = await store.listen(INBOX, deliver, lambda source: None)
    try:
        for record in (b"one", b"two", b"three"):
            store.push(INBOX, record, ttl_s=60)
        async with asyncio.timeout(10):
            while len(got) < 3:
                arrived.clear()
                await arrived.wait()
        assert got == [b"one", b"two", b"three"]
        await asyncio.sleep(0.2)  # the thread is blocked in BLPOP again
        started = time.monotonic()
    finally:
        await listening.close()
    assert time.monotonic() - started < 0.5 and not listening.thread.is_alive()  # type: ignore[attr-defined]
    assert got == [b"one", b"two", b"three"]  # the wake-up record is not delivered
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert not client.exists(INBOX)
    finally:
        client.close()
        store.close()
