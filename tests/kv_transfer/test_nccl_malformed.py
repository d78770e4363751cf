"""nccl control frames the real peers never send. On the receiver each bad kv_bulk header drops its
connection before anything is allocated or received, fails the request it named and leaves the receiver
serving others; a stranger without the secret never learns a group's key. On the sender a bad or missing
rendezvous is a KVTransferError that says what was wrong."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import struct
import time
from collections.abc import AsyncIterator

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, assert_dropped, make_pools, raw_client
from nccl_peer import SECRET, joined_client
from test_nccl import serves_others

from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.nccl import NcclKVReceiver, NcclKVSender
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp import TcpKVReceiver
from pdserve.kv_transfer.wire import (
    Auth,
    BulkKVHeader,
    Error,
    FrameLimits,
    Hello,
    Pools,
    Ready,
    Rendezvous,
    auth_mac,
    encode_frame,
    kv_frame,
    read_header,
    write_frame,
)

BLOCK = [2, 1, 16, 2, 8]  # one block of the test pools
BLOCK_BYTES = 2 * 16 * 2 * 8 * 4  # 2048: float32
PAYLOAD_LIMIT = 4 * BLOCK_BYTES


def bulk(request_id: str = "victim", **changes: object) -> bytes:
    header = BulkKVHeader(request_id, 0, [3], "float32", list(BLOCK), BLOCK_BYTES)
    return bytes(encode_frame(dataclasses.replace(header, **changes))[0])


# case: (frame, why the connection is dropped, whether the victim request fails with it: it does when the
# frame named it and passed the request check, so the node frees its blocks; otherwise its lease ends it)
MALFORMED = {
    "claims_10GB": (bulk(bulk_nbytes=10 * 2**30), "nbytes 10737418240 != 2048", True),
    "claims_10GB_of_blocks": (bulk(shape=[2, 2_621_440, 16, 2, 8], bulk_nbytes=10 * 2**30), "shape", True),
    "over_the_payload_limit": (bulk(block_ids=[0, 1, 2, 3, 4], shape=[2, 5, 16, 2, 8], bulk_nbytes=5 * BLOCK_BYTES),
                               f"payload of {5 * BLOCK_BYTES} bytes exceeds the {PAYLOAD_LIMIT} byte limit", True),
    "wrong_dtype": (bulk(dtype="float16", bulk_nbytes=BLOCK_BYTES // 2), "dtype 'float16' is not the pool's", True),
    "unknown_dtype": (bulk(dtype="object"), "dtype 'object'", True),
    "wrong_shape": (bulk(shape=[2, 1, 16, 4, 4]), r"shape \[2, 1, 16, 4, 4\] != \[2, 1, 16, 2, 8\]", True),
    "unreserved_block": (bulk(block_ids=[6]), r"blocks \[6\] are not reserved", True),
    "duplicate_blocks": (bulk(block_ids=[3, 3]), "distinct", True),
    "bad_layer": (bulk(layer=NUM_LAYERS), "layer 3 outside", True),
    "unknown_request": (bulk(request_id="who"), "kv_bulk frame for unknown request id 'who'", False),
    "tcp_kv_frame": (b"".join(bytes(b) for b in kv_frame("victim", 0, [3], torch.zeros(BLOCK))),
                     "an nccl connection carries no kv frames", False),
    "second_rendezvous": (bytes(encode_frame(Rendezvous("gloo", "127.0.0.1", 1, "k", 1))[0]),
                          "unexpected rendezvous frame on a nccl connection", False),
    "length_4GiB": (struct.pack(">I", 0xFFFFFFFF), "header length 4294967295 outside", False),
}


@pytest.fixture
async def receiver(outcomes: Outcomes) -> AsyncIterator[NcclKVReceiver]:
    receiver = NcclKVReceiver("127.0.0.1", 0, make_pools(), outcomes.on_complete, outcomes.on_failure,
                              secret=SECRET, limits=FrameLimits(max_payload_bytes=PAYLOAD_LIMIT, read_timeout_s=5.0),
                              group_timeout_s=5.0)
    await receiver.start()
    yield receiver
    await receiver.close()


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_bad_control_frame_drops_the_connection_only(
    case: str, receiver: NcclKVReceiver, outcomes: Outcomes, caplog: pytest.LogCaptureFixture
) -> None:
    frame, message, fails_victim = MALFORMED[case]
    receiver.expect("victim", [0, 1, 2, 3, 4], deadline=time.monotonic() + 30)
    reader, writer, _, _ = await joined_client(receiver)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.control.server"):
        await write_frame(writer, [frame])
        await assert_dropped(reader)
    assert time.monotonic() - started < 1.0  # no receive was posted: it would have waited 5 s for the bytes
    assert re.search(message, caplog.text), caplog.text
    if fails_victim:
        await outcomes.wait("victim")
        assert outcomes.failed["victim"].startswith("protocol error")
        assert re.search(message, outcomes.failed["victim"]), outcomes.failed["victim"]
    else:
        assert "victim" not in outcomes.failed and receiver.num_pending == 1
    assert not any(pool.any() for pool in receiver.pools), "nothing was written into the pools"
    writer.close()
    await serves_others(receiver, outcomes)


async def test_a_stranger_without_the_secret_never_learns_the_group_key(receiver: NcclKVReceiver) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    hello = await read_header(reader, FrameLimits())
    assert isinstance(hello, Hello)
    await write_frame(writer, encode_frame(Auth(auth_mac("wrong", hello.nonce))))
    refusal = await read_header(reader, FrameLimits())
    assert isinstance(refusal, Error) and "authentication failed" in refusal.reason
    await assert_dropped(reader)  # and no rendezvous frame came before the close
    writer.close()


async def test_a_tcp_receiver_refuses_bulk_headers(outcomes: Outcomes, caplog: pytest.LogCaptureFixture) -> None:
    receiver = TcpKVReceiver("127.0.0.1", 0, make_pools(), outcomes.on_complete, outcomes.on_failure)
    await receiver.start()
    reader, writer = await raw_client(receiver)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.control.server"):
        await write_frame(writer, [bulk()])
        await assert_dropped(reader)
    assert "unexpected kv_bulk frame on a tcp connection" in caplog.text
    writer.close()
    await receiver.close()


# ---- the sender's side -------------------------------------------------------------------------------


async def fake_receiver(after_ready: list[bytes]) -> tuple[asyncio.Server, int]:
    """Hello / auth / ready like a real receiver, then `after_ready` frames, then silence."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_frame(writer, encode_frame(Hello(os.urandom(16))))
        await read_header(reader, FrameLimits())
        await write_frame(writer, encode_frame(Ready()))
        for frame in after_ready:
            await write_frame(writer, [frame])
        await reader.read()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def rendezvous(**changes: object) -> bytes:
    frame = Rendezvous("gloo", "127.0.0.1", 29500, "a" * 32, 2000)
    return bytes(encode_frame(dataclasses.replace(frame, **changes))[0])


@pytest.mark.parametrize("frames,message", [
    ([rendezvous(backend="nccl")], "needs a nccl group, this prefill worker's pool on cpu a gloo one"),
    ([rendezvous(key="")], "rendezvous key of 0 characters"),
    ([rendezvous(key="k" * 200)], "rendezvous key of 200 characters"),
    ([rendezvous(timeout_ms=0)], "rendezvous timeout 0 ms"),
    ([rendezvous(store_port=0)], "is not an address"),
    ([bytes(encode_frame(Pools(b"x"))[0])], "expected the receiver's rendezvous after ready, got Pools"),
    ([], "no rendezvous from 127.0.0.1:.* is it an nccl receiver"),
])
async def test_sender_refuses_a_bad_rendezvous(frames: list[bytes], message: str) -> None:
    server, port = await fake_receiver(frames)
    sender = NcclKVSender("cpu", connect_timeout_s=0.5)
    sender.begin(TransferTarget("nccl", "r", (0,), NUM_LAYERS, 16, "float32", "127.0.0.1", port))
    started = time.monotonic()
    with pytest.raises(KVTransferError, match=message):
        await sender.send_layer("r", 0, make_pools()[0], [0], [0])
    assert time.monotonic() - started < 3.0
    await sender.close()
    server.close()
