"""A handshaken data-plane connection, and the two ends of the handshake (protocol/__init__.py).

`Connection.send` never waits: it queues the frame on the transport (a decode step's TOKENS must not wait
for a slow router). A peer that stops reading while more than `max_buffered_bytes` wait for it is cut off:
its requests fail together, as when the connection breaks.
"""

from __future__ import annotations

import asyncio
import contextlib

from pdserve.protocol.auth import auth_mac, mac_matches, new_nonce
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.framing import FrameLimits, frame, read_message
from pdserve.protocol.messages import PROTOCOL_VERSION, Auth, Error, Hello, Message, Welcome

AUTH_CONTEXT = b"pdserve-data-plane-v1"


class ConnectionClosed(Exception):
    """The connection is gone (closed, broken, or cut off for not reading)."""


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                 limits: FrameLimits) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer  # the other side's name: a worker id, or the router's
        self.limits = limits
        self.closed = False

    def send(self, message: Message) -> None:
        self.send_raw(frame(message))

    def send_raw(self, data: bytes) -> None:
        if self.closed or self.writer.is_closing():
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        transport = self.writer.transport
        if transport.get_write_buffer_size() > self.limits.max_buffered_bytes:
            self.close()
            raise ConnectionClosed(f"{self.peer} stopped reading ({self.limits.max_buffered_bytes} bytes unsent)")
        self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise ConnectionClosed(f"connection to {self.peer} broke: {exc!r}") from exc

    async def recv(self) -> Message | None:
        """The next message; None once the peer closed. ProtocolError / ConnectionError when it broke."""
        return await read_message(self.reader, self.limits)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(RuntimeError):  # the loop may be closing already
            self.writer.close()


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str | None,
                 worker_id: str, limits: FrameLimits, timeout_s: float = 10.0) -> Connection:
    """Acceptor side: challenge, check the answer; raises ProtocolError (after telling the peer why)."""
    connection = Connection(reader, writer, "?", limits)
    nonce = new_nonce()
    connection.send(Hello(nonce, worker_id))
    try:
        async with asyncio.timeout(timeout_s):
            answer = await connection.recv()
    except TimeoutError:
        raise ProtocolError(f"no AUTH within {timeout_s} s") from None
    problem = _auth_problem(answer, secret, nonce)
    if problem is not None:
        with contextlib.suppress(ConnectionClosed):
            connection.send(Error(problem))
            await connection.drain()
        raise ProtocolError(problem)
    assert isinstance(answer, Auth)
    connection.peer = answer.peer
    connection.send(Welcome())
    return connection


def _auth_problem(answer: Message | None, secret: str | None, nonce: bytes) -> str | None:
    if not isinstance(answer, Auth):
        return f"expected AUTH first, got {type(answer).__name__}"
    if answer.version != PROTOCOL_VERSION:
        return f"protocol version {answer.version} is not {PROTOCOL_VERSION}"
    if not mac_matches(secret, AUTH_CONTEXT, nonce, answer.mac):
        return "authentication failed: missing or wrong shared secret"
    return None


async def connect(host: str, port: int, secret: str | None, peer: str, limits: FrameLimits,
                  timeout_s: float = 5.0) -> tuple[Connection, Hello]:
    """Connector side: open, answer the challenge, wait for WELCOME. Raises OSError / TimeoutError /
    ProtocolError (the acceptor's ERROR message included)."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port, limit=limits.max_frame_bytes + 8)
        connection = Connection(reader, writer, f"{host}:{port}", limits)
        try:
            hello = await connection.recv()
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected HELLO from {host}:{port}, got {type(hello).__name__}")
            mac = auth_mac(secret, AUTH_CONTEXT, hello.nonce) if secret is not None else None
            connection.send(Auth(mac, peer))
            answer = await connection.recv()
        except BaseException:
            connection.close()
            raise
    if isinstance(answer, Error):
        connection.close()
        raise ProtocolError(f"{hello.worker_id} refused the connection: {answer.message}")
    if not isinstance(answer, Welcome):
        connection.close()
        raise ProtocolError(f"expected WELCOME from {hello.worker_id}, got {type(answer).__name__}")
    connection.peer = hello.worker_id
    return connection, hello
