"""Shared pieces of the kv_transfer tests (a plain module: conftest.py names collide across test folders)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from pdserve.kv_transfer.tcp import TcpKVReceiver
from pdserve.kv_transfer.wire import (
    Auth,
    FrameLimits,
    Hello,
    Ready,
    auth_mac,
    encode_frame,
    read_header,
    write_frame,
)

NUM_LAYERS = 3
NUM_BLOCKS = 8
BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_DIM = 8


def make_pools(dtype: torch.dtype = torch.float32, *, random: bool = False, seed: int = 0) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if not random:
        return [torch.zeros(shape, dtype=dtype) for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(NUM_LAYERS)]


@dataclass
class Outcomes:
    """Records receiver callbacks; `wait` blocks until a request has an outcome."""

    completed: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    tops: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # P's top-k of the first token
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_complete(self, request_id: str, first_token_id: int, first_logprob: float | None,
                    first_top: list[tuple[int, float]] | None = None) -> None:
        assert request_id not in self.completed and request_id not in self.failed
        self.completed[request_id] = (first_token_id, first_logprob)
        self.tops[request_id] = list(first_top or [])
        self.changed.set()

    def on_failure(self, request_id: str, reason: str) -> None:
        assert request_id not in self.completed and request_id not in self.failed
        self.failed[request_id] = reason
        self.changed.set()

    async def wait(self, request_id: str, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while request_id not in self.completed and request_id not in self.failed:
                self.changed.clear()
                await self.changed.wait()


async def start_receiver(
    outcomes: Outcomes, dtype: torch.dtype = torch.float32, *, secret: str | None = None,
) -> TcpKVReceiver:
    receiver = TcpKVReceiver(
        "127.0.0.1", 0, make_pools(dtype), outcomes.on_complete, outcomes.on_failure,
        secret=secret, limits=FrameLimits(read_timeout_s=5.0),
    )
    await receiver.start()
    return receiver



async def raw_client(
    receiver: TcpKVReceiver, secret: str | None = None, *, handshake: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hand-driven connection, for sending frames the real sender would never produce."""
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    if handshake:
        hello = await read_header(reader, FrameLimits())
        assert isinstance(hello, Hello)
        mac = None if secret is None else auth_mac(secret, hello.nonce)
        await write_frame(writer, encode_frame(Auth(mac)))
        ready = await read_header(reader, FrameLimits())
        assert isinstance(ready, Ready), ready
    return reader, writer


async def assert_dropped(reader: asyncio.StreamReader, within_s: float = 1.0) -> None:
    """The receiver closed the connection well before its 5 s read timeout: it did not wait for more."""
    async with asyncio.timeout(within_s):
        rest = await reader.read()
    assert rest == b""
