"""`cuda_ipc` backend, decode side: the control server (kv_transfer/control/server.py), plus the pool handles
it hands out.

The pools are exported once, at construction (one reference per layer in torch's IPC counter files, whatever
the number of connections); every sender that passes the HMAC handshake gets them in a "pools" frame right
after "ready", so a stranger without the secret never learns a handle. On such a connection no "kv" frame
may arrive (the sender writes into the pool itself); its "done" means every layer of every reserved block
was written and the sender's copies have completed, so the request is recorded whole and completed at once
(`remote_writes`). A request whose sender vanishes before "done" fails by its lease, as with tcp. A request
the node gives up before "done" (the router aborted it) keeps its blocks until the sender's "error" (sent once
its queued copies have landed: kv_transfer/cuda_ipc/sender.py `abort`) or its lease of silence: nothing
reuses a block that P's kernels may still write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Unpack

import torch

from pdserve.kv_transfer.base import OnComplete, OnFailure
from pdserve.kv_transfer.control.server import ConnectionPath, ListeningReceiver, ListenOptions
from pdserve.kv_transfer.cuda_ipc.descriptor import export_pools, require_cuda
from pdserve.kv_transfer.wire import Header, KVHeader, Pools, encode_frame, write_frame


class NoBytesIn(ConnectionPath):
    """A cuda_ipc connection's data path: none, the sender's kernels write the pool."""

    def refusal(self, header: Header, backend: str) -> str:
        if isinstance(header, KVHeader):
            return "a cuda_ipc connection carries no kv frames: the sender writes into the pool"
        return super().refusal(header, backend)


class CudaIpcKVReceiver(ListeningReceiver):
    backend = "cuda_ipc"
    remote_writes = True  # P's copy kernels write our pool: an aborted request's blocks wait for its "error"

    def __init__(self, host: str, port: int, pools: Sequence[torch.Tensor], on_complete: OnComplete,
                 on_failure: OnFailure, **options: Unpack[ListenOptions]) -> None:
        if pools:
            require_cuda("the decode worker's KV pool", pools[0].device)
        super().__init__(host, port, pools, on_complete, on_failure, **options)
        self.descriptor = export_pools(self.pools).to_bytes()

    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        await write_frame(writer, encode_frame(Pools(self.descriptor)))
        return NoBytesIn()
