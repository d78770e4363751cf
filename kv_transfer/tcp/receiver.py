"""`tcp` backend, decode side: the control server (kv_transfer/control/server.py) whose connections also carry
the KV bytes, as "kv" frames written into the layer pools.

    kv frame ─▶ checks (below) ─▶ payload ─▶ crc32 ─▶ scatter_blocks into pools[layer] ─▶ record the layer

Checks before the payload is read, so nothing is allocated for a bad frame: the request id is expected;
the layer exists; block ids are distinct and reserved for that request; dtype is the pool's and on the
whitelist; shape is [2, n, block_size, Hkv, D] of the pool with n = len(block_ids); nbytes equals
prod(shape) * itemsize and is within FrameLimits.max_payload_bytes. Any violation drops the connection.

The payload is received straight into a host buffer (pinned for a CUDA pool: kv_transfer/payload_reader.py),
its CRC-32 summed in 1 MiB pieces on the sums' threads as they arrive (wire.receive_payload, kv_transfer/checksum.py);
the scatter runs on the loop thread (on CUDA the copy to the device from the pinned buffer is queued, not
waited for). Before (asyncio's StreamReader, a pageable buffer, the sums on the loop) the receive path copied
every byte three times in user space and the sums took ~40 % of the time; on the 2-core dev box a 4,096-token Llama-3-8B KV
(benchmarks/transfer_backends.py --backends tcp) went 1,048 -> 776-790 ms in bf16 and 897 -> 321-385 ms in
fp8 (with the CPU scatter of fp8 blocks as words, kernels/block_copy.py); on an H100 host (CUDA pools, Python
3.12, base and change alternating in one call) 1,002 / 977 -> 374 / 353 ms in bf16 and 429 / 475 -> 200 / 194
ms in fp8 (benchmarks/results/transfer_tcp_receive_ab_h100.json). Those runs had both sides on asyncio's own
loop; the workers run uvloop, where the same A/B on the dev box gave bf16 784 / 741 -> 528 / 535 ms and fp8
735 / 757 -> 281 / 253 ms (results/transfer_tcp_receive_ab_uvloop_cpu.json; the benchmark now runs uvloop).
"""

from __future__ import annotations

import asyncio

import torch

from pdserve.kv_transfer.base import KVReceiver
from pdserve.kv_transfer.checksum import PieceSums
from pdserve.kv_transfer.control.server import ConnectionPath, DataFrame, ListeningReceiver, check_frame
from pdserve.kv_transfer.payload_reader import PayloadReader
from pdserve.kv_transfer.wire import (
    KVHeader,
    ProtocolError,
    receive_payload,
    tensor_from_payload,
    verify_payload,
)


class TcpBytesIn(ConnectionPath):
    """A frame's payload is received, then checked and written while the next frame arrives: the connection
    reads on as soon as the last byte is in, and the check (the last piece's sum) and the scatter follow. A frame
    is applied only after the one before it (stream order, so a block sent twice ends with its second copy) and
    before a "done" is acted on (`flush`); a bad checksum drops the connection at once, and is its reason."""

    carries = (KVHeader,)

    def __init__(self, receiver: KVReceiver, writer: asyncio.StreamWriter) -> None:
        self.receiver = receiver
        self.writer = writer
        self._applying: asyncio.Task[None] | None = None  # the last frame's check and write

    async def receive(self, header: DataFrame, reader: PayloadReader) -> None:
        assert isinstance(header, KVHeader)
        receiver = self.receiver
        check_frame(receiver, header, header.nbytes)
        pool = receiver.pools[header.layer]
        host = torch.empty(header.nbytes, dtype=torch.uint8, pin_memory=pool.device.type == "cuda")
        sums = await receive_payload(reader, header, receiver.limits, memoryview(host.numpy()))
        try:
            await self.flush()
        except BaseException:
            sums.cancel()
            raise
        self._applying = asyncio.ensure_future(self._apply(header, host, sums))

    async def _apply(self, header: KVHeader, host: torch.Tensor, sums: PieceSums) -> None:
        """Frames of a request that ended meanwhile (lease expired, cancelled) are dropped, so one expired
        request does not cost the other requests sharing its connection."""
        try:
            await verify_payload(sums, header)
        except ProtocolError:
            self.writer.transport.abort()  # the connection stops here, whatever it is waiting for
            raise
        receiver = self.receiver
        if header.request_id in receiver.table:
            receiver.write_blocks(header.request_id, header.layer, header.block_ids, tensor_from_payload(host, header))

    async def flush(self) -> None:
        applying, self._applying = self._applying, None
        if applying is not None:
            await applying

    def close(self) -> None:
        if self._applying is not None:
            self._applying.cancel()
            self._applying = None


class TcpKVReceiver(ListeningReceiver):
    backend = "tcp"

    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        return TcpBytesIn(self, writer)
