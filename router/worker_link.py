"""WorkerLink: the router's one data-plane connection to one worker, shared by every sub-request routed there.

    link.ready()      connect + handshake once (callers arriving meanwhile wait for the same attempt)
    link.subscribe(request_id, channel); link.send(RESERVE | PREFILL | PREFILL_TARGET | ABORT)
    reader task:      each answer to its channel by request id; TOKENS split into deltas, each to its channel
    watchdog:         a PING every quarter of --stream-stall-timeout; a link silent for all of it (no message,
                      no PONG: the worker is frozen, or its host is gone without a reset) is closed as stalled
    connection lost:  the link is down; every channel on it hears `on_link_lost` at once (it fails or retries);
                      the registry marks the worker unreachable (no new work until its next heartbeat); the next
                      `ready()` connects again. The worker, seeing the connection close, frees what it held

WorkerLinks keeps one link per worker id and replaces it when the worker registers again at another address.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol
from urllib.parse import urlsplit

from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.connection import Connection, ConnectionClosed, connect
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Error, Message, Ping, Pong, TokenDelta, Tokens
from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)


class LinkDown(Exception):
    """The worker cannot be reached on its data plane (refused, broken, or no data port known)."""


class Subscriber(Protocol):
    def on_message(self, link: WorkerLink, message: Message) -> None: ...

    def on_delta(self, link: WorkerLink, delta: TokenDelta) -> None: ...

    def on_link_lost(self, link: WorkerLink, reason: str) -> None: ...


class WorkerLink:
    def __init__(self, worker: Worker, host: str, port: int, secret: str | None, router_id: str,
                 registry: WorkerRegistry, connect_timeout_s: float, limits: FrameLimits,
                 stall_timeout_s: float = 4.0) -> None:
        self.worker = worker
        self.stall_timeout_s = stall_timeout_s
        self.address = (host, port)
        self._secret = secret
        self._router_id = router_id
        self._registry = registry
        self._connect_timeout_s = connect_timeout_s
        self._limits = limits
        self._connection: Connection | None = None
        self._connecting: asyncio.Task[Connection] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._close_reason: str | None = None
        self.last_heard = 0.0  # loop time of the last message from the worker
        self.subscribers: dict[str, Subscriber] = {}
        self.closed = False

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def up(self) -> bool:
        return self._connection is not None and not self._connection.closed

    async def ready(self) -> None:
        """Connected (raises LinkDown when the worker does not answer or refuses us)."""
        if self.up:
            return
        if self.closed:
            raise LinkDown(f"the link to {self.worker_id} was closed")
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        try:
            await asyncio.shield(self._connecting)
        except (OSError, TimeoutError, ProtocolError) as exc:
            self._registry.mark_unreachable(self.worker_id)
            raise LinkDown(f"cannot reach {self.worker_id}'s data plane at {self.address[0]}:"
                           f"{self.address[1]}: {exc!r}") from exc
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> Connection:
        host, port = self.address
        connection, _ = await connect(host, port, self._secret, self._router_id, self._limits,
                                      self._connect_timeout_s)
        self._connection = connection
        loop = asyncio.get_running_loop()
        self.last_heard = loop.time()
        self._reader = loop.create_task(self._read(connection))
        self._watchdog = loop.create_task(self._watch(connection))
        return connection

    def subscribe(self, request_id: str, subscriber: Subscriber) -> None:
        self.subscribers[request_id] = subscriber

    def unsubscribe(self, request_id: str) -> None:
        self.subscribers.pop(request_id, None)

    def send(self, message: Message) -> None:
        connection = self._connection
        if connection is None or connection.closed:
            raise LinkDown(f"the data-plane connection to {self.worker_id} is down")
        try:
            connection.send(message)
        except ConnectionClosed as exc:
            raise LinkDown(str(exc)) from exc

    async def _read(self, connection: Connection) -> None:
        reason = "closed by the worker"
        loop = asyncio.get_running_loop()
        try:
            while (message := await connection.recv()) is not None:
                self.last_heard = loop.time()
                self._dispatch(message)
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
        except (ConnectionError, OSError) as exc:
            reason = f"connection broke: {exc!r}"
        finally:
            self._lost(connection, reason)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Tokens):
            subscribers = self.subscribers
            for delta in message.deltas:
                subscriber = subscribers.get(delta.request_id)
                if subscriber is not None:
                    subscriber.on_delta(self, delta)
            return
        request_id = getattr(message, "request_id", None)
        if request_id is not None:
            subscriber = self.subscribers.get(request_id)
            if subscriber is not None:
                subscriber.on_message(self, message)
        elif isinstance(message, Error):
            log.warning("worker %s reports a data-plane error: %s", self.worker_id, message.message)
        elif not isinstance(message, Pong):
            log.warning("unexpected %s from worker %s", type(message).__name__, self.worker_id)

    async def _watch(self, connection: Connection) -> None:
        """Ping every quarter of the stall timeout; close the connection once nothing came for all of it."""
        loop, seq = asyncio.get_running_loop(), 0
        while not connection.closed:
            await asyncio.sleep(self.stall_timeout_s / 4)
            silent_s = loop.time() - self.last_heard
            if silent_s > self.stall_timeout_s:
                self._close_reason = (f"stalled: nothing from it for {silent_s:.1f} s "
                                      f"(--stream-stall-timeout {self.stall_timeout_s:g})")
                connection.close()  # the reader ends, _lost tells every channel why
                return
            seq += 1
            try:
                connection.send(Ping(seq))
            except ConnectionClosed:
                return

    def _lost(self, connection: Connection, reason: str) -> None:
        reason, self._close_reason = self._close_reason or reason, None
        if self._watchdog is not None:
            self._watchdog.cancel()
        connection.close()
        if self._connection is connection:
            self._connection = None
        if not self.closed:
            log.warning("data-plane connection to %s lost: %s", self.worker_id, reason)
            self._registry.mark_unreachable(self.worker_id)
        subscribers, self.subscribers = self.subscribers, {}
        for subscriber in set(subscribers.values()):
            subscriber.on_link_lost(self, reason)

    def close(self, reason: str = "closed by the router") -> None:
        """Close for good: requests on the link fail with `reason`."""
        self.closed = True
        if self._connection is not None:
            self._close_reason = self._close_reason or reason
            self._connection.close()


class WorkerLinks:
    """One WorkerLink per worker, made on first use from the worker's URL host and data port."""

    def __init__(self, registry: WorkerRegistry, secret: str | None, router_id: str, connect_timeout_s: float,
                 limits: FrameLimits | None = None, stall_timeout_s: float = 4.0) -> None:
        self._registry = registry
        self._stall_timeout_s = stall_timeout_s
        self._secret = secret
        self._router_id = router_id
        self._connect_timeout_s = connect_timeout_s
        self._limits = limits or FrameLimits()
        self._links: dict[str, WorkerLink] = {}

    def get(self, worker: Worker) -> WorkerLink:
        if worker.data_port is None:
            raise LinkDown(f"worker {worker.worker_id} has not told its data port (an older worker, or its "
                           "status was not read yet)")
        address = (urlsplit(worker.url).hostname or "127.0.0.1", worker.data_port)
        link = self._links.get(worker.worker_id)
        if link is not None and (link.address != address or link.closed):
            link.close("it registered again at another address")  # a restart: requests on the old one fail now
            link = None
        if link is None:
            link = self._links[worker.worker_id] = WorkerLink(
                worker, *address, self._secret, self._router_id, self._registry, self._connect_timeout_s,
                self._limits, self._stall_timeout_s)
        link.worker = worker  # a re-registration with the same address made a new Worker object
        return link

    def forget(self, worker_id: str, reason: str) -> None:
        link = self._links.pop(worker_id, None)
        if link is not None:
            link.close(reason)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
