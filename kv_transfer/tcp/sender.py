"""`tcp` backend, prefill side: each layer's blocks as a "kv" frame on the control connection itself.

The sender is the staged one (kv_transfer/staging.py: host snapshot on the compute thread, the write on the
loop); its data path, `TcpBytes`, writes the snapshot as one frame through control/links.py, where "done" and
"error" go too, so no frame overtakes another to the same decode worker. One connection per receiver address,
opened on first use and kept; a failed write drops it and the next send reconnects. The loop is the one
`begin` runs on (or the `loop` argument).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Unpack

import torch

from pdserve.kv_transfer.control.links import ControlLinks, LinkOptions
from pdserve.kv_transfer.staging import StagedBlocks, StagedKVSender
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import kv_frame


class TcpBytes:
    """The `StagedPath` of tcp: a host snapshot, written as one kv frame."""

    def __init__(self, links: ControlLinks) -> None:
        self.links = links

    def stage(self, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> StagedBlocks:
        return StagedBlocks.gather(kv_cache, block_ids)

    async def send(self, target: TransferTarget, layer: int, staged: StagedBlocks, dst_block_ids: list[int]) -> None:
        checksum = await staged.checksum()
        await self.links.write(target.address, kv_frame(target.request_id, layer, dst_block_ids, staged.host, checksum))

    async def settle(self, request_id: str, failed: bool) -> None:
        """A written frame is the receiver's: nothing stays in flight."""

    async def close(self) -> None:
        await self.links.close()


class TcpKVSender(StagedKVSender[StagedBlocks]):
    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None, **options: Unpack[LinkOptions]) -> None:
        self.links = ControlLinks("tcp", **options)
        super().__init__("tcp", self.links, TcpBytes(self.links), loop)
