"""The worker's end of the data plane: each message to its role's service, new work only for admitted roles.

    RESERVE ─▶ decode service   (REFUSED 503 + retry_after when the worker takes no decode work now)
    PREFILL ─▶ prefill service  (PREFILL_FAILED 503 likewise), PREFILL_TARGET ─▶ prefill service
    ABORT ─▶ both services (the id is known to at most one of them, or to both when colocated)
    SENDER_LOST ─▶ decode service (its KV receiver decides: kv_transfer/base.py)
    a router connection lost ─▶ both services abort what it carried
"""

from __future__ import annotations

import logging

from pdserve.decode_node.service import DecodeService
from pdserve.prefill_node.service import PrefillService
from pdserve.protocol.connection import Connection
from pdserve.protocol.messages import (
    Abort,
    Error,
    Message,
    Prefill,
    PrefillFailed,
    PrefillTarget,
    Refused,
    Reserve,
    SenderLost,
)
from pdserve.worker.control import RETRY_AFTER_S, WorkerControl

logger = logging.getLogger("pdserve.worker")


class WorkerDataPlane:
    def __init__(self, prefill: PrefillService | None, decode: DecodeService | None, control: WorkerControl) -> None:
        self.prefill = prefill
        self.decode = decode
        self.control = control

    def on_message(self, connection: Connection, message: Message) -> None:
        if isinstance(message, Reserve):
            if self.decode is None or not self.control.admits("decode"):
                connection.send(Refused(message.request_id, 503, self._not_admitted("decode"), RETRY_AFTER_S))
            else:
                self.decode.reserve(connection, message)
        elif isinstance(message, Prefill):
            if self.prefill is None or not self.control.admits("prefill"):
                connection.send(PrefillFailed(message.request_id, 503, self._not_admitted("prefill"), RETRY_AFTER_S))
            else:
                self.prefill.prefill(connection, message)
        elif isinstance(message, PrefillTarget):
            if self.prefill is not None:
                self.prefill.target(message)
        elif isinstance(message, Abort):
            for service in (self.prefill, self.decode):
                if service is not None:
                    service.abort(message)
        elif isinstance(message, SenderLost):
            if self.decode is not None:
                self.decode.sender_lost(message)
        else:
            logger.warning("unexpected %s from %s on the data plane", type(message).__name__, connection.peer)
            connection.send(Error(f"a worker does not take {type(message).__name__} messages"))

    def on_disconnect(self, connection: Connection, reason: str) -> None:
        for service in (self.prefill, self.decode):
            if service is not None:
                service.disconnected(connection)
        logger.info("router connection %s ended: %s", connection.peer, reason)

    def _not_admitted(self, role: str) -> str:
        why = "draining" if self.control.draining else f"admitting only {list(self.control.roles)}"
        return f"this worker takes no {role} work now ({why})"

    @property
    def num_open(self) -> int:
        """Requests of either role the routers still wait on."""
        return sum(s.num_open for s in (self.prefill, self.decode) if s is not None)
