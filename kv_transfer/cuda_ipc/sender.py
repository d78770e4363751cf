"""`cuda_ipc` backend, prefill side: writes each finished layer's blocks straight into D's pool on the GPU.

The control path is tcp's (one authenticated connection per D, msgpack frames): right after "ready" D sends
its pool handles ("pools"), which this sender opens once per connection. Then, per finished layer, on the
compute thread:

    transfer stream waits for the compute stream (the layer's K/V writes are enqueued there)
    copy_blocks(P's pool[layer], src ids ─▶ D's pool[layer], dst ids)     one pass, on the transfer stream

so layer L is copied while layer L+1 computes. `finish` records one blocking CUDA event on the transfer stream
and waits for it in a worker thread (cudaEventBlockingSync: the thread sleeps in the driver, nothing polls)
and only then writes "done" on the control connection; D marks every layer received and admits the request. D never waits on a GPU
event itself: its next kernel is ordered after P's copies by that "done".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence

import torch

from pdserve.kernels.block_copy import copy_blocks
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.cuda_ipc.descriptor import PoolDescriptor, open_pools, require_cuda
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp_sender import TcpKVSender
from pdserve.kv_transfer.wire import Done, FrameLimits, Pools, ProtocolError, encode_frame, read_header


class CudaIpcKVSender(TcpKVSender):
    backend = "cuda_ipc"

    def __init__(
        self,
        device: torch.device | str,
        *,
        secret: str | None = None,
        connect_timeout_s: float = 5.0,
        write_timeout_s: float = 30.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`device`: the GPU of this worker's pool (where the copies run)."""
        self.device = torch.device(device)
        require_cuda("the prefill worker's KV pool", self.device)
        super().__init__(secret=secret, connect_timeout_s=connect_timeout_s, write_timeout_s=write_timeout_s,
                         loop=loop)
        self._remote: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._stream = torch.cuda.Stream(self.device)
        self._copied: set[str] = set()  # requests with copies enqueued: added on the compute thread, taken on the loop
        self._events_lock = threading.Lock()
        # the ids of the last copy, on the device: every layer of a chunk sends the same blocks, so 31 of
        # Llama-3-8B's 32 layers skip two host -> device copies
        self._ids: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    @property
    def transfer_stream(self) -> torch.cuda.Stream:
        """The stream the copies run on (ordered after the compute stream at each layer): wait on it, or
        record an event on it, to order or time work after the copies."""
        return self._stream

    def begin(self, target: TransferTarget) -> None:
        super().begin(target)
        if target.address not in self._remote:  # handshake now, while the request waits for its prefill
            task = asyncio.get_running_loop().create_task(self._ensure_remote(target.address))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure resurfaces on first use

    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        self._check(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        pools = await self._ensure_remote(self._get(request_id).target.address)
        self._copy(request_id, layer, kv_cache, pools, src_block_ids, dst_block_ids)

    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        """The copy is enqueued before this returns; the future is already resolved (errors raise here)."""
        self._check(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        pools = self._pools_from_thread(self._get(request_id).target.address)
        self._copy(request_id, layer, kv_cache, pools, src_block_ids, dst_block_ids)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_result(None)
        return future

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int
    ) -> None:
        outgoing = self._pop(request_id)
        event = self._take_event(request_id)
        if event is not None:
            await asyncio.to_thread(event.synchronize)
        logprob = None if first_logprob is None else float(first_logprob)
        await self._write(outgoing.target, encode_frame(Done(request_id, first_token_id, logprob, num_tokens)))

    async def abort(self, request_id: str, reason: str) -> None:
        event = self._take_event(request_id)
        if event is not None:  # D may reuse the blocks once told: let the copies already queued land first
            await asyncio.to_thread(event.synchronize)
        await super().abort(request_id, reason)

    # ---- internals ------------------------------------------------------------------------------

    def _copy(self, request_id: str, layer: int, kv_cache: torch.Tensor, pools: list[torch.Tensor],
              src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        if layer >= len(pools):
            raise KVTransferError(f"send of {request_id!r} layer {layer}: the receiver exported {len(pools)} layers")
        remote = pools[layer]
        if max(dst_block_ids) >= remote.shape[1] or tuple(remote.shape[2:]) != tuple(kv_cache.shape[2:]):
            raise KVTransferError(f"send of {request_id!r} layer {layer}: blocks {max(dst_block_ids)} / shape "
                                  f"{tuple(kv_cache.shape)} do not fit the receiver's pool {tuple(remote.shape)}")
        with torch.cuda.device(self.device):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):  # the id tensors are allocated (and freed) in this stream's order
                src, dst = self._device_ids(tuple(src_block_ids), tuple(dst_block_ids))
                copy_blocks(kv_cache, src, remote, dst)
        with self._events_lock:
            self._copied.add(request_id)

    def _device_ids(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Called on the transfer stream (the tensors live, and are freed, in its order)."""
        if self._ids is None or self._ids[:2] != (src, dst):
            # from pinned memory, non-blocking: a copy from pageable memory would make this thread wait for
            # the transfer stream, i.e. for the compute stream's layer in flight (the first H200 run: the
            # launch queue drained at every request's first layer)
            ids = torch.tensor([src, dst], dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
            self._ids = (src, dst, ids[0], ids[1])
        return self._ids[2], self._ids[3]

    def _take_event(self, request_id: str) -> torch.cuda.Event | None:
        """An event after every copy of the request, recorded now: they were all enqueued before finish/abort
        was called (the compute thread's layer_done calls happen before the prefill returns), and stream order
        makes one event cover them all: one record per request, not one per layer."""
        with self._events_lock:
            if request_id not in self._copied:
                return None
            self._copied.discard(request_id)
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)
        return event

    def _pools_from_thread(self, address: tuple[str, int]) -> list[torch.Tensor]:
        pools = self._remote.get(address)
        connection = self._connections.get(address)
        if pools is not None and connection is not None and connection.usable():
            return pools
        if self._loop is None:
            raise KVTransferError("submit_layer before begin(): the sender has no event loop yet")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise KVTransferError("submit_layer called on the sender's own loop: use `await send_layer(...)`")
        future = asyncio.run_coroutine_threadsafe(self._ensure_remote(address), self._loop)
        return future.result(timeout=2 * self.connect_timeout_s)

    async def _ensure_remote(self, address: tuple[str, int]) -> list[torch.Tensor]:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            try:
                await self._connection(address)
            except (OSError, TimeoutError, ProtocolError) as exc:
                self._drop(address)
                raise KVTransferError(f"cuda_ipc handshake with {address[0]}:{address[1]} failed: {exc!r}") from exc
        return self._remote[address]

    async def _after_ready(self, address: tuple[str, int], reader: asyncio.StreamReader) -> None:
        frame = await read_header(reader, FrameLimits(read_timeout_s=self.connect_timeout_s))
        if not isinstance(frame, Pools):
            raise ProtocolError(f"expected the receiver's pools after ready, got {type(frame).__name__}: is "
                                f"{address[0]}:{address[1]} a cuda_ipc receiver?")
        descriptor = PoolDescriptor.from_bytes(frame.descriptor)
        self._remote[address] = open_pools(descriptor, self.device)
