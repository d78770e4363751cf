"""`tcp` backend, prefill side: pushes layer frames to decode workers over reused asyncio connections.

Threading (why `submit_layer` exists). The prefill worker computes layers on a compute thread while
the sender's sockets live on an asyncio loop thread. For each finished layer the compute thread calls

    future = sender.submit_layer(request_id, layer, kv_caches[layer], src_block_ids, dst_block_ids)

(or, for all the chunks of a forward, `sends = sender.prepare_sends(chunks)` once and then
`sender.submit_prepared(sends, layer, kv_caches[layer])`: the checks run once and each chunk's block ids go
to the device once, at its first layer, instead of a synchronous host -> device copy per layer and chunk)
which, on the calling thread, gathers the blocks (ordered after the layer's kernels on that thread's
stream) into a snapshot: on CPU the gather is already a copy; on CUDA it is followed by a non-blocking
copy into pinned host memory and a recorded event. It then hands the snapshot to the loop with
`asyncio.run_coroutine_threadsafe`, and returns at once, so layer L+1 computes while layer L is on the
wire. On the loop the send waits for the event in a worker thread (never blocking the loop), then writes
the frame. `await finish(...)` (or `run_coroutine_threadsafe(sender.finish(...), loop)` from the thread)
waits for all of a request's layer sends before writing "done", so "done" never overtakes a layer.

One connection per receiver address, opened on first use and kept; frames to one address are written one
at a time under a lock (a frame is header + payload, never interleaved). A failed write drops the
connection; the next send reconnects. The loop is the one `begin` runs on (or the `loop` argument).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pdserve.kernels.block_copy import gather_blocks
from pdserve.kv_transfer.base import ChunkSend, KVSender, KVTransferError, PreparedSends
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import (
    Auth,
    Error,
    FrameLimits,
    Hello,
    ProtocolError,
    Ready,
    auth_mac,
    done_frame,
    dtype_name,
    encode_frame,
    kv_frame,
    read_header,
    write_frame,
)

logger = logging.getLogger(__name__)


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
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, blocks)

    async def ready(self) -> None:
        if self.event is not None:
            await asyncio.to_thread(self.event.synchronize)
            self.device_copy = None


def ids_on(device: torch.device, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Block ids as an int64 tensor on `device`; to a GPU from pinned memory without blocking (a pageable copy
    waits for the stream, i.e. for the layer being computed)."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    host = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class _Prepared:
    """One chunk's part of a forward's sends: its target and, from its first layer on, its ids on the device."""

    chunk: ChunkSend
    target: TransferTarget
    ids: torch.Tensor | None = None


class _TcpSends(PreparedSends):
    def __init__(self, chunks: Sequence[ChunkSend]) -> None:
        super().__init__(chunks)
        self.prepared: list[_Prepared] = []


@dataclass
class _Outgoing:
    target: TransferTarget
    sends: list[asyncio.Future[None]] = field(default_factory=list)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


class TcpKVSender(KVSender):
    backend: ClassVar[str] = "tcp"

    def __init__(
        self,
        *,
        secret: str | None = None,
        connect_timeout_s: float = 5.0,
        write_timeout_s: float = 30.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.secret = secret
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self._loop = loop
        self._transfers: dict[str, _Outgoing] = {}
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    def begin(self, target: TransferTarget) -> None:
        if target.backend != self.backend:
            raise KVTransferError(f"{self.backend} sender got a {target.backend!r} target for {target.request_id!r}")
        target.address  # noqa: B018 - raises when the target has no address
        if target.request_id in self._transfers:
            raise KVTransferError(f"transfer for {target.request_id!r} already begun")
        self._loop = self._loop or asyncio.get_running_loop()
        self._transfers[target.request_id] = _Outgoing(target)

    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        self._check(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        await self._send_staged(request_id, layer, self._stage(kv_cache, src_block_ids), list(dst_block_ids))

    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        if self._loop is None:
            raise KVTransferError("submit_layer before begin(): the sender has no event loop yet")
        self._check(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
        staged = self._stage(kv_cache, src_block_ids)  # on the calling (compute) thread, in its stream order
        return asyncio.run_coroutine_threadsafe(
            self._send_staged(request_id, layer, staged, list(dst_block_ids)), self._loop
        )

    def prepare_sends(self, chunks: Sequence[ChunkSend]) -> PreparedSends:
        sends = _TcpSends(chunks)
        for chunk in chunks:
            try:
                target = self._check_chunk(chunk.request_id, chunk.src_block_ids, chunk.dst_block_ids)
            except KVTransferError as exc:
                sends.fail(chunk.request_id, str(exc))
                continue
            sends.prepared.append(_Prepared(chunk, target))
        return sends

    def submit_prepared(self, sends: PreparedSends, layer: int, kv_cache: torch.Tensor) -> None:
        if not isinstance(sends, _TcpSends):
            super().submit_prepared(sends, layer, kv_cache)
            return
        loop = self._loop
        for item in sends.prepared:
            rid = item.chunk.request_id
            if rid in sends.failed:
                continue
            if loop is None:
                sends.fail(rid, f"send of {rid!r} layer {layer}: the sender has no event loop yet "
                                "(submit before begin())")
                continue
            problem = self._layer_problem(item.target, layer, kv_cache)
            if problem is not None:
                sends.fail(rid, f"send of {rid!r} layer {layer}: {problem}")
                continue
            if item.ids is None:
                item.ids = ids_on(kv_cache.device, item.chunk.src_block_ids)
            staged = self._stage(kv_cache, item.ids)  # on the calling (compute) thread, in its stream order
            asyncio.run_coroutine_threadsafe(self._send_staged(rid, layer, staged, item.chunk.dst_block_ids), loop)

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        outgoing = self._pop(request_id)
        failures = [r for r in await asyncio.gather(*outgoing.sends, return_exceptions=True) if r is not None]
        if failures:
            await self._write_quietly(outgoing.target, Error(request_id, f"layer send failed: {failures[0]}"))
            raise KVTransferError(f"transfer of {request_id!r}: {len(failures)} layer sends failed") from failures[0]
        logprob = None if first_logprob is None else float(first_logprob)
        await self._write(outgoing.target, encode_frame(done_frame(request_id, first_token_id, logprob, num_tokens, first_top)))

    async def abort(self, request_id: str, reason: str) -> None:
        outgoing = self._transfers.pop(request_id, None)
        if outgoing is None:
            return
        await asyncio.gather(*outgoing.sends, return_exceptions=True)
        await self._write_quietly(outgoing.target, Error(request_id, reason))

    async def close(self) -> None:
        for connection in self._connections.values():
            connection.writer.close()
        self._connections.clear()

    # ---- internals ------------------------------------------------------------------------------

    def _check(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        """Refuse what the receiver would refuse, before anything is copied or sent."""
        target = self._check_chunk(request_id, src_block_ids, dst_block_ids)
        problem = self._layer_problem(target, layer, kv_cache)
        if problem is not None:
            raise KVTransferError(f"send of {request_id!r} layer {layer}: {problem}")

    def _check_chunk(self, request_id: str, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int]) -> TransferTarget:
        """The checks that hold for every layer of a chunk; returns its target."""
        target = self._get(request_id).target
        problem = None
        if len(src_block_ids) != len(dst_block_ids) or not dst_block_ids:
            problem = f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks"
        elif not set(dst_block_ids) <= set(target.block_ids):
            problem = f"destination blocks {sorted(set(dst_block_ids) - set(target.block_ids))[:8]} not reserved"
        if problem is not None:
            raise KVTransferError(f"send of {request_id!r}: {problem}")
        return target

    @staticmethod
    def _layer_problem(target: TransferTarget, layer: int, kv_cache: torch.Tensor) -> str | None:
        if not 0 <= layer < target.num_layers:
            return f"layer {layer} outside 0..{target.num_layers - 1}"
        if dtype_name(kv_cache.dtype) != target.dtype or kv_cache.shape[2] != target.block_size:
            return f"cache {kv_cache.dtype} block_size {kv_cache.shape[2]} vs target {target.dtype} {target.block_size}"
        return None

    def _stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> Any:
        """What a layer's send carries away from the pool (a backend's own kind: nccl keeps it on the device)."""
        return StagedBlocks.gather(kv_cache, block_ids)

    async def _send_staged(
        self, request_id: str, layer: int, staged: StagedBlocks, dst_block_ids: Sequence[int]
    ) -> None:
        # Registered before the first await: a finish() scheduled after this send always waits for it.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outgoing = self._get(request_id)
        outgoing.sends.append(done)
        try:
            await staged.ready()
            await self._write(outgoing.target, kv_frame(request_id, layer, list(dst_block_ids), staged.host))
            done.set_result(None)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # the caller gets it too: no "never retrieved" noise if finish never comes
            raise

    async def _write(self, target: TransferTarget, buffers: list[bytes | memoryview]) -> None:
        address = target.address
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            try:
                connection = await self._connection(address)
                async with asyncio.timeout(self.write_timeout_s):
                    await write_frame(connection.writer, buffers)
            except (OSError, TimeoutError, ProtocolError) as exc:
                self._drop(address)
                raise KVTransferError(f"KV send to {address[0]}:{address[1]} failed: {exc!r}") from exc

    async def _write_quietly(self, target: TransferTarget, header: Error) -> None:
        try:
            await self._write(target, encode_frame(header))
        except KVTransferError as exc:
            logger.warning("could not tell %s that %s failed: %s", target.address, header.request_id, exc)

    async def _connection(self, address: tuple[str, int]) -> _Connection:
        connection = self._connections.get(address)
        if connection is not None and connection.usable():
            return connection
        self._drop(address)
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(*address)
            hello = await read_header(reader, FrameLimits(read_timeout_s=self.connect_timeout_s))
        if not isinstance(hello, Hello):
            writer.close()
            raise ProtocolError(f"expected a hello frame from {address}, got {type(hello).__name__}")
        mac = None if self.secret is None else auth_mac(self.secret, hello.nonce)
        async with asyncio.timeout(self.connect_timeout_s):
            await write_frame(writer, encode_frame(Auth(mac)))
            reply = await read_header(reader, FrameLimits(read_timeout_s=self.connect_timeout_s))
        if not isinstance(reply, Ready):
            writer.close()
            reason = reply.reason if isinstance(reply, Error) else f"a {type(reply).__name__} frame"
            raise ProtocolError(f"receiver refused the connection: {reason}")
        try:
            await self._after_ready(address, reader)
        except BaseException:
            writer.close()
            raise
        self._connections[address] = connection = _Connection(reader, writer)
        return connection

    async def _after_ready(self, address: tuple[str, int], reader: asyncio.StreamReader) -> None:
        """What a backend on this control path reads once accepted (cuda_ipc: the receiver's pools)."""

    def _drop(self, address: tuple[str, int]) -> None:
        connection = self._connections.pop(address, None)
        if connection is not None:
            connection.writer.close()

    def _get(self, request_id: str) -> _Outgoing:
        outgoing = self._transfers.get(request_id)
        if outgoing is None:
            raise KVTransferError(f"no transfer begun for {request_id!r}")
        return outgoing

    def _pop(self, request_id: str) -> _Outgoing:
        outgoing = self._get(request_id)
        del self._transfers[request_id]
        return outgoing
