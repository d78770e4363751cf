"""Both sides of a control connection's handshake, each within its deadline.

    receiver (accept)                                sender (connect)
    send hello{nonce: 16 random bytes}       ──▶     read hello              (connect_timeout_s)
    read auth{mac}   (read_timeout_s: a peer  ◀──     send auth{HMAC-SHA256(secret, nonce), None without a secret}
                      that connects must
                      authenticate promptly)
    check the mac; refused: send error{"", why}, raise ProtocolError
    send ready                               ──▶     read ready, or the error's reason (connect_timeout_s)

What a backend sends right after "ready" (cuda_ipc: its pools, nccl: the rendezvous) is its data path's
(control/server.py `ConnectionPath`, control/links.py `AfterReady`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from pdserve.kv_transfer.wire import (
    Auth,
    Error,
    FrameLimits,
    Hello,
    ProtocolError,
    Ready,
    auth_mac,
    check_auth,
    encode_frame,
    read_header,
    write_frame,
)

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str | None,
                 limits: FrameLimits) -> None:
    """The receiver's part: returns once the sender is authenticated and told "ready"."""
    nonce = os.urandom(16)
    await write_frame(writer, encode_frame(Hello(nonce)))
    # No idle wait here: a peer that connects must authenticate promptly.
    auth = await read_header(reader, dataclasses.replace(limits, idle_timeout_s=limits.read_timeout_s))
    try:
        if not isinstance(auth, Auth):
            raise ProtocolError(f"expected an auth frame first, got {type(auth).__name__}")
        check_auth(secret, nonce, auth)
    except ProtocolError as exc:
        await write_frame(writer, encode_frame(Error("", str(exc))))  # tell a misconfigured sender why
        raise
    await write_frame(writer, encode_frame(Ready()))


async def connect(address: tuple[str, int], secret: str | None, timeout_s: float) -> Streams:
    """The sender's part: an accepted connection to `address`, or ProtocolError / OSError / TimeoutError."""
    limits = FrameLimits(read_timeout_s=timeout_s)
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(*address)
        hello = await read_header(reader, limits)
    if not isinstance(hello, Hello):
        writer.close()
        raise ProtocolError(f"expected a hello frame from {address}, got {type(hello).__name__}")
    mac = None if secret is None else auth_mac(secret, hello.nonce)
    async with asyncio.timeout(timeout_s):
        await write_frame(writer, encode_frame(Auth(mac)))
        reply = await read_header(reader, limits)
    if not isinstance(reply, Ready):
        writer.close()
        reason = reply.reason if isinstance(reply, Error) else f"a {type(reply).__name__} frame"
        raise ProtocolError(f"receiver refused the connection: {reason}")
    return reader, writer
