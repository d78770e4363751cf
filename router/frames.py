"""Token-stream frames from a decode worker: 4-byte big-endian length + one msgpack map (docs/internal_api.md).

    bytes on the wire:  [len0:4][map0: len0 bytes][len1:4][map1] ...   chunk boundaries fall anywhere
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a frame is a few tokens; anything near this is a corrupt length


@dataclass(frozen=True)
class Frame:
    """One decode step's output for one request."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> Frame:
        return cls(
            token_ids=data.get("token_ids") or [],
            text=data.get("text") or "",
            finish_reason=data.get("finish_reason"),
            logprobs=data.get("logprobs"),
            prompt_tokens=data.get("prompt_tokens", 0),
            completion_tokens=data.get("completion_tokens", 0),
            cached_tokens=data.get("cached_tokens", 0),
            error=data.get("error"),
        )


def encode_frame(data: dict[str, Any]) -> bytes:
    body = msgpack.packb(data, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed raw chunks, get whole frames back."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[Frame]:
        self._buffer += chunk
        frames = []
        start = 0
        while len(self._buffer) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer, start)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame length {length} exceeds {MAX_FRAME_BYTES} bytes: corrupt stream")
            end = start + _HEADER.size + length
            if end > len(self._buffer):
                break
            data = msgpack.unpackb(self._buffer[start + _HEADER.size:end], raw=False)
            frames.append(Frame.from_map(data))
            start = end
        if start:
            del self._buffer[:start]
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
