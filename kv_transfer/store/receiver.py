"""`store` backend, decode side: listens on its inbox in the shared store and loads each chunk as it lands.

    expect(request)   ─▶ a random token for it; the target names the store, this receiver's inbox, the token
    kv_stored record  ─▶ the checks of a tcp kv frame (request, layer, reserved blocks, dtype, shape, size)
                      ─▶ I/O thread: take the value (exactly stored_nbytes + seal, then gone), seal, CRC-32,
                         into pinned memory for a CUDA pool
                      ─▶ event loop, in record order: scatter into pools[layer] (a CUDA pool's copy queued, never
                         waited for), record the layer (renews the lease)
    done / error      ─▶ once every load before it was applied: end_transfer, as every backend
                         (kv_transfer/control/server.py)
    lost              ─▶ (pushed by this receiver to its own inbox when the router saw the sender go, so it comes
                         after every record the sender pushed) no done before it: the transfer fails now
    a sender's stream ends (shm: its connection; the records it pushed were all delivered first): what it
                         left without done fails now

Loads run in parallel on the I/O threads; their blocks are written into the pool only on the event loop, in
the order the records came, and only while the request is still expected, so nothing writes a block that the
node freed (abort, lease, failure) and a block sent twice (split between two forwards) ends with its second,
complete copy. What a request still has in the store when it ends (loads not taken, late records) is deleted;
the store's TTL (Redis) or `expire_old` (shm) drops the rest.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import warnings
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.cache_store.kv_codec import DTYPES
from pdserve.cache_store.redis_auth import ForgedValueError
from pdserve.cache_store.shared_store import Listening, SharedStore, StoreError
from pdserve.kv_transfer.base import KVReceiver, OnComplete, OnFailure
from pdserve.kv_transfer.control.server import end_transfer
from pdserve.kv_transfer.store.records import TransferSeal, stored_size
from pdserve.kv_transfer.wire import Done, Error, FrameLimits, Header, Lost, ProtocolError, StoredKV

logger = logging.getLogger(__name__)
_REMEMBERED = 4096  # ended requests whose late records are recognised (and their values deleted)


class LoadError(Exception):
    """A chunk that cannot be used: missing, of another size, forged or damaged."""


@dataclass
class _Incoming:
    token: str
    loads: deque[tuple[StoredKV, asyncio.Future[torch.Tensor]]] = field(default_factory=deque)
    end: Done | Error | Lost | None = None
    source: object = None  # the sender's stream its records came on (shm)
    keys: set[str] = field(default_factory=set)  # announced, not yet taken


class StoreKVReceiver(KVReceiver):
    backend = "store"

    def __init__(self, pools: Sequence[torch.Tensor], on_complete: OnComplete, on_failure: OnFailure, *,
                 store: SharedStore, secret: str | None = None, model_fingerprint: str = "",
                 limits: FrameLimits | None = None, io_threads: int = 4, expire_after_s: float = 300.0) -> None:
        """`expire_after_s`: values older than this that nobody took are dropped (shm; Redis keys have TTLs)."""
        super().__init__(pools, self._completed(on_complete), self._failed(on_failure))
        self.store = store
        self.limits = limits or FrameLimits()
        self.inbox = secrets.token_hex(8)
        self.seal = TransferSeal(secret, model_fingerprint, self.layout.block_size)
        self.inbox_key = self.seal.inbox_key(self.inbox)
        self.expire_after_s = expire_after_s
        self.num_bad_records = 0
        self._incoming: dict[str, _Incoming] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> token
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="store-load")
        self._listening: Listening | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._listening = await self.store.listen(self.inbox_key, self._deliver, self._sender_ended)
        self._sweep()
        logger.info("KV receiver listening on the %s transfer store (%s)", self.store.kind, self.store.store_id)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._listening is not None:
            await self._listening.close()
        await super().close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def _address(self, request_id: str) -> dict[str, Any]:
        """A fresh random token names this reservation's values in the store (expect: just registered)."""
        token = secrets.token_hex(16)
        self._incoming[request_id] = _Incoming(token)
        return {"store": self.store.store_id, "inbox": self.inbox, "token": token}

    def cancel(self, request_id: str) -> bool:
        cancelled = super().cancel(request_id)
        self._forget(request_id)
        return cancelled

    def sender_lost(self, request_id: str, reason: str) -> None:
        incoming = self._incoming.get(request_id)
        if incoming is None or incoming.end is not None or not self.store.orders_all_senders:
            return  # ended, done on its way, or (shm) the sender's connection closing tells
        record = self.seal.seal_record(self.inbox_key, Lost(request_id, reason))
        future = asyncio.get_running_loop().run_in_executor(self._io, self.store.push, self.inbox_key, record,
                                                            int(self.expire_after_s))
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self.table.fail(
            request_id, f"the prefill worker was lost ({reason}) and the store could not be asked: {f.exception()}"))

    # ---- records --------------------------------------------------------------------------------

    def _deliver(self, raw: bytes, source: object) -> None:
        try:
            header = self.seal.open_record(self.inbox_key, raw)
        except ProtocolError as exc:
            self.num_bad_records += 1
            logger.warning("dropped a record from the %s transfer store: %s", self.store.kind, exc)
            return
        if not isinstance(header, StoredKV | Done | Error | Lost):
            self.num_bad_records += 1
            logger.warning("dropped a %s record: not a store transfer's", header.KIND)
            return
        incoming = self._incoming.get(header.request_id)
        if incoming is None:
            self._late(header)
            return
        incoming.source = incoming.source if isinstance(header, Lost) else source
        if isinstance(header, StoredKV):
            self._load(header, incoming)
        elif incoming.end is None:
            incoming.end = header
            self._drain(header.request_id)

    def _late(self, header: Header) -> None:
        """A record of a request that ended (or was never expected here): delete its value, nothing else."""
        token = self._ended.get(getattr(header, "request_id", ""))
        if token is None:
            self.num_bad_records += 1
            logger.warning("dropped a %s record for unknown request %r", header.KIND, getattr(header, "request_id", ""))
        elif isinstance(header, StoredKV):
            self._delete([self.seal.chunk_key(token, header.part)])

    def _load(self, header: StoredKV, incoming: _Incoming) -> None:
        rid = header.request_id
        problem = self.check_blocks(rid, header.layer, header.block_ids, header.dtype, header.shape,
                                     header.stored_nbytes)
        key = self.seal.chunk_key(incoming.token, header.part)
        if problem is not None:
            self._delete([key])
            self.table.fail(rid, f"kv_stored record for layer {header.layer}: {problem}")
            return
        incoming.keys.add(key)
        future = asyncio.get_running_loop().run_in_executor(self._io, self._read_chunk, key, header)
        incoming.loads.append((header, future))
        future.add_done_callback(lambda _: self._drain(rid))

    def _read_chunk(self, key: str, header: StoredKV) -> torch.Tensor:
        """I/O thread: the chunk's blocks once its size, seal and CRC-32 passed, on the host: in pinned memory for
        a CUDA pool, so that `write_blocks` (on the loop) queues the copy to the device behind the step in flight.
        A copy to the device from the store's pageable bytes, made here, would wait for that step: this thread's
        stream is the decode loop's (the default one)."""
        try:
            value = self.store.take(key, stored_size(header.stored_nbytes))
        except StoreError as exc:
            raise LoadError(str(exc)) from exc
        if value is None:
            raise LoadError(f"chunk {header.part} (layer {header.layer}) is missing from the store or not "
                            f"{header.stored_nbytes} bytes: expired, deleted, or never written")
        try:
            payload = self.seal.open_value(key, value)
        except ForgedValueError as exc:
            raise LoadError(f"chunk {header.part} (layer {header.layer}): {exc}") from None
        if zlib.crc32(payload) != header.checksum:
            raise LoadError(f"chunk {header.part} (layer {header.layer}): checksum mismatch")
        with warnings.catch_warnings():  # a read-only buffer (Redis's bytes): only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.frombuffer(payload, dtype=DTYPES[header.dtype]).view(header.shape)
        return blocks.pin_memory() if self.pools[header.layer].device.type == "cuda" else blocks

    def _drain(self, request_id: str) -> None:
        """Event loop: apply the finished loads at the head of the request's queue, in order; then its end."""
        incoming = self._incoming.get(request_id)
        while incoming is not None and incoming.loads and incoming.loads[0][1].done():
            header, future = incoming.loads.popleft()
            incoming.keys.discard(self.seal.chunk_key(incoming.token, header.part))
            if future.cancelled() or future.exception() is not None:
                self.table.fail(request_id, f"loading KV from the store failed: {future.exception()}")
                return
            self.write_blocks(request_id, header.layer, header.block_ids, future.result())
        if incoming is None or incoming.loads or incoming.end is None:
            return
        end = incoming.end
        if isinstance(end, Lost):
            self.table.fail(request_id, f"the prefill worker was lost before its KV landed: {end.reason}")
        else:
            end_transfer(self.table, end)

    def _sender_ended(self, source: object) -> None:
        for rid, incoming in list(self._incoming.items()):
            if incoming.source is source and incoming.end is None:
                incoming.end = Lost(rid, "its connection to the store's inbox closed before done")
                self._drain(rid)

    # ---- ends -----------------------------------------------------------------------------------

    def _completed(self, on_complete: OnComplete) -> OnComplete:
        def completed(request_id: str, *args: object) -> None:
            self._forget(request_id)
            on_complete(request_id, *args)  # type: ignore[arg-type]
        return completed

    def _failed(self, on_failure: OnFailure) -> OnFailure:
        def failed(request_id: str, reason: str) -> None:
            self._forget(request_id)
            on_failure(request_id, reason)
        return failed

    def _forget(self, request_id: str) -> None:
        """The request ended: its late records are recognised, what it left in the store is deleted."""
        incoming = self._incoming.pop(request_id, None)
        if incoming is None:
            return
        self._ended[request_id] = incoming.token
        if len(self._ended) > _REMEMBERED:
            self._ended.popitem(last=False)
        if incoming.keys:
            self._delete(list(incoming.keys))

    def _delete(self, keys: list[str]) -> None:
        future = self._io.submit(self.store.delete, keys)
        future.add_done_callback(_log_failure("deleting transfer values"))

    def _sweep(self) -> None:
        future = self._io.submit(self.store.expire_old, self.expire_after_s)
        future.add_done_callback(_log_failure("expiring transfer values"))
        self._sweeper = asyncio.get_running_loop().call_later(self.expire_after_s / 2, self._sweep)


def _log_failure(what: str) -> Callable[[object], None]:
    def check(future: object) -> None:
        exc = future.exception() if not future.cancelled() else None  # type: ignore[attr-defined]
        if exc is not None:
            logger.warning("%s failed: %s", what, exc)
    return check

