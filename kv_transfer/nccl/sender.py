"""`nccl` backend, prefill side: layer frames announced on tcp's control connection, bytes through the group.

Per D one authenticated control connection (tcp's, reused) and, beside it, one two-rank process group whose
store and key D names in the "rendezvous" frame right after "ready" (group.py). Per finished layer, on the
compute thread (`submit_layer`) or the loop (`send_layer`):

    gather the request's blocks on the pool's device      [2, n, block_size, Hkv, D], one copy
    CUDA: record an event after the gather                  (the layer's kernels are on that stream)
    on the loop, under the connection's lock:
        write kv_bulk{request_id, layer, dst block ids, dtype, shape, bulk_nbytes}
        post group.send(blocks) on the group's side stream, after the event
    `finish`: wait for this request's sends (a daemon thread, each with the group's deadline) ─▶ "done"

Header and send are written under one lock, so D, which receives in header order, posts its receives in
the order the sends were posted. Layer L is on the wire while L+1 computes; `submit_layer`'s future resolves
once the send is posted, `finish` once every send completed and "done" is written. A send that fails or
passes its deadline (D died, or stopped receiving) fails the request; its connection and group are dropped,
and the next request opens new ones.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdserve.kernels.block_copy import gather_blocks
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.nccl.group import (
    SENDER_RANK,
    PairGroup,
    client_store,
    group_backend,
    in_thread,
    local_address,
)
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp_sender import TcpKVSender, ids_on
from pdserve.kv_transfer.wire import (
    BulkKVHeader,
    Error,
    FrameLimits,
    ProtocolError,
    Rendezvous,
    done_frame,
    dtype_name,
    encode_frame,
    read_header,
    write_frame,
)

MAX_GROUP_TIMEOUT_MS = 3_600_000


@dataclass
class _Gathered:
    """One layer's blocks on the pool's device, packed; on CUDA ready once `event` completed."""

    blocks: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def of(cls, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> _Gathered:
        blocks = gather_blocks(kv_cache, ids_on(kv_cache.device, block_ids)).contiguous()
        if kv_cache.device.type != "cuda":
            return cls(blocks, None)
        event = torch.cuda.Event()
        event.record()
        return cls(blocks, event)


@dataclass
class _Posted:
    work: Any  # torch.distributed Work
    blocks: torch.Tensor  # alive until the send completed
    group: PairGroup
    what: str


class NcclKVSender(TcpKVSender):
    backend: ClassVar[str] = "nccl"

    def __init__(
        self,
        device: torch.device | str,
        *,
        secret: str | None = None,
        connect_timeout_s: float = 5.0,
        write_timeout_s: float = 30.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`device`: this worker's pool (cuda: an NCCL group; cpu: gloo). The group's deadlines are D's."""
        self.device = torch.device(device)
        self.group_backend = group_backend(self.device)
        super().__init__(secret=secret, connect_timeout_s=connect_timeout_s, write_timeout_s=write_timeout_s,
                         loop=loop)
        self._groups: dict[tuple[str, int], PairGroup] = {}
        self._posted: dict[str, list[_Posted]] = {}

    def begin(self, target: TransferTarget) -> None:
        super().begin(target)
        self._posted[target.request_id] = []
        if target.address not in self._groups:  # handshake and join now, while the request waits for its prefill
            task = asyncio.get_running_loop().create_task(self._preconnect(target.address))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure resurfaces on first use

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        outgoing = self._pop(request_id)
        failures = [r for r in await asyncio.gather(*outgoing.sends, return_exceptions=True) if r is not None]
        if not failures:
            try:
                await in_thread(_wait_all, self._posted.pop(request_id, []))
            except KVTransferError as exc:
                self._drop(outgoing.target.address)  # the group's stream is out of step: start afresh
                failures.append(exc)
        self._posted.pop(request_id, None)
        if failures:
            await self._write_quietly(outgoing.target, Error(request_id, f"layer send failed: {failures[0]}"))
            raise KVTransferError(f"transfer of {request_id!r}: {len(failures)} layer sends failed") from failures[0]
        logprob = None if first_logprob is None else float(first_logprob)
        await self._write(outgoing.target, encode_frame(done_frame(request_id, first_token_id, logprob, num_tokens, first_top)))

    async def abort(self, request_id: str, reason: str) -> None:
        outgoing = self._transfers.get(request_id)
        if outgoing is not None:
            await asyncio.gather(*outgoing.sends, return_exceptions=True)
            try:  # D receives what was announced before it reads the error: let those sends end first
                await in_thread(_wait_all, self._posted.pop(request_id, []))
            except KVTransferError:
                self._drop(outgoing.target.address)
        await super().abort(request_id, reason)

    async def close(self) -> None:
        await super().close()
        for group in self._groups.values():
            group.close()
        self._groups.clear()

    # ---- internals ------------------------------------------------------------------------------

    def _stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> _Gathered:
        return _Gathered.of(kv_cache, block_ids)

    async def _send_staged(  # type: ignore[override]  # tcp's flow, with this backend's staged blocks
        self, request_id: str, layer: int, gathered: _Gathered, dst_block_ids: Sequence[int]
    ) -> None:
        # Registered before the first await: a finish() scheduled after this send always waits for it.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outgoing = self._get(request_id)
        outgoing.sends.append(done)
        blocks = gathered.blocks
        header = BulkKVHeader(request_id, layer, list(dst_block_ids), dtype_name(blocks.dtype), list(blocks.shape),
                              blocks.numel() * blocks.element_size())
        try:
            posted = await self._announce_and_post(outgoing.target.address, header, gathered)
            self._posted.setdefault(request_id, []).append(posted)
            done.set_result(None)
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # the caller gets it too: no "never retrieved" noise if finish never comes
            raise

    async def _announce_and_post(self, address: tuple[str, int], header: BulkKVHeader,
                                 gathered: _Gathered) -> _Posted:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            try:
                connection = await self._connection(address)
                async with asyncio.timeout(self.write_timeout_s):
                    await write_frame(connection.writer, encode_frame(header))
                group = self._groups[address]
                work = group.send(gathered.blocks, after=gathered.event)
            except (OSError, TimeoutError, ProtocolError, KVTransferError) as exc:
                self._drop(address)
                raise KVTransferError(f"KV send to {address[0]}:{address[1]} failed: {exc!r}") from exc
        what = f"send of {header.request_id!r} layer {header.layer} ({header.bulk_nbytes} bytes)"
        return _Posted(work, gathered.blocks, group, what)

    async def _preconnect(self, address: tuple[str, int]) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            try:
                await self._connection(address)
            except (OSError, TimeoutError, ProtocolError):
                self._drop(address)
                raise

    async def _after_ready(self, address: tuple[str, int], reader: asyncio.StreamReader) -> None:
        wait = self.connect_timeout_s  # a tcp or cuda_ipc receiver sends no rendezvous: do not wait for ever
        try:
            frame = await read_header(reader, FrameLimits(read_timeout_s=wait, idle_timeout_s=wait))
        except ProtocolError as exc:
            raise ProtocolError(f"no rendezvous from {address[0]}:{address[1]} after ready ({exc}): is it an "
                                f"nccl receiver?") from None
        if not isinstance(frame, Rendezvous):
            raise ProtocolError(f"expected the receiver's rendezvous after ready, got {type(frame).__name__}: is "
                                f"{address[0]}:{address[1]} an nccl receiver?")
        _check_rendezvous(frame, self.group_backend, self.device)
        store_host = address[0] if _is_wildcard(frame.store_host) else frame.store_host
        timeout_s = frame.timeout_ms / 1000
        try:
            store = await in_thread(client_store, store_host, frame.store_port, frame.key, timeout_s)
            group = await in_thread(PairGroup.join, frame.backend, store, SENDER_RANK, self.device,
                                    local_address(store_host, frame.store_port), timeout_s)
        except (KVTransferError, RuntimeError) as exc:  # RuntimeError: torch's store / group constructors
            raise ProtocolError(f"could not join the receiver's {frame.backend} group at {store_host}:"
                                f"{frame.store_port}: {str(exc).splitlines()[0][:300]}") from None
        old = self._groups.pop(address, None)
        if old is not None:
            old.close()
        self._groups[address] = group

    def _drop(self, address: tuple[str, int]) -> None:
        super()._drop(address)
        group = self._groups.pop(address, None)
        if group is not None:
            group.close()


def _wait_all(posted: list[_Posted]) -> None:
    """Blocking, for a thread: every send completed; the first failure raises."""
    for item in posted:
        item.group.wait(item.work, item.what)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _check_rendezvous(frame: Rendezvous, backend: str, device: torch.device) -> None:
    """Bound what the receiver sent before any of it is used."""
    if frame.backend != backend:
        raise ProtocolError(f"the receiver's pool needs a {frame.backend} group, this prefill worker's pool on "
                            f"{device} a {backend} one: put both pools on the same kind of device")
    if not 0 < frame.store_port < 65536 or not 0 < len(frame.store_host) <= 255:
        raise ProtocolError(f"rendezvous store {frame.store_host!r}:{frame.store_port} is not an address")
    if not 0 < len(frame.key) <= 128:
        raise ProtocolError(f"rendezvous key of {len(frame.key)} characters (1..128 expected)")
    if not 0 < frame.timeout_ms <= MAX_GROUP_TIMEOUT_MS:
        raise ProtocolError(f"rendezvous timeout {frame.timeout_ms} ms outside 1..{MAX_GROUP_TIMEOUT_MS}")
