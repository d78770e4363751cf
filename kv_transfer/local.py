"""`local` backend: P and D in one process over ONE block pool, so nothing is copied.

The prefill side writes K/V straight into the blocks the decode side reserved; "sending" a layer only
records it as arrived (and copies within the pool when P computed into other blocks, e.g. a prefix hit
under a different block id). It runs the same expected-transfer bookkeeping as the network backends, so
`--role both` and the tests exercise the same completion and lease logic.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import torch

from pdserve.kernels.block_copy import gather_blocks, scatter_blocks
from pdserve.kv_transfer.base import KVReceiver, KVSender, KVTransferError
from pdserve.kv_transfer.target import TransferTarget


class LocalKVReceiver(KVReceiver):
    backend = "local"


class LocalKVSender(KVSender):
    shares_pool = True

    def __init__(self, receiver: LocalKVReceiver) -> None:
        self.receiver = receiver

    def begin(self, target: TransferTarget) -> None:
        if target.backend != "local":
            raise KVTransferError(f"local sender got a {target.backend!r} target for {target.request_id!r}")
        if target.request_id not in self.receiver.table:
            raise KVTransferError(f"request {target.request_id!r} is not expected by the local receiver")

    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        self._send(request_id, layer, kv_cache, src_block_ids, dst_block_ids)

    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        """Runs at once on the calling thread: the table is only read and written under the GIL."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            self._send(request_id, layer, kv_cache, src_block_ids, dst_block_ids)
            future.set_result(None)
        except KVTransferError as exc:
            future.set_exception(exc)
        return future

    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        if not self.receiver.table.complete(request_id, first_token_id, first_logprob, num_tokens, first_top):
            raise KVTransferError(f"request {request_id!r} is no longer expected (lease expired or cancelled)")

    async def abort(self, request_id: str, reason: str) -> None:
        self.receiver.table.fail(request_id, f"sender aborted: {reason}")

    def _send(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        table = self.receiver.table
        problem = table.check_layer(request_id, layer, dst_block_ids)
        if problem is None and len(src_block_ids) != len(dst_block_ids):
            problem = f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks"
        if problem is None and kv_cache.data_ptr() != self.receiver.pools[layer].data_ptr():
            problem = f"layer {layer}'s cache is not the shared pool: use a network backend"
        if problem is not None:
            raise KVTransferError(f"local send of {request_id!r} layer {layer}: {problem}")
        if list(src_block_ids) != list(dst_block_ids):
            src = torch.tensor(list(src_block_ids), dtype=torch.int64, device=kv_cache.device)
            dst = torch.tensor(list(dst_block_ids), dtype=torch.int64, device=kv_cache.device)
            scatter_blocks(kv_cache, dst, gather_blocks(kv_cache, src))
        table.record_layer(request_id, layer, dst_block_ids)
