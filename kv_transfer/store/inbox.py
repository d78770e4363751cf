"""The `store` backend's control channel, prefill side: sealed records pushed to the decode worker's inbox.

    check(target) ─▶ the target names the store this worker writes (else: the flags that make them one)
    send(target, done | error) ─▶ push([record]);  push(target, records): the data path's kv_stored records

A record is a wire header sealed with the deployment's secret (records.py); pushes run on the I/O threads.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.cache_store.shared_store import SharedStore, StoreError
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.store.records import TransferSeal
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import Done, Error, Header


class Inbox:
    def __init__(self, store: SharedStore, io: ThreadPoolExecutor, *, secret: str | None, model_fingerprint: str,
                 ttl_s: int) -> None:
        self.store = store
        self.io = io
        self.secret = secret
        self.model_fingerprint = model_fingerprint
        self.ttl_s = ttl_s
        self._seals: dict[int, TransferSeal] = {}

    def seal(self, block_size: int) -> TransferSeal:
        if block_size not in self._seals:
            self._seals[block_size] = TransferSeal(self.secret, self.model_fingerprint, block_size)
        return self._seals[block_size]

    def check(self, target: TransferTarget) -> None:
        if target.store != self.store.store_id:
            raise KVTransferError(
                f"the decode worker reads the transfer store {target.store!r}, this worker writes "
                f"{self.store.store_id!r}: give every worker the same --transfer-store (and --redis-url, or "
                f"--transfer-store-dir on one host)")

    def begun(self, target: TransferTarget) -> None:
        """Nothing to open: the store was reached when this worker started."""

    async def send(self, target: TransferTarget, header: Done | Error) -> None:
        await self.push(target, [header])

    async def push(self, target: TransferTarget, records: list[Header]) -> None:
        """Seal and push records to the target's inbox, in order (KVTransferError when the store fails)."""
        assert target.inbox is not None
        seal = self.seal(target.block_size)
        inbox = seal.inbox_key(target.inbox)
        sealed = [seal.seal_record(inbox, record) for record in records]

        def push_all() -> None:
            for record in sealed:
                self.store.push(inbox, record, self.ttl_s)

        try:
            await asyncio.get_running_loop().run_in_executor(self.io, push_all)
        except (StoreError, OSError) as exc:
            raise KVTransferError(f"pushing {len(records)} records of {target.request_id!r} failed: {exc}") from exc
