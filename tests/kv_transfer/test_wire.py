from __future__ import annotations

import asyncio
import struct
import zlib

import msgpack
import pytest
import torch

from pdserve.kv_transfer.payload_reader import PayloadReader
from pdserve.kv_transfer.wire import (
    Auth,
    Done,
    Error,
    FrameLimits,
    Hello,
    KVHeader,
    ProtocolError,
    Ready,
    auth_mac,
    check_auth,
    decode_header,
    done_frame,
    dtype_name,
    encode_frame,
    kv_frame,
    read_header,
    read_payload,
    tensor_bytes,
    tensor_from_payload,
)


def header_bytes(buffers: list) -> bytes:
    return bytes(buffers[0])[4:]


def stream_of(data: bytes, eof: bool = True) -> PayloadReader:
    reader = PayloadReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


@pytest.mark.parametrize(
    "header",
    [
        Hello(b"n" * 16),
        Auth(None),
        Auth(b"m" * 32),
        Ready(),
        KVHeader("r", 1, [3, 4], "bfloat16", [2, 2, 16, 2, 8], 2048, 123),
        Done("r", 42, -0.25, 17),
        Done("r", 42, None, 17),
        Error("r", "out of memory"),
    ],
)
def test_headers_round_trip(header: object) -> None:
    assert decode_header(header_bytes(encode_frame(header))) == header  # type: ignore[arg-type]


def pack(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1\xc1", "undecodable"),
        (msgpack.packb([1, 2]), "must be a map"),
        (pack(version=2, kind="done", nbytes=0), "wire version 2"),
        (pack(version=1, kind="pickle", nbytes=0), "unknown frame kind"),
        (pack(version=1, kind="error", nbytes=5, request_id="r", reason="x"), "bad nbytes"),
        (pack(version=1, kind="error", nbytes=0, request_id="r"), "lacks 'reason'"),
        (pack(version=1, kind="done", nbytes=0, request_id="r", first_token_id=True, first_logprob=None,
              num_tokens=3), "first_token_id"),
        (pack(version=1, kind="kv", nbytes=0, request_id="r", layer=0, block_ids=[1, "2"], dtype="float32",
              shape=[], checksum=0), "only ints"),
        (msgpack.packb({1: 2}), "undecodable"),  # strict_map_key: int keys are refused
    ],
)
def test_decode_rejects(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_header(raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_bytes_round_trip(dtype: torch.dtype) -> None:
    blocks = torch.randn(2, 3, 16, 2, 8).to(dtype)
    buffers = kv_frame("r", 0, [5, 6, 7], blocks)
    header = decode_header(header_bytes(buffers))
    assert isinstance(header, KVHeader)
    assert header.nbytes == blocks.numel() * blocks.element_size() == len(buffers[1])
    assert header.checksum == zlib.crc32(buffers[1])
    back = tensor_from_payload(torch.frombuffer(bytearray(buffers[1]), dtype=torch.uint8), header)
    assert back.dtype == dtype and torch.equal(back, blocks)


def test_dtype_whitelist() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="cannot be sent"):
        dtype_name(torch.complex64)
    with pytest.raises(ValueError, match="host"):
        tensor_bytes(torch.zeros(2, device="meta"))


async def test_read_header_limits() -> None:
    limits = FrameLimits(max_header_bytes=128, read_timeout_s=0.2)
    assert await read_header(stream_of(b""), limits) is None, "clean EOF between frames"
    with pytest.raises(ProtocolError, match="length prefix"):
        await read_header(stream_of(b"\x00\x00"), limits)
    for length in (0, 129, 0xFFFFFFFF):
        with pytest.raises(ProtocolError, match=f"header length {length} outside 1..128"):
            await read_header(stream_of(struct.pack(">I", length)), limits)
    with pytest.raises(ProtocolError, match="closed after 3 of 10 header bytes"):
        await read_header(stream_of(struct.pack(">I", 10) + b"abc"), limits)
    with pytest.raises(ProtocolError, match="timed out"):
        await read_header(stream_of(struct.pack(">I", 10), eof=False), limits)
    frame = encode_frame(Error("r", "x"))
    assert await read_header(stream_of(bytes(frame[0])), limits) == Error("r", "x")


async def test_read_payload_sums_large_payloads_while_they_arrive() -> None:
    """Past 2 MiB the sum runs in a worker thread on what has arrived: a damaged byte in the part summed
    there or in the tail summed after is caught, and the bytes land in the caller's buffer."""
    limits = FrameLimits(read_timeout_s=5)
    blocks = torch.randint(0, 255, (2, 5, 1 << 19), dtype=torch.uint8).view(torch.float8_e4m3fn)  # 5 MiB
    buffers = kv_frame("r", 0, [1, 2, 3, 4, 5], blocks)
    header = decode_header(header_bytes(buffers))
    assert isinstance(header, KVHeader)
    payload = bytes(buffers[1])

    def arriving(data: bytes) -> PayloadReader:
        reader = PayloadReader()

        async def feed() -> None:
            for i in range(0, len(data), 1 << 20):
                reader.feed_data(data[i:i + (1 << 20)])
                await asyncio.sleep(0.002)
            reader.feed_eof()

        feeders.append(asyncio.ensure_future(feed()))
        return reader

    feeders: list[asyncio.Future[None]] = []
    into = bytearray(len(payload))
    await read_payload(arriving(payload), header, limits, memoryview(into))
    assert into == payload
    for where in (1 << 20, len(payload) - 1):
        damaged = bytearray(payload)
        damaged[where] ^= 1
        with pytest.raises(ProtocolError, match="checksum"):
            await read_payload(arriving(bytes(damaged)), header, limits)
    with pytest.raises(ValueError, match="buffer of 3 bytes"):
        await read_payload(arriving(payload), header, limits, memoryview(bytearray(3)))
    await asyncio.gather(*feeders)


async def test_read_payload_checks_crc_and_length() -> None:
    limits = FrameLimits(read_timeout_s=0.2)
    blocks = torch.arange(2 * 16, dtype=torch.float32).view(2, 1, 16, 1, 1)
    buffers = kv_frame("r", 0, [1], blocks)
    header = decode_header(header_bytes(buffers))
    assert isinstance(header, KVHeader)
    payload = bytes(buffers[1])
    assert await read_payload(stream_of(payload), header, limits) == payload
    corrupt = bytes([payload[0] ^ 1]) + payload[1:]
    with pytest.raises(ProtocolError, match="checksum"):
        await read_payload(stream_of(corrupt), header, limits)
    with pytest.raises(ProtocolError, match="closed after 10 of 128"):
        await read_payload(stream_of(payload[:10]), header, limits)
    with pytest.raises(ProtocolError, match="stalled at 10 of 128"):
        await read_payload(stream_of(payload[:10], eof=False), header, limits)


def test_auth() -> None:
    nonce = b"x" * 16
    check_auth(None, nonce, Auth(None))
    check_auth("s3cret", nonce, Auth(auth_mac("s3cret", nonce)))
    for auth in (Auth(None), Auth(auth_mac("wrong", nonce)), Auth(auth_mac("s3cret", b"y" * 16))):
        with pytest.raises(ProtocolError, match="authentication failed"):
            check_auth("s3cret", nonce, auth)


def test_done_frame_carries_the_first_tokens_top_logprobs() -> None:
    """D's first delta must carry P's top-k: the "done" frame brings them; a frame without them (an older
    sender) reads as empty lists."""
    header = decode_header(header_bytes(encode_frame(done_frame("r", 7, -0.5, 20, [(7, -0.5), (3, -1)]))))
    assert header == Done("r", 7, -0.5, 20, [7, 3], [-0.5, -1.0])
    old = msgpack.packb({"version": 1, "kind": "done", "nbytes": 0, "request_id": "r", "first_token_id": 7,
                         "first_logprob": None, "num_tokens": 20})
    assert decode_header(old) == Done("r", 7, None, 20, [], [])
    bad = msgpack.packb({"version": 1, "kind": "done", "nbytes": 0, "request_id": "r", "first_token_id": 7,
                         "first_logprob": None, "num_tokens": 20, "top_token_ids": [1], "top_logprobs": [0]})
    with pytest.raises(ProtocolError, match="only floats"):
        decode_header(bad)
