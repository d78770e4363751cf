"""The prefill role on the data plane: PREFILL, PREFILL_TARGET and ABORT in, PREFILLED / PREFILL_FAILED out.

    PREFILL (target follows) ─▶ origins[id], targets[id] = a future ─▶ node.prefill (a task): checks, looks
                                the prefix up while it waits for the target, queues, awaits the hand-off
    PREFILL_TARGET ─▶ targets[id] resolved with D's transfer target
    ─▶ PREFILLED (first token + its text) | PREFILL_FAILED on the request's connection
    ABORT ─▶ a request still waiting for its target is answered 499; a queued or running one is aborted
    connection lost ─▶ every request it carried is aborted
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.prefill_node.node import PrefillNode
from pdserve.protocol.connection import Connection, ConnectionClosed
from pdserve.protocol.messages import Abort, Prefill, PrefillFailed, PrefillTarget

logger = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, node: PrefillNode) -> None:
        self.node = node
        self.origins: dict[str, Connection] = {}
        self._targets: dict[str, asyncio.Future[dict[str, Any] | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def prefill(self, connection: Connection, message: Prefill) -> None:
        rid = message.request_id
        if rid in self.origins:
            connection.send(PrefillFailed(rid, 409, f"request {rid!r} is already prefilling on this worker"))
            return
        self.origins[rid] = connection
        target = None
        if message.transfer is None:
            target = self._targets[rid] = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self._prefill(connection, message, target))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefill(self, connection: Connection, message: Prefill,
                       target: asyncio.Future[dict[str, Any] | None] | None) -> None:
        rid = message.request_id
        try:
            answer = await self.node.prefill(message, target)
        finally:
            self._targets.pop(rid, None)
            if self.origins.get(rid) is connection:
                del self.origins[rid]
        try:
            connection.send(answer)
        except ConnectionClosed:
            pass  # the router is gone; what the request held is freed already

    def target(self, message: PrefillTarget) -> None:
        future = self._targets.get(message.request_id)
        if future is not None and not future.done():
            future.set_result(message.transfer)

    def abort(self, message: Abort) -> None:
        self._abort(message.request_id, message.reason)

    def _abort(self, rid: str, reason: str) -> None:
        self.node.abort(rid, reason)
        future = self._targets.get(rid)
        if future is not None and not future.done():
            future.set_result(None)  # the node answers 499

    def disconnected(self, connection: Connection) -> None:
        orphans = [rid for rid, origin in self.origins.items() if origin is connection]
        for rid in orphans:
            self._abort(rid, "the router's connection was lost")
        if orphans:
            logger.warning("router connection %s lost: aborted %d prefill requests", connection.peer, len(orphans))

    @property
    def num_open(self) -> int:
        return len(self.origins)
