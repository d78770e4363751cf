"""`tcp` backend, decode side: the control server (kv_transfer/control/server.py) whose connections also carry
the KV bytes, as "kv" frames written into the layer pools.

    kv frame ─▶ checks (below) ─▶ payload ─▶ crc32 ─▶ scatter_blocks into pools[layer] ─▶ record the layer

Checks before the payload is read, so nothing is allocated for a bad frame: the request id is expected;
the layer exists; block ids are distinct and reserved for that request; dtype is the pool's and on the
whitelist; shape is [2, n, block_size, Hkv, D] of the pool with n = len(block_ids); nbytes equals
prod(shape) * itemsize and is within FrameLimits.max_payload_bytes. Any violation drops the connection.

The payload is received straight into a host buffer (pinned for a CUDA pool: kv_transfer/payload_reader.py),
its CRC-32 summed in 1 MiB pieces on the sums' threads as they arrive (wire.read_payload, kv_transfer/checksum.py);
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
from pdserve.kv_transfer.control.server import ConnectionPath, DataFrame, ListeningReceiver, check_frame
from pdserve.kv_transfer.payload_reader import PayloadReader
from pdserve.kv_transfer.wire import KVHeader, read_payload, tensor_from_payload


class TcpBytesIn(ConnectionPath):
    carries = (KVHeader,)

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    async def receive(self, header: DataFrame, reader: PayloadReader) -> None:
        """Frames of a request that ended meanwhile (lease expired, cancelled) are read and dropped, so
        one expired request does not cost the other requests sharing its connection."""
        assert isinstance(header, KVHeader)
        receiver = self.receiver
        check_frame(receiver, header, header.nbytes)
        pool = receiver.pools[header.layer]
        host = torch.empty(header.nbytes, dtype=torch.uint8, pin_memory=pool.device.type == "cuda")
        await read_payload(reader, header, receiver.limits, memoryview(host.numpy()))
        if header.request_id not in receiver.table:
            return
        receiver.write_blocks(header.request_id, header.layer, header.block_ids, tensor_from_payload(host, header))


class TcpKVReceiver(ListeningReceiver):
    backend = "tcp"

    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        return TcpBytesIn(self)
