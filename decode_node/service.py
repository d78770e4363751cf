"""The decode role on the data plane: RESERVE and ABORT in, RESERVED / REFUSED and TOKENS out.

    RESERVE ─▶ origins[id] = its connection ─▶ node.reserve (a task: a colocated lookup may wait on Redis)
                 └─▶ RESERVED | REFUSED on that connection (a connection gone meanwhile: the reservation is freed)
    every step: engine deltas ─▶ grouped by origin ─▶ one TOKENS per router connection
    a delta that finishes its request ─▶ origins entry dropped
    ABORT ─▶ node.abort (a request inside a forward ends at that step's update)
    SENDER_LOST ─▶ node.sender_lost (the KV receiver finishes or fails a transfer whose sender is gone)
    connection lost ─▶ every request it carried is aborted and its blocks freed
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.decode_node.node import DecodeNode
from pdserve.decode_node.step import RequestOutput
from pdserve.protocol.connection import Connection, ConnectionClosed
from pdserve.protocol.messages import Abort, Refused, Reserve, SenderLost, TokenDelta, Tokens

logger = logging.getLogger(__name__)


class DecodeService:
    def __init__(self, node: DecodeNode) -> None:
        self.node = node
        self.origins: dict[str, Connection] = {}  # live request id -> the router connection it came on
        self._reserving: dict[str, bool] = {}  # request id -> aborted, while its reservation is being made
        self._tasks: set[asyncio.Task[None]] = set()
        node.engine.on_outputs = self.publish

    def reserve(self, connection: Connection, message: Reserve) -> None:
        rid = message.request_id
        if rid in self.origins:
            connection.send(Refused(rid, 409, f"request {rid!r} is already reserved on this worker"))
            return
        self.origins[rid] = connection
        self._reserving[rid] = False
        task = asyncio.get_running_loop().create_task(self._reserve(connection, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reserve(self, connection: Connection, message: Reserve) -> None:
        rid = message.request_id
        try:
            answer = await self.node.reserve(message)
        finally:
            aborted = self._reserving.pop(rid)
        if aborted and not isinstance(answer, Refused):  # an ABORT came while it was being made
            self.node.abort(rid, "aborted while its reservation was made")
        if isinstance(answer, Refused) or aborted:
            if self.origins.get(rid) is connection:
                del self.origins[rid]
            if aborted:
                return
        try:
            connection.send(answer)
        except ConnectionClosed:
            self.node.abort(rid, "the router's connection closed before the reservation was answered")

    def abort(self, message: Abort) -> None:
        if message.request_id in self._reserving:
            self._reserving[message.request_id] = True
        self.node.abort(message.request_id, message.reason, message.sender_may_write)

    def sender_lost(self, message: SenderLost) -> None:
        self.node.sender_lost(message.request_id, message.reason)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Event loop thread: one TOKENS message per router connection for this batch of deltas."""
        batches: dict[Connection, list[TokenDelta]] = {}
        for output in outputs:
            rid = output.request_id
            connection = self.origins.get(rid)
            if output.delta.finish_reason is not None:
                self.origins.pop(rid, None)
            if connection is not None and not connection.closed:
                batches.setdefault(connection, []).append(output.delta)
        for connection, deltas in batches.items():
            try:
                connection.send(Tokens(deltas))
            except ConnectionClosed:
                pass  # disconnected() aborts its requests

    def disconnected(self, connection: Connection) -> None:
        orphans = [rid for rid, origin in self.origins.items() if origin is connection]
        for rid in orphans:
            del self.origins[rid]
            if rid in self._reserving:
                self._reserving[rid] = True
            self.node.abort(rid, "the router's connection was lost")
        if orphans:
            logger.warning("router connection %s lost: aborted %d decode requests", connection.peer, len(orphans))

    @property
    def num_open(self) -> int:
        return len(self.origins)
