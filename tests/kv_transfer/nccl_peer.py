"""The prefill side of the nccl tests, as a second process: `python nccl_peer.py MODE DEVICE TARGETS_JSON`.

send: pushes every layer of each target (blocks [1, 2, 5] of the seed-7 pools into the target's blocks), the
      first target's first two layers from a compute thread (submit_layer), the rest from the loop, then
      finishes each with first token 5, logprob -0.25, 40 tokens.
die:  joins the first target's group, announces its layer 0 in a kv_bulk header, and exits without sending
      the bytes (a prefill worker that crashes mid-layer).

Also the in-process helpers that join a receiver's group by hand, for frames the real sender never sends.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import torch
from kv_helpers import NUM_LAYERS, make_pools, raw_client

from pdserve.kv_transfer.nccl import NcclKVSender, PairGroup
from pdserve.kv_transfer.nccl.group import SENDER_RANK, client_store, in_thread
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp import TcpKVReceiver
from pdserve.kv_transfer.wire import (
    BulkKVHeader,
    FrameLimits,
    Rendezvous,
    encode_frame,
    read_header,
    write_frame,
)

SECRET = "s3cret"
SRC_BLOCKS = [1, 2, 5]
DTYPE_OF = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def sent_pools(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return make_pools(dtype, random=True, seed=7)


async def send(device: str, targets: list[TransferTarget]) -> None:
    pools = [p.to(device) for p in sent_pools(DTYPE_OF[targets[0].dtype])]
    sender = NcclKVSender(device, secret=SECRET)
    for target in targets:
        sender.begin(target)
    first, dst = targets[0], list(targets[0].block_ids)
    thread = threading.Thread(target=lambda: [sender.submit_layer(first.request_id, layer, pools[layer], SRC_BLOCKS,
                                                                  dst).result() for layer in (0, 1)])
    thread.start()
    await asyncio.to_thread(thread.join)
    await sender.send_layer(first.request_id, 2, pools[2], SRC_BLOCKS, dst)
    for target in targets[1:]:
        for layer in range(NUM_LAYERS):
            await sender.send_layer(target.request_id, layer, pools[layer], SRC_BLOCKS, list(target.block_ids))
    for target in targets:
        await sender.finish(target.request_id, 5, -0.25, 40)
    await sender.close()


async def die(device: str, target: TransferTarget) -> None:
    sender = NcclKVSender(device, secret=SECRET)
    await sender.links.connect(target.address)  # handshake + group join, as a first send would
    connection = sender.links.connections[target.address]
    shape = [2, len(target.block_ids), target.block_size, 2, 8]
    nbytes = 2 * len(target.block_ids) * target.block_size * 2 * 8 * DTYPE_OF[target.dtype].itemsize
    header = BulkKVHeader(target.request_id, 0, list(target.block_ids), target.dtype, shape, nbytes)
    await write_frame(connection.writer, encode_frame(header))
    os._exit(3)



async def joined_client(
    receiver: TcpKVReceiver, *, join: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Rendezvous, PairGroup | None]:
    """A hand-driven connection past the handshake; with `join`, also rank 1 of its group."""
    reader, writer = await raw_client(receiver, SECRET)
    frame = await read_header(reader, FrameLimits())
    assert isinstance(frame, Rendezvous), frame
    if not join:
        return reader, writer, frame, None
    store = await in_thread(client_store, "127.0.0.1", frame.store_port, frame.key, 5.0)
    group = await in_thread(PairGroup.join, frame.backend, store, SENDER_RANK, torch.device("cpu"), "127.0.0.1", 5.0)
    return reader, writer, frame, group


if __name__ == "__main__":
    mode, device, raw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    parsed = [TransferTarget.from_dict(t) for t in raw]
    asyncio.run(send(device, parsed) if mode == "send" else die(device, parsed[0]))
