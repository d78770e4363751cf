"""The worker's end of the data plane: accept routers' connections, handshake, hand every message on.

    listen ─▶ per connection: accept() (HELLO / AUTH / WELCOME) ─▶ loop: recv ─▶ PING: PONG here
                                                                        └──▶ handler.on_message(connection, m)
              connection ends (closed, broken, malformed frame) ─▶ handler.on_disconnect(connection, why)

`on_message` runs on the event loop and must not block: it answers at once or starts a task. A malformed
frame is answered with ERROR and ends that connection only; the handler frees the requests it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.connection import Connection, ConnectionClosed, accept
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Error, Message, Ping, Pong

logger = logging.getLogger(__name__)


class MessageHandler(Protocol):
    def on_message(self, connection: Connection, message: Message) -> None: ...

    def on_disconnect(self, connection: Connection, reason: str) -> None: ...


class DataPlaneServer:
    def __init__(self, handler: MessageHandler, secret: str | None, worker_id: str,
                 limits: FrameLimits | None = None) -> None:
        self.handler = handler
        self.secret = secret
        self.worker_id = worker_id
        self.limits = limits or FrameLimits()
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            connection = await accept(reader, writer, self.secret, self.worker_id, self.limits)
        except (ProtocolError, ConnectionError, ConnectionClosed, asyncio.IncompleteReadError) as exc:
            logger.warning("data-plane connection refused: %s", exc)
            writer.close()
            return
        self.connections.add(connection)
        reason = "closed by the peer"
        try:
            reason = await self._receive(connection)
        finally:
            self.connections.discard(connection)
            connection.close()
            self.handler.on_disconnect(connection, reason)

    async def _receive(self, connection: Connection) -> str:
        while True:
            try:
                message = await connection.recv()
            except ProtocolError as exc:
                with contextlib.suppress(ConnectionClosed):
                    connection.send(Error(str(exc)))
                logger.warning("dropping the data-plane connection of %s: %s", connection.peer, exc)
                return f"protocol error: {exc}"
            except (ConnectionError, OSError) as exc:
                return f"connection broke: {exc!r}"
            if message is None:
                return "closed by the peer"
            if isinstance(message, Ping):
                with contextlib.suppress(ConnectionClosed):
                    connection.send(Pong(message.seq))
                continue
            try:
                self.handler.on_message(connection, message)
            except ConnectionClosed:
                return "closed while answering"
