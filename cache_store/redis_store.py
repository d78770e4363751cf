"""The shared store across hosts: a Redis server (the tier's `--redis-url`) that every worker reaches.

    pdserve:xfer:store-id        a random id, SET NX by whoever came first: equal ids = one Redis
    pdserve:xfer:{ns}:{id}       one value per key, SET with EX ttl (the reader UNLINKs it once read)
    pdserve:xfer:{ns}:inbox:{id} a decode worker's inbox: a list; senders RPUSH (and renew its EXPIRE), one
                                 thread of the listener BLPOPs with a 1 s timeout (a blocking wait, no polling;
                                 closing pushes an empty record that wakes it)

`take` reads with STRLEN + GETRANGE 0..nbytes-1 + UNLINK in one round trip, so a value of another size than the
one announced is refused having read at most the announced bytes. An inbox record is read whole by BLPOP
(redis-py allocates it), then refused past MAX_RECORD_BYTES before it is parsed. Every sender's records land in
one list, so a marker the decode worker pushes to its own inbox comes out after everything pushed before it.

Keys and lists carry TTLs, so what a dead decode worker never took disappears by itself; the listener deletes
its inbox when it closes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import redis

from pdserve.cache_store.redis_tier import connect_redis, redacted_url
from pdserve.cache_store.shared_store import (
    MAX_RECORD_BYTES,
    Deliver,
    Ended,
    Listening,
    SharedStore,
    StoreError,
)

logger = logging.getLogger(__name__)
_ERRORS = (redis.RedisError, OSError)
_ID_KEY = "pdserve:xfer:store-id"
_BLOCK_S = 1  # BLPOP's timeout: how soon a closing listener's thread notices if its wake-up push failed
_WAKE = b""  # pushed by close() to its own inbox: the thread's BLPOP returns now instead of within _BLOCK_S


class RedisStore(SharedStore):
    kind = "redis"
    orders_all_senders = True

    def __init__(self, url: str, socket_timeout_s: float = 10.0) -> None:
        self.url = url
        self.name = redacted_url(url)
        self.socket_timeout_s = socket_timeout_s
        self.client = connect_redis(url, socket_timeout_s)
        try:
            self.client.set(_ID_KEY, secrets.token_hex(8), nx=True)
            store_id = self.client.get(_ID_KEY)
        except _ERRORS as exc:
            raise StoreError(f"the transfer store {self.name} cannot be reached: {type(exc).__name__}: {exc}") from exc
        super().__init__(f"redis:{store_id.decode()}")

    def _call(self, what: str, pipe: Any) -> list[Any]:
        try:
            results: list[Any] = pipe.execute()
            return results
        except _ERRORS as exc:
            raise StoreError(f"{what} on {self.name} failed: {type(exc).__name__}: {exc}") from exc

    def put(self, key: str, parts: Sequence[bytes | memoryview], ttl_s: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, b"".join(parts), ex=ttl_s)
        self._call(f"SET {key}", pipe)

    def take(self, key: str, nbytes: int) -> bytes | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.strlen(key)
        pipe.getrange(key, 0, nbytes - 1)
        pipe.unlink(key)
        length, value, _ = self._call(f"GETRANGE {key}", pipe)
        return value if length == nbytes and len(value) == nbytes else None

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:  # one by one: a cluster holds them in different slots
                pipe.unlink(key)
            self._call("UNLINK", pipe)

    def push(self, inbox: str, record: bytes, ttl_s: int) -> None:
        if len(record) > MAX_RECORD_BYTES:
            raise StoreError(f"a {len(record)}-byte record exceeds the {MAX_RECORD_BYTES}-byte limit")
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(inbox, record)
        pipe.expire(inbox, ttl_s)
        self._call(f"RPUSH {inbox}", pipe)

    async def listen(self, inbox: str, deliver: Deliver, ended: Ended) -> Listening:
        client = connect_redis(self.url, self.socket_timeout_s + _BLOCK_S, max_connections=1)
        listening = _RedisListening(self, client, inbox, deliver, asyncio.get_running_loop())
        listening.thread.start()
        return listening

    def close(self) -> None:
        try:
            self.client.close()
        except _ERRORS:
            pass


class _RedisListening(Listening):
    def __init__(self, store: RedisStore, client: Any, inbox: str, deliver: Deliver,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.client = client
        self.inbox = inbox
        self.deliver = deliver
        self.loop = loop
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="transfer-inbox", daemon=True)

    def _run(self) -> None:
        failing = False
        while not self.closed.is_set():
            try:
                item = self.client.blpop([self.inbox], timeout=_BLOCK_S)
            except _ERRORS as exc:
                if not failing:
                    logger.warning("transfer inbox on %s: %s: %s; retrying every second", self.store.name,
                                   type(exc).__name__, exc)
                failing = True
                self.closed.wait(1.0)
                continue
            if failing:
                logger.warning("transfer inbox on %s is back", self.store.name)
                failing = False
            if item is None:
                continue
            if self.closed.is_set():
                return
            record = item[1]
            if len(record) > MAX_RECORD_BYTES:
                logger.warning("dropped a %d-byte record from %s (limit %d)", len(record), self.inbox, MAX_RECORD_BYTES)
                continue
            try:
                self.loop.call_soon_threadsafe(self.deliver, record, None)
            except RuntimeError:  # the loop closed
                return

    async def close(self) -> None:
        self.closed.set()
        try:  # closing took the 1 s of BLPOP's timeout per listener (7 s of tests/kv_transfer/test_store.py)
            await asyncio.to_thread(self._wake)
        except _ERRORS:
            pass  # the thread notices within _BLOCK_S
        await asyncio.to_thread(self.thread.join, _BLOCK_S + self.store.socket_timeout_s)
        try:
            self.store.client.unlink(self.inbox)
        except _ERRORS:
            pass
        try:
            self.client.close()
        except _ERRORS:
            pass

    def _wake(self) -> None:
        pipe = self.store.client.pipeline(transaction=False)
        pipe.rpush(self.inbox, _WAKE)
        pipe.expire(self.inbox, 60)  # should the UNLINK below fail, the list still goes
        pipe.execute()
