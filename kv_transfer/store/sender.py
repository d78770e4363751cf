"""`store` backend, prefill side: each finished layer's blocks go into the shared store, a record to D's inbox.

tcp's flow (kv_transfer/tcp_sender.py), with the store where the socket was. On the compute thread, per layer,
the blocks are gathered into a host snapshot (tcp's `StagedBlocks`: on CUDA a pinned copy ordered by an event)
and handed to the event loop. There, per layer send, on the I/O threads:

    split into chunks of at most `chunk_bytes` (whole blocks)   ─▶ per chunk: CRC-32, seal, put under its key
    ─▶ once the previous send's records are pushed: a kv_stored record per chunk to D's inbox

so the chunks of different layers are written in parallel while their records reach D in the order the layers
were sent (a block split between two forwards goes twice: the complete second copy must land last). `finish`
waits for every send's records, then pushes `done` with the first token; a failed put or push fails the
request (its record `error` is pushed, best effort) and `finish` raises, as tcp's does. Nothing here waits for
D: once `done` is pushed the KV is in the store, whatever becomes of this process.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch

from pdserve.cache_store.shared_store import SharedStore, StoreError
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.store.records import TransferSeal, chunk_bounds
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp_sender import StagedBlocks, TcpKVSender, _Outgoing
from pdserve.kv_transfer.wire import Error, Header, StoredKV, done_frame, dtype_name, tensor_bytes


class StoreKVSender(TcpKVSender):
    backend: ClassVar[str] = "store"

    def __init__(self, store: SharedStore, *, secret: str | None = None, model_fingerprint: str = "",
                 chunk_bytes: int = 4 << 20, ttl_s: int = 300, io_threads: int = 4,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`store`: where D reads (its target must name the same store_id); `ttl_s`: how long a value waits for D
        at most; `chunk_bytes`: the largest value (benchmarks/transfer_backends.py measured the choice)."""
        if chunk_bytes <= 0 or ttl_s <= 0 or io_threads <= 0:
            raise ValueError(f"chunk_bytes, ttl_s and io_threads must be positive: {chunk_bytes}, {ttl_s}, {io_threads}")
        super().__init__(secret=secret, loop=loop)
        self.store = store
        self.model_fingerprint = model_fingerprint
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s
        self._seals: dict[int, TransferSeal] = {}
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="store-send")
        self._parts: dict[str, int] = {}  # request id -> the next chunk's number
        self._pushed: dict[str, asyncio.Future[None]] = {}  # request id -> its last send's records pushed

    def begin(self, target: TransferTarget) -> None:
        if target.backend != self.backend:
            raise KVTransferError(f"{self.backend} sender got a {target.backend!r} target for {target.request_id!r}")
        if target.store != self.store.store_id:
            raise KVTransferError(
                f"the decode worker reads the transfer store {target.store!r}, this worker writes "
                f"{self.store.store_id!r}: give every worker the same --transfer-store (and --redis-url, or "
                f"--transfer-store-dir on one host)")
        if target.request_id in self._transfers:
            raise KVTransferError(f"transfer for {target.request_id!r} already begun")
        self._loop = self._loop or asyncio.get_running_loop()
        self._transfers[target.request_id] = _Outgoing(target)
        self._parts[target.request_id] = 0

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        outgoing = self._pop(request_id)
        failures = [r for r in await asyncio.gather(*outgoing.sends, return_exceptions=True) if r is not None]
        if failures:
            await self._push_quietly(outgoing.target, Error(request_id, f"layer send failed: {failures[0]}"))
            raise KVTransferError(f"transfer of {request_id!r}: {len(failures)} layer sends failed") from failures[0]
        logprob = None if first_logprob is None else float(first_logprob)
        await self._push(outgoing.target, [done_frame(request_id, first_token_id, logprob, num_tokens, first_top)])

    async def abort(self, request_id: str, reason: str) -> None:
        outgoing = self._transfers.get(request_id)
        if outgoing is None:
            return
        self._pop(request_id)
        await asyncio.gather(*outgoing.sends, return_exceptions=True)
        await self._push_quietly(outgoing.target, Error(request_id, reason))

    async def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    # ---- internals ------------------------------------------------------------------------------

    def _pop(self, request_id: str) -> _Outgoing:
        self._parts.pop(request_id, None)
        self._pushed.pop(request_id, None)
        return super()._pop(request_id)

    def _seal(self, block_size: int) -> TransferSeal:
        if block_size not in self._seals:
            self._seals[block_size] = TransferSeal(self.secret, self.model_fingerprint, block_size)
        return self._seals[block_size]

    async def _send_staged(
        self, request_id: str, layer: int, staged: StagedBlocks, dst_block_ids: Sequence[int]
    ) -> None:
        # Registered before the first await: a finish() scheduled after this send always waits for it.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        outgoing = self._get(request_id)
        outgoing.sends.append(done)
        previous = self._pushed.get(request_id)
        pushed = self._pushed[request_id] = loop.create_future()
        bounds = chunk_bounds(len(dst_block_ids), staged.host[:, :1].nbytes, self.chunk_bytes)
        first_part = self._parts[request_id]
        self._parts[request_id] = first_part + len(bounds)
        try:
            await staged.ready()
            records = await loop.run_in_executor(self._io, self._put_chunks, outgoing.target, layer, staged.host,
                                                 list(dst_block_ids), bounds, first_part)
            if previous is not None:
                await asyncio.wait([previous])  # in order; its failure is its own send's
            await self._push(outgoing.target, records)
            done.set_result(None)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except (StoreError, OSError, ValueError) as exc:
            error = KVTransferError(f"store send of {request_id!r} layer {layer} failed: {exc}")
            done.set_exception(error)
            done.exception()  # the caller gets it too: no "never retrieved" noise if finish never comes
            raise error from exc
        finally:
            pushed.set_result(None)

    def _put_chunks(self, target: TransferTarget, layer: int, host: torch.Tensor, dst_block_ids: list[int],
                    bounds: list[tuple[int, int]], first_part: int) -> list[Header]:
        """I/O thread: every chunk of one layer's send into the store; their records, in order."""
        assert target.token is not None
        seal, records = self._seal(target.block_size), list[Header]()
        dtype = dtype_name(host.dtype)
        for part, (lo, hi) in enumerate(bounds, start=first_part):
            blocks = host[:, lo:hi]
            payload = tensor_bytes(blocks)
            key = seal.chunk_key(target.token, part)
            self.store.put(key, [payload, seal.value_seal(key, payload)], self.ttl_s)
            records.append(StoredKV(target.request_id, layer, dst_block_ids[lo:hi], dtype, list(blocks.shape),
                                    payload.nbytes, zlib.crc32(payload), part))
        return records

    async def _push(self, target: TransferTarget, records: list[Header]) -> None:
        assert target.inbox is not None
        seal = self._seal(target.block_size)
        inbox = seal.inbox_key(target.inbox)
        sealed = [seal.seal_record(inbox, record) for record in records]

        def push_all() -> None:
            for record in sealed:
                self.store.push(inbox, record, self.ttl_s)

        try:
            await asyncio.get_running_loop().run_in_executor(self._io, push_all)
        except (StoreError, OSError) as exc:
            raise KVTransferError(f"pushing {len(records)} records of {target.request_id!r} failed: {exc}") from exc

    async def _push_quietly(self, target: TransferTarget, header: Error) -> None:
        try:
            await self._push(target, [header])
        except KVTransferError:
            pass  # D's lease, or the router, ends what it waits for
