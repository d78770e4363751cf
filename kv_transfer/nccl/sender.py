"""`nccl` backend, prefill side: layer frames announced on the control connection, bytes through the group.

The sender is the staged one (kv_transfer/staging.py), its data path `NcclSends`. Per D one authenticated
control connection (kv_transfer/control/links.py, reused) and, beside it, one two-rank process group whose
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
from typing import Any, Unpack

import torch

from pdserve.kernels.block_copy import gather_blocks
from pdserve.kv_transfer.base import KVTransferError, ids_on
from pdserve.kv_transfer.control.links import ControlLinks, LinkOptions
from pdserve.kv_transfer.nccl.group import (
    SENDER_RANK,
    PairGroup,
    client_store,
    group_backend,
    in_thread,
    local_address,
)
from pdserve.kv_transfer.staging import StagedKVSender
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import (
    BulkKVHeader,
    FrameLimits,
    ProtocolError,
    Rendezvous,
    dtype_name,
    encode_frame,
    read_header,
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
    address: tuple[str, int]


class NcclSends:
    """The `StagedPath` of nccl: blocks gathered on the device, announced by a kv_bulk header, sent by the group."""

    def __init__(self, device: torch.device, options: LinkOptions) -> None:
        self.device = device
        self.group_backend = group_backend(device)
        self.links = ControlLinks("nccl", after_ready=self._join, on_drop=self._close_group, preconnect=True, **options)
        self._groups: dict[tuple[str, int], PairGroup] = {}
        self._posted: dict[str, list[_Posted]] = {}

    def stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> _Gathered:
        return _Gathered.of(kv_cache, block_ids)

    async def send(self, target: TransferTarget, layer: int, gathered: _Gathered, dst_block_ids: list[int]) -> None:
        blocks = gathered.blocks
        header = BulkKVHeader(target.request_id, layer, dst_block_ids, dtype_name(blocks.dtype), list(blocks.shape),
                              blocks.numel() * blocks.element_size())
        address = target.address
        # header and send under one lock: D receives in header order, so in the order the sends were posted
        def post() -> tuple[Any, PairGroup]:
            group = self._groups[address]
            return group.send(blocks, after=gathered.event), group

        work, group = await self.links.write_then(address, encode_frame(header), post)
        what = f"send of {header.request_id!r} layer {header.layer} ({header.bulk_nbytes} bytes)"
        self._posted.setdefault(target.request_id, []).append(_Posted(work, blocks, group, what, address))

    async def settle(self, request_id: str, failed: bool) -> None:
        """Every posted send of the request completed (a daemon thread, each with the group's deadline)."""
        posted = self._posted.pop(request_id, [])
        if failed or not posted:
            return
        try:
            await in_thread(_wait_all, posted)
        except KVTransferError:
            self.links.drop(posted[0].address)  # the group's stream is out of step: start afresh
            raise

    async def close(self) -> None:
        await self.links.close()
        for group in self._groups.values():
            group.close()
        self._groups.clear()

    async def _join(self, address: tuple[str, int], reader: asyncio.StreamReader) -> None:
        """The links' after-ready step: read D's rendezvous and join its group as rank 1."""
        wait = self.links.connect_timeout_s  # a tcp or cuda_ipc receiver sends no rendezvous: do not wait for ever
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
        self._close_group(address)
        self._groups[address] = group

    def _close_group(self, address: tuple[str, int]) -> None:
        group = self._groups.pop(address, None)
        if group is not None:
            group.close()


class NcclKVSender(StagedKVSender[_Gathered]):
    def __init__(self, device: torch.device | str, *, loop: asyncio.AbstractEventLoop | None = None,
                 **options: Unpack[LinkOptions]) -> None:
        """`device`: this worker's pool (cuda: an NCCL group; cpu: gloo). The group's deadlines are D's."""
        self.device = torch.device(device)
        sends = NcclSends(self.device, options)
        self.links = sends.links
        super().__init__("nccl", sends.links, sends, loop)


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
