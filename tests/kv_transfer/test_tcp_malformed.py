"""Frames the real sender never sends: each must drop its connection, allocate nothing, fail the request
it named (so the decode node frees the blocks), and leave the receiver serving everyone else."""

from __future__ import annotations

import dataclasses
import re
import struct
import time
import zlib

import msgpack
import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, assert_dropped, make_pools, raw_client, start_receiver

from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kv_transfer.wire import (
    Auth,
    Done,
    Error,
    FrameLimits,
    Hello,
    KVHeader,
    auth_mac,
    encode_frame,
    kv_frame,
    read_header,
    tensor_bytes,
)

BLOCK = [2, 1, 16, 2, 8]  # one block of the test pools
BLOCK_BYTES = 2 * 16 * 2 * 8 * 4  # 2048: float32


def valid_header(request_id: str = "victim", **changes: object) -> tuple[KVHeader, memoryview]:
    payload = tensor_bytes(torch.randn(BLOCK))
    header = KVHeader(request_id, 0, [3], "float32", list(BLOCK), BLOCK_BYTES, zlib.crc32(payload))
    return dataclasses.replace(header, **changes), payload


def header_only(**changes: object) -> bytes:
    """A kv frame's length prefix and header, without its payload."""
    header, _ = valid_header(**changes)
    return bytes(encode_frame(header)[0])


async def serves_others(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    sender = TcpKVSender()
    pools = make_pools(random=True)
    target = receiver.expect("bystander", [6], deadline=time.monotonic() + 5)
    sender.begin(target)
    for layer in range(NUM_LAYERS):
        await sender.send_layer("bystander", layer, pools[layer], [6], [6])
    await sender.finish("bystander", 1, None, 3)
    await outcomes.wait("bystander")
    assert "bystander" in outcomes.completed
    await sender.close()


MALFORMED = {
    "length_4GiB": (struct.pack(">I", 0xFFFFFFFF), None),
    "header_over_64KiB": (struct.pack(">I", 64 * 1024 + 1) + b"\x80" * 100, None),
    "garbage_header": (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", None),
    "not_a_map": (struct.pack(">I", 3) + msgpack.packb([1, 2]), None),
    "claims_10GB": (header_only(nbytes=10 * 2**30), "nbytes 10737418240 != 2048"),
    "claims_10GB_of_blocks": (header_only(shape=[2, 2_621_440, 16, 2, 8], nbytes=10 * 2**30), "shape"),
    "wrong_dtype": (header_only(dtype="float16", nbytes=BLOCK_BYTES // 2), "dtype 'float16' is not the pool's"),
    "unknown_dtype": (header_only(dtype="object"), "dtype 'object'"),
    "wrong_shape": (header_only(shape=[2, 1, 16, 4, 4]), r"shape \[2, 1, 16, 4, 4\] != \[2, 1, 16, 2, 8\]"),
    "unreserved_block": (header_only(block_ids=[5]), r"blocks \[5\] are not reserved"),
    "duplicate_blocks": (header_only(block_ids=[3, 3]), "distinct"),
    "bad_layer": (header_only(layer=NUM_LAYERS), "layer 3 outside"),
    "unknown_request": (header_only(request_id="who"), None),
    "truncated_payload": (header_only() + b"\x00" * 100, "closed after 100 of 2048"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_frame_drops_the_connection_only(
    case: str, receiver: TcpKVReceiver, outcomes: Outcomes
) -> None:
    data, failure = MALFORMED[case]
    receiver.expect("victim", [3, 4], deadline=time.monotonic() + 30)
    started = time.monotonic()
    reader, writer = await raw_client(receiver)
    writer.write(data)
    if case == "truncated_payload":
        writer.write_eof()
    await assert_dropped(reader)  # at once: nothing waits for a payload that was never sent
    assert time.monotonic() - started < 1.0
    if failure is None:
        assert "victim" not in outcomes.failed and receiver.num_pending == 1
    else:
        await outcomes.wait("victim")
        assert outcomes.failed["victim"].startswith("protocol error")
        assert re.search(failure, outcomes.failed["victim"]), outcomes.failed["victim"]
    assert not any(pool.any() for pool in receiver.pools), "nothing was written into the pools"
    writer.close()
    await serves_others(receiver, outcomes)


async def test_bad_checksum_is_caught_after_the_payload(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    receiver.expect("victim", [3], deadline=None)
    header, payload = valid_header(checksum=0)
    reader, writer = await raw_client(receiver)
    writer.writelines(encode_frame(header, payload))
    await assert_dropped(reader)
    await outcomes.wait("victim")
    assert "payload checksum" in outcomes.failed["victim"]
    assert not receiver.pools[0].any()
    await serves_others(receiver, outcomes)


async def test_payload_limit_is_configurable(outcomes: Outcomes) -> None:
    receiver = await start_receiver(outcomes)
    receiver.limits = FrameLimits(max_payload_bytes=BLOCK_BYTES)
    receiver.expect("victim", [3, 4], deadline=None)
    reader, writer = await raw_client(receiver)
    two_blocks = torch.zeros(2, 2, 16, 2, 8)
    writer.writelines(kv_frame("victim", 0, [3, 4], two_blocks))
    await assert_dropped(reader)
    await outcomes.wait("victim")
    assert "payload of 4096 bytes exceeds the 2048 byte limit" in outcomes.failed["victim"]
    await receiver.close()


async def test_bad_secret_is_refused_with_a_reason(outcomes: Outcomes) -> None:
    receiver = await start_receiver(outcomes, secret="s3cret")
    receiver.expect("victim", [3], deadline=None)
    for secret in (None, "guess"):
        reader, writer = await raw_client(receiver, handshake=False)
        hello = await read_header(reader, FrameLimits())
        assert isinstance(hello, Hello)
        writer.writelines(encode_frame(Auth(None if secret is None else auth_mac(secret, hello.nonce))))
        refusal = await read_header(reader, FrameLimits())
        assert isinstance(refusal, Error) and "authentication failed" in refusal.reason
        await assert_dropped(reader)
    assert receiver.num_pending == 1 and not outcomes.failed
    await receiver.close()


async def test_frames_before_auth_are_refused(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    receiver.expect("victim", [3], deadline=None)
    reader, writer = await raw_client(receiver, handshake=False)
    await read_header(reader, FrameLimits())
    writer.writelines(encode_frame(Done("victim", 1, None, 1)))
    refusal = await read_header(reader, FrameLimits())
    assert isinstance(refusal, Error) and "expected an auth frame first" in refusal.reason
    await assert_dropped(reader)
    assert receiver.num_pending == 1


async def test_connection_lost_mid_transfer_fails_the_request(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    receiver.expect("victim", [3], deadline=None)
    header, payload = valid_header()
    _reader, writer = await raw_client(receiver)
    writer.writelines(encode_frame(header, payload))
    await writer.drain()
    writer.close()
    await outcomes.wait("victim")
    assert outcomes.failed["victim"] == "connection closed before done"
    await serves_others(receiver, outcomes)
