"""The prefill side of the control channel: one authenticated connection per decode worker, reused.

    first use of an address (or `begun` with preconnect) ─▶ handshake.connect ─▶ after_ready(address, reader)
        (cuda_ipc: read D's pools; nccl: read the rendezvous, join the group) ─▶ kept in `connections`
    write(address, frame) / write_then(address, frame, then)  under the address's lock, within
        write_timeout_s; `then` runs under the same lock (nccl: the group send its kv_bulk header announces, so D receives in header order)
    a failed handshake or write ─▶ drop(address) (on_drop: nccl closes the group) ─▶ KVTransferError;
        the next use reconnects

Frames to one address are written one at a time (a frame is header + payload, never interleaved). After the
handshake the receiver never writes: a dropped connection shows at the next write. `ControlLinks` is the
`ControlChannel` (control/outgoing.py) of the tcp, cuda_ipc and nccl senders: done and error go this way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypedDict, TypeVar, Unpack

from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.control.handshake import connect
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import Done, Error, ProtocolError, encode_frame, write_frame

logger = logging.getLogger(__name__)
Address = tuple[str, int]
AfterReady = Callable[[Address, asyncio.StreamReader], Awaitable[None]]
T = TypeVar("T")


class LinkOptions(TypedDict, total=False):
    secret: str | None  # the deployment's (PDSERVE_SECRET); None: no authentication
    connect_timeout_s: float  # the handshake's deadline (5 s)
    write_timeout_s: float  # each frame's (30 s)


@dataclass
class Link:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


class ControlLinks:
    def __init__(self, backend: str, *, after_ready: AfterReady | None = None,
                 on_drop: Callable[[Address], None] | None = None, preconnect: bool = False,
                 **options: Unpack[LinkOptions]) -> None:
        """`preconnect`: `begun` handshakes now, while the request waits for its prefill (cuda_ipc, nccl:
        their handshakes open pools or join a group, which the first layer should not wait for)."""
        self.backend = backend
        self.secret = options.get("secret")
        self.connect_timeout_s = options.get("connect_timeout_s", 5.0)
        self.write_timeout_s = options.get("write_timeout_s", 30.0)
        self.connections: dict[Address, Link] = {}
        self._after_ready = after_ready
        self._on_drop = on_drop
        self._preconnect = preconnect
        self._locks: dict[Address, asyncio.Lock] = {}

    # ---- the ControlChannel -------------------------------------------------------------------

    def check(self, target: TransferTarget) -> None:
        target.address  # noqa: B018 - raises when the target has no address

    def begun(self, target: TransferTarget) -> None:
        if self._preconnect and not self.usable(target.address):
            task = asyncio.get_running_loop().create_task(self.connect(target.address))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure resurfaces on first use

    async def send(self, target: TransferTarget, header: Done | Error) -> None:
        await self.write(target.address, encode_frame(header))

    # ---- connections --------------------------------------------------------------------------

    def usable(self, address: Address) -> bool:
        link = self.connections.get(address)
        return link is not None and link.usable()

    async def connect(self, address: Address) -> None:
        """Handshake now unless connected (KVTransferError naming the address when it fails)."""
        async with self._lock(address):
            try:
                await self._link(address)
            except (OSError, TimeoutError, ProtocolError) as exc:
                self.drop(address)
                raise KVTransferError(f"{self.backend} handshake with {address[0]}:{address[1]} failed: "
                                      f"{exc!r}") from exc

    async def write(self, address: Address, buffers: list[bytes | memoryview]) -> None:
        """Write one frame, connecting first if needed."""
        await self.write_then(address, buffers, lambda: None)

    async def write_then(self, address: Address, buffers: list[bytes | memoryview], then: Callable[[], T]) -> T:
        """`write`, then call `then` under the same lock; its result (its KVTransferError drops the connection)."""
        async with self._lock(address):
            try:
                link = await self._link(address)
                async with asyncio.timeout(self.write_timeout_s):
                    await write_frame(link.writer, buffers)
                return then()
            except (OSError, TimeoutError, ProtocolError, KVTransferError) as exc:
                self.drop(address)
                raise KVTransferError(f"KV send to {address[0]}:{address[1]} failed: {exc!r}") from exc

    def drop(self, address: Address) -> None:
        link = self.connections.pop(address, None)
        if link is not None:
            link.writer.close()
        if self._on_drop is not None:
            self._on_drop(address)

    async def close(self) -> None:
        for address in list(self.connections):
            self.drop(address)

    def _lock(self, address: Address) -> asyncio.Lock:
        return self._locks.setdefault(address, asyncio.Lock())

    async def _link(self, address: Address) -> Link:
        """The address's connection, opened (handshake, then the backend's after_ready) if it has none."""
        link = self.connections.get(address)
        if link is not None and link.usable():
            return link
        self.drop(address)
        reader, writer = await connect(address, self.secret, self.connect_timeout_s)
        try:
            if self._after_ready is not None:
                await self._after_ready(address, reader)
        except BaseException:
            writer.close()
            raise
        self.connections[address] = link = Link(reader, writer)
        return link
