"""`ChannelSender`: the prefill side's transfers in flight, and how each ends: "done" or "error" over the channel.

    begin(target)   ─▶ the target check (this backend's, addressable by the channel, not begun twice) ─▶ begun
    each layer send ─▶ track(request_id): a future registered before the send's first await, so that a finish
                       scheduled after the send always waits for it
    finish          ─▶ pop ─▶ every tracked send settled ─▶ _settle(request_id, failed) (what the data path
                       still has in flight: nccl's group sends, cuda_ipc's copies) ─▶ "done" with the first
                       token; any failure ─▶ "error" (best effort) and KVTransferError
    abort           ─▶ pop ─▶ the sends and _settle as above (D may reuse the blocks once told) ─▶ "error"

The channel is how done and error reach D: control/links.py (one authenticated connection per D: tcp,
cuda_ipc, nccl) or kv_transfer/store/inbox.py (sealed records in D's inbox). `check_chunk` / `check_layer`
refuse before anything is copied what the receiver would refuse. Every backend's sender but `local` is one:
kv_transfer/staging.py (tcp, nccl, store) and cuda_ipc/sender.py, each with its own data path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.kv_transfer.base import ChunkSend, KVSender, KVTransferError, PreparedSends
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import Done, Error, done_frame, dtype_name

logger = logging.getLogger(__name__)


class ControlChannel(Protocol):
    def check(self, target: TransferTarget) -> None:
        """Raise KVTransferError or ValueError when the channel cannot reach the target's receiver."""

    def begun(self, target: TransferTarget) -> None:
        """A transfer to the target was begun (on the sender's loop)."""

    async def send(self, target: TransferTarget, header: Done | Error) -> None:
        """Deliver a control message to the target's receiver; KVTransferError when it cannot."""


@dataclass
class Outgoing:
    target: TransferTarget
    sends: list[asyncio.Future[None]] = field(default_factory=list)


class ChannelSender(KVSender):
    def __init__(self, backend: str, channel: ControlChannel, loop: asyncio.AbstractEventLoop | None) -> None:
        """`loop`: the sender's event loop (default: the one the first `begin` runs on)."""
        self.backend = backend
        self.channel = channel
        self.loop = loop
        self._transfers: dict[str, Outgoing] = {}

    def begin(self, target: TransferTarget) -> None:
        if target.backend != self.backend:
            raise KVTransferError(f"{self.backend} sender got a {target.backend!r} target for {target.request_id!r}")
        self.channel.check(target)
        if target.request_id in self._transfers:
            raise KVTransferError(f"transfer for {target.request_id!r} already begun")
        self.loop = self.loop or asyncio.get_running_loop()
        self._transfers[target.request_id] = Outgoing(target)
        self.channel.begun(target)

    def outgoing(self, request_id: str) -> Outgoing:
        outgoing = self._transfers.get(request_id)
        if outgoing is None:
            raise KVTransferError(f"no transfer begun for {request_id!r}")
        return outgoing

    def track(self, request_id: str) -> tuple[Outgoing, asyncio.Future[None]]:
        """A layer send of the request starts: its future, which finish and abort wait for."""
        outgoing = self.outgoing(request_id)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outgoing.sends.append(done)
        return outgoing, done

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        outgoing = self.outgoing(request_id)
        del self._transfers[request_id]
        failures = await self._wait_sends(outgoing)
        try:
            await self._settle(request_id, bool(failures))
        except KVTransferError as exc:
            failures.append(exc)
        if failures:
            await self._send_quietly(outgoing.target, Error(request_id, f"layer send failed: {failures[0]}"))
            raise KVTransferError(f"transfer of {request_id!r}: {len(failures)} layer sends failed") from failures[0]
        logprob = None if first_logprob is None else float(first_logprob)
        await self.channel.send(outgoing.target, done_frame(request_id, first_token_id, logprob, num_tokens,
                                                            first_top))

    async def abort(self, request_id: str, reason: str) -> None:
        outgoing = self._transfers.pop(request_id, None)
        if outgoing is None:
            return
        await self._wait_sends(outgoing)
        try:  # D receives (or has written) what was sent before it reads the error: let those sends end first
            await self._settle(request_id, False)
        except KVTransferError as exc:
            logger.warning("sends of aborted %s failed: %s", request_id, exc)
        await self._send_quietly(outgoing.target, Error(request_id, reason))

    # ---- the target check ---------------------------------------------------------------------

    def check_chunk(self, request_id: str, src_block_ids: Sequence[int],
                    dst_block_ids: Sequence[int]) -> TransferTarget:
        """The checks that hold for every layer of a chunk; returns its target."""
        target = self.outgoing(request_id).target
        problem = None
        if len(src_block_ids) != len(dst_block_ids) or not dst_block_ids:
            problem = f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks"
        elif not set(dst_block_ids) <= set(target.block_ids):
            problem = f"destination blocks {sorted(set(dst_block_ids) - set(target.block_ids))[:8]} not reserved"
        if problem is not None:
            raise KVTransferError(f"send of {request_id!r}: {problem}")
        return target

    def check_chunks(self, sends: PreparedSends) -> list[tuple[ChunkSend, TransferTarget]]:
        """`check_chunk` for each chunk of a forward: the good ones with their targets; the others fail `sends`."""
        checked = []
        for chunk in sends.chunks:
            try:
                checked.append((chunk, self.check_chunk(chunk.request_id, chunk.src_block_ids, chunk.dst_block_ids)))
            except KVTransferError as exc:
                sends.fail(chunk.request_id, str(exc))
        return checked

    def check_layer(self, request_id: str, layer: int, kv_cache: torch.Tensor, src_block_ids: Sequence[int],
                    dst_block_ids: Sequence[int]) -> None:
        """Refuse what the receiver would refuse, before anything is copied or sent."""
        target = self.check_chunk(request_id, src_block_ids, dst_block_ids)
        problem = layer_problem(target, layer, kv_cache)
        if problem is not None:
            raise KVTransferError(f"send of {request_id!r} layer {layer}: {problem}")

    # ---- internals ----------------------------------------------------------------------------

    async def _settle(self, request_id: str, failed: bool) -> None:
        """The request's sends were all made (`failed`: one of them failed): wait for what the data path still
        has in flight for it; KVTransferError when that failed. Nothing, unless a backend says otherwise."""

    @staticmethod
    async def _wait_sends(outgoing: Outgoing) -> list[BaseException]:
        results = await asyncio.gather(*outgoing.sends, return_exceptions=True)
        return [r for r in results if r is not None]

    async def _send_quietly(self, target: TransferTarget, header: Error) -> None:
        try:
            await self.channel.send(target, header)
        except KVTransferError as exc:
            logger.warning("could not tell the receiver of %s that it failed: %s", header.request_id, exc)


def layer_problem(target: TransferTarget, layer: int, kv_cache: torch.Tensor) -> str | None:
    """Why this layer's cache cannot be sent to the target (None: it can)."""
    if not 0 <= layer < target.num_layers:
        return f"layer {layer} outside 0..{target.num_layers - 1}"
    if dtype_name(kv_cache.dtype) != target.dtype or kv_cache.shape[2] != target.block_size:
        return f"cache {kv_cache.dtype} block_size {kv_cache.shape[2]} vs target {target.dtype} {target.block_size}"
    return None
