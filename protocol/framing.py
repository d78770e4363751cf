"""Frames on an asyncio stream: a 4-byte big-endian body length, then the msgpack body (protocol/codec.py).

    [len0:4][body0][len1:4][body1] ...

A reader checks the length against `FrameLimits.max_frame_bytes` before it reads the body, so a frame that
claims 10 GB is refused after 4 bytes, with nothing allocated.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.messages import Message

_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class FrameLimits:
    """What a reader accepts. A 128k-token prompt is ~0.6 MB of msgpack; 16 MiB leaves room for logprobs."""

    max_frame_bytes: int = 16 << 20
    read_timeout_s: float = 10.0  # for the rest of a frame once its first byte arrived
    max_buffered_bytes: int = 256 << 20  # unsent bytes a writer holds for a peer that stopped reading

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= 0 or self.read_timeout_s <= 0 or self.max_buffered_bytes <= 0:
            raise ValueError(f"FrameLimits must be positive: {self}")


def frame(message: Message) -> bytes:
    body = encode(message)
    return _LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, limits: FrameLimits) -> Message | None:
    """The next message, or None when the peer closed cleanly between frames."""
    try:
        prefix = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame's length") from None
    (length,) = _LENGTH.unpack(prefix)
    if not 0 < length <= limits.max_frame_bytes:
        raise ProtocolError(f"frame length {length} outside 1..{limits.max_frame_bytes} bytes")
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed after {len(exc.partial)} of {length} frame bytes") from None
    except TimeoutError:
        raise ProtocolError(f"a {length}-byte frame stalled for {limits.read_timeout_s} s") from None
    return decode(body)
