"""`nccl` backend, decode side: the control server (kv_transfer/control/server.py); the KV bytes arrive through a
process group, one per connection, which is the connection's data path (`GroupBytesIn`).

A connection's life (the control server's, with a group beside it):

    accept ─▶ hello ─▶ auth (HMAC) ─▶ ready ─▶ rendezvous{backend, store, key} ─▶ PairGroup.join(rank 0)
           ─▶ loop: kv_bulk header ─▶ the checks of a kv frame (request, layer, blocks, dtype, shape, nbytes ≤ limit)
                    ─▶ buffer [2, n, block_size, Hkv, D] on the pool's device ─▶ group recv ─▶ wait
                    ─▶ scatter_blocks into pools[layer] ─▶ record the layer
                    done / error ─▶ end_transfer, as every backend
           ─▶ close: the group is given up; requests this connection carried that are still pending fail

Nothing is allocated before the header passed the checks, and the receive is posted with exactly the
header's size (see group.py: gloo ends the process on a larger message). A receive that fails or passes its
deadline (`group_timeout_s`: a dead or stalled peer) drops the connection like a bad frame. One receive is in
flight per connection; its frames are handled in order, which is the order the sender posted its sends. That
costs a round trip per layer: about 2.3 ms per layer over gloo on the 2-core dev box (30 layers of 96 KiB, P and D
in two processes: `python benchmarks/transfer_backends.py --devices cpu cpu --presets smollm2-135m --tokens 64 --backends
nccl`), mostly the thread hand-offs; if the two-GPU run shows it dominating (16 MiB layers take ~0.1 ms over
NVLink), post the next receives before the current one completes.
Frames of a request that ended meanwhile are still received (the group's stream must stay aligned) and dropped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, Unpack

import torch

from pdserve.cache_store.kv_codec import DTYPES
from pdserve.kernels.block_copy import scatter_blocks
from pdserve.kv_transfer.base import KVTransferError, OnComplete, OnFailure
from pdserve.kv_transfer.control.server import (
    ConnectionPath,
    DataFrame,
    ListeningReceiver,
    ListenOptions,
    check_frame,
)
from pdserve.kv_transfer.nccl.group import (
    RECEIVER_RANK,
    PairGroup,
    RendezvousStore,
    group_backend,
    in_thread,
)
from pdserve.kv_transfer.wire import (
    BulkKVHeader,
    Header,
    KVHeader,
    ProtocolError,
    Rendezvous,
    encode_frame,
    write_frame,
)

T = TypeVar("T")


class GroupBytesIn(ConnectionPath):
    """One connection's group: kv_bulk headers on the socket, their blocks received through the group."""

    carries = (BulkKVHeader,)

    def __init__(self, receiver: NcclKVReceiver, group: PairGroup) -> None:
        self.receiver = receiver
        self.group = group

    def refusal(self, header: Header, backend: str) -> str:
        if isinstance(header, KVHeader):
            return "an nccl connection carries no kv frames: the bytes go through the process group"
        return super().refusal(header, backend)

    async def receive(self, header: DataFrame, reader: asyncio.StreamReader) -> None:
        assert isinstance(header, BulkKVHeader)
        receiver = self.receiver
        check_frame(receiver, header, header.bulk_nbytes)
        group = self.group
        pool = receiver.pools[header.layer]
        with group.side_stream():  # the buffer, the receive and the scatter: all ordered on the group's stream
            blocks = torch.empty(header.shape, dtype=DTYPES[header.dtype], device=pool.device)
            try:
                work = group.recv(blocks)
            except KVTransferError as exc:
                raise ProtocolError(str(exc)) from None
        what = f"receive of {header.request_id!r} layer {header.layer} ({header.bulk_nbytes} bytes)"
        try:
            await receiver.wait(in_thread(group.wait, work, what))
        except KVTransferError as exc:
            raise ProtocolError(str(exc)) from None
        if header.request_id not in receiver.table:
            return
        with group.side_stream():
            block_ids = torch.tensor(header.block_ids, dtype=torch.int64, device=pool.device)
            scatter_blocks(pool, block_ids, blocks)
        if pool.device.type == "cuda":  # recorded means written: D admits the request on this
            await receiver.wait(in_thread(group.synchronize))
        receiver.table.record_layer(header.request_id, header.layer, header.block_ids)

    def close(self) -> None:
        self.group.close()


class NcclKVReceiver(ListeningReceiver):
    backend = "nccl"

    def __init__(self, host: str, port: int, pools: Sequence[torch.Tensor], on_complete: OnComplete,
                 on_failure: OnFailure, *, group_timeout_s: float = 30.0, **options: Unpack[ListenOptions]) -> None:
        """`group_timeout_s`: how long a peer may take to join the group, and each layer's receive."""
        super().__init__(host, port, pools, on_complete, on_failure, **options)
        if group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s must be positive, got {group_timeout_s}")
        self.device = self.pools[0].device
        self.group_backend = group_backend(self.device)
        self.group_timeout_s = group_timeout_s
        self._store: RendezvousStore | None = None
        self._waits: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        self._store = RendezvousStore(self.host, self.group_timeout_s)
        await super().start()

    async def close(self) -> None:
        # a handler awaiting a receive does not see its socket close: end those waits first
        for wait in list(self._waits):
            wait.cancel()
        await super().close()
        self._store = None

    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        """Name a fresh key of our store in the rendezvous, then join the pair's group as rank 0."""
        assert self._store is not None, "start() first"
        key = os.urandom(16).hex()
        timeout_ms = int(self.group_timeout_s * 1000)
        await write_frame(writer, encode_frame(Rendezvous(self.group_backend, self.advertise_host, self._store.port,
                                                          key, timeout_ms)))
        local_host = writer.get_extra_info("sockname")[0]
        try:
            group = await self.wait(in_thread(PairGroup.join, self.group_backend, self._store.prefixed(key),
                                              RECEIVER_RANK, self.device, local_host, self.group_timeout_s))
        except KVTransferError as exc:
            raise ProtocolError(f"the sender did not join the {self.group_backend} group: {exc}") from None
        return GroupBytesIn(self, group)

    async def wait(self, waiting: Coroutine[Any, Any, T]) -> T:
        """Await a thread's result; `close` cancels it (the thread itself ends at its own deadline)."""
        future = asyncio.ensure_future(waiting)
        self._waits.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise ProtocolError("receiver closed") from None
        finally:
            self._waits.discard(future)
