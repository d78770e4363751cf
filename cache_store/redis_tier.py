"""The Redis tier: one key per KV block, read and written in pipelined batches, never on the model thread.

    key    pdserve:{namespace}:{block id}        keyed digests of the model fingerprint and block size, then of
                                                 the salt and block hash (cache_store/redis_auth.py)
    value  msgpack header + raw block bytes (kv_codec.encode_block) + a 32-byte HMAC over key and value

Every value read is checked in that order: its seal (HMAC with the deployment's secret; a failure is a miss,
counted as `redis_auth_failures`, and the value is deleted), then everything kv_codec checks (a failure is a
miss counted as `redis_corrupt_values`, deleted too). Only then is a byte copied.

Granularity: one block per value, `batch_blocks` (16) blocks pipelined per round trip. Measured with
`python benchmarks/redis_granularity.py` (redis-py + hiredis, loopback redis-server 7.0, 64-block prefix,
16 blocks' worth of values per round trip; benchmarks/results/redis_granularity.json, 16-core H200 host):

    block size                 1 block/value    4 blocks/value   16 blocks/value   (GET GB/s; server ms per value)
    64 KiB                     1.51  (0.04)     1.77  (0.15)     1.50  (0.70)
    360 KiB (SmolLM2, bf16)    2.01  (0.18)     1.05  (1.41)     0.85  (6.96)
    2 MiB (Llama-3-8B, bf16)   0.62  (3.38)     0.52  (16.0)     0.39  (86.7)

Bigger values never pay for themselves once a block is 360 KiB or more, and at 64 KiB chunks of 4 gain only
~15%. They would cost: a chunk is usable only whole, so chunks of 4 and 16 could hold only 94% and 77% of
the full blocks of prompts of 1..128 blocks (tails shorter than a chunk are never stored), a miss anywhere
in a chunk loses all of it, and the single-threaded server is held for the whole value (87 ms for a 16-block
Llama-3-8B chunk, blocking every other worker's lookups). On the loaded 2-core dev box the same runs vary 2x
between repeats with no consistent winner (results/redis_granularity_devbox_2cpu.json).

Failures never reach a request: every call catches Redis and socket errors, counts them, and returns a miss
(or writes nothing). After an error Redis is skipped for `retry_interval_s` (counted as skipped), then
tried again: the client reconnects by itself, so a restarted server is used again. The console hears of it
once per change, not per call: `probe()` at start warns when Redis cannot be reached, the first failure after
a success warns that it went away, and the first success after failures warns that it is back.

URL forms: redis://, rediss://, unix:// (redis-py's own), redis+cluster:// or rediss+cluster:// (a
RedisCluster from one or more seed nodes) and redis+sentinel://[:password@]host:port[,host:port]/service[/db].
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from pdserve.cache_store.kv_codec import BlockLayout, CorruptValueError, decode_block, encode_block_parts
from pdserve.cache_store.policy import redis_url_scheme
from pdserve.cache_store.redis_auth import ForgedValueError, RedisAuth
from pdserve.cache_store.tier_stats import TieredCacheStats

_ERRORS = (redis.RedisError, OSError)
logger = logging.getLogger(__name__)


def redacted_url(url: str) -> str:
    """The URL for a log line: a password in it becomes '***'."""
    scheme, sep, rest = url.partition("://")
    auth, at, location = rest.rpartition("@")
    if not at or ":" not in auth:
        return url
    return f"{scheme}{sep}{auth.partition(':')[0]}:***@{location}"


def connect_redis(url: str, socket_timeout_s: float, max_connections: int = 32) -> Any:
    """A redis-py client for any supported URL; nothing is contacted until the first command."""
    # One immediate retry: the first command on a pooled connection to a restarted server fails once.
    options: dict[str, Any] = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s,
                               "retry": Retry(NoBackoff(), 1)}
    scheme, rest = redis_url_scheme(url), url.partition("://")[2]
    if scheme in ("redis+cluster", "rediss+cluster"):
        return _cluster(scheme.split("+")[0], rest, options)
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return _sentinel(scheme.split("+")[0], rest, options)
    return redis.Redis.from_url(url, max_connections=max_connections, **options)


def _host_ports(netloc: str, default_port: int) -> list[tuple[str, int]]:
    nodes = []
    for item in netloc.split(","):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", str(default_port))
        nodes.append((host, int(port)))
    return nodes


def _cluster(scheme: str, rest: str, options: dict[str, Any]) -> RedisCluster:
    """redis+cluster://[:password@]host:port[,host:port] → RedisCluster seeded with those nodes."""
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.split("/")[0]
    password = urllib.parse.unquote(auth.partition(":")[2]) if auth else None
    nodes = [ClusterNode(h, p) for h, p in _host_ports(hosts, 6379)]  # type: ignore[no-untyped-call]
    return RedisCluster(startup_nodes=nodes, password=password, ssl=scheme == "rediss", **options)


def _sentinel(scheme: str, rest: str, options: dict[str, Any]) -> redis.Redis:
    """redis+sentinel://[:password@]h:p[,h:p]/service[/db] → the service's current master (follows failover)."""
    auth, _, location = rest.rpartition("@")
    hosts, _, path = location.partition("/")
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"Sentinel URL needs a service name: redis+sentinel://host:port/service, got {rest!r}")
    password = urllib.parse.unquote(auth.partition(":")[2]) if auth else None
    # redis 8.1 annotates neither Sentinel nor master_for and 8.2 does: called through Any, both type-check
    make_sentinel: Any = Sentinel
    sentinel = make_sentinel(_host_ports(hosts, 26379), sentinel_kwargs=dict(options), **options)
    master: redis.Redis = sentinel.master_for(service, password=password, db=int(db or 0), ssl=scheme == "rediss")
    return master


class PrefixSink:
    """Where an I/O thread leaves the blocks it found, so a caller that stops waiting keeps what arrived."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: list[tuple[tuple[bytes, ...], torch.Tensor]] = []
        self._closed = False

    def add(self, hashes: Sequence[bytes], blocks: torch.Tensor) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._chunks.append((tuple(hashes), blocks))
            return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> list[tuple[tuple[bytes, ...], torch.Tensor]]:
        """Stop accepting blocks; returns those accepted."""
        with self._lock:
            self._closed = True
            return list(self._chunks)


class RedisTier:
    def __init__(self, client: Any, layout: BlockLayout, stats: TieredCacheStats, secret: str | None,
                 retry_interval_s: float = 1.0, batch_blocks: int = 16, pin_memory: bool = False,
                 name: str = "Redis") -> None:
        """`secret`: the deployment's shared secret, which names and seals every value (None: unauthenticated,
        warned about). `name`: how log lines call this server (its URL, redacted)."""
        self.client = client
        self.name = name
        self.reachable: bool | None = None  # None: not tried yet
        self.pin_memory = pin_memory
        self.layout = layout
        self.stats = stats
        self.retry_interval_s = retry_interval_s
        self.batch_blocks = batch_blocks
        self.auth = RedisAuth(secret, layout.model_fingerprint, layout.block_size)
        self._down_until = 0.0
        if not self.auth.authenticated:
            logger.warning("%s: no shared secret (PDSERVE_SECRET), so Redis values are checked for damage only: "
                           "anyone who can write to this Redis can make this worker use KV of their choosing", name)

    def key(self, block_hash: bytes, salt: str | None) -> str:
        return self.auth.key(block_hash, salt)

    @property
    def backing_off(self) -> bool:
        return time.monotonic() < self._down_until

    def probe(self) -> bool:
        """PING once (at start): warns when Redis cannot be reached. Returns whether it answered."""
        try:
            self.client.ping()
        except _ERRORS as exc:
            self.mark_failed(error=exc)
            return False
        self.mark_ok()
        return True

    def mark_failed(self, timed_out: bool = False, error: BaseException | None = None) -> None:
        """Count one failed call and skip Redis for `retry_interval_s`; the first failure after a success (or
        at start) is logged."""
        self.stats.count(redis_errors=1, redis_timeouts=int(timed_out))
        self._down_until = time.monotonic() + self.retry_interval_s
        if self.reachable is not False:
            cause = "a lookup ran past its deadline" if timed_out else f"{type(error).__name__}: {error}"
            when = "at start" if self.reachable is None else "any more"
            logger.warning("%s cannot be reached %s (%s): Redis lookups miss and writes are dropped, retried every "
                           "%g s", self.name, when, cause, self.retry_interval_s)
        self.reachable = False

    def mark_ok(self) -> None:
        """A call succeeded: logged when Redis was failing before."""
        if self.reachable is False:
            logger.warning("%s is back: the Redis tier is used again", self.name)
        elif self.reachable is None:
            logger.info("%s reachable: the Redis tier is on", self.name)
        self.reachable = True

    def _usable(self) -> bool:
        if self.backing_off:
            self.stats.count(redis_skipped=1)
            return False
        return True

    # ---- reads --------------------------------------------------------------------------------------

    def fetch_prefix(self, hashes: Sequence[bytes], salt: str | None, sink: PrefixSink, deadline: float,
                     ttl_s: int | None) -> None:
        """Leading blocks of `hashes` found in Redis → `sink`, batch by batch, until a miss or the deadline.

        A hit's TTL is refreshed (GETEX), so blocks in use stay while one-off blocks expire.
        """
        if not hashes or not self._usable():
            return
        for start in range(0, len(hashes), self.batch_blocks):
            if sink.closed:
                return
            if time.monotonic() >= deadline:  # keep what arrived; the rest is a miss
                self.stats.count(redis_timeouts=1)
                return
            batch = hashes[start:start + self.batch_blocks]
            keys = [self.key(h, salt) for h in batch]
            try:
                values = self._get_many(keys, ttl_s)
            except _ERRORS as exc:
                if not sink.closed:  # a closed sink's caller already counted the timeout
                    self.mark_failed(error=exc)
                return
            if self.reachable is not True:
                self.mark_ok()
            found = self._decode_prefix(batch, keys, values)
            if found.shape[0]:
                self.stats.count(redis_read_bytes=sum(len(v or b"") for v in values[:found.shape[0]]))
                if not sink.add(batch[:found.shape[0]], found):
                    return
            if found.shape[0] < len(batch):
                return

    def _get_many(self, keys: list[str], ttl_s: int | None) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            if ttl_s is None:
                pipe.get(key)
            else:
                pipe.getex(key, ex=ttl_s)
        answers: list[bytes | None] = pipe.execute()
        return answers

    def _decode_prefix(self, hashes: Sequence[bytes], keys: list[str], values: list[bytes | None]) -> torch.Tensor:
        """Decode the leading present values; a corrupt one ends the prefix and is deleted."""
        present: list[bytes] = []
        for value in values:
            if value is None:
                break
            present.append(value)
        out = self.layout.empty(len(present), pin_memory=self.pin_memory and len(present) > 0)
        for i, value in enumerate(present):
            try:
                decode_block(self.layout, hashes[i], self.auth.open(keys[i], value), out[i])
            except ForgedValueError:
                self.stats.count(redis_auth_failures=1)
                self._delete([keys[i]])
                return out[:i]
            except CorruptValueError:
                self.stats.count(redis_corrupt_values=1)
                self._delete([keys[i]])
                return out[:i]
        return out

    def _delete(self, keys: list[str]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            pipe.execute()
        except _ERRORS as exc:
            self.mark_failed(error=exc)

    # ---- writes -------------------------------------------------------------------------------------

    def store(self, hashes: Sequence[bytes], salts: Sequence[str | None], blocks: torch.Tensor,
              ttl_s: int | None, only_missing: bool = False) -> int:
        """SET blocks [n, layers, 2, block_size, Hkv, D] in pipelined batches; returns how many were written.

        `only_missing` first asks which keys exist (one small round trip) and skips those.
        """
        if not hashes or not self._usable():
            return 0
        keys = [self.key(h, s) for h, s in zip(hashes, salts, strict=True)]
        todo = list(range(len(keys)))
        written = 0
        try:
            if only_missing:
                todo = self._missing(keys)
            for start in range(0, len(todo), self.batch_blocks):
                batch = todo[start:start + self.batch_blocks]
                written += self._set_batch([(keys[i], hashes[i], blocks[i]) for i in batch], ttl_s)
        except _ERRORS as exc:
            self.mark_failed(error=exc)
            return written
        if self.reachable is not True:
            self.mark_ok()
        return written

    def _missing(self, keys: list[str]) -> list[int]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [i for i, present in enumerate(pipe.execute()) if not present]

    def _set_batch(self, items: list[tuple[str, bytes, torch.Tensor]], ttl_s: int | None) -> int:
        pipe = self.client.pipeline(transaction=False)
        size = 0
        for key, block_hash, block in items:
            header, raw = encode_block_parts(self.layout, block_hash, block)
            value = b"".join((header, raw, self.auth.seal(key, header, raw)))
            size += len(value)
            pipe.set(key, value, ex=ttl_s)
        pipe.execute()
        self.stats.count(redis_written_bytes=size, redis_written_blocks=len(items))
        return len(items)

    def close(self) -> None:
        try:
            self.client.close()
        except _ERRORS:
            pass
