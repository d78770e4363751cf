"""`cuda_ipc` backend, prefill side: writes each finished layer's blocks straight into D's pool on the GPU.

The control channel is every socket backend's (kv_transfer/control/: one authenticated connection per D, msgpack
frames, done and error): right after "ready" D sends its pool handles ("pools"), which this sender opens once
per connection. Once per forward, on the compute thread, `prepare_sends` checks every chunk and puts the block
ids of all chunks bound for one receiver on the device (one pinned, non-blocking copy on the transfer stream);
then, per finished layer:

    transfer stream waits for the compute stream (the layer's K/V writes are enqueued there)
    copy_blocks(P's pool[layer], src ids ─▶ D's pool[layer], dst ids)     one launch per receiver, transfer stream

The copy is checked and set up at the first layer (kernels/block_copy.py prepare_copy) and the stream switched
once, so the step thread spends ~30 us a layer and returns (61-72 us before, on an H100 host:
benchmarks/kv_send_layer_cost_gpu.py; a forward of 256 chunks made 256 launches and id tensors a layer before
prepare_sends), and layer L is copied while layer L+1 computes. `finish` records one blocking CUDA event on the
transfer stream and waits for it in a worker thread (cudaEventBlockingSync: the thread sleeps in the driver,
nothing polls) and only then writes "done" on the control connection; D marks every layer received and admits
the request. D never waits on a GPU event itself: its next kernel is ordered after P's copies by that "done".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Unpack

import torch

from pdserve.kernels.block_copy import prepare_copy
from pdserve.kv_transfer.base import ChunkSend, KVTransferError, PreparedSends
from pdserve.kv_transfer.control.links import ControlLinks, LinkOptions
from pdserve.kv_transfer.control.outgoing import ChannelSender
from pdserve.kv_transfer.cuda_ipc.descriptor import PoolDescriptor, open_pools, require_cuda
from pdserve.kv_transfer.wire import FrameLimits, Pools, ProtocolError, dtype_name, read_header


def device_block_ids(src: Sequence[int], dst: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """src and dst ids as int64 rows of one [2, n + n % 2] tensor on `device`, copied from pinned memory without
    blocking (a pageable copy would make the calling thread wait for the stream, i.e. for the layer in flight:
    the first H200 run drained the launch queue at every request's first layer). The row length is even so the
    dst row starts 16-byte aligned, as the copy kernel is compiled for (kernels/block_copy_triton.py)."""
    pad = [0] * (len(src) % 2)
    host = torch.tensor([[*src, *pad], [*dst, *pad]], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    ids = host.to(device, non_blocking=True)
    return ids[0, : len(src)], ids[1, : len(src)]


@dataclass
class _Copy:
    """The blocks of one forward bound for one receiver: one copy launch per layer."""

    request_ids: list[str]
    pools: list[torch.Tensor]  # the receiver's, per layer
    src: torch.Tensor  # [n] int64 on our device
    dst: torch.Tensor  # [n] int64 on our device
    num_layers: int
    dtype: str
    block_size: int
    dead: bool = False
    launch: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # set up at the first layer sent

    def run(self, layer: int, kv_cache: torch.Tensor) -> None:
        if self.launch is None:
            self.launch = prepare_copy(kv_cache, self.src, self.pools[layer], self.dst)
        self.launch(kv_cache, self.pools[layer])


class _IpcSends(PreparedSends):
    def __init__(self, chunks: Sequence[ChunkSend]) -> None:
        super().__init__(chunks)
        self.copies: list[_Copy] = []


class CudaIpcKVSender(ChannelSender):
    def __init__(self, device: torch.device | str, *, loop: asyncio.AbstractEventLoop | None = None,
                 **options: Unpack[LinkOptions]) -> None:
        """`device`: the GPU of this worker's pool (where the copies run)."""
        self.device = torch.device(device)
        require_cuda("the prefill worker's KV pool", self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.links = ControlLinks("cuda_ipc", after_ready=self._open_pools, preconnect=True, **options)
        super().__init__("cuda_ipc", self.links, loop)
        self._remote: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._stream = torch.cuda.Stream(self.device)
        self._copied: set[str] = set()  # requests with copies enqueued: added on the compute thread, taken on the loop
        self._events_lock = threading.Lock()

    @property
    def transfer_stream(self) -> torch.cuda.Stream:
        """The stream the copies run on (ordered after the compute stream at each layer): wait on it, or
        record an event on it, to order or time work after the copies."""
        return self._stream

    def prepare_sends(self, chunks: Sequence[ChunkSend]) -> _IpcSends:
        """Checks each chunk once and groups them by receiver, ids on the device (see the module docstring)."""
        sends = _IpcSends(chunks)
        by_address: dict[tuple[str, int], list[ChunkSend]] = {}
        for chunk, target in self.check_chunks(sends):
            by_address.setdefault(target.address, []).append(chunk)
        for address, group in by_address.items():
            try:
                pools = self._pools_from_thread(address)
            except KVTransferError as exc:
                for chunk in group:
                    sends.fail(chunk.request_id, str(exc))
                continue
            self._add_copy(sends, group, pools)
        return sends

    def submit_prepared(self, sends: PreparedSends, layer: int, kv_cache: torch.Tensor) -> None:
        if not isinstance(sends, _IpcSends):
            super().submit_prepared(sends, layer, kv_cache)
            return
        live = []
        for copy in sends.copies:
            problem = None if copy.dead else self._copy_problem(copy, layer, kv_cache)
            if problem is not None:
                copy.dead = True
                for rid in copy.request_ids:
                    sends.fail(rid, f"send of {rid!r} layer {layer}: {problem}")
            elif not copy.dead:
                live.append(copy)
        if not live:
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        if torch.cuda.current_device() == self.device.index:  # the compute thread's own device: one stream switch
            torch.cuda.set_stream(self._stream)
            try:
                for copy in live:
                    copy.run(layer, kv_cache)
            finally:
                torch.cuda.set_stream(compute)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                for copy in live:
                    copy.run(layer, kv_cache)
        with self._events_lock:
            for copy in live:
                self._copied.update(copy.request_ids)

    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        self.check_layer(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        pools = await self._ensure_remote(self.outgoing(request_id).target.address)
        chunk = ChunkSend(request_id, tuple(src_block_ids), tuple(dst_block_ids))
        sends = _IpcSends([chunk])
        self._add_copy(sends, [chunk], pools)
        self._submit_one(sends, layer, kv_cache)

    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        """One request's layer (ids put on the device for this call alone: a forward should prepare its sends
        once instead). The copy is enqueued before this returns; the future is already resolved (errors
        raise here)."""
        self.check_layer(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        sends = self.prepare_sends([ChunkSend(request_id, tuple(src_block_ids), tuple(dst_block_ids))])
        self._submit_one(sends, layer, kv_cache)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_result(None)
        return future

    async def close(self) -> None:
        await self.links.close()

    # ---- internals ------------------------------------------------------------------------------

    def _add_copy(self, sends: _IpcSends, chunks: list[ChunkSend], pools: list[torch.Tensor]) -> None:
        """One copy for these chunks (all bound for the receiver owning `pools`), less those that do not fit."""
        fitting = []
        for chunk in chunks:
            if max(chunk.dst_block_ids) >= pools[0].shape[1]:
                sends.fail(chunk.request_id, f"send of {chunk.request_id!r}: block {max(chunk.dst_block_ids)} is "
                                             f"outside the receiver's pool {tuple(pools[0].shape)}")
            else:
                fitting.append(chunk)
        if not fitting:
            return
        target = self.outgoing(fitting[0].request_id).target
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):  # ids allocated (and freed) in its order
            src, dst = device_block_ids([b for c in fitting for b in c.src_block_ids],
                                        [b for c in fitting for b in c.dst_block_ids], self.device)
        sends.copies.append(_Copy([c.request_id for c in fitting], pools, src, dst,
                                  min(len(pools), target.num_layers), target.dtype, target.block_size))

    @staticmethod
    def _copy_problem(copy: _Copy, layer: int, kv_cache: torch.Tensor) -> str | None:
        if not 0 <= layer < copy.num_layers:
            return f"layer outside the receiver's {copy.num_layers} layers"
        if dtype_name(kv_cache.dtype) != copy.dtype or kv_cache.shape[2] != copy.block_size:
            return f"cache {kv_cache.dtype} block_size {kv_cache.shape[2]} vs target {copy.dtype} {copy.block_size}"
        remote = copy.pools[layer]
        if tuple(remote.shape[2:]) != tuple(kv_cache.shape[2:]):
            return f"cache {tuple(kv_cache.shape)} does not fit the receiver's pool {tuple(remote.shape)}"
        return None

    def _submit_one(self, sends: _IpcSends, layer: int, kv_cache: torch.Tensor) -> None:
        """A one-chunk send: its failure raises."""
        if not sends.failed:
            self.submit_prepared(sends, layer, kv_cache)
        for reason in sends.failed.values():
            raise KVTransferError(reason)

    async def _settle(self, request_id: str, failed: bool) -> None:
        """Before "done" (finish) or "error" (abort: D may reuse the blocks once told): the copies queued land."""
        event = self._take_event(request_id)
        if event is not None:
            await asyncio.to_thread(event.synchronize)

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
        if pools is not None and self.links.usable(address):
            return pools
        loop = self.loop
        if loop is None:
            raise KVTransferError("submit_layer before begin(): the sender has no event loop yet")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise KVTransferError("submit_layer called on the sender's own loop: use `await send_layer(...)`")
        future = asyncio.run_coroutine_threadsafe(self._ensure_remote(address), loop)
        try:
            return future.result(timeout=2 * self.links.connect_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVTransferError(f"cuda_ipc handshake with {address[0]}:{address[1]} took over "
                                  f"{2 * self.links.connect_timeout_s:g} s") from None

    async def _ensure_remote(self, address: tuple[str, int]) -> list[torch.Tensor]:
        await self.links.connect(address)
        return self._remote[address]

    async def _open_pools(self, address: tuple[str, int], reader: asyncio.StreamReader) -> None:
        """The links' after-ready step: read D's pool handles and open them on our device."""
        frame = await read_header(reader, FrameLimits(read_timeout_s=self.links.connect_timeout_s))
        if not isinstance(frame, Pools):
            raise ProtocolError(f"expected the receiver's pools after ready, got {type(frame).__name__}: is "
                                f"{address[0]}:{address[1]} a cuda_ipc receiver?")
        descriptor = PoolDescriptor.from_bytes(frame.descriptor)
        self._remote[address] = open_pools(descriptor, self.device)
