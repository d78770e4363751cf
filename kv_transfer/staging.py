"""The sender of backends whose layer sends copy the blocks out on the compute thread and send them on the loop:
tcp (bytes on the socket), store (chunks in the shared store), nccl (a group send on the device).

Threading (why `submit_layer` exists). The prefill worker computes layers on a compute thread while
the sender's sockets live on an asyncio loop thread. For each finished layer the compute thread calls

    future = sender.submit_layer(request_id, layer, kv_caches[layer], src_block_ids, dst_block_ids)

(or, for all the chunks of a forward, `sends = sender.prepare_sends(chunks)` once and then
`sender.submit_prepared(sends, layer, kv_caches[layer])`: the checks run once and each chunk's block ids go
to the device once, at its first layer, instead of a synchronous host -> device copy per layer and chunk)
which, on the calling thread, has the data path `stage` the blocks (ordered after the layer's kernels on that
thread's stream: tcp and store gather into a host snapshot, `StagedBlocks`; nccl gathers on the device). It
then hands the staged blocks to the loop with `asyncio.run_coroutine_threadsafe` and returns at once, so layer
L+1 computes while layer L is on its way; on the loop the path's `send` moves them. `await finish(...)` (or
`run_coroutine_threadsafe(sender.finish(...), loop)` from the thread) waits for all of a request's layer sends
before "done" (control/outgoing.py), so "done" never overtakes a layer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from pdserve.kernels.block_copy import gather_blocks
from pdserve.kv_transfer.base import ChunkSend, KVTransferError, PreparedSends, ids_on
from pdserve.kv_transfer.checksum import crc32_threaded
from pdserve.kv_transfer.control.outgoing import ChannelSender, ControlChannel, layer_problem
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import tensor_bytes

S = TypeVar("S")
# one thread waits for the staged layers' copies to the host, in submission order: they complete in that order
# (the compute thread's stream), so one waiter loses nothing, and a forward's 32 layers in flight do not hold 32
# of asyncio's default threads while the GPU catches up with the launches
_WAITS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-staged")


@dataclass
class StagedBlocks:
    """A host snapshot of some blocks of one layer, ready once `event` (CUDA only) has completed."""

    host: torch.Tensor  # [2, n, block_size, Hkv, D], CPU
    event: torch.cuda.Event | None = None
    device_copy: torch.Tensor | None = None  # keeps the gathered device buffer alive until the copy ends

    @classmethod
    def gather(cls, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> StagedBlocks:
        blocks = gather_blocks(kv_cache, ids_on(kv_cache.device, block_ids))
        if kv_cache.device.type == "cpu":
            return cls(blocks)
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        host.copy_(blocks, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # its waiter sleeps in the driver, not spins
        event.record()
        return cls(host, event, blocks)

    async def ready(self) -> None:
        if self.event is not None:
            await asyncio.get_running_loop().run_in_executor(_WAITS, self.event.synchronize)
            self.device_copy = None

    async def checksum(self) -> int:
        """Once ready: the host bytes' CRC-32, large ones in pieces on the sums' threads (kv_transfer/checksum.py),
        so the loop writes other layers meanwhile and a layer's sum takes a fraction of one thread's time."""
        await self.ready()
        return await crc32_threaded(tensor_bytes(self.host))


class StagedPath(Protocol[S]):
    """A backend's data path: what a layer send does on each thread, and what is left in flight at the end."""

    def stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> S:
        """Compute thread: copy the blocks out of the pool, in the thread's stream order."""

    async def send(self, target: TransferTarget, layer: int, staged: S, dst_block_ids: list[int]) -> None:
        """Event loop: move them to the target's blocks `dst_block_ids` (KVTransferError when that fails)."""

    async def settle(self, request_id: str, failed: bool) -> None:
        """The request's sends were all made: wait for what is still in flight (KVTransferError if it failed)."""

    async def close(self) -> None:
        """Release connections, threads, stores."""


@dataclass
class _Prepared:
    """One chunk's part of a forward's sends: its target and, from its first layer on, its ids on the device."""

    chunk: ChunkSend
    target: TransferTarget
    ids: torch.Tensor | None = None


class _StagedSends(PreparedSends):
    def __init__(self, chunks: Sequence[ChunkSend]) -> None:
        super().__init__(chunks)
        self.prepared: list[_Prepared] = []


class StagedKVSender(ChannelSender, Generic[S]):
    def __init__(self, backend: str, channel: ControlChannel, path: StagedPath[S],
                 loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__(backend, channel, loop)
        self.path = path

    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        self.check_layer(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        await self._send(request_id, layer, self.path.stage(kv_cache, src_block_ids), list(dst_block_ids))

    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        loop = self.loop
        if loop is None:
            raise KVTransferError("submit_layer before begin(): the sender has no event loop yet")
        self.check_layer(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        staged = self.path.stage(kv_cache, src_block_ids)  # on the calling (compute) thread, in its stream order
        return asyncio.run_coroutine_threadsafe(self._send(request_id, layer, staged, list(dst_block_ids)), loop)

    def prepare_sends(self, chunks: Sequence[ChunkSend]) -> PreparedSends:
        sends = _StagedSends(chunks)
        sends.prepared = [_Prepared(chunk, target) for chunk, target in self.check_chunks(sends)]
        return sends

    def submit_prepared(self, sends: PreparedSends, layer: int, kv_cache: torch.Tensor) -> None:
        if not isinstance(sends, _StagedSends):
            super().submit_prepared(sends, layer, kv_cache)
            return
        loop = self.loop
        for item in sends.prepared:
            rid = item.chunk.request_id
            if rid in sends.failed:
                continue
            if loop is None:
                sends.fail(rid, f"send of {rid!r} layer {layer}: the sender has no event loop yet "
                                "(submit before begin())")
                continue
            problem = layer_problem(item.target, layer, kv_cache)
            if problem is not None:
                sends.fail(rid, f"send of {rid!r} layer {layer}: {problem}")
                continue
            if item.ids is None:
                item.ids = ids_on(kv_cache.device, item.chunk.src_block_ids)
            staged = self.path.stage(kv_cache, item.ids)  # on the calling (compute) thread, in its stream order
            asyncio.run_coroutine_threadsafe(self._send(rid, layer, staged, list(item.chunk.dst_block_ids)), loop)

    async def close(self) -> None:
        await self.path.close()

    async def _settle(self, request_id: str, failed: bool) -> None:
        await self.path.settle(request_id, failed)

    async def _send(self, request_id: str, layer: int, staged: S, dst_block_ids: list[int]) -> None:
        outgoing, done = self.track(request_id)  # before the first await (see control/outgoing.py)
        try:
            await self.path.send(outgoing.target, layer, staged, dst_block_ids)
            done.set_result(None)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # the caller gets it too: no "never retrieved" noise if finish never comes
            raise
