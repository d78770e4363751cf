"""`store` backend, prefill side: each finished layer's blocks go into the shared store, a record to D's inbox.

The sender is the staged one (kv_transfer/staging.py), with the store where tcp has its socket: on the compute
thread, per layer, the blocks are gathered into a host snapshot (`StagedBlocks`: on CUDA a pinned copy ordered
by an event) and handed to the event loop. There the data path, `StoreWrites`, per layer send, on the I/O
threads:

    split into chunks of at most `chunk_bytes` (whole blocks)   ─▶ per chunk: CRC-32, seal, put under its key
    ─▶ once the previous send's records are pushed: a kv_stored record per chunk to D's inbox

so the chunks of different layers are written in parallel while their records reach D in the order the layers
were sent (a block split between two forwards goes twice: the complete second copy must land last). The
control channel is the inbox (inbox.py): `finish` waits for every send's records, then pushes `done` with the
first token; a failed put or push fails the request (its record `error` is pushed, best effort) and `finish`
raises (kv_transfer/control/outgoing.py). Nothing here waits for D: once `done` is pushed the KV is in the
store, whatever becomes of this process.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.cache_store.shared_store import SharedStore, StoreError
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.staging import StagedBlocks, StagedKVSender
from pdserve.kv_transfer.store.inbox import Inbox
from pdserve.kv_transfer.store.records import chunk_bounds
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import Header, StoredKV, dtype_name, tensor_bytes


class StoreWrites:
    """The `StagedPath` of store: a host snapshot, put in chunks, announced by records pushed in send order."""

    def __init__(self, inbox: Inbox, chunk_bytes: int) -> None:
        self.inbox = inbox
        self.store = inbox.store
        self.chunk_bytes = chunk_bytes
        self._parts: dict[str, int] = {}  # request id -> the next chunk's number
        self._pushed: dict[str, asyncio.Future[None]] = {}  # request id -> its last send's records pushed

    def stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> StagedBlocks:
        return StagedBlocks.gather(kv_cache, block_ids)

    async def send(self, target: TransferTarget, layer: int, staged: StagedBlocks, dst_block_ids: list[int]) -> None:
        # Up to the first await, in send order: the chunk numbers and the chain of pushes.
        request_id = target.request_id
        loop = asyncio.get_running_loop()
        previous = self._pushed.get(request_id)
        pushed = self._pushed[request_id] = loop.create_future()
        bounds = chunk_bounds(len(dst_block_ids), staged.host[:, :1].nbytes, self.chunk_bytes)
        first_part = self._parts.get(request_id, 0)
        self._parts[request_id] = first_part + len(bounds)
        try:
            await staged.ready()
            records = await loop.run_in_executor(self.inbox.io, self._put_chunks, target, layer, staged.host,
                                                 dst_block_ids, bounds, first_part)
            if previous is not None:
                await asyncio.wait([previous])  # in order; its failure is its own send's
            await self.inbox.push(target, records)
        except (StoreError, OSError, ValueError) as exc:
            raise KVTransferError(f"store send of {request_id!r} layer {layer} failed: {exc}") from exc
        finally:
            pushed.set_result(None)

    async def settle(self, request_id: str, failed: bool) -> None:
        """Every record was pushed by the sends themselves: forget the request's chunk numbering."""
        self._parts.pop(request_id, None)
        self._pushed.pop(request_id, None)

    async def close(self) -> None:
        self.inbox.io.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def _put_chunks(self, target: TransferTarget, layer: int, host: torch.Tensor, dst_block_ids: list[int],
                    bounds: list[tuple[int, int]], first_part: int) -> list[Header]:
        """I/O thread: every chunk of one layer's send into the store; their records, in order."""
        assert target.token is not None
        seal, records = self.inbox.seal(target.block_size), list[Header]()
        dtype = dtype_name(host.dtype)
        for part, (lo, hi) in enumerate(bounds, start=first_part):
            blocks = host[:, lo:hi]
            payload = tensor_bytes(blocks)
            key = seal.chunk_key(target.token, part)
            self.store.put(key, [payload, seal.value_seal(key, payload)], self.inbox.ttl_s)
            records.append(StoredKV(target.request_id, layer, dst_block_ids[lo:hi], dtype, list(blocks.shape),
                                    payload.nbytes, zlib.crc32(payload), part))
        return records


class StoreKVSender(StagedKVSender[StagedBlocks]):
    def __init__(self, store: SharedStore, *, secret: str | None = None, model_fingerprint: str = "",
                 chunk_bytes: int = 4 << 20, ttl_s: int = 300, io_threads: int = 4,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`store`: where D reads (its target must name the same store_id); `ttl_s`: how long a value waits for D
        at most; `chunk_bytes`: the largest value (benchmarks/transfer_backends.py measured the choice)."""
        if chunk_bytes <= 0 or ttl_s <= 0 or io_threads <= 0:
            raise ValueError(f"chunk_bytes, ttl_s and io_threads must be positive: {chunk_bytes}, {ttl_s}, {io_threads}")
        self.store = store
        io = ThreadPoolExecutor(io_threads, thread_name_prefix="store-send")
        self.inbox = Inbox(store, io, secret=secret, model_fingerprint=model_fingerprint, ttl_s=ttl_s)
        super().__init__("store", self.inbox, StoreWrites(self.inbox, chunk_bytes), loop)
