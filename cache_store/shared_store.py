"""Stores that several worker processes share, for the `store` KV transfer (kv_transfer/store/).

    prefill worker (P)                                    decode worker (D)
    put(key, parts, ttl_s)   a chunk's bytes               take(key, nbytes)   exactly nbytes, and the key is gone
    push(inbox, record)      a small record, queued        listen(inbox, deliver, ended)   records as they come
                             behind what was pushed        delete(keys)        values it will not read
                             before                        expire_old(s)       leftovers nobody took

Two stores, one interface:

    ShmStore    files in a tmpfs directory (/dev/shm/pdserve), records on a Unix stream socket per inbox:
                the processes of one host; a sender's end (its process died) is seen as its connection closing
    RedisStore  keys with a TTL, records on a Redis list per inbox (RPUSH / BLPOP): any hosts that reach the
                server; every sender's records are in one queue, so D can queue a marker behind them

What a value or record holds is the caller's business (sealed with the deployment's secret:
kv_transfer/store/records.py); a store moves bytes and never interprets them. `take` allocates at most the
`nbytes` it is told, so a value of another size (forged, damaged) costs no more than the one expected.
`store_id` is equal in two processes exactly when they share the store (a marker both read), so a prefill worker
can refuse a decode worker that listens on another one instead of writing where nobody reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

MAX_RECORD_BYTES = 64 * 1024

Deliver = Callable[[bytes, object], None]  # (record, the sender's stream it came on: None where not told apart)
Ended = Callable[[object], None]  # that sender's stream ended: every record it pushed was delivered


class StoreError(RuntimeError):
    """The store could not do what was asked (unreachable, full, gone)."""


class Listening(ABC):
    """An inbox being listened to; `close` stops the deliveries."""

    @abstractmethod
    async def close(self) -> None: ...


class SharedStore(ABC):
    kind: ClassVar[str]
    # whether every sender's records reach an inbox through one queue (a marker pushed now is delivered after
    # everything pushed before it, by anyone); False: per sender, whose end is reported instead
    orders_all_senders: ClassVar[bool]

    def __init__(self, store_id: str) -> None:
        self.store_id = store_id

    @abstractmethod
    def put(self, key: str, parts: Sequence[bytes | memoryview], ttl_s: int) -> None:
        """Store the concatenation of `parts` under `key`, for at most `ttl_s` seconds."""

    @abstractmethod
    def take(self, key: str, nbytes: int) -> bytes | bytearray | None:
        """The value of `key` if it holds exactly `nbytes` (None otherwise); the key is deleted either way."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Drop values (missing ones are fine)."""

    @abstractmethod
    def push(self, inbox: str, record: bytes, ttl_s: int) -> None:
        """Queue `record` (at most MAX_RECORD_BYTES) for the listener of `inbox`."""

    @abstractmethod
    async def listen(self, inbox: str, deliver: Deliver, ended: Ended) -> Listening:
        """Deliver the records pushed to `inbox`, on the calling event loop's thread, in push order per sender."""

    def expire_old(self, older_than_s: float) -> int:
        """Drop values older than this that nobody took (where the store has no TTL of its own); how many."""
        return 0

    def close(self) -> None:
        """Release connections (idempotent)."""


def open_store(kind: str, directory: str, redis_url: str | None, socket_timeout_s: float = 10.0) -> SharedStore:
    """The store a worker's `--transfer-store` names: `shm` (a directory on this host) or `redis` (a URL)."""
    if kind == "shm":
        from pdserve.cache_store.shm_store import ShmStore

        return ShmStore(directory, socket_timeout_s)
    if kind == "redis":
        if not redis_url:
            raise ValueError("the redis transfer store needs a Redis URL (--redis-url)")
        from pdserve.cache_store.redis_store import RedisStore

        return RedisStore(redis_url, socket_timeout_s)
    raise ValueError(f"unknown transfer store {kind!r}; choose shm or redis")
